"""The raw-UDP baseline: sane rows, bursts, and repair of lost datagrams."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import pytest

from udpverbs import cli
from udpverbs.bench import rawudp
from udpverbs.bench.stats import bandwidth_stats, latency_stats


class LossyRelay(threading.Thread):
    """Forwards datagrams between two sockets, dropping the ones numbered in ``drop``."""

    def __init__(self, drop: set[int]) -> None:
        super().__init__(daemon=True)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.drop = drop
        self.ends: tuple[tuple[str, int], tuple[str, int]] | None = None
        self.stop = threading.Event()
        self.forwarded = 0
        self.dropped = 0

    def run(self) -> None:
        assert self.ends is not None
        a, b = self.ends
        deadline = time.monotonic() + 60
        count = 0
        while not self.stop.is_set() and time.monotonic() < deadline:
            if not select.select([self.sock], [], [], 0.02)[0]:
                continue
            data, src = self.sock.recvfrom(65536)
            count += 1
            if count in self.drop:
                self.dropped += 1
                continue
            self.sock.sendto(data, b if src == a else a)
            self.forwarded += 1


@pytest.fixture
def relayed():  # type: ignore[no-untyped-def]
    """Two baseline sockets talking through a relay that drops datagrams 3, 10 and 11."""
    relay = LossyRelay({3, 10, 11})
    a, b = rawudp.open_socket("127.0.0.1"), rawudp.open_socket("127.0.0.1")
    relay.ends = (a.getsockname(), b.getsockname())
    a.connect(relay.sock.getsockname())
    b.connect(relay.sock.getsockname())
    relay.start()
    try:
        yield a, b, relay
    finally:
        relay.stop.set()
        relay.join(5)
        for s in (a, b, relay.sock):
            s.close()


def _serve(fn, sock, size, window):  # type: ignore[no-untyped-def]
    done = threading.Event()
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["n"] = fn(sock, size, 1500, stop=done.is_set, run=7, window=window)
        except BaseException as e:  # checked by the test
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return done, t, result


def test_ping_pong_in_bursts_survives_lost_datagrams(relayed) -> None:  # type: ignore[no-untyped-def]
    a, b, relay = relayed
    size = 6 * rawudp.chunk_bytes(1500) + 5  # 7 datagrams: bursts of 2, 2, 2, 1
    done, t, result = _serve(rawudp.latency_server, b, size, 2)
    samples = rawudp.latency_client(a, size, 1500, iters=6, warmup=1, run=7, window=2)
    done.set()
    t.join(10)
    assert "error" not in result and result["n"] == 7
    assert len(samples) == 6 and relay.dropped == 3
    assert latency_stats(samples).t_min_us > 0


def test_read_shaped_ping_pong_small_request_long_reply(relayed) -> None:  # type: ignore[no-untyped-def]
    a, b, relay = relayed
    size = 5 * rawudp.chunk_bytes(1500)  # the reply: 5 datagrams, bursts of 2, 2, 1; the request: 1 byte
    done = threading.Event()
    result: dict[str, object] = {}

    def serve() -> None:
        result["n"] = rawudp.latency_server(b, size, 1500, stop=done.is_set, run=9, window=2, request_size=1)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    samples = rawudp.latency_client(a, size, 1500, iters=5, run=9, window=2, request_size=1, rtt_factor=1)
    done.set()
    t.join(10)
    assert result["n"] == 5 and len(samples) == 5 and relay.dropped == 3


def test_stream_survives_lost_datagrams_and_counts_every_message(relayed) -> None:  # type: ignore[no-untyped-def]
    a, b, relay = relayed
    size = 3000  # 3 datagrams a message
    done, t, result = _serve(rawudp.bandwidth_server, b, size, 8)
    start, completions = rawudp.bandwidth_client(a, size, 1500, iters=40, run=7, window=8)
    done.set()
    t.join(10)
    assert "error" not in result and result["n"] == 120
    assert len(completions) == 40 and relay.dropped == 3
    assert completions == sorted(completions) and completions[0] > start
    assert bandwidth_stats(size, start, completions, 8).bw_avg_MBps > 0


def _answered_server(sock, size, window):  # type: ignore[no-untyped-def]
    def answering(sock, size, mtu, **kw):  # type: ignore[no-untyped-def]
        return rawudp.bandwidth_server(sock, size, mtu, answer=True, **kw)

    return _serve(answering, sock, size, window)


def test_answered_stream_survives_lost_datagrams(relayed) -> None:  # type: ignore[no-untyped-def]
    a, b, relay = relayed
    done, t, result = _answered_server(b, 8, 4)
    start, completions = rawudp.bandwidth_client(a, 8, 1500, iters=30, run=7, window=4, answer=True)
    done.set()
    t.join(10)
    assert "error" not in result and result["n"] == 30
    # every request answered: 30 requests + 30 answers + 3 repeated, less 3 dropped
    assert len(completions) == 30 and relay.dropped == 3 and relay.forwarded + relay.dropped >= 60
    assert completions == sorted(completions) and completions[0] > start


def test_answered_stream_for_a_duration_completes_what_it_sent() -> None:
    a, b = rawudp.open_socket("127.0.0.1"), rawudp.open_socket("127.0.0.1")
    with a, b:
        a.connect(b.getsockname())
        b.connect(a.getsockname())
        done, t, result = _answered_server(b, 8, 16)
        start, completions = rawudp.bandwidth_client(a, 8, 1500, iters=0, duration_s=0.2, run=7, window=16,
                                                     answer=True)  # fmt: skip
        done.set()
        t.join(10)
        assert "error" not in result and result["n"] == len(completions) > 0


def test_answered_stream_needs_one_datagram_messages() -> None:
    a = rawudp.open_socket("127.0.0.1")
    with a, pytest.raises(rawudp.BaselineError, match="one datagram"):
        rawudp.bandwidth_client(a, 5000, 1500, iters=1, answer=True)


def test_server_pause_delays_every_answer_but_the_first() -> None:
    a, b = rawudp.open_socket("127.0.0.1"), rawudp.open_socket("127.0.0.1")
    with a, b:
        a.connect(b.getsockname())
        b.connect(a.getsockname())
        done = threading.Event()
        result: dict[str, object] = {}

        def serve() -> None:
            result["n"] = rawudp.latency_server(b, 2, 1500, stop=done.is_set, run=3, pause_s=0.01)

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        samples = rawudp.latency_client(a, 2, 1500, iters=4, warmup=1, run=3)
        done.set()
        t.join(10)
        # the next request waits in the socket while the server pauses: half a round trip >= ~5 ms
        assert result["n"] == 5 and min(samples) >= 4_000_000


def test_stale_datagrams_of_another_run_are_ignored() -> None:
    a, b = rawudp.open_socket("127.0.0.1"), rawudp.open_socket("127.0.0.1")
    with a, b:
        a.connect(b.getsockname())
        b.connect(a.getsockname())
        # leftovers of run 1 waiting in the client's socket must not count as replies in run 2
        for i in range(3):
            b.send(rawudp.HDR.pack(rawudp.KIND_DATA, rawudp.FLAG_FIN, 1, i, 0, 1) + b"xx")
        done, t, result = _serve(rawudp.latency_server, b, 2, None)
        samples = rawudp.latency_client(a, 2, 1500, iters=5, run=7)
        done.set()
        t.join(10)
        assert "error" not in result and result["n"] == 5 and len(samples) == 5


def test_silent_peer_raises_instead_of_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rawudp, "GIVE_UP_S", 0.3)
    a, b = rawudp.open_socket("127.0.0.1"), rawudp.open_socket("127.0.0.1")
    with a, b:
        a.connect(b.getsockname())
        with pytest.raises(rawudp.BaselineError, match="silent"):
            rawudp.latency_client(a, 2, 1500, iters=1, run=1)


@pytest.mark.parametrize("mtu", [1500, 9000, 65535])
def test_a_full_window_fits_a_receiver_that_reads_nothing(mtu: int) -> None:
    # The window is all a stream may have unacknowledged: a receiver that
    # falls behind must still find every datagram of it in its buffer, or
    # the stream waits out a retransmission timeout (at 64 KB datagrams a
    # window counted at 4 KB a datagram was 256, twice what the buffer took).
    a, b = rawudp.open_socket("127.0.0.1"), rawudp.open_socket("127.0.0.1")
    with a, b:
        a.connect(b.getsockname())
        window = rawudp.default_window(b, mtu)
        assert window >= 4
        datagram = bytes(mtu - rawudp.IP_UDP_OVERHEAD)
        for _ in range(window):
            a.send(datagram)
        b.setblocking(False)
        got = 0
        try:
            while got <= window:
                b.recv(len(datagram))
                got += 1
        except BlockingIOError:
            pass
        assert got == window


def test_mtu_without_room_is_refused() -> None:
    with pytest.raises(rawudp.BaselineError):
        rawudp.chunk_bytes(rawudp.IP_UDP_OVERHEAD + rawudp.HDR.size)


@pytest.mark.parametrize(
    "test, extra, keys",
    [
        ("write_lat", ["-s", "3000", "-n", "30"], {"t_typical_us", "p999_us"}),
        ("write_bw", ["-s", "5000", "-n", "200"], {"bw_avg_MBps", "msg_rate_Mpps"}),
        ("send_lat", ["--rnr-delay-us", "200", "-n", "20"], {"t_typical_us", "p999_us"}),
        ("send_bw", ["-s", "5000", "-n", "200"], {"bw_avg_MBps", "msg_rate_Mpps"}),
        ("atomic_lat", ["-n", "30"], {"t_typical_us", "p999_us"}),
        ("atomic_bw", ["-t", "16", "-n", "300"], {"bw_avg_MBps", "msg_rate_Mpps"}),
    ],
)
def test_local_baseline_run_in_two_processes_gives_sane_json(
    test: str, extra: list[str], keys: set[str], capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli.main(["perf", test, "--local", "--baseline", "raw-udp", "--baseline-only", "--json", *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 1
    row = rows[0]
    assert keys <= set(row)
    assert (row["test"], row["transport"], row["iterations"]) == (test, "raw-udp", int(extra[-1]))
    assert all(row[k] > 0 for k in keys)
    assert row["bytes"] == (8 if test.startswith("atomic") else int(extra[1]) if extra[0] == "-s" else 2)
    assert row.get("rnr_delay_us", 0) == (200 if "--rnr-delay-us" in extra else 0)
