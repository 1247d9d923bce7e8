"""The control connection: framing, the parameter handshake, a whole session in two threads."""

from __future__ import annotations

import io
import struct
import threading
from typing import Any, Callable

import pytest

from udpverbs.bench.control import ControlChannel, ControlError, accept, connect, listen
from udpverbs.bench.perf import PerfParams, Session, hello, welcome


def _pair() -> tuple[ControlChannel, ControlChannel]:
    listener = listen("127.0.0.1", 0)
    try:
        client = connect("127.0.0.1", listener.getsockname()[1], 5.0)
        server = accept(listener, 5.0)
    finally:
        listener.close()
    return server, client


class _Thread(threading.Thread):
    """Runs a function and keeps its result or exception for the test to check."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # handed to the test thread
            self.error = e


def test_frames_round_trip_and_exchange_is_a_barrier() -> None:
    server, client = _pair()
    with server, client:
        client.send({"op": "x", "n": [1, 2]})
        assert server.recv(5.0) == {"op": "x", "n": [1, 2]}
        t = _Thread(lambda: server.exchange({"op": "step", "side": "s"}, 5.0))
        t.start()
        assert client.exchange({"op": "step", "side": "c"}, 5.0)["side"] == "s"
        t.join(5.0)
        assert t.error is None and t.result["side"] == "c"


def test_malformed_frames_raise_control_error() -> None:
    server, client = _pair()
    with server, client:
        client.sock.sendall(struct.pack("!I", 5) + b"nope!")
        with pytest.raises(ControlError, match="not JSON"):
            server.recv(5.0)
        client.sock.sendall(struct.pack("!I", 2) + b"[]")
        with pytest.raises(ControlError, match="not a JSON object"):
            server.recv(5.0)
        client.sock.sendall(struct.pack("!I", 1 << 30))
        with pytest.raises(ControlError, match="exceeds"):
            server.recv(5.0)


def test_silence_and_close_raise_control_error() -> None:
    server, client = _pair()
    with server:
        with pytest.raises(ControlError, match="silent"):
            server.recv(0.05)
        client.close()
        with pytest.raises(ControlError, match="closed"):
            server.recv(5.0)


def test_expect_reports_the_peers_error_and_wrong_steps() -> None:
    server, client = _pair()
    with server, client:
        client.send({"op": "error", "message": "no daemon"})
        with pytest.raises(ControlError, match="no daemon"):
            server.expect("udp", 5.0)
        client.send({"op": "bye"})
        with pytest.raises(ControlError, match="expected 'udp'"):
            server.expect("udp", 5.0)


def test_handshake_agrees_on_the_clients_parameters() -> None:
    server, client = _pair()
    params = PerfParams(test="write_bw", size=4096, iters=10, baseline="raw-udp").validate()
    with server, client:
        t = _Thread(lambda: welcome(server, "write_bw", 5.0))
        t.start()
        hello(client, params)
        t.join(5.0)
        assert t.error is None and t.result == params


def test_handshake_refuses_another_test_on_both_sides() -> None:
    server, client = _pair()
    with server, client:
        t = _Thread(lambda: welcome(server, "read_lat", 5.0))
        t.start()
        with pytest.raises(ControlError, match="started for read_lat"):
            hello(client, PerfParams(test="write_lat").validate())
        t.join(5.0)
        assert isinstance(t.error, ControlError)


def test_baseline_session_in_two_threads_prints_the_same_rows_on_both_sides() -> None:
    params = PerfParams(test="write_lat", size=3000, iters=20, mtu=1500, baseline="raw-udp", baseline_only=True).validate()
    server, client = _pair()
    out_s, out_c = io.StringIO(), io.StringIO()
    with server, client:
        t = _Thread(lambda: Session(params, server, is_client=False, out=out_s, json_out=True).run())
        t.start()
        rows = Session(params, client, is_client=True, out=out_c, json_out=True).run()
        t.join(10.0)
    assert t.error is None
    assert rows == t.result and len(rows) == 1
    assert out_s.getvalue() == out_c.getvalue()
    base = rows[0].baseline
    assert rows[0].ours is None and base is not None and base.iterations == 20
    assert 0 < base.t_min_us <= base.t_typical_us <= base.t_max_us


def test_bidirectional_baseline_adds_the_servers_stream_to_the_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    # -b: each side streams on its own socket pair while it receives the
    # other's; the row is the client's stream plus the server's
    params = PerfParams(test="write_bw", size=5000, iters=200, baseline="raw-udp", baseline_only=True,
                        bidirectional=True).validate()  # fmt: skip
    own: dict[bool, Any] = {}
    real = Session._raw_both_ways

    def recording(self, *a):  # type: ignore[no-untyped-def]
        own[self.is_client] = stats = real(self, *a)
        return stats

    monkeypatch.setattr(Session, "_raw_both_ways", recording)
    server, client = _pair()
    out_s, out_c = io.StringIO(), io.StringIO()
    with server, client:
        t = _Thread(lambda: Session(params, server, is_client=False, out=out_s).run())
        t.start()
        rows = Session(params, client, is_client=True, out=out_c).run()
        t.join(30.0)
    assert t.error is None and rows == t.result
    (row,) = rows
    assert row.bidirectional and row.ours is None and row.baseline is not None
    assert own[True].iterations == own[False].iterations == row.baseline.iterations == 200
    assert row.baseline.bw_avg_MBps == pytest.approx(own[True].bw_avg_MBps + own[False].bw_avg_MBps)
    assert all("RDMA_Write Bidirectional BW Test" in out.getvalue() for out in (out_s, out_c))


@pytest.mark.parametrize(
    "report, fragment",
    [
        ({"ours": {"iterations": 5, "bw_peak_MBps": 1.0}, "baseline": None}, "malformed bandwidth report"),
        ({"ours": "fast", "baseline": None}, "malformed bandwidth report"),
        ({"ours": {"iterations": 5, "bw_peak_MBps": "x", "bw_avg_MBps": 1, "msg_rate_Mpps": 1}, "baseline": None},
         "malformed bandwidth report"),
        ({"ours": {"iterations": 5, "t_min_us": 1, "t_max_us": 1, "t_typical_us": 1, "t_avg_us": 1, "t_stdev_us": 0,
                   "p99_us": 1, "p999_us": 1}, "baseline": None}, "malformed bandwidth report"),
        ({"ours": None, "baseline": None}, "disagree on whether ours ran"),
    ],
    ids=["missing_figures", "not_an_object", "not_a_number", "latency_figures", "no_figures"],
)
def test_a_bad_bidirectional_report_is_a_control_error(report: dict[str, Any], fragment: str) -> None:
    from udpverbs.bench.stats import BandwidthStats

    params = PerfParams(test="write_bw", bidirectional=True).validate()
    server, client = _pair()
    mine = BandwidthStats(iterations=5, bw_peak_MBps=2.0, bw_avg_MBps=1.0, msg_rate_Mpps=0.1)
    with server, client:
        server.send({"op": "bw-report", **report})
        with pytest.raises(ControlError, match=fragment):
            Session(params, client, is_client=True)._both_ways(mine, None)


@pytest.mark.parametrize("pct", [None, [1.0], [1.0, "2"], [True, 2.0], [1.0, -2.0], 5.0], ids=repr)
def test_a_bad_cpu_report_is_a_control_error(pct: Any) -> None:
    params = PerfParams(test="write_bw", cpu_util=True).validate()
    server, client = _pair()
    with server, client:
        server.send({"op": "cpu", "pct": pct})
        with pytest.raises(ControlError, match="malformed CPU figures from the server"):
            Session(params, client, is_client=True)._both_daemons([50.0, 40.0])
