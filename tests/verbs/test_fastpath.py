"""The compiled post and poll (verbs/_fastpath.c) against the Python path.

Both write the same WQE bytes and raise the same errors at the same work
request of a post list; both build the same work completions.  The rings
live in plain memory, the daemon's side of each read through cffi.
"""

from __future__ import annotations

import errno
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from udpverbs import verbs
from udpverbs.verbs import cq as cq_module, qp as qp_module
from udpverbs.wire import shm

from ..wire.strategies import SETTINGS, u32, u64
from .test_layout import _Rings

pytestmark = pytest.mark.skipif(qp_module._fast is None, reason="no compiler: the Python path alone")

INLINE = shm.SendFlags.IBV_SEND_INLINE
SIGNALED = shm.SendFlags.IBV_SEND_SIGNALED
#: what inline SGEs point at: memory of this process, as an application's buffer
_SOURCE = shm.ffi.new("char[]", bytes(range(256)) * 2)
_BASE = int(shm.ffi.cast("uintptr_t", _SOURCE))


@pytest.fixture(params=["compiled", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "python":
        monkeypatch.setattr(qp_module, "_fast", None)
        monkeypatch.setattr(cq_module, "_fast", None)
    yield request.param


# --- post lists ---------------------------------------------------------------------------

_sges = st.lists(st.builds(lambda off, n, lkey: verbs.SGE(_BASE + off, n, lkey), st.integers(0, 255),
                           st.integers(0, 40), u32), max_size=5)
#: mostly good values, now and then one the verbs refuse
_opcodes = st.sampled_from([*shm.WrOpcode, -1, 1 << 32, None])
_flags = st.sampled_from([0, SIGNALED, INLINE, INLINE | SIGNALED, shm.SendFlags.IBV_SEND_FENCE | 6, 1 << 32])


@st.composite
def _send_wrs(draw: Any) -> verbs.SendWR:
    sg = draw(_sges)
    if sg and draw(st.integers(0, 9)) == 0:
        sg[-1].addr = -1  # an address no SGE has
    wr = verbs.SendWR(wr_id=draw(st.integers(-(1 << 70), 1 << 70)), opcode=draw(_opcodes), sg=sg,
                      send_flags=draw(_flags), imm_data=draw(st.integers(-(1 << 40), 1 << 40)),
                      num_sge=draw(st.sampled_from([None, None, None, len(sg) + 1, -1])))
    wr.set_wr_atomic(draw(st.one_of(u32, st.just(-1))), draw(st.one_of(u64, st.just(1 << 64))),
                     draw(st.integers(-(1 << 64), 1 << 65)), draw(u64))
    return wr


def _post(r: _Rings, post: Any) -> tuple[Any, ...]:
    """Post with ``post(qp)``; what it left: the error (kind, text, which WR), the ring's bytes, the doorbells."""
    failure = None
    try:
        post(r.qp)
    except (verbs.VerbsError, verbs.UserError) as e:
        failure = (type(e), str(e), getattr(e, "bad_wr", None))
    n = r.sq.available()
    start = r.sq.slot_offset(0)
    return failure, n, bytes(r.sq.buf[start:start + n * shm.SEND_WQE_SIZE]), r.ctx.doorbells


def _one_by_one(wrs: list[verbs.SendWR]) -> Any:
    def post(qp: verbs.QP) -> None:
        for wr in wrs:
            try:
                qp.post_send(wr)
            except (verbs.VerbsError, verbs.UserError) as e:
                e.bad_wr = wr  # type: ignore[attr-defined]
                raise
    return post


@settings(SETTINGS, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_send_wrs(), min_size=1, max_size=10))
def test_a_post_list_writes_what_posting_one_by_one_writes(monkeypatch: pytest.MonkeyPatch,
                                                           wrs: list[verbs.SendWR]) -> None:
    for a, b in zip(wrs, wrs[1:]):
        a.next_wr = b
    compiled_list = _post(_Rings(), lambda qp: qp.post_send(wrs))
    compiled_chain = _post(_Rings(), lambda qp: qp.post_send(wrs[0]))
    with monkeypatch.context() as m:
        m.setattr(qp_module, "_fast", None)
        python_chain = _post(_Rings(), lambda qp: qp.post_send(wrs[0]))
        for wr in wrs:
            wr.next_wr = None
        python_each = _post(_Rings(), _one_by_one(wrs))
    assert compiled_list == compiled_chain == python_chain
    assert compiled_list[:3] == python_each[:3]  # the same error at the same WR, the same WQEs before it
    failure, posted, _, doorbells = compiled_list
    assert doorbells == (1 if posted else 0)  # one publish and doorbell per list
    assert failure is not None or posted == len(wrs)


def test_the_first_bad_wr_raises_and_the_wrs_before_it_are_posted(path: str) -> None:
    r = _Rings(entries=8, max_send_sge=1)
    sge = verbs.SGE(0x1000, 8, 1)
    wrs = [verbs.SendWR(wr_id=i, opcode=0, sg=[sge]) for i in range(5)]
    wrs[2] = verbs.SendWR(wr_id=2, opcode=0, sg=[sge, sge])  # one SGE more than the QP takes
    bad = verbs.SendWR()
    with pytest.raises(verbs.VerbsError, match="num_sge 2 > max_send_sge 1") as e:
        r.qp.post_send(wrs, bad)
    assert e.value.error_code == errno.EINVAL and e.value.bad_wr is wrs[2]  # type: ignore[attr-defined]
    assert (bad.wr_id, bad.num_sge, bad.sg) == (2, 2, wrs[2].sg)  # pyverbs: a copy of the failed WR
    assert r.ctx.doorbells == 1 and [r.sq.peek(i).wr_id for i in range(r.sq.available())] == [0, 1]
    # a chain that outgrows the ring: ENOMEM at the first WR without a slot
    more = [verbs.SendWR(wr_id=10 + i, opcode=0, sg=[sge]) for i in range(8)]
    for a, b in zip(more, more[1:]):
        a.next_wr = b
    with pytest.raises(verbs.VerbsError, match="send queue full") as e:
        r.qp.post_send(more[0])
    assert e.value.error_code == errno.ENOMEM and e.value.bad_wr is more[6]  # type: ignore[attr-defined]
    assert [r.sq.peek(i).wr_id for i in range(r.sq.available())] == [0, 1, 10, 11, 12, 13, 14, 15]
    assert r.ctx.doorbells == 2


def test_a_list_posts_its_wrs_not_their_chains(path: str) -> None:
    r = _Rings()
    sge = verbs.SGE(0x1000, 8, 1)
    tail = verbs.SendWR(wr_id=9, opcode=0, sg=[sge])
    wrs = (verbs.SendWR(wr_id=1, opcode=0, sg=[sge], next_wr=tail), verbs.SendWR(wr_id=2, opcode=0, sg=[sge]))
    r.qp.post_send(wrs)
    r.qp.post_send([])
    assert [r.sq.peek(i).wr_id for i in range(r.sq.available())] == [1, 2] and r.ctx.doorbells == 1


def test_inline_bytes_are_gathered_from_the_sges(path: str) -> None:
    r = _Rings(max_inline=64)
    sg = [verbs.SGE(_BASE + 72, 5, 0), verbs.SGE(_BASE + 32, 3, 0), verbs.SGE(_BASE, 0, 0)]
    r.qp.post_send(verbs.SendWR(wr_id=3, opcode=shm.WrOpcode.IBV_WR_SEND, sg=sg, send_flags=INLINE | SIGNALED))
    e = r.sq.peek()
    assert (e.num_sge, e.inline_len, bytes(e.inline_data)[:8]) == (0, 8, bytes([72, 73, 74, 75, 76, 32, 33, 34]))


# --- poll -----------------------------------------------------------------------------

_cqe_values = st.tuples(st.one_of(u64, st.just(0)), st.one_of(st.sampled_from(list(shm.WcStatus)), u32),
                        st.one_of(st.sampled_from(list(shm.WcOpcode)), u32), u32, u32, u32, u32, u32,
                        st.one_of(st.integers(0, 15), u32))


@settings(SETTINGS, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_cqe_values, min_size=1, max_size=8), st.integers(0, 8), st.integers(1, 9))
def test_poll_builds_the_wcs_the_python_path_builds(monkeypatch: pytest.MonkeyPatch, cqes: list[tuple[int, ...]],
                                                     skip: int, batch: int) -> None:
    def polled() -> list[tuple[Any, ...]]:
        r = _Rings()
        r.complete(cqes, skip)
        wcs: list[verbs.WC] = []
        while len(wcs) < len(cqes):
            n, got = r.cq.poll(batch)
            assert n == len(got) == min(batch, len(cqes) - len(wcs))
            wcs += got
        assert r.cq.poll(batch) == (0, []) and r.cqr.free() == 8
        # every field, and its type: an enum member where the Python path gives one
        return [tuple((type(getattr(w, f)), getattr(w, f)) for f in verbs.WC.__slots__) + (repr(w),) for w in wcs]

    compiled = polled()
    with monkeypatch.context() as m:
        m.setattr(cq_module, "_fast", None)
        assert polled() == compiled
    assert [w[0][1] for w in compiled] == [c[0] for c in cqes]
