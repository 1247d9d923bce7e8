"""The Send batch (``daemon/rxsends.py``) does what the usual receive path does.

Two receiving devices built from the same seed, one with the compiled
lanes (where a GRO buffer of one-segment Sends is placed and completed in
one call) and one without, get the same datagrams from one sender: streams
of small Sends, mixed with ones the batch must leave to the usual path
(Solicited Event, Immediate Data, several segments, longer than their
receive, no receive posted yet, a receive with a bad lkey), lost,
duplicated, swapped, corrupted and coalesced.  After every step they must
answer the sender with the same bytes, be in the same link state and have
written the same CQEs; at the end they hold the same memory, counters and
QP state.
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from udpverbs.bench.inprocess import MR_LEN, Host
from udpverbs.wire import native, shm
from udpverbs.wire.shm import QPState as S, SendFlags as F, WrOpcode

from .twins import assert_twins_agree, close_all, turn, twins, twins_answer, with_twins

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler here: the daemon uses the Python path")

_STEP_S = 0.001
_RECV_AT, _RECV_STRIDE = MR_LEN // 2, 8192
#: (WR opcode, send flags, receive room: its share of the message, or None: posted late)
_KINDS = {"ok": (WrOpcode.IBV_WR_SEND, 0, 1.0), "se": (WrOpcode.IBV_WR_SEND, int(F.IBV_SEND_SOLICITED), 1.0),
          "imm": (WrOpcode.IBV_WR_SEND_WITH_IMM, 0, 1.0), "too_long": (WrOpcode.IBV_WR_SEND, 0, 0.5),
          "late": (WrOpcode.IBV_WR_SEND, 0, None), "bad_lkey": (WrOpcode.IBV_WR_SEND, 0, 1.0)}


@pytest.fixture(autouse=True)
def _roomy_qps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(Host.QP_CAPS, "max_recv_wr", 64)


def _post_send(a: Host, wr_id: int, src: int, length: int, peer: Host, opcode: int, flags: int) -> None:
    ring = a.qp.sq
    ring.prod = ring.hdr.producer
    at = ring.next_slot_offset()
    shm.SEND_WQE_HEAD.pack_into(ring.buf, at, wr_id, 0, int(opcode), int(F.IBV_SEND_SIGNALED) | flags, 1, 0x5EED,
                                peer.mr.stag, 0, 0, 0)
    shm.SGE.pack_into(ring.buf, at + shm.SEND_WQE_SG_OFFSET, a.mr.addr + src, length, a.mr.stag)
    ring.push()
    ring.publish()


def _post_recv(h: Host, wr_id: int, at: int, room: int, lkey: int) -> None:
    rq = h.qp.recv_ring
    rq.prod = rq.hdr.producer
    slot = rq.next_slot_offset()
    shm.RECV_WQE_HEAD.pack_into(rq.buf, slot, wr_id, 1)
    shm.SGE.pack_into(rq.buf, slot + shm.RECV_WQE_SG_OFFSET, h.mr.addr + at, room, lkey)
    rq.push()
    rq.publish()


def _stream(seed: int, sends: list[tuple[int, str]], loss: float, gro: float,
            armed: bool = False) -> tuple[Host, Host, Host]:
    """A Sends ``sends`` ((length, kind)) to both receivers (``armed``:
    whose CQs are armed for every completion); returns A and them."""
    rng = random.Random(seed)
    return with_twins(lambda a, fast, slow: _exchange(rng, a, fast, slow, sends, loss, gro, armed))


def _exchange(rng: random.Random, a: Host, fast: Host, slow: Host, sends: list[tuple[int, str]], loss: float,
              gro: float, armed: bool) -> tuple[Host, Host, Host]:
    clock, pa, pf, ps = twins(a, fast, slow)
    a.mr.view[:] = rng.randbytes(MR_LEN)
    late: list[tuple[int, int, int]] = []
    for i, (length, kind) in enumerate(sends):
        opcode, flags, share = _KINDS[kind]
        at = _RECV_AT + i * _RECV_STRIDE
        room = length if share is None else int(length * share)
        if share is None or late:
            late.append((i, at, room))
        else:
            for h in (fast, slow):
                _post_recv(h, 300 + i, at, room, h.mr.stag ^ 0x100 if kind == "bad_lkey" else h.mr.stag)
        _post_send(a, i, 4096 * i + 7, length, fast, opcode, flags)
    done: list[tuple[int, int]] = []
    held: list[bytes] = []
    replies = 0
    for step in range(3000):
        if step == 60:
            for i, at, room in late:
                for h in (fast, slow):
                    _post_recv(h, 300 + i, at, room, h.mr.stag)
        clock[0] += _STEP_S
        now = clock[0]
        if armed:
            for h in (fast, slow):
                h.cq.ring.hdr.armed = 1
        held += turn(a, pa, now)
        if rng.random() < 0.3:
            continue
        twins_answer(held, (a, fast, slow), (pa, pf, ps), rng, loss, gro, now)
        held = []
        done += a.completions()
        cqes = fast.cqes()
        assert cqes == slow.cqes()  # every field
        replies += len(cqes)
        if len(done) == len(sends) and replies >= len(sends) or a.qp.state == S.IBV_QPS_ERR and step > 100:
            break
    assert_twins_agree(fast, slow, pf, ps, ("rx_native_datagrams", "rx_native_sends", "rx_batched_sends"))
    assert (fast.qp.rx_msn, fast.qp.recv_ring.cons) == (slow.qp.rx_msn, slow.qp.recv_ring.cons)
    return a, fast, slow


_SEND = st.tuples(st.sampled_from([0, 1, 64, 700, 1024, 1400, 3000]),
                  st.sampled_from(["ok"] * 12 + ["se", "imm", "too_long", "late", "bad_lkey"]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32), sends=st.lists(_SEND, min_size=1, max_size=60),
       loss=st.sampled_from([0.0, 0.0, 0.02, 0.1]), gro=st.sampled_from([0.7, 1.0]))
def test_the_send_batch_and_the_usual_path_agree(seed: int, sends: list[tuple[int, str]], loss: float,
                                                  gro: float) -> None:
    close_all(*_stream(seed, sends, loss, gro))


@pytest.mark.parametrize("size", [1, 64, 1024])
def test_a_stream_of_small_sends_is_completed_in_batches(size: int) -> None:
    a, fast, slow = _stream(5, [(size, "ok")] * 60, 0.0, 1.0)
    try:
        # (the first goes the Python way: nothing told the lane of Sends before)
        assert fast.dev.stats["rx_native_sends"] == 59 and "rx_native_sends" not in slow.dev.stats
        assert fast.dev.stats["rx_batched_sends"] >= 50
        for i in range(60):
            at, src = _RECV_AT + i * _RECV_STRIDE, 4096 * i + 7
            assert bytes(fast.mr.view[at:at + size]) == bytes(a.mr.view[src:src + size])
    finally:
        close_all(a, fast, slow)


@pytest.mark.parametrize("kind", ["se", "imm", "too_long", "late", "bad_lkey"])
def test_a_send_the_batch_leaves_behind_ends_alike(kind: str) -> None:
    sends = [(64, "ok")] * 20 + [(64, kind)] + [(64, "ok")] * 20
    a, fast, slow = _stream(9, sends, 0.0, 1.0)
    try:
        assert fast.dev.stats["rx_batched_sends"] >= 15
        if kind in ("se", "imm", "late"):
            assert a.qp.state == fast.qp.state == S.IBV_QPS_RTS
            assert fast.dev.stats["rnr_nack_sent"] == (kind == "late")
        else:
            # the receive's error completes it and fails the QP; the sender learns by Terminate
            assert fast.qp.state == S.IBV_QPS_ERR and a.qp.state == S.IBV_QPS_ERR
    finally:
        close_all(a, fast, slow)


def test_an_armed_cq_is_woken_alike() -> None:
    # the application re-arms its CQ after every wake-up: each receiver
    # must signal its eventfd as often as the other
    a, fast, slow = _stream(13, [(64, "ok")] * 40, 0.0, 1.0, armed=True)
    try:
        wakes = [os.eventfd_read(h.cq.eventfd) for h in (fast, slow)]
        assert wakes[0] == wakes[1] > 0
    finally:
        close_all(a, fast, slow)
