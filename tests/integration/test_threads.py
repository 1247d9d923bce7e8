"""One Context used from several threads: what the README promises is safe.

Control verbs share the context's one control connection; posting to one
QP (or SRQ) and polling one CQ from two threads share a ring's private
index.  Each test runs its threads with a switch interval of a microsecond,
so that they interleave inside the verbs, not only between them.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from typing import Any, Callable, Iterator

from udpverbs import verbs
from udpverbs.wire.ctl import Op, StatusSection
from udpverbs.verbs.enums import (
    IBV_ACCESS_LOCAL_WRITE,
    IBV_QPS_INIT,
    IBV_QPT_RC,
    IBV_SEND_SIGNALED,
    IBV_WC_SUCCESS,
    IBV_WR_RDMA_WRITE,
    IBV_WR_SEND,
)

from .conftest import Side, connect_manual

PER_THREAD = 1000  #: work requests each thread posts (or completions it polls)
YIELD_S = 20e-6  #: how long a thread sleeps in the middle of a post or poll (_Yielding)


@contextlib.contextmanager
def _switching_often() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


class _Yielding:
    """A ring (``wire.shm.Ring``) that lets another thread run in the middle
    of each post or poll, right after the slot is chosen (or filled, or read): a short sleep
    drops the GIL there for long enough that a waiting thread takes it, where
    a thread switch would otherwise fall only now and then.  Everything else
    is the ring's own."""

    def __init__(self, ring: Any) -> None:
        self._ring = ring

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ring, name)

    def next_slot_offset(self) -> int:
        off = self._ring.next_slot_offset()
        time.sleep(YIELD_S)
        return off

    def slot_offset(self, i: int = 0) -> int:
        off = self._ring.slot_offset(i)
        time.sleep(YIELD_S)
        return off

    # The compiled post and poll fill or read their slots in one call: the
    # window is between that and moving the ring's private index.
    def push(self, n: int = 1) -> None:
        time.sleep(YIELD_S)
        self._ring.push(n)

    def pop(self, n: int = 1) -> None:
        time.sleep(YIELD_S)
        self._ring.pop(n)


def _run_threads(targets: list[Callable[[], None]], timeout_s: float = 60.0) -> None:
    """Run each target in its own thread, all at once; re-raise the first error."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(targets))

    def run(target: Callable[[], None]) -> None:
        try:
            start.wait(10)
            target()
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,), daemon=True) for t in targets]
    with _switching_often():
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a thread did not finish in time"
    if errors:
        raise errors[0]


def _qp(side: Side, cq: verbs.CQ, depth: int) -> verbs.QP:
    return verbs.QP(side.pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq, sq_sig_all=0,
                                              cap=verbs.QPCap(depth, depth, 1, 1)))


def _in_use(ctx: verbs.Context) -> dict[str, int]:
    """What the daemon holds (``udpverbs devinfo``'s "in use" line)."""
    rep, _ = ctx.call(Op.QUERY_STATUS, section=int(StatusSection.DEVICE), start=0)
    dev = json.loads(rep.data)
    return {k: dev[k] for k in ("qps", "cqs", "mrs")}


def test_control_verbs_from_several_threads_share_one_context(sides) -> None:
    side, _ = sides
    before = _in_use(side.ctx)
    done: list[int] = []

    def churn() -> None:
        for _ in range(25):
            with verbs.PD(side.ctx) as pd:
                verbs.MR(pd, 4096, IBV_ACCESS_LOCAL_WRITE)
                cq = verbs.CQ(side.ctx, 16)
                qp = verbs.QP(pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq))
                qp.to_init(verbs.QPAttr(qp_access_flags=IBV_ACCESS_LOCAL_WRITE))
                assert qp.query()[0].qp_state == IBV_QPS_INIT and side.ctx.query_stats()
                cq.close()  # closes the QP first; the PD takes the MR with it
            done.append(1)

    _run_threads([churn] * 4)
    assert len(done) == 100
    # what the threads made is gone, in the daemon and in the library's tree, and the context goes on working
    assert _in_use(side.ctx) == before and side.ctx._children == [side.pd, side.cq]
    assert verbs.PD(side.ctx).handle


def test_two_threads_posting_to_one_qp_lose_no_work_request(sides) -> None:
    a, b = sides
    threads = 2  # posting sends, and as many posting receives
    n = threads * PER_THREAD
    cq_a, cq_b = verbs.CQ(a.ctx, 2 * n), verbs.CQ(b.ctx, 2 * n)
    qa, qb = _qp(a, cq_a, n), _qp(b, cq_b, n)
    connect_manual(a, qa, b, qb)
    qa._sq, qb._rq = _Yielding(qa._sq), _Yielding(qb._rq)

    def sends(first: int) -> Callable[[], None]:
        return lambda: [qa.post_send(verbs.SendWR(wr_id=first + i, opcode=IBV_WR_SEND,
                                                  send_flags=IBV_SEND_SIGNALED)) for i in range(PER_THREAD)]

    def receives(first: int) -> Callable[[], None]:
        return lambda: [qb.post_recv(verbs.RecvWR(wr_id=first + i)) for i in range(PER_THREAD)]

    _run_threads([post(t * PER_THREAD) for t in range(threads) for post in (sends, receives)])
    for cq in (cq_a, cq_b):
        wcs = cq.poll_blocking(n, timeout=30)
        assert sorted(wc.wr_id for wc in wcs) == list(range(n))
        assert {wc.status for wc in wcs} == {IBV_WC_SUCCESS}


def test_two_threads_polling_one_cq_take_each_completion_once(sides) -> None:
    a, b = sides
    n = 2 * PER_THREAD
    cq = verbs.CQ(a.ctx, n)
    qa = _qp(a, cq, n)
    connect_manual(a, qa, b, b.qp)
    for i in range(n):
        wr = verbs.SendWR(wr_id=i, opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(a.mr.buf, 8, a.mr.lkey)],
                          send_flags=IBV_SEND_SIGNALED)
        wr.set_wr_rdma(b.mr.rkey, b.mr.buf)
        qa.post_send(wr)
    deadline = time.monotonic() + 30
    while cq._ring.available() < n:  # every completion waits in the CQ before the threads start
        assert time.monotonic() < deadline, f"{cq._ring.available()} of {n} completions"
        time.sleep(0.01)
    taken: list[list[int]] = [[], []]
    cq._ring = _Yielding(cq._ring)

    def poller(mine: list[int]) -> Callable[[], None]:
        def run() -> None:
            while sum(map(len, taken)) < n:
                _, wcs = cq.poll(1 + len(mine) % 7)
                mine.extend(wc.wr_id for wc in wcs)
        return run

    _run_threads([poller(taken[0]), poller(taken[1])])
    assert sorted(taken[0] + taken[1]) == list(range(n))
    assert taken[0] and taken[1], "both threads took completions"
    assert cq.poll(1) == (0, [])


def test_two_threads_posting_to_one_srq_lose_no_receive(sides) -> None:
    a, b = sides
    threads = 2
    n = threads * PER_THREAD
    cq_a, cq_b = verbs.CQ(a.ctx, 2 * n), verbs.CQ(b.ctx, 2 * n)
    srq = verbs.SRQ(b.pd, verbs.SrqInitAttr(verbs.SrqAttr(max_wr=n, max_sge=1)))
    qa = _qp(a, cq_a, n)
    qb = verbs.QP(b.pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=cq_b, rcq=cq_b, srq=srq,
                                         cap=verbs.QPCap(16, 1, 1, 1)))
    connect_manual(a, qa, b, qb)
    srq._ring = _Yielding(srq._ring)

    def receives(first: int) -> Callable[[], None]:
        return lambda: [srq.post_recv(verbs.RecvWR(wr_id=first + i)) for i in range(PER_THREAD)]

    _run_threads([receives(t * PER_THREAD) for t in range(threads)])
    for i in range(n):
        qa.post_send(verbs.SendWR(wr_id=i, opcode=IBV_WR_SEND, send_flags=IBV_SEND_SIGNALED))
    wcs = cq_b.poll_blocking(n, timeout=30)
    assert sorted(wc.wr_id for wc in wcs) == list(range(n))
