"""``transport.builder.admit`` against the send loop it stands for.

The framer's path admits a run of packets with ``admit``; the Python path
admits packet by packet, testing the window and the pacer and advancing the
pacer before each next one.  Both must agree to the bit on how many leave,
on their bytes and on the pacer's next time, or a daemon's pacing would
depend on which path sent (``test_native_send_lane`` compares whole
daemons; this compares the arithmetic alone, near every boundary).
"""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from udpverbs.transport.congestion.base import INF
from udpverbs.transport.builder import admit


def _loop(m: int, full: int, tail: int, cwnd: float, inflight: int, rate: float, nxt: float, floor: float,
          now: float) -> tuple[int, float, int]:
    """The admission as the send loop runs it, one packet at a time."""
    k = total = 0
    while k < m:
        if inflight >= cwnd or now < nxt:
            break
        size = tail if k == m - 1 else full
        inflight += size
        total += size
        if rate != INF:
            nxt = (nxt if nxt > floor else floor) + size / rate
        k += 1
    return k, nxt, total


@settings(max_examples=1000, deadline=None)
@given(m=st.integers(1, 80), full=st.integers(60, 65_535), tail_cut=st.integers(0, 65_535),
       cwnd=st.one_of(st.integers(0, 4_000_000), st.floats(0, 4e6)), inflight=st.integers(0, 4_000_000),
       rate=st.sampled_from([INF, 1e6, 1.25e8, 1e9, 3.3e9, 7.77e10]),
       base=st.sampled_from([0.0, 1.5, 12_345.678, 1e6, 1e12]), nxt_off=st.floats(-1e-3, 1e-3),
       floor_off=st.floats(-2e-3, 1e-3), now_off=st.floats(0, 2e-3))
def test_the_run_admits_what_the_loop_admits(m: int, full: int, tail_cut: int, cwnd: float, inflight: int,
                                             rate: float, base: float, nxt_off: float, floor_off: float,
                                             now_off: float) -> None:
    tail = full - tail_cut % full  # 1 .. full
    now = base + now_off
    args = (m, full, tail, cwnd, inflight, rate, base + nxt_off, base + floor_off, now)
    assert admit(*args) == _loop(*args)


def test_the_boundaries_are_exact() -> None:
    # the window: the packet that would start at exactly cwnd is refused
    assert admit(10, 100, 100, 500, 0, INF, 0.0, 0.0, 1.0) == (5, 0.0, 500)
    assert admit(10, 100, 100, 500.5, 0, INF, 0.0, 0.0, 1.0) == (6, 0.0, 600)
    # a window so large that the float division rounds up past the boundary
    cwnd, full, inflight = 9.440299487687922e18, 5936, 919
    exact = -(-(int(cwnd) - inflight) // full)
    assert admit(2 * exact, full, full, cwnd, inflight, INF, 0.0, 0.0, 1.0)[0] == exact
    # the last packet, shorter, is checked before its size counts
    assert admit(3, 100, 7, 201, 0, INF, 0.0, 0.0, 1.0) == (3, 0.0, 207)
    # the pacer: a packet whose time is exactly now leaves
    args = (4, 100, 100, 1e9, 0, 100.0, 1.0, 0.0, 3.0)
    assert admit(*args) == _loop(*args) == (3, 4.0, 300)
