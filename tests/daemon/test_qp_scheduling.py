"""Which QPs a data-loop pass visits, and in what order they send.

A pass does not walk every QP: idle QPs are looked at only for new WQEs,
QPs with data to send wait on their link's ready line and take turns while
the link has room, and a QP is visited for completions only when a message
or an ACK concerns it (``QPScheduler`` in daemon/scheduler.py).  The suite as a
whole runs with ``UDPVERBS_CHECK_PASSES`` (tests/conftest.py), which checks
after every pass that no QP was left with work where no pass would find it;
these tests pin the cost and the order.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from udpverbs.daemon.scheduler import SQWatch
from udpverbs.daemon.udp import UDP_SEGMENT
from udpverbs.daemon.qp import QueuePair
from udpverbs.wire import native as wire_native
from udpverbs.wire import link as wire_link
from udpverbs.wire import segment
from udpverbs.wire.envelope import Kind
from udpverbs.wire.rdmap import Opcode
from udpverbs.wire.shm import WcStatus as W

from udpverbs.bench.inprocess import Host, establish, qp_pairs


def _count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Record the QPN of every call of ``QueuePair.<name>``."""
    calls: list[int] = []
    real = getattr(QueuePair, name)

    def counted(self: QueuePair, *args: Any) -> Any:
        calls.append(self.qpn)
        return real(self, *args)

    monkeypatch.setattr(QueuePair, name, counted)
    return calls


def _quiet(a: Host, b: Host, passes: int = 50) -> None:
    for _ in range(passes):
        a.dev.poll_once()
        b.dev.poll_once()


async def test_an_idle_pass_visits_no_qp_and_a_post_wakes_only_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = Host("127.0.0.2", gso=True), Host("127.0.0.3", gso=True)
    try:
        pairs = qp_pairs(a, b, 64)
        await establish(a, b)
        _quiet(a, b)
        pumped = _count_calls(monkeypatch, "pump")
        completed = _count_calls(monkeypatch, "complete_acked")
        for _ in range(20):
            a.dev.poll_once()
            b.dev.poll_once()
        assert pumped == [] and completed == []

        qa, qb = pairs[36]
        a.post_write(5, 0, 3000, b, 8192, qp=qa)
        a.dev.poll_once()
        assert pumped == [qa.qpn]  # the one QP with a new WQE, no other
        done: list[tuple[int, int]] = []
        for _ in range(2000):
            b.dev.poll_once()
            a.dev.poll_once()
            done += a.completions()
            if done:
                break
        assert done == [(5, W.IBV_WC_SUCCESS)]
        assert set(pumped) == {qa.qpn} and set(completed) == {qa.qpn}
        assert bytes(b.mr.view[8192:8192 + 3000]) == bytes(a.mr.view[:3000])
    finally:
        a.close()
        b.close()


class Tap:
    """The socket of a Device, recording the QPN and opcode of every DDP
    segment it sends."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.sent: list[tuple[int, int, int]] = []  # (QPN, RDMAP opcode, last flag)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)

    def _note(self, datagram: Any) -> None:
        h, body = wire_link.decode_untrusted(datagram)
        if h.ptype != wire_link.PacketType.DATA:
            return
        env, hdr, _ = segment.decode_untrusted(body)
        if env.kind == Kind.DDP:
            self.sent.append((env.src_qpn, int(hdr.opcode), int(hdr.last)))

    def sendto(self, data: Any, addr: Any) -> int:
        self._note(data)
        return self.sock.sendto(data, addr)

    def sendmsg(self, buffers: list[Any], anc: Any, flags: int, addr: Any) -> int:
        # as the kernel cuts a UDP_SEGMENT send: the buffers end to end, in datagrams of the size given
        (size,) = [int.from_bytes(v, sys.byteorder) for _, kind, v in anc if kind == UDP_SEGMENT]
        data = b"".join(bytes(d) for d in buffers)
        for at in range(0, len(data), size):
            self._note(data[at:at + size])
        return self.sock.sendmsg(buffers, anc, flags, addr)


@pytest.mark.parametrize("native", [True, False])
async def test_qps_take_turns_and_each_write_leaves_in_one_run(native: bool) -> None:
    """Three QPs with four 64 KiB Writes each, through a link that takes 60
    messages at a time: every Write's 47 segments leave back to back (the
    receiver's compiled lane places a run per QP), and the QPs take turns
    (no QP starts its third Write before every QP has started its first)."""
    a, b = Host("127.0.0.2", gso=True, native=native), Host("127.0.0.3", gso=True, native=native)
    a.dev.link_config.send_buffer_packets = 60
    tap = Tap(a.dev.udp.sock)
    try:
        pairs = qp_pairs(a, b, 3)
        await establish(a, b)
        a.dev.udp.sock = tap  # type: ignore[assignment]
        n = 4
        for k, (qa, _) in enumerate(pairs):
            for i in range(n):
                a.post_write(10 * k + i, 65536 * i, 65536, b, 65536 * (n * k + i), qp=qa)
        done: list[tuple[int, int]] = []
        for _ in range(20000):
            a.dev.poll_once()
            b.dev.poll_once()
            done += a.completions()
            if len(done) == 3 * n:
                break
        assert sorted(done) == sorted((10 * k + i, W.IBV_WC_SUCCESS) for k in range(3) for i in range(n))
        for k in range(3):
            for i in range(n):
                at = 65536 * (n * k + i)
                assert bytes(b.mr.view[at:at + 65536]) == bytes(a.mr.view[65536 * i:65536 * (i + 1)])
        writes = [(qpn, last) for qpn, op, last in tap.sent if op == Opcode.RDMA_WRITE]
        per = -(-65536 // a.qp.link.max_data)  # segments per Write
        assert len(writes) == 3 * n * per  # no retransmission on loopback
        starts = []
        for j in range(0, len(writes), per):
            run = writes[j:j + per]
            assert {qpn for qpn, _ in run} == {run[0][0]}, f"Write {j // per} interleaved with another QP's"
            assert [last for _, last in run] == [0] * (per - 1) + [1]
            starts.append(run[0][0])
        first_of_each = max(starts.index(qa.qpn) for qa, _ in pairs)
        for qa, _ in pairs:
            third = [i for i, q in enumerate(starts) if q == qa.qpn][2]
            assert third > first_of_each, f"QP {qa.qpn} started its third Write before another its first: {starts}"
    finally:
        a.dev.udp.sock = tap.sock
        a.close()
        b.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["post", "consume", "watch", "unwatch", "scan"]),
                          st.integers(0, 5), st.integers(1, 3)), max_size=40))
def test_the_compiled_sq_watch_finds_what_the_python_one_finds(ops: list[tuple[str, int, int]]) -> None:
    """Both SQWatch forms, over the same rings and the same members, take
    the same QPs: watched ones whose producer index moved past the daemon's."""
    native = wire_native.load()
    if native is None:
        pytest.skip("no compiled module on this machine")
    a = Host("127.0.0.2", gso=False)
    try:
        a.more_qps = [QueuePair(a.dev, qpn, a.sess, a.qp.pd, a.cq, a.cq, dict(Host.QP_CAPS), False)
                      for qpn in range(2, 7)]
        qps = [a.qp, *a.more_qps]
        for rank, qp in enumerate(qps):
            qp.rank = rank
        fast, slow = SQWatch(qps, native), SQWatch(qps, None)
        for op, i, n in ops:
            qp = qps[i]
            if op == "post":  # as the application does: WQE slots, then the index
                qp.sq.hdr.producer = (qp.sq.hdr.producer + n) & 0xFFFFFFFF
            elif op == "consume":
                qp.sq.pop(min(n, qp.sq.available()))
            elif op in ("watch", "unwatch"):
                for w in (fast, slow):
                    (w.add if op == "watch" else w.discard)(qp)
            else:
                assert fast.take_posted() == slow.take_posted()
                assert fast.members == slow.members
        assert fast.take_posted() == slow.take_posted()
    finally:
        a.close()
