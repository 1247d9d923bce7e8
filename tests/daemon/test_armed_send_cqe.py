"""The armed read of a Send writes its receive's CQE as the Python path would.

A device armed for a Send (``ReceiveLane.arm``) reads it, places it and,
when the read ends the Send, writes the receive's CQE in the same compiled
call (``udpv_rx_recv_send``); the pass then accounts for it.  Twin devices
get the same datagrams on their real sockets from one sender, one Send at
a time as a ping-pong sends them, each twin armed before each read: one
writes the CQE in the read, the other (the compiled lanes without it, or
the Python path alone) does not.  Mixed in are Sends the read must leave
to the usual path: Solicited Event, Immediate Data, Invalidate, several
segments, longer than their receive (an error completion and a
Terminate), no receive posted (RNR), a receive in another region; with a
QP's own receive queue or an SRQ, and a CQ armed for events.  After each
step the twins answer with the same bytes, are in the same link state and
have written the same CQEs.
"""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from udpverbs.bench.inprocess import MR_LEN, Host
from udpverbs.daemon import receive as receive_mod, udp as udp_mod
from udpverbs.daemon.cq import SharedReceiveQueue
from udpverbs.daemon.policy import IN_PASS_ORDER
from udpverbs.daemon.qp import QueuePair
from udpverbs.wire import native, shm
from udpverbs.wire.shm import QPState as S, SendFlags as F, WrOpcode

from .twins import close_all, link_state, receive_all, turn, twins

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler here: the daemon uses the Python path")

_STEP_S = 0.001
_RECV_AT, _RECV_STRIDE = MR_LEN // 2, 8192
_OP = {"ok": WrOpcode.IBV_WR_SEND, "se": WrOpcode.IBV_WR_SEND, "imm": WrOpcode.IBV_WR_SEND_WITH_IMM,
       "inv": WrOpcode.IBV_WR_SEND_WITH_INV, "too_long": WrOpcode.IBV_WR_SEND, "rnr": WrOpcode.IBV_WR_SEND,
       "spare": WrOpcode.IBV_WR_SEND}


@pytest.fixture(autouse=True)
def _pinned_arrival(monkeypatch: pytest.MonkeyPatch) -> None:
    # The twins read real sockets: a kernel arrival stamp would put each
    # twin's RTT sample at its own real moment, not on the test's clock.
    for mod in (receive_mod, udp_mod):
        monkeypatch.setattr(mod, "arrival", lambda stamp, now: now)
    monkeypatch.setitem(Host.QP_CAPS, "max_recv_wr", 64)


def _use_srq(h: Host) -> SharedReceiveQueue:
    """Give ``h`` a QP 1 that takes its receives from an SRQ."""
    srq = SharedReceiveQueue(1, h.sess, h.qp.pd, 64, 1, 0)
    h.qp.close()
    h.qp = QueuePair(h.dev, 1, h.sess, h.qp.pd, h.cq, h.cq, dict(Host.QP_CAPS), False, srq)
    h.dev.qps[1] = h.qp
    return srq


def _post_send(a: Host, wr_id: int, src: int, length: int, peer: Host, opcode: int, flags: int, imm: int) -> None:
    ring = a.qp.sq
    ring.prod = ring.hdr.producer
    at = ring.next_slot_offset()
    shm.SEND_WQE_HEAD.pack_into(ring.buf, at, wr_id, 0, int(opcode), int(F.IBV_SEND_SIGNALED) | flags, 1, imm,
                                peer.mr.stag, 0, 0, 0)
    shm.SGE.pack_into(ring.buf, at + shm.SEND_WQE_SG_OFFSET, a.mr.addr + src, length, a.mr.stag)
    ring.push()
    ring.publish()


def _post_recv(h: Host, wr_id: int, at: int, room: int, spare: bool) -> None:
    h.post_recv(wr_id, 0 if spare else at, room, local=h._spares[0] if spare else None)


def _deliver(a: Host, out: list[bytes], hosts: tuple[Host, Host]) -> None:
    """Send ``out`` from A's own socket to both twins and wait until each has it all."""
    sock = a.dev.udp.sock.sock  # (under the Recorder ``turn`` put there)
    for d in out:
        for h in hosts:
            sock.sendto(d, (h.dev.config.addr, h.dev.udp.sock.getsockname()[1]))
    if not out:
        return
    for h in hosts:
        deadline = time.monotonic() + 2.0
        while not h.dev.udp.rx_epoll.poll(0):
            assert time.monotonic() < deadline, "nothing arrived"
            time.sleep(0.0005)


def _read(h: Host, pl: object, now: float) -> None:
    """What a pass of ``h`` reads: armed first, as the data loop arms at
    the end of the pass before, then the socket drained."""
    dev = h.dev
    for _ in range(50):
        if dev.lane is not None and dev.lane.armed is None:
            dev.lane.arm(pl, dev.links, dev.arm_limit)  # type: ignore[arg-type]
        if not dev.receiver.step(now):
            break
        while dev.receiver.rest is not None:
            dev.receiver.receive_rest(now)
    for msg in pl.link.drain_received():  # type: ignore[attr-defined]
        dev.receiver.dispatch(pl, msg)  # type: ignore[arg-type]


def _pingpong(rng: random.Random, sends: list[tuple[int, str]], slow_native: bool, srq: bool,
              events: bool) -> tuple[Host, Host]:
    a = Host("127.0.0.2", gso=True, policy=IN_PASS_ORDER)
    fast = Host("127.0.0.3", gso=False, policy=IN_PASS_ORDER)
    slow = Host("127.0.0.3", gso=False, native=slow_native, policy=IN_PASS_ORDER)
    hosts = (fast, slow)
    srqs = [_use_srq(h) for h in hosts] if srq else []
    if slow.dev.lane is not None:
        slow.dev.lane.cqe_in_read = False
    try:
        clock, pa, pf, ps = twins(a, fast, slow)
        inv = [h.spare_stag() for h in hosts]
        assert inv[0] == inv[1]
        a.mr.view[:65536] = rng.randbytes(65536)
        for i, (length, kind) in enumerate(sends):
            at = _RECV_AT + (i % 32) * _RECV_STRIDE
            room = length // 2 if kind == "too_long" else length + rng.choice([0, 5])
            if kind != "rnr":
                for h in hosts:
                    _post_recv(h, 300 + i, at, room, kind == "spare")
            flags = int(F.IBV_SEND_SOLICITED) if kind == "se" else 0
            _post_send(a, i, 1024 * (i % 32) + 3, length, fast, _OP[kind], flags,
                       inv[0] if kind == "inv" else 0x1234 + i)
            done: list[tuple[int, int]] = []
            for step in range(400):
                clock[0] += _STEP_S
                now = clock[0]
                if events:
                    for h in hosts:
                        h.cq.ring.hdr.armed = 1
                _deliver(a, turn(a, pa, now), hosts)
                _read(fast, pf, now)
                _read(slow, ps, now)
                out_f, out_s = turn(fast, pf, now), turn(slow, ps, now)
                assert out_f == out_s  # the same ACKs, Modified ACKs, RNR NACKs, Terminates
                assert link_state(pf) == link_state(ps)
                assert fast.cqes() == slow.cqes()  # every field
                receive_all(a, pa, [(d, len(d)) for d in out_f], now)
                if kind == "rnr" and step == 3:
                    for h in hosts:
                        _post_recv(h, 300 + i, at, room, False)
                done += a.completions()
                if any(wr == i for wr, _ in done) or a.qp.state == S.IBV_QPS_ERR:
                    break
            if a.qp.state == S.IBV_QPS_ERR or fast.qp.state == S.IBV_QPS_ERR:
                break
        assert bytes(fast.mr.view) == bytes(slow.mr.view)
        assert fast.qp.state == slow.qp.state
        assert (fast.qp.rx_msn, fast.qp.recv_ring.cons) == (slow.qp.rx_msn, slow.qp.recv_ring.cons)
        assert pf.link.stats.as_dict() == ps.link.stats.as_dict()
        return a, fast
    finally:
        close_all(a, fast, slow)
        for s in srqs:
            s.close()


_SEND = st.tuples(st.sampled_from([0, 1, 2, 64, 1400, 3000]),
                  st.sampled_from(["ok"] * 10 + ["se", "imm", "inv", "too_long", "rnr", "spare"]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32), sends=st.lists(_SEND, min_size=1, max_size=24), slow_native=st.booleans(),
       srq=st.booleans(), events=st.booleans())
def test_the_armed_send_cqe_and_the_usual_path_agree(seed: int, sends: list[tuple[int, str]], slow_native: bool,
                                                     srq: bool, events: bool) -> None:
    _pingpong(random.Random(seed), sends, slow_native, srq, events)


@pytest.mark.parametrize("srq", [False, True])
def test_a_send_ping_pong_has_its_cqes_written_by_the_armed_read(srq: bool) -> None:
    # The first Send sets the hint; every later one is read armed, and its
    # receive's CQE written in the read.
    _, fast = _pingpong(random.Random(7), [(2, "ok")] * 12, True, srq, False)
    assert fast.dev.stats["rx_armed_send_cqes"] == 11
