"""The udpverbs command line: parsing, validation and clear errors."""

from __future__ import annotations

import sys

import pytest

from udpverbs import cli
from udpverbs.bench import local, verbs_perf
from udpverbs.bench.perf import ALL_SIZES, PerfParams, PerfUsageError


def _params(*argv: str) -> PerfParams:
    return cli.params_from_args(cli.build_parser().parse_args(["perf", *argv]))


def test_defaults_follow_perftest() -> None:
    lat = _params("write_lat")
    assert lat.sizes() == [2] and lat.iterations_for(2) == 1000 and lat.depth() == 1
    bw = _params("write_bw")
    assert bw.sizes() == [65536] and bw.depth() == 128
    assert _params("atomic_lat").sizes() == [8]


def test_all_sizes_and_max_size() -> None:
    assert _params("write_lat", "-a").sizes() == ALL_SIZES == [2**k for k in range(1, 24)]
    assert _params("write_bw", "-a", "--max-size", "64k").sizes()[-1] == 65536


def test_large_messages_get_fewer_default_iterations_but_n_wins() -> None:
    p = _params("write_bw", "-s", "8M")
    assert p.iterations_for(8 << 20) == 16  # 128 MB per size
    assert _params("write_bw", "-s", "8M", "-n", "7").iterations_for(8 << 20) == 7


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["write_lat", "-s", "8", "-a"], "-s and -a"),
        (["write_lat", "-n", "10", "-D", "2"], "-n and -D"),
        (["write_lat", "-n", "0"], "-n must be"),
        (["write_lat", "-q", "2"], "one QP"),
        (["write_lat", "-t", "4"], "-t applies"),
        (["write_bw", "-m", "64"], "-m"),
        (["atomic_bw", "-s", "64"], "atomic"),
        (["write_bw", "-D", "0"], "-D"),
        (["write_bw", "--baseline-only"], "--baseline"),
        (["send_bw", "--rnr-delay-us", "100"], "--rnr-delay-us drives send_lat's receiver-not-ready path"),
        (["atomic_bw", "--rnr-delay-us", "1"], "does not apply to atomic_bw (bandwidth tests keep"),
        (["write_lat", "--rnr-delay-us", "100"], "does not apply to write_lat (write_lat has no receives)"),
        (["send_lat", "--rnr-delay-us", "-1"], "--rnr-delay-us must be between 0 (off) and 1000000"),
        (["send_lat", "--rnr-delay-us", "1000001"], "--rnr-delay-us must be between"),
        # --daemon-arg: checked as the daemon checks its flags, before anything starts
        (["write_lat", "--daemon-arg=--cc=aimd"], "--daemon-arg goes with --local"),
        (["write_bw", "--local", "--baseline", "raw-udp", "--baseline-only", "--daemon-arg=--cc=aimd"],
         "--baseline-only starts no daemon"),
        (["write_lat", "--local", "--daemon-arg=--cc=bogus"], "unknown congestion controller 'bogus'"),
        (["write_lat", "--local", "--daemon-arg=--frob"], "unrecognized arguments: --frob"),
        (["write_lat", "--local", "--daemon-arg=--link=nope=1"], "unknown link setting 'nope'"),
        (["write_lat", "--local", "--daemon-arg=--spin-us"], "--spin-us: expected one argument"),
        (["atomic_bw", "--local", "--daemon-arg=--rx-dispatch-budget=-1"],
         "rx_dispatch_budget must be 0 (no limit) or more"),
        (["atomic_bw", "--local", "--daemon-arg=--rx-dispatch-budget=x"], "invalid int value"),
        (["write_bw", "--local", "--daemon-arg=--heap-keep-mb=2048"], "heap_keep_mb must be a whole number from 0"),
        (["write_lat", "--local", "--daemon-arg=--log-level=loud"], "unknown log level 'loud'"),
        (["write_lat", "--local", "--daemon-arg=--port=5"], "--local sets --port itself"),
        (["write_lat", "--local", "--daemon-arg=--mt=9000"], "--local sets --mtu itself (-m sets the MTU)"),
        (["write_lat", "--local", "--daemon-arg=--config=/nonexistent.toml"], "a --config file could set"),
        (["write_bw", "--local", "--daemon-arg=--impair=loss=2"], "--daemon-arg: impair loss='2': a probability"),
        (["write_bw", "--local", "--daemon-arg=--impair=delay=5"], "give a time with its unit"),
        (["write_lat", "--peer", "127.0.0.2", "--no-pin"], "--no-pin goes with --local"),
        (["write_lat", "-I", "-1"], "-I must be between 0 and 4096"),
        (["send_bw", "-I", "4097"], "-I must be between 0 and 4096"),
        (["read_lat", "-I", "64"], "-I does not apply to read_lat"),
        (["atomic_bw", "-I", "8"], "-I does not apply to atomic_bw"),
        (["write_bw", "-o", "4"], "-o does not apply to write_bw"),
        (["send_lat", "--outs", "1"], "-o does not apply to send_lat"),
        (["read_bw", "-o", "0"], "-o must be between 1 and 65536"),
        (["atomic_bw", "-o", "65537"], "-o must be between 1 and 65536"),
        (["write_lat", "-b"], "-b applies to bandwidth tests: write_lat is a ping-pong"),
        (["write_bw", "--use_srq"], "--use_srq does not apply to write_bw: only Sends consume receives"),
        (["read_lat", "--use-srq"], "--use_srq does not apply to read_lat"),
        (["send_lat", "-r", "8"], "-r does not apply to send_lat: it sizes send_bw's posted receives"),
        (["send_bw", "-r", "0"], "-r must be between 1 and 1048576"),
        (["write_lat", "-l", "2"], "-l applies to bandwidth tests: a latency test signals every WR"),
        (["read_lat", "-Q", "1"], "-Q applies to bandwidth tests"),
        (["write_bw", "-Q", "0"], "-Q must be between 1 and the TX depth (128)"),
        (["send_bw", "-t", "8", "-Q", "9"], "-Q must be between 1 and the TX depth (8)"),
        (["write_bw", "-t", "8", "-l", "9"], "-l must be between 1 and the TX depth (8): a whole list must fit"),
        (["write_bw", "--post_list", "0"], "-l must be between 1"),
        (["write_bw", "--local", "-H"], "-H applies to latency tests: a bandwidth test keeps no samples"),
        (["write_bw", "--cpu_util", "--baseline", "raw-udp", "--baseline-only"],
         "--cpu_util measures the daemons: --baseline-only starts none"),
        (["send_lat", "-U"], "-U prints the client's samples: give it to the client (or with --local)"),
        (["read_bw", "-t", "16", "-Q", "16", "-l", "3"],
         "-Q 16 and -l 3: up to 15 WRs could wait unsignaled with no room for another list; make -t at least 18"),
        (["atomic_lat", "--bidirectional"], "-b applies to bandwidth tests"),
        (["read_lat", "-A", "CMP_AND_SWAP"], "-A does not apply to read_lat: it chooses the atomic tests' operation"),
        (["write_lat", "--output=bandwidth"], "--output=bandwidth does not apply to write_lat, a latency test"),
        (["read_bw", "--output", "latency"], "--output=latency does not apply to read_bw, a bandwidth test"),
        (["write_bw", "--output=bandwidth", "--json"], "--output and --json are exclusive"),
        (["atomic_bw", "--atomic_type", "SWAP"],
         "unknown atomic type 'SWAP'; choose one of CMP_AND_SWAP, FETCH_AND_ADD"),
        (["write_lat", "-R", "--baseline", "raw-udp", "--baseline-only"],
         "-R connects QPs through the connection manager: --baseline-only makes none"),
        (["write_bw", "--local-paths", "2"], "--local-paths goes with --local"),
        (["write_bw", "--local", "--local-paths", "9"], "--local-paths: a local daemon has 1 to 8 addresses, not 9"),
    ],
)
def test_usage_errors_exit_2_with_a_clear_message(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["perf", *argv]) == 2
    err = capsys.readouterr().err
    assert "error" in err and fragment in err


@pytest.mark.parametrize("argv, usage", [
    (["perf", "write_lat", "--bogus"], "usage: udpverbs perf "),
    (["perf", "--bogus", "write_lat"], "usage: udpverbs perf "),
    (["devices", "--bogus"], "usage: udpverbs devices "),
    (["--bogus", "devices"], "usage: udpverbs [-h]"),
])
def test_a_stray_argument_shows_the_usage_it_belongs_to(argv: list[str], usage: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and "unrecognized arguments: --bogus" in err, err


def test_demo_checks_its_daemon_flags_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--daemon-arg=--socket=/tmp/x.sock"]) == 2
    assert "--local sets --socket itself" in capsys.readouterr().err


def test_daemon_flags_are_checked_and_returned_in_order() -> None:
    assert local.check_daemon_args(["--cc", "fixed", "--no-native", "--link=rwnd_packets=64"]) == [
        "--cc", "fixed", "--no-native", "--link=rwnd_packets=64"]
    # after ours on the daemon's command line, so a later --log-level wins
    argv = verbs_perf.daemon_command("127.0.0.2", "uv", "/tmp/uv.sock", 1472, ["--log-level=INFO"])
    assert argv[-1] == "--log-level=INFO" and argv.index("ERROR") < len(argv) - 1


def test_unknown_test_is_rejected_by_the_parser() -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["perf", "write_latency"])
    assert exc.value.code == 2


@pytest.mark.parametrize(
    "text, expected",
    [("10.0.0.2", ("10.0.0.2", 18515)), ("host:7000", ("host", 7000)), ("127.0.0.2:1", ("127.0.0.2", 1))],
)
def test_parse_peer(text: str, expected: tuple[str, int]) -> None:
    assert cli.parse_peer(text, 18515) == expected


@pytest.mark.parametrize("text", [":80", "host:x", "host:70000"])
def test_parse_peer_errors(text: str) -> None:
    with pytest.raises(cli.UsageError):
        cli.parse_peer(text, 18515)


def test_params_from_the_wire_are_checked() -> None:
    good = _params("write_bw", "-s", "4096").to_wire()
    assert PerfParams.from_wire(good) == _params("write_bw", "-s", "4096")
    bads = [{**good, "size": "4096"}, {**good, "evil": 1}, {**good, "size": -1}, [1], {"size": 2},
            {**good, "duration_s": "1", "iters": None}, {**good, "all_sizes": 1}, {**good, "qps": True},
            {**good, "baseline": 7}, {**good, "test": None}]  # fmt: skip
    for bad in bads:
        with pytest.raises(PerfUsageError):
            PerfParams.from_wire(bad)


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert cli.main(["perf", "write_lat", "--plot", "x.png", "--peer", "127.0.0.1:1"]) == 2
    assert "pip install 'udpverbs[plot]'" in capsys.readouterr().err


def test_unreachable_server_fails_with_status_1(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    # a port nobody listens on: bind one, do not listen
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        rc = cli.main(["perf", "write_lat", "--peer", f"127.0.0.1:{port}", "--baseline", "raw-udp", "--baseline-only"])
    assert rc == 1
    assert "cannot reach the server" in capsys.readouterr().err


def test_events_flag_applies_to_cq_polling_tests_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert _params("read_lat", "-e").use_events
    assert cli.main(["perf", "write_lat", "-e"]) == 2
    assert "-e does not apply" in capsys.readouterr().err


def test_rnr_delay_is_off_by_default_and_send_lat_takes_it() -> None:
    assert _params("send_lat").rnr_delay_us == 0
    p = _params("send_lat", "--rnr-delay-us", "250", "-n", "10")
    assert p.rnr_delay_us == 250
    assert p.title() == "Send Latency Test (RNR path: includes the server's 250 usec receive delay)"
    assert _params("send_lat", "--rnr-delay-us", "0").title() == "Send Latency Test"
    # 0 means off for every test, so scripts may always pass it
    assert _params("send_bw", "--rnr-delay-us", "0").rnr_delay_us == 0
    assert PerfParams.from_wire(p.to_wire()) == p


def test_rnr_delay_must_be_a_whole_number_of_microseconds(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["perf", "send_lat", "--rnr-delay-us", "1.5"])
    assert exc.value.code == 2 and "--rnr-delay-us" in capsys.readouterr().err


def test_rnr_delay_from_the_wire_is_checked() -> None:
    good = _params("send_lat", "--rnr-delay-us", "100").to_wire()
    for bad in ({**good, "rnr_delay_us": "100"}, {**good, "rnr_delay_us": True}, {**good, "rnr_delay_us": None},
                {**good, "rnr_delay_us": -5}, {**good, "test": "send_bw"}):  # fmt: skip
        with pytest.raises(PerfUsageError):
            PerfParams.from_wire(bad)
    # a client that predates the flag sends no rnr_delay_us: off
    old = {k: v for k, v in good.items() if k != "rnr_delay_us"}
    assert PerfParams.from_wire(old).rnr_delay_us == 0


def test_inline_size_defaults_as_perftest_and_travels_to_the_server() -> None:
    # perftest: 220 bytes for ib_write_lat, 236 for ib_send_lat, none for the
    # bandwidth tests unless -I asks
    assert [_params(t).inline() for t in ("write_lat", "send_lat", "read_lat", "atomic_lat")] == [220, 236, 0, 0]
    assert [_params(t).inline() for t in ("write_bw", "send_bw", "read_bw", "atomic_bw")] == [0, 0, 0, 0]
    assert _params("write_lat", "-I", "0").inline() == 0
    assert _params("read_lat", "-I", "0").inline() == 0  # 0 means none for every test, so scripts may pass it
    p = _params("send_bw", "--inline-size", "64")
    assert p.inline() == 64 and PerfParams.from_wire(p.to_wire()) == p
    for bad in ({**p.to_wire(), "inline_size": "64"}, {**p.to_wire(), "inline_size": True}):
        with pytest.raises(PerfUsageError):
            PerfParams.from_wire(bad)
    # a client that predates the flag: the test's default
    old = {k: v for k, v in _params("write_lat").to_wire().items() if k != "inline_size"}
    assert PerfParams.from_wire(old).inline() == 220


def test_outs_bounds_reads_and_atomics_and_travels_to_the_server() -> None:
    assert _params("read_bw").outs is None and _params("atomic_lat").outs is None  # the device's offer
    p = _params("read_bw", "-o", "4")
    assert p.outs == 4 and PerfParams.from_wire(p.to_wire()) == p
    assert _params("atomic_bw", "--outs", "2").outs == 2
    for bad in ({**p.to_wire(), "outs": "4"}, {**p.to_wire(), "outs": True}, {**p.to_wire(), "outs": 0},
                {**p.to_wire(), "test": "write_bw"}):  # fmt: skip
        with pytest.raises(PerfUsageError):
            PerfParams.from_wire(bad)
    # a client that predates the flag: what the device offers
    old = {k: v for k, v in p.to_wire().items() if k != "outs"}
    assert PerfParams.from_wire(old).outs is None


def test_bidirectional_names_itself_as_perftest_and_travels_to_the_server() -> None:
    p = _params("send_bw", "-b")
    assert p.bidirectional and PerfParams.from_wire(p.to_wire()) == p
    assert p.title() == "Send Bidirectional BW Test" and _params("send_bw").title() == "Send BW Test"
    assert _params("atomic_bw", "--bidirectional").title() == "Atomic FETCH_AND_ADD Bidirectional BW Test"
    for bad in ({**p.to_wire(), "bidirectional": 1}, {**p.to_wire(), "test": "send_lat"}):
        with pytest.raises(PerfUsageError):
            PerfParams.from_wire(bad)
    # a client that predates the flag: one direction
    old = {k: v for k, v in p.to_wire().items() if k != "bidirectional"}
    assert PerfParams.from_wire(old).bidirectional is False


def test_atomic_type_names_itself_as_perftest_and_travels_to_the_server() -> None:
    p = _params("atomic_lat", "-A", "CMP_AND_SWAP")
    assert p.atomic() == "CMP_AND_SWAP" and PerfParams.from_wire(p.to_wire()) == p
    assert p.title() == "Atomic CMP_AND_SWAP Latency Test"
    assert _params("atomic_bw", "--atomic-type", "CMP_AND_SWAP", "-b").title() == "Atomic CMP_AND_SWAP Bidirectional BW Test"
    default = _params("atomic_bw")
    assert default.atomic() == "FETCH_AND_ADD" and default.title() == "Atomic FETCH_AND_ADD BW Test"
    assert _params("atomic_bw", "--atomic_type", "FETCH_AND_ADD").atomic() == "FETCH_AND_ADD"
    for bad in ({**p.to_wire(), "atomic_type": 1}, {**p.to_wire(), "atomic_type": "cas"},
                {**p.to_wire(), "test": "read_lat"}):  # fmt: skip
        with pytest.raises(PerfUsageError):
            PerfParams.from_wire(bad)
    # a client that predates the flag: Fetch-and-Add
    old = {k: v for k, v in p.to_wire().items() if k != "atomic_type"}
    assert PerfParams.from_wire(old).atomic() == "FETCH_AND_ADD"


def test_rdma_cm_is_parsed_in_perftest_spellings_and_travels_to_the_server() -> None:
    p = _params("write_bw", "-R")
    assert p.rdma_cm and _params("read_lat", "--rdma_cm").rdma_cm and _params("send_bw", "--rdma-cm").rdma_cm
    assert PerfParams.from_wire(p.to_wire()) == p and not _params("write_bw").rdma_cm
    with pytest.raises(PerfUsageError):
        PerfParams.from_wire({**p.to_wire(), "rdma_cm": 1})
    # a client that predates the flag connects by hand
    old = {k: v for k, v in p.to_wire().items() if k != "rdma_cm"}
    assert not PerfParams.from_wire(old).rdma_cm


def test_report_gbits_is_parsed_in_both_spellings() -> None:
    parse = cli.build_parser().parse_args
    assert parse(["perf", "write_bw", "--report_gbits"]).report_gbits
    assert parse(["perf", "write_bw", "--report-gbits"]).report_gbits
    assert not parse(["perf", "write_bw"]).report_gbits


def test_srq_and_rx_depth_follow_perftest_and_travel_to_the_server() -> None:
    # perftest's default: 512 receives posted, here at least twice -t on every QP
    assert _params("send_bw").rx_total() == 512 and _params("send_bw", "-t", "300").rx_total() == 600
    assert _params("send_bw", "-q", "4", "-t", "128").rx_total() == 4 * 256
    assert _params("send_bw", "-q", "3", "-r", "7").rx_total() == 7  # -r wins, even below the depth
    p = _params("send_bw", "--use_srq", "-r", "64")
    assert p.use_srq and PerfParams.from_wire(p.to_wire()) == p
    assert _params("send_lat", "--use-srq").use_srq
    for bad in ({**p.to_wire(), "use_srq": 1}, {**p.to_wire(), "rx_depth": "64"}, {**p.to_wire(), "test": "send_lat"}):
        with pytest.raises(PerfUsageError):
            PerfParams.from_wire(bad)
    # a client that predates the flags: no SRQ, the default depth
    old = {k: v for k, v in _params("send_bw").to_wire().items() if k not in ("use_srq", "rx_depth")}
    assert PerfParams.from_wire(old) == _params("send_bw")


def test_cq_moderation_and_post_list_follow_perftest_and_travel_to_the_server() -> None:
    assert _params("write_bw").cq_mod() == 16 and _params("write_bw", "-t", "4").cq_mod() == 4
    assert _params("write_bw", "-Q", "5").cq_mod() == 5
    # as perftest: a post list sets the moderation to its length, unless -Q says otherwise
    assert _params("write_bw", "-l", "4").cq_mod() == 4 and _params("write_bw", "-l", "4", "-Q", "8").cq_mod() == 8
    assert _params("send_bw", "--post-list", "3").post_list == 3
    p = _params("read_bw", "-Q", "2", "-l", "6")
    assert PerfParams.from_wire(p.to_wire()) == p
    for bad in ({**p.to_wire(), "post_list": "6"}, {**p.to_wire(), "cq_moderation": True},
                {**p.to_wire(), "test": "read_lat"}):  # fmt: skip
        with pytest.raises(PerfUsageError):
            PerfParams.from_wire(bad)
    old = {k: v for k, v in _params("write_bw").to_wire().items() if k not in ("cq_moderation", "post_list")}
    assert PerfParams.from_wire(old) == _params("write_bw")


def test_histogram_and_unsorted_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["perf", "write_lat", "-H", "-U"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
