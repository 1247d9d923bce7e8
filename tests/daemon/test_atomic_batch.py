"""The atomic batch (``daemon/atombatch.py``) does what the usual responder path does.

Two responding devices built from the same seed, one with the compiled
lanes (where a GRO buffer of Atomic Requests is applied and answered in one
call) and one without, get the same datagrams from one requester: ORD
windows of Fetch-and-Adds and Compare-and-Swaps, mixed with Reads (whose
responses queue ahead of the atomics' on the IRRQ) and with requests the
batch must leave to the usual path (a bad rkey, a region without remote
atomic access, a misaligned or out-of-bounds word), lost, duplicated,
swapped, corrupted and coalesced.  After every step they must answer with
the same bytes, be in the same link state and have written the same
CQEs; at the end they hold the same memory, replay records, counters and
QP state.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from udpverbs.bench.inprocess import MR_LEN, Host
from udpverbs.wire import native
from udpverbs.wire.shm import QPState as S, WrOpcode

from .twins import assert_twins_agree, close_all, turn, twins, twins_answer, with_twins

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler here: the daemon uses the Python path")

_STEP_S = 0.001
_WORDS = 64  # the target words, at the start of the responder's region
_SINK_AT = MR_LEN // 2  # where the requester's fetched values land, 8 bytes each
_FADD, _CAS, _READ = WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD, WrOpcode.IBV_WR_ATOMIC_CMP_AND_SWP, WrOpcode.IBV_WR_RDMA_READ
_ORD = 16


def _post(a: Host, peer: Host, i: int, kind: str, word: int, rng: random.Random, no_access: int) -> None:
    sink = _SINK_AT + 8 * i
    dst, rkey = 8 * word, None
    if kind == "read":
        a.post_write(i, sink + 4096 * 16, rng.choice([8, 64, 3000]), peer, dst, opcode=_READ)
        return
    if kind == "misaligned":
        dst += 4
    elif kind == "oob":
        dst = MR_LEN
    elif kind == "bad_rkey":
        rkey = peer.mr.stag ^ 0x100
    elif kind == "no_access":
        rkey = no_access
    if kind == "cas":
        a.post_write(i, sink, 8, peer, dst, rkey, opcode=_CAS, compare_add=rng.choice([0, 7, word]),
                     swap=rng.getrandbits(64))
    else:
        a.post_write(i, sink, 8, peer, dst, rkey, opcode=_FADD, compare_add=rng.getrandbits(rng.choice([3, 64])))


def _stream(seed: int, ops: list[tuple[str, int]], loss: float, gro: float, ird: int = _ORD) -> tuple[Host, Host, Host]:
    """A posts ``ops`` ((kind, target word)) to both responders (whose IRD is
    ``ird``, A's ORD 16); returns A and them."""
    rng = random.Random(seed)
    return with_twins(lambda a, fast, slow: _exchange(rng, a, fast, slow, ops, loss, gro, ird))


def _exchange(rng: random.Random, a: Host, fast: Host, slow: Host, ops: list[tuple[str, int]], loss: float,
              gro: float, ird: int) -> tuple[Host, Host, Host]:
    clock, pa, pf, ps = twins(a, fast, slow)
    a.qp.attrs["max_rd_atomic"] = _ORD
    words = rng.randbytes(8 * _WORDS)
    no_access = [h.spare_stag() for h in (fast, slow)]
    assert no_access[0] == no_access[1]
    for h in (fast, slow):
        h.qp.attrs["max_dest_rd_atomic"] = ird
        h.mr.view[:8 * _WORDS] = words
    for i, (kind, word) in enumerate(ops):
        _post(a, fast, i, kind, word, rng, no_access[0])
    done: list[tuple[int, int]] = []
    held: list[bytes] = []
    for step in range(3000):
        clock[0] += _STEP_S
        now = clock[0]
        held += turn(a, pa, now)
        if rng.random() < 0.3:
            continue
        twins_answer(held, (a, fast, slow), (pa, pf, ps), rng, loss, gro, now)
        held = []
        done += a.completions()
        assert fast.cqes() == slow.cqes()
        if len(done) == len(ops) or a.qp.state == S.IBV_QPS_ERR and step > 100:
            break
    assert_twins_agree(fast, slow, pf, ps, ("rx_native_datagrams", "rx_native_requests", "rx_atomic_batched",
                                            "rx_read_batched"))
    assert fast.qp.atomic_replay == slow.qp.atomic_replay
    assert (fast.qp.rx_read_msn, fast.qp.atomic_resp_msn, len(fast.qp.irrq)) == \
        (slow.qp.rx_read_msn, slow.qp.atomic_resp_msn, len(slow.qp.irrq))
    return a, fast, slow


_OP = st.tuples(st.sampled_from(["fadd"] * 12 + ["cas"] * 4 + ["read", "misaligned", "oob", "bad_rkey", "no_access"]),
                st.integers(0, _WORDS - 1))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32), ops=st.lists(_OP, min_size=1, max_size=60),
       loss=st.sampled_from([0.0, 0.0, 0.02, 0.1]), gro=st.sampled_from([0.7, 1.0]))
def test_the_atomic_batch_and_the_usual_path_agree(seed: int, ops: list[tuple[str, int]], loss: float,
                                                   gro: float) -> None:
    close_all(*_stream(seed, ops, loss, gro))


@pytest.mark.parametrize("kind", ["fadd", "cas"])
def test_an_ord_window_of_atomics_is_answered_in_batches(kind: str) -> None:
    ops = [(kind, i % 3) for i in range(60)]
    a, fast, slow = _stream(5, ops, 0.0, 1.0)
    try:
        assert fast.dev.stats["rx_atomic_batched"] >= 40 and "rx_atomic_batched" not in slow.dev.stats
        assert a.qp.state == S.IBV_QPS_RTS
        # what each fetched is what the other responder's Python path returned: the sinks agree
        assert bytes(fast.mr.view[:8 * _WORDS]) == bytes(slow.mr.view[:8 * _WORDS])
    finally:
        close_all(a, fast, slow)


@pytest.mark.parametrize("kind", ["misaligned", "oob", "bad_rkey", "no_access"])
def test_a_request_the_batch_leaves_behind_ends_alike(kind: str) -> None:
    ops = [("fadd", 1)] * 20 + [(kind, 2)] + [("fadd", 1)] * 20
    a, fast, slow = _stream(9, ops, 0.0, 1.0)
    try:
        assert fast.dev.stats["rx_atomic_batched"] >= 8
        assert fast.dev.stats["terminate_sent"] == 1 and fast.qp.state == S.IBV_QPS_ERR
        assert a.qp.state == S.IBV_QPS_ERR
    finally:
        close_all(a, fast, slow)


def test_more_requests_than_the_ird_end_alike() -> None:
    # a requester that does not keep to our IRD: the request that finds
    # the IRRQ full is refused by the usual path's Terminate
    a, fast, slow = _stream(3, [("fadd", 1)] * 40, 0.0, 1.0, ird=6)
    try:
        assert fast.dev.stats["rx_atomic_batched"] >= 4
        assert fast.dev.stats["terminate_sent"] == 1 and a.qp.state == S.IBV_QPS_ERR
    finally:
        close_all(a, fast, slow)


def test_atomics_behind_reads_take_their_turn() -> None:
    # Read Responses queued ahead of a batch on the IRRQ: the Atomic
    # Responses keep their MSNs (queue 3) and leave after them
    ops = ([("read", 3)] * 3 + [("fadd", 1)] * 5 + [("cas", 2)] * 4) * 5
    a, fast, slow = _stream(11, ops, 0.0, 1.0)
    try:
        assert fast.dev.stats["rx_atomic_batched"] >= 10 and a.qp.state == S.IBV_QPS_RTS
    finally:
        close_all(a, fast, slow)
