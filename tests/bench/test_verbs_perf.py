"""perftest's tests over real udpverbs daemons on loopback (tiny runs: outcomes, not speed)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from udpverbs import cli
from udpverbs.bench import control, local, report, verbs_perf

LAT = {"t_min_us", "t_max_us", "t_typical_us", "t_avg_us", "t_stdev_us", "p99_us", "p999_us"}
BW = {"bw_peak_MBps", "bw_avg_MBps", "msg_rate_Mpps"}


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[dict], str]:
    rc = cli.main(["perf", *argv])
    out, err = capsys.readouterr()
    return rc, [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


@pytest.mark.parametrize(
    "argv, keys, iters",
    [
        # 3000 B: a Write of three DDP segments, with the baseline beside it
        (["write_lat", "-s", "3000", "-n", "20", "--baseline", "raw-udp"], LAT, 20),
        (["read_lat", "-s", "2", "-n", "20"], LAT, 20),
        # two QPs share the iterations; 41 is odd so one QP ends on its quota, not on cq_mod
        (["write_bw", "-s", "5000", "-n", "41", "-q", "2", "-t", "8"], BW, 41),
        (["read_bw", "-s", "4096", "-n", "30", "-t", "4", "--baseline", "raw-udp"], BW, 30),
        # -e: sleep on the CQ's completion events instead of busy-polling
        (["write_bw", "-s", "2", "-n", "20", "-e"], BW, 20),
        # a Send of three segments into a posted receive, and back
        (["send_lat", "-s", "3000", "-n", "20", "--baseline", "raw-udp"], LAT, 20),
        (["send_lat", "-s", "2", "-n", "20", "-e"], LAT, 20),
        # the server re-posts receives on two QPs; depth 8 against 41 Sends
        (["send_bw", "-s", "5000", "-n", "41", "-q", "2", "-t", "8"], BW, 41),
        (["send_bw", "-s", "2", "-n", "300", "-t", "64", "--baseline", "raw-udp"], BW, 300),
        (["atomic_lat", "-n", "20", "--baseline", "raw-udp"], LAT, 20),
        # 32 in flight: more than the daemon's ORD/IRD (16), so the send queue holds the rest
        (["atomic_bw", "-n", "100", "-t", "32", "--baseline", "raw-udp"], BW, 100),
        (["atomic_bw", "-n", "41", "-q", "2", "-t", "4", "-e"], BW, 41),
    ],
    ids=["write_lat", "read_lat", "write_bw_2qps", "read_bw", "write_bw_events", "send_lat", "send_lat_events",
         "send_bw_2qps", "send_bw", "atomic_lat", "atomic_bw", "atomic_bw_2qps_events"],
)
def test_local_run_reports_a_sane_row(capsys: pytest.CaptureFixture[str], argv: list[str], keys: set[str], iters: int) -> None:
    rc, rows, err = _run(capsys, *argv, "--local", "--json")
    assert rc == 0, err
    assert len(rows) == 1
    _check_row(rows[0], argv, keys, iters)
    assert rows[0]["bytes"] == (8 if argv[0].startswith("atomic") else int(argv[2]))


def _check_row(row: dict, argv: list[str], keys: set[str], iters: int) -> None:
    assert row["transport"] == "udpverbs" and row["iterations"] == iters and row["test"] == argv[0]
    assert keys <= set(row) and all(row[k] > 0 for k in keys - {"t_stdev_us"})
    assert "rnr_delay_us" not in row or "--rnr-delay-us" in argv
    if keys is LAT:
        assert row["t_min_us"] <= row["t_typical_us"] <= row["p99_us"] <= row["p999_us"] <= row["t_max_us"]
    if "--baseline" in argv:
        assert set(row["ratio"]) == keys and row["baseline"]["iterations"] == iters


def _at_client_close(monkeypatch: pytest.MonkeyPatch, take: Callable[[Any], object]) -> None:
    """Call ``take(side)`` as the client's side closes (this process is the
    client), while its context is still open."""
    real = verbs_perf.VerbsSide.close

    def close(self):  # type: ignore[no-untyped-def]
        if getattr(self, "ctx", None) is not None:
            take(self)
        real(self)

    monkeypatch.setattr(verbs_perf.VerbsSide, "close", close)


@pytest.fixture
def client_stats(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The counters of the client's daemon, taken as its side closes."""
    stats: dict[str, int] = {}
    _at_client_close(monkeypatch, lambda side: stats.update(side.ctx.query_stats()))
    return stats


@pytest.mark.parametrize("test", ["send_lat", "send_bw"])
def test_receives_stay_posted_across_a_sweep(
    test: str, capsys: pytest.CaptureFixture[str], client_stats: dict[str, int]
) -> None:
    # Each size starts with the receives the previous one left posted (and re-posted).
    argv = [test, "-a", "--max-size", "4096", "-n", "5", *([] if test == "send_lat" else ["-t", "4"])]
    rc, rows, err = _run(capsys, *argv, "--local", "--json")
    assert rc == 0, err
    assert [r["bytes"] for r in rows] == [2**k for k in range(1, 13)]
    for row in rows:
        _check_row(row, argv, LAT if test == "send_lat" else BW, 5)
    if test == "send_lat":
        # a receive is always posted before the peer can send: never an RNR NACK
        assert client_stats.get("rnr_nack_received", 0) == 0 and "link_data_sent" in client_stats


def test_send_lat_rnr_path_includes_the_delay(capsys: pytest.CaptureFixture[str], client_stats: dict[str, int]) -> None:
    # The server posts each receive 20 ms after its reply, and the next reply
    # can only follow that: unless a reply takes over 10 ms to reach the
    # client, a round trip is over 10 ms, half of it over delay / 4.
    delay_us = 20_000
    argv = ["send_lat", "-n", "8", "--rnr-delay-us", str(delay_us), "--baseline", "raw-udp"]
    rc, rows, err = _run(capsys, *argv, "--local", "--json")
    assert rc == 0, err
    (row,) = rows
    _check_row(row, argv, LAT, 8)
    assert row["rnr_delay_us"] == delay_us
    assert row["t_typical_us"] >= delay_us / 4 and row["baseline"]["t_typical_us"] >= delay_us / 4
    # the pings really met a QP without a receive, and the server's daemon said when one came
    assert client_stats["rnr_nack_received"] >= 1 and client_stats["rnr_resume_received"] >= 1
    assert client_stats.get("rnr_retry_exceeded", 0) == 0


def test_daemon_args_reach_both_local_daemons(capfd: pytest.CaptureFixture[str], client_stats: dict[str, int]) -> None:
    # --log-level=INFO: each daemon logs its start (the default for --local
    # is ERROR); --no-native: no datagram goes through a compiled lane,
    # which otherwise carries every 2-byte Write of this test both ways.
    argv = ["perf", "write_lat", "-n", "20", "--local", "--daemon-arg=--log-level=INFO", "--daemon-arg=--no-native"]
    rc = cli.main(argv)
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert "udpverbsd uvlocal-s: udp 127.0.0.2:" in err and "udpverbsd uvlocal-c: udp 127.0.0.3:" in err
    assert client_stats["link_data_received"] >= 20 and client_stats["link_data_sent"] >= 20
    assert "rx_native_datagrams" not in client_stats and "tx_native_datagrams" not in client_stats
    assert " Daemon flags    : --log-level=INFO --no-native" in out  # the table says what it measured


def test_any_local_test_runs_on_a_bad_network(capsys: pytest.CaptureFixture[str],
                                              client_stats: dict[str, int]) -> None:
    # What the README tells users: impair both local daemons' datagrams
    # through --daemon-arg; the run completes and its banner says so.
    rc, rows, err = _run(capsys, "write_bw", "-s", "65536", "-n", "200", "--local", "--json",
                         "--daemon-arg=--impair=loss=0.01")
    assert rc == 0, err
    (row,) = rows
    _check_row(row, ["write_bw", "-s", "65536"], BW, 200)
    # the client's daemon sent the Writes (over 9,000 datagrams): about 1 in 100 lost, and sent again
    assert client_stats["impair_offered"] > 9000 and client_stats["impair_lost"] > 30
    assert client_stats["link_retransmits"] >= client_stats["impair_lost"] // 2


@pytest.mark.parametrize("no_pin", [False, True], ids=["pinned", "no_pin"])
def test_local_run_places_its_client_and_gives_the_cpus_back(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], client_stats: dict[str, int],
        no_pin: bool) -> None:
    before = os.sched_getaffinity(0)
    during = []
    real = cli.run_client

    def recording(*a, **kw):  # type: ignore[no-untyped-def]
        during.append(os.sched_getaffinity(0))
        return real(*a, **kw)

    monkeypatch.setattr(cli, "run_client", recording)
    rc = cli.main(["perf", "write_lat", "-n", "20", "--local", *(["--no-pin"] if no_pin else [])])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert os.sched_getaffinity(0) == before
    placement = local.default_placement(not no_pin)
    if placement is None:
        assert during == [before] and " CPU placement   : not pinned" in out
        # an application may run on the daemon's CPU: each delivery yields to it
        assert client_stats["delivery_yields"] >= 20
    else:
        assert during == [placement.client_app]
        assert f" CPU placement   : {placement.describe()}" in out
        # only the other side's application runs on the daemon's CPU: no yield
        assert client_stats.get("delivery_yields", 0) == 0 and client_stats["link_data_received"] >= 20


def test_send_lat_rnr_banner_says_the_latency_includes_the_delay(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["perf", "send_lat", "-n", "3", "--rnr-delay-us", "500", "--local"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "Send Latency Test (RNR path: includes the server's 500 usec receive delay)" in out


def _tamper(monkeypatch: pytest.MonkeyPatch, change) -> None:  # type: ignore[no-untyped-def]
    """Make this process's (the client's) work requests wrong in the way ``change`` says."""
    real = verbs_perf.VerbsSide._work_request

    def wrong(self, size, k=0):  # type: ignore[no-untyped-def]
        wr = real(self, size, k)
        change(wr)
        return wr

    monkeypatch.setattr(verbs_perf.VerbsSide, "_work_request", wrong)


# The tampering tests read file-descriptor output (capfd): which side reports
# the bad data first is a race, and the server is a child process of --local.
def test_short_sends_fail_loudly(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    def one_byte_short(wr):  # type: ignore[no-untyped-def]
        wr.sg[0].length -= 1

    _tamper(monkeypatch, one_byte_short)
    rc, rows, err = _run(capfd, "send_bw", "-s", "100", "-n", "20", "-t", "4", "--local", "--json")
    assert rc == 1 and rows == []
    assert "received 99 B, expected 100 B" in err


def test_sends_that_never_arrived_fail_loudly(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    real = verbs_perf.VerbsSide._bw

    def claims_one_more(self, *a):  # type: ignore[no-untyped-def]
        stats = real(self, *a)
        self._count += 1
        return stats

    monkeypatch.setattr(verbs_perf.VerbsSide, "_bw", claims_one_more)
    rc, rows, err = _run(capfd, "send_bw", "-s", "100", "-n", "20", "-t", "4", "--local", "--json")
    assert rc == 1 and rows == []
    assert "the server received 20 Sends, the client completed 21" in err


@pytest.mark.parametrize(
    "test, fragment",
    [("atomic_lat", "Fetch-and-Add 1 returned"), ("atomic_bw", "counter advanced by 40, the client completed 20")],
)
def test_wrong_atomics_fail_loudly(
    test: str, fragment: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    def add_two(wr):  # type: ignore[no-untyped-def]
        wr.compare_add = 2

    _tamper(monkeypatch, add_two)
    # atomic_lat: the second fetch already shows the first add's 2; atomic_bw: the server's count does
    depth = [] if test == "atomic_lat" else ["-t", "4"]
    rc, rows, err = _run(capfd, test, "-n", "20", *depth, "--local", "--json")
    assert rc == 1 and rows == []
    assert fragment in err


@pytest.mark.parametrize(
    "argv",
    [
        ["atomic_lat", "-n", "20"],
        # each QP swaps its own word, 8 in flight, more than the ORD (4): the send queue holds the rest
        ["atomic_bw", "-n", "41", "-q", "3", "-t", "8", "-o", "4"],
        ["atomic_bw", "-n", "60", "-q", "2", "-t", "8", "-b"],
    ],
    ids=["atomic_lat", "atomic_bw_3qps", "atomic_bw_both_ways"],
)
def test_compare_and_swap_runs_and_every_swap_succeeds(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    # Every Compare-and-Swap expects its word's last value (atomic_lat checks
    # each one's old value, the server that its words moved once for each);
    # the completions say they were Compare-and-Swaps.
    from udpverbs.verbs import enums as E

    opcodes: set[int] = set()
    real = verbs_perf.VerbsSide._check

    def check(self, wcs):  # type: ignore[no-untyped-def]
        opcodes.update(wc.opcode for wc in wcs)
        real(self, wcs)

    monkeypatch.setattr(verbs_perf.VerbsSide, "_check", check)
    rc, rows, err = _run(capsys, *argv, "-A", "CMP_AND_SWAP", "--local", "--json")
    assert rc == 0, err
    (row,) = rows
    _check_row(row, argv, LAT if argv[0] == "atomic_lat" else BW, int(argv[2]))
    assert row["atomic_type"] == "CMP_AND_SWAP"
    assert opcodes == {E.IBV_WC_COMP_SWAP}


def test_compare_and_swaps_that_fail_are_caught(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    # Both QPs swap the same word: of each pair of swaps that expect the same
    # value only the first succeeds, and the word falls behind the count.
    real = verbs_perf.VerbsSide._work_request
    monkeypatch.setattr(verbs_perf.VerbsSide, "_work_request", lambda self, size, k=0: real(self, size, 0))
    rc, rows, err = _run(capfd, "atomic_bw", "-n", "40", "-q", "2", "-t", "4", "-A", "CMP_AND_SWAP", "--local", "--json")
    assert rc == 1 and rows == []
    assert "the server's words advanced by" in err and "the client completed 40 Compare-and-Swaps" in err


def test_a_compare_and_swap_that_swaps_the_wrong_value_is_caught(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    def two_ahead(wr, start, i):  # type: ignore[no-untyped-def]
        wr.compare_add, wr.swap = start + i, start + i + 2

    monkeypatch.setattr(verbs_perf, "_cas_operands", two_ahead)
    rc, rows, err = _run(capfd, "atomic_lat", "-n", "20", "-A", "CMP_AND_SWAP", "--local", "--json")
    assert rc == 1 and rows == []
    assert "Compare-and-Swap 1 returned 2, expected 1" in err


@pytest.mark.parametrize(
    "argv, lines",
    [
        (["write_lat", "-n", "20", "--output=latency_typical"], 1),
        (["write_bw", "-a", "--max-size", "8", "-n", "20", "-t", "4", "--output", "bandwidth", "--report_gbits"], 3),
        (["atomic_bw", "-n", "20", "-t", "4", "--output=message_rate", "--baseline", "raw-udp"], 1),
    ],
    ids=["latency", "bandwidth_sweep", "message_rate"],
)
def test_output_prints_one_figure_per_size_and_nothing_else(
        capsys: pytest.CaptureFixture[str], argv: list[str], lines: int) -> None:
    rc = cli.main(["perf", *argv, "--local"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    figures = out.splitlines()
    assert len(figures) == lines and all(float(f) > 0 for f in figures), out


def test_a_verbs_library_without_receives_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from udpverbs import verbs

    monkeypatch.delattr(verbs, "RecvWR")
    with pytest.raises(verbs_perf.VerbsUnavailable, match="RecvWR"):
        verbs_perf.load_verbs()


def test_demo_prints_both_sweeps_and_writes_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import matplotlib  # noqa: F401

        have_matplotlib = True
    except ImportError:
        have_matplotlib = False
    png = tmp_path / "demo.png"
    rc = cli.main(["demo", "--max-size", "4", "-n", "10", "--plot", str(png), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["test"], r["bytes"]) for r in rows] == [("write_lat", 2), ("write_lat", 4), ("write_bw", 2), ("write_bw", 4)]
    assert all("baseline" in r for r in rows)
    if have_matplotlib:
        assert png.read_bytes()[:4] == b"\x89PNG"
    else:  # the demo still succeeds, and says how to get the plot
        assert not png.exists() and "udpverbs[plot]" in err


@pytest.mark.parametrize(
    "argv, inline",
    [
        (["write_lat", "-s", "220", "-n", "20"], True),  # perftest's default: up to 220 bytes
        (["write_lat", "-s", "221", "-n", "20"], False),
        (["send_lat", "-s", "236", "-n", "20"], True),
        (["write_bw", "-s", "64", "-n", "40", "-t", "8"], False),
        (["send_bw", "-s", "64", "-n", "40", "-t", "8", "-I", "64"], True),
    ],
    ids=["write_lat_220", "write_lat_221", "send_lat_236", "write_bw", "send_bw_I64"],
)
def test_inline_size_decides_ibv_send_inline(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], inline: bool) -> None:
    from udpverbs.verbs import QP, enums as E

    flags: list[int] = []
    real = QP.post_send

    def recording(self, wr, bad_wr=None):  # type: ignore[no-untyped-def]
        flags.append(int(wr.send_flags))
        return real(self, wr, bad_wr)

    monkeypatch.setattr(QP, "post_send", recording)  # this process is the client
    rc, rows, err = _run(capsys, *argv, "--local", "--json")
    assert rc == 0, err
    _check_row(rows[0], argv, LAT if argv[0].endswith("lat") else BW, int(argv[argv.index("-n") + 1]))
    assert flags and {bool(f & E.IBV_SEND_INLINE) for f in flags} == {inline}  # the data still arrived: _verify


def test_inline_size_beyond_the_device_fails_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    rc, rows, err = _run(capsys, "write_lat", "-n", "5", "-I", "300", "--local")
    assert rc == 1 and not rows
    assert "-I 300: the device takes at most 256 inline bytes" in err


@pytest.mark.parametrize("argv, ord_", [(["read_bw", "-o", "2"], 2), (["atomic_bw"], 128), (["read_bw", "-o", "12", "-t", "4"], 4)],
                         ids=["o2", "device_max", "tx_depth_bounds"])
def test_outs_sets_the_qps_ord_and_the_banner_says_so(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], ord_: int) -> None:
    # perftest's -o: the client's QPs get it as their ORD (the server's as
    # their IRD), and the banner's "Outstand reads" replaces "Max inline data"
    seen: list[int] = []
    _at_client_close(monkeypatch, lambda side: seen.extend(qp.query()[0].max_rd_atomic for qp in getattr(side, "qps", ())))
    rc = cli.main(["perf", *argv, "-n", "40", "--local"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert seen == [ord_]
    assert f"Outstand reads  : {ord_}" in out and "Max inline data" not in out


def test_outs_beyond_the_device_fails_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    rc, rows, err = _run(capsys, "read_bw", "-n", "5", "-o", "129", "--local")
    assert rc == 1 and not rows
    assert "-o 129: the device takes at most 128 outstanding Reads and atomics per QP" in err


@pytest.fixture
def client_side(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What the client's side measured of its own stream (``own``), the
    peer's count it checked (``peer_count``, ``received``), and, under -b,
    the figures the server reported for its stream (``server``), as they
    came over the control connection."""
    seen: dict[str, Any] = {}
    real_bw, real_verify = verbs_perf.VerbsSide._bw, verbs_perf.VerbsSide._verify
    real_expect = control.ControlChannel.expect

    def bw(self, *a):  # type: ignore[no-untyped-def]
        seen["own"] = stats = real_bw(self, *a)
        return stats

    def verify(self, size, count, counter, received):  # type: ignore[no-untyped-def]
        seen.update(peer_count=count, received=received)
        real_verify(self, size, count, counter, received)

    def expect(self, op, timeout_s):  # type: ignore[no-untyped-def]
        msg = real_expect(self, op, timeout_s)
        if op == "bw-report" and msg.get("ours") is not None:
            seen["server"] = report.stats_from_json(msg["ours"])
        return msg

    monkeypatch.setattr(verbs_perf.VerbsSide, "_bw", bw)
    monkeypatch.setattr(verbs_perf.VerbsSide, "_verify", verify)
    monkeypatch.setattr(control.ControlChannel, "expect", expect)
    return seen


@pytest.mark.parametrize(
    "argv",
    [
        ["write_bw", "-s", "5000", "-n", "41", "-q", "2", "-t", "8", "--baseline", "raw-udp"],
        ["read_bw", "-s", "4096", "-n", "30", "-t", "4"],
        # both sides keep receives posted and re-post them from the CQ their Sends complete on
        ["send_bw", "-s", "3000", "-n", "41", "-q", "2", "-t", "8"],
        # each side's old values land beside the counter the other advances
        ["atomic_bw", "-n", "100", "-t", "32"],
    ],
    ids=["write_bw", "read_bw", "send_bw", "atomic_bw"],
)
def test_bidirectional_run_streams_both_ways_and_adds_them_up(
        capsys: pytest.CaptureFixture[str], client_side: dict[str, Any], argv: list[str]) -> None:
    rc, rows, err = _run(capsys, *argv, "-b", "--local", "--json")
    assert rc == 0, err
    (row,) = rows
    iters = int(argv[argv.index("-n") + 1])
    _check_row(row, argv, BW, iters)
    assert row["bidirectional"] is True
    # the server ran its -n too, and the client checked what reached it
    assert client_side["peer_count"] == iters
    assert client_side["received"] == (iters if argv[0] == "send_bw" else 0)
    # the row is the client's stream plus the one the server reported for its own
    own, server = client_side["own"], client_side["server"]
    assert server.iterations == iters
    for key in BW:
        assert row[key] == pytest.approx(getattr(own, key) + getattr(server, key), rel=1e-9), key


def test_bidirectional_sends_for_a_duration_end_with_every_send_received(
        capsys: pytest.CaptureFixture[str], client_side: dict[str, Any]) -> None:
    # under -D the two sides stop at different counts: each keeps receiving
    # until the other's count has come
    rc, rows, err = _run(capsys, "send_bw", "-s", "2000", "-t", "8", "-D", "0.5", "-b", "--local", "--json")
    assert rc == 0, err
    (row,) = rows
    assert row["bidirectional"] is True and row["iterations"] == client_side["own"].iterations > 0
    assert client_side["received"] == client_side["peer_count"] > 0


@pytest.mark.parametrize(
    "argv",
    [
        ["send_lat", "-s", "3000", "-n", "20"],
        ["send_lat", "-n", "8", "--rnr-delay-us", "2000"],  # the SRQ empty when the Send comes: RNR, then resume
        # both sides receive, 3 QPs share 8 receives: most Sends find the pool empty at first
        ["send_bw", "-s", "3000", "-n", "41", "-q", "3", "-t", "8", "-b", "-r", "8"],
    ],
    ids=["send_lat", "send_lat_rnr", "send_bw_shared_by_3_qps"],
)
def test_use_srq_takes_every_receive_from_the_shared_queue(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    # A QP made with an SRQ refuses receives posted to itself (EINVAL), so a
    # run that completes took them all from the SRQ.
    seen: dict[str, Any] = {}
    _at_client_close(monkeypatch, lambda side: seen.update(srq=side.srq, qp_srqs={qp.srq for qp in side.qps},
                                                           size=side.srq.query().max_wr))
    rc = cli.main(["perf", *argv, "--use_srq", "--local"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert seen["srq"] is not None and seen["qp_srqs"] == {seen["srq"]}
    assert seen["size"] == (8 if "-r" in argv else 1)
    assert "Using SRQ      : ON" in out
    assert ("RX depth        : 8" in out) == (argv[0] == "send_bw")


def test_receives_beyond_the_device_fail_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    rc, rows, err = _run(capsys, "send_bw", "-n", "5", "--use_srq", "-r", "20000", "--local")
    assert rc == 1 and not rows
    assert "-r 20000: the device takes at most 16384 receives per SRQ" in err


@pytest.mark.parametrize(
    "argv, chains, signaled",
    [
        # 21 Writes per QP in lists of 4: five whole lists and a tail of one on each QP;
        # one signaled WR per list, and the tail's (the quota's last)
        (["write_bw", "-s", "2000", "-n", "42", "-q", "2", "-t", "8", "-l", "4"], {4: 10, 1: 2}, 12),
        # -Q 1 signals every WR, lists or not
        (["send_bw", "-s", "2000", "-n", "30", "-t", "8", "-l", "3", "-Q", "1"], {3: 10}, 30),
        (["atomic_bw", "-n", "40", "-t", "16", "-Q", "5"], {1: 40}, 8),
    ],
    ids=["write_bw_lists_of_4", "send_bw_every_wr_signaled", "atomic_bw_q5"],
)
def test_post_lists_and_cq_moderation_shape_the_posts(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str],
        chains: dict[int, int], signaled: int) -> None:
    from udpverbs.verbs import QP, enums as E

    lengths: list[int] = []
    flags: list[int] = []
    real = QP.post_send

    def recording(self, wr, bad_wr=None):  # type: ignore[no-untyped-def]
        w, n = wr, 0
        while w is not None:
            flags.append(int(w.send_flags))
            w, n = w.next_wr, n + 1
        lengths.append(n)
        return real(self, wr, bad_wr)

    monkeypatch.setattr(QP, "post_send", recording)  # this process is the client
    rc, rows, err = _run(capsys, *argv, "--local", "--json")
    assert rc == 0, err
    _check_row(rows[0], argv, BW, int(argv[argv.index("-n") + 1]))
    assert {n: lengths.count(n) for n in set(lengths)} == chains
    assert sum(1 for f in flags if f & E.IBV_SEND_SIGNALED) == signaled


def test_histogram_lists_every_sample_sorted_under_the_row(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["perf", "write_lat", "-n", "30", "-H", "--local"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = out.splitlines()
    at = lines.index("#, usec")
    row = lines[at - 1].split()
    listed = [line.split(", ") for line in lines[at + 1 : at + 31]]
    assert [int(i) for i, _ in listed] == list(range(1, 31)) and not lines[at + 31][0].isdigit()
    samples = [float(v) for _, v in listed]
    assert samples == sorted(samples)
    # the row's t_min and t_max are the first and last samples (2 decimals)
    assert (float(row[2]), float(row[3])) == (round(samples[0], 2), round(samples[-1], 2))


def test_unsorted_samples_ride_in_the_json_row(capsys: pytest.CaptureFixture[str]) -> None:
    from udpverbs.bench.stats import latency_stats

    rc, rows, err = _run(capsys, "read_lat", "-n", "25", "-U", "--local", "--json")
    assert rc == 0, err
    (row,) = rows
    samples = row["samples_us"]
    assert len(samples) == 25
    again = latency_stats([round(us * 1000) for us in samples])
    assert again.t_typical_us == pytest.approx(row["t_typical_us"]) and again.t_max_us == pytest.approx(row["t_max_us"])


@pytest.mark.parametrize("argv", [["write_bw", "-s", "20000", "-n", "300"], ["send_lat", "-n", "50"]],
                         ids=["write_bw", "send_lat"])
def test_cpu_util_reports_both_daemons(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    rc, rows, err = _run(capsys, *argv, "--cpu_util", "--local", "--json")
    assert rc == 0, err
    (row,) = rows
    for key in ("daemon_cpu_pct", "daemon_busy_pct"):
        # shares of the run's wall time: a daemon has one data loop
        assert set(row[key]) == {"client", "server"} and all(0 < v < 150 for v in row[key].values()), row


@pytest.mark.parametrize(
    "argv",
    [
        ["write_bw", "-s", "3000", "-n", "30", "-q", "3", "-t", "4"],
        # the QPs in INIT keep the atomic access the connection manager would not give
        ["atomic_lat", "-n", "20", "-A", "CMP_AND_SWAP"],
        # receives posted after the connection, from the SRQ on both sides
        ["send_bw", "-s", "100", "-n", "25", "-q", "2", "-t", "4", "-b", "--use_srq"],
    ],
    ids=["write_bw_3_qps", "atomic_lat_cas", "send_bw_srq_both_ways"],
)
def test_rdma_cm_connects_every_qp_through_the_connection_manager(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    from udpverbs import verbs

    # The real connect, counted: it returns only once the server has accepted.
    connected: list[tuple[int, bytes]] = []
    real = verbs.connect

    def connect(qp, host, port, **kw):  # type: ignore[no-untyped-def]
        conn = real(qp, host, port, **kw)
        connected.append((qp.qp_num, kw["private_data"]))
        return conn

    monkeypatch.setattr(verbs, "connect", connect)
    monkeypatch.setattr(verbs_perf.VerbsSide, "_connect_by_hand", lambda self: pytest.fail("connected by hand"))
    seen: dict[str, Any] = {}
    _at_client_close(monkeypatch, lambda side: seen.update(qpns=[qp.qp_num for qp in side.qps],
                                                           remote=side.remote["qpns"]))
    rc = cli.main(["perf", *argv, "-R", "--local"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "Data ex. method : rdma_cm" in out
    assert [q for q, _ in connected] == seen["qpns"] and len(seen["remote"]) == len(seen["qpns"])
    assert [verbs_perf._CM_INDEX.unpack(pd)[0] for _, pd in connected] == list(range(len(seen["qpns"])))


def test_rdma_cm_server_refuses_requests_that_are_not_the_clients(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    from udpverbs import verbs
    from udpverbs.verbs import enums as E

    refused: list[int] = []
    real = verbs_perf.VerbsSide._connect_with_cm

    def strays_first(self, timeout_s):  # type: ignore[no-untyped-def]
        # A QP the client never announced asks for index 0, then one with
        # private data that names no index; the server turns both away and
        # goes on waiting for the client's own.
        r = self.remote
        stray = verbs.QP(self.pd, verbs.QPInitAttr(qp_type=E.IBV_QPT_RC, scq=self.cq, rcq=self.cq))
        for data in (verbs_perf._CM_INDEX.pack(0), b"?"):
            with pytest.raises(verbs.VerbsError) as e:
                verbs.connect(stray, verbs.GID(r["gid"]).ip, r["cm_port"], udp_port=r["port"], private_data=data,
                              timeout=10)
            refused.append(e.value.error_code)
            stray.close()
            stray = verbs.QP(self.pd, verbs.QPInitAttr(qp_type=E.IBV_QPT_RC, scq=self.cq, rcq=self.cq))
        stray.close()
        real(self, timeout_s)

    monkeypatch.setattr(verbs_perf.VerbsSide, "_connect_with_cm", strays_first)
    rc, rows, err = _run(capsys, "write_bw", "-n", "20", "-q", "2", "-R", "--local", "--json")
    assert rc == 0, err
    assert refused == [errno.ECONNABORTED, errno.ECONNABORTED]  # rejected, not refused for want of a listener
    assert len(rows) == 1 and rows[0]["iterations"] == 20
