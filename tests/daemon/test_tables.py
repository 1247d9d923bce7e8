"""Unit tests of the daemon's tables: STag keys, region checks, handles, the QP state machine."""

from __future__ import annotations

import errno
import mmap
import random

import pytest
from hypothesis import given, strategies as st

from udpverbs.daemon import tables
from udpverbs.daemon.tables import STagTable, TableError, check_transition
from udpverbs.wire.shm import AccessFlags as A, QPAttrMask as M, QPState as S


def _mr(pd: tables.ProtectionDomain, access: int = A.IBV_ACCESS_REMOTE_WRITE, addr: int = 0x10000,
        length: int = 4096) -> tables.MemoryRegion:
    return tables.MemoryRegion(0, pd, access, addr, length, mmap.mmap(-1, max(length, 1)))


def test_stag_key_changes_on_every_reregistration() -> None:
    t = STagTable(max_entries=1, rng=random.Random(1))
    pd = tables.ProtectionDomain(1, None)
    seen = set()
    stag = 0
    for _ in range(4000):
        mr = _mr(pd)
        old = stag
        stag = t.register(mr)
        assert stag >> 8 == 1 and t.lookup(stag) is mr
        assert stag != old  # the index's previous key never comes back at once
        assert t.invalidate(stag) is mr
        assert t.lookup(stag) is None  # stale after deregistration
        seen.add(stag & 0xFF)
    assert len(seen) == 256


def test_stale_and_guessed_stags_do_not_resolve() -> None:
    t = STagTable(max_entries=1)
    pd = tables.ProtectionDomain(1, None)
    a = _mr(pd)
    sa = t.register(a)
    t.invalidate(sa)
    b = _mr(pd)
    sb = t.register(b)
    assert sb >> 8 == sa >> 8 and sb != sa
    assert t.lookup(sa) is None and t.lookup(sb) is b
    assert t.lookup(0) is None and t.lookup(0xFFFFFFFF) is None and t.lookup(sb ^ 1) is None


def test_stag_of_a_reregistered_region_is_refused() -> None:
    # The old STag of a region deregistered and registered again
    # names nothing, wherever the new registration lands
    t = STagTable()
    pd = tables.ProtectionDomain(1, None)
    live = [t.register(_mr(pd)) for _ in range(10)]
    for _ in range(200):
        old = live.pop(0)
        t.invalidate(old)
        live.append(t.register(_mr(pd)))
        assert t.lookup(old) is None or old in live
    assert all(t.lookup(s) is not None for s in live)


def test_stags_are_not_sequential() -> None:
    # Sequential STags (0x101, 0x201, ...) would give the next away from
    # the last: neither index nor key may follow.
    t = STagTable()
    pd = tables.ProtectionDomain(1, None)
    stags = [t.register(_mr(pd)) for _ in range(64)]
    assert stags != [(i << 8) | 1 for i in range(1, 65)]
    steps = {b - a for a, b in zip(stags, stags[1:])}
    assert len(steps) > 8  # no fixed stride between consecutive STags
    assert len({s & 0xFF for s in stags}) > 16  # keys spread over the byte
    assert len({s >> 8 for s in stags}) == 64
    assert [s >> 8 for s in stags] != sorted(s >> 8 for s in stags)


def test_seeded_stag_tables_agree() -> None:
    # twin devices built from one seed give equal STags
    pd = tables.ProtectionDomain(1, None)
    a, b = STagTable(rng=random.Random(7)), STagTable(rng=random.Random(7))
    assert [a.register(_mr(pd)) for _ in range(20)] == [b.register(_mr(pd)) for _ in range(20)]


def test_stag_table_full() -> None:
    t = STagTable(max_entries=2)
    pd = tables.ProtectionDomain(1, None)
    t.register(_mr(pd))
    t.register(_mr(pd))
    with pytest.raises(TableError) as e:
        t.register(_mr(pd))
    assert e.value.errno == errno.ENOMEM


def test_region_check_codes() -> None:
    pd, other = tables.ProtectionDomain(1, None), tables.ProtectionDomain(2, None)
    mr = _mr(pd, A.IBV_ACCESS_REMOTE_WRITE, 0x10000, 100)
    W = A.IBV_ACCESS_REMOTE_WRITE
    assert mr.check(pd, W, 0x10000, 100, tagged=True) == (tables.OK, 0)
    assert mr.check(pd, W, 0x10010, 0, tagged=True) == (tables.OK, 0x10)
    assert mr.check(other, W, 0x10000, 1, tagged=True)[0] == tables.WRONG_PD
    assert mr.check(pd, A.IBV_ACCESS_REMOTE_READ, 0x10000, 1, tagged=True)[0] == tables.ACCESS
    assert mr.check(pd, W, 0x10000, 101, tagged=True)[0] == tables.BOUNDS
    assert mr.check(pd, W, 0xFFFF, 1, tagged=True)[0] == tables.BOUNDS
    mr.valid = False
    assert mr.check(pd, W, 0x10000, 1, tagged=True)[0] == tables.INVALID_STAG


def test_zero_based_region_uses_offsets() -> None:
    pd = tables.ProtectionDomain(1, None)
    mr = _mr(pd, A.IBV_ACCESS_REMOTE_WRITE | A.IBV_ACCESS_ZERO_BASED, 0x10000, 100)
    assert mr.check(pd, A.IBV_ACCESS_REMOTE_WRITE, 10, 90, tagged=True) == (tables.OK, 10)
    # local SGEs still use virtual addresses
    assert mr.check(pd, 0, 0x10000 + 10, 90, tagged=False) == (tables.OK, 10)


@given(st.integers(-(1 << 64), 1 << 64), st.integers(-5, 1 << 20))
def test_check_never_allows_outside(to: int, length: int) -> None:
    pd = tables.ProtectionDomain(1, None)
    mr = _mr(pd, A.IBV_ACCESS_REMOTE_WRITE, 0x10000, 4096)
    code, off = mr.check(pd, A.IBV_ACCESS_REMOTE_WRITE, to, length, tagged=True)
    if code == tables.OK:
        assert 0 <= off and length >= 0 and off + length <= 4096


def test_handles_are_per_session() -> None:
    h = tables.Handles(limit=2)

    class Obj:
        def __init__(self, session: object) -> None:
            self.session = session

    s1, s2 = object(), object()
    k = h.add(Obj(s1))
    assert h.get(k, s1).session is s1
    with pytest.raises(TableError):
        h.get(k, s2)
    h.add(Obj(s2))
    with pytest.raises(TableError) as e:
        h.add(Obj(s2))
    assert e.value.errno == errno.ENOMEM


# --- state machine ------------------------------------------------------------

TO_INIT = M.IBV_QP_STATE | M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT | M.IBV_QP_ACCESS_FLAGS
TO_RTR = (M.IBV_QP_STATE | M.IBV_QP_AV | M.IBV_QP_PATH_MTU | M.IBV_QP_DEST_QPN | M.IBV_QP_RQ_PSN
          | M.IBV_QP_MAX_DEST_RD_ATOMIC | M.IBV_QP_MIN_RNR_TIMER)
TO_RTS = (M.IBV_QP_STATE | M.IBV_QP_SQ_PSN | M.IBV_QP_TIMEOUT | M.IBV_QP_RETRY_CNT | M.IBV_QP_RNR_RETRY
          | M.IBV_QP_MAX_QP_RD_ATOMIC)


def test_the_normal_path() -> None:
    assert check_transition(S.IBV_QPS_RESET, TO_INIT, S.IBV_QPS_INIT) == S.IBV_QPS_INIT
    assert check_transition(S.IBV_QPS_INIT, TO_RTR, S.IBV_QPS_RTR) == S.IBV_QPS_RTR
    assert check_transition(S.IBV_QPS_RTR, TO_RTS, S.IBV_QPS_RTS) == S.IBV_QPS_RTS
    assert check_transition(S.IBV_QPS_RTS, M.IBV_QP_STATE, S.IBV_QPS_SQD) == S.IBV_QPS_SQD
    assert check_transition(S.IBV_QPS_SQD, M.IBV_QP_STATE, S.IBV_QPS_RTS) == S.IBV_QPS_RTS
    for s in (S.IBV_QPS_RESET, S.IBV_QPS_INIT, S.IBV_QPS_RTR, S.IBV_QPS_RTS, S.IBV_QPS_SQD, S.IBV_QPS_ERR):
        assert check_transition(s, M.IBV_QP_STATE, S.IBV_QPS_ERR) == S.IBV_QPS_ERR
        assert check_transition(s, M.IBV_QP_STATE, S.IBV_QPS_RESET) == S.IBV_QPS_RESET


@pytest.mark.parametrize("cur,mask,new", [
    (S.IBV_QPS_RESET, TO_RTR, S.IBV_QPS_RTR),  # skipping INIT
    (S.IBV_QPS_RESET, TO_RTS, S.IBV_QPS_RTS),
    (S.IBV_QPS_INIT, TO_RTS, S.IBV_QPS_RTS),
    (S.IBV_QPS_ERR, TO_INIT, S.IBV_QPS_INIT),  # ERR only leaves through RESET
    (S.IBV_QPS_RTS, TO_RTR, S.IBV_QPS_RTR),  # no way back
    (S.IBV_QPS_RESET, TO_INIT & ~M.IBV_QP_PORT, S.IBV_QPS_INIT),  # a required bit missing
    (S.IBV_QPS_RESET, TO_INIT | M.IBV_QP_SQ_PSN, S.IBV_QPS_INIT),  # a bit this transition does not take
    (S.IBV_QPS_RTR, TO_RTS & ~M.IBV_QP_MAX_QP_RD_ATOMIC, S.IBV_QPS_RTS),
    (S.IBV_QPS_RESET, M.IBV_QP_STATE, 99),
    (S.IBV_QPS_RESET, M.IBV_QP_ACCESS_FLAGS, 0),  # attributes without a state change in RESET
])
def test_invalid_transitions_raise_einval(cur: int, mask: int, new: int) -> None:
    with pytest.raises(TableError) as e:
        check_transition(cur, mask, new)
    assert e.value.errno == errno.EINVAL


def test_attribute_change_without_state() -> None:
    assert check_transition(S.IBV_QPS_RTS, M.IBV_QP_MIN_RNR_TIMER, 0) == S.IBV_QPS_RTS
