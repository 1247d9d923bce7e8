"""Statistics of perftest-style runs: latency samples and completion times.

Theory of operation
-------------------
A latency test is a ping-pong: every iteration measures one round trip and
records half of it, as perftest's ``*_lat`` tools report "half round trip"
figures.  :func:`latency_stats` turns those samples into perftest's columns:
minimum, maximum, typical (the median), mean, standard deviation, and the
99% and 99.9% percentiles (nearest rank, so a percentile is always a sample
that was really seen).

A bandwidth test keeps up to ``tx_depth`` messages in flight and notes when
each one completes.  :func:`bandwidth_stats` reports perftest's columns:
average bandwidth over the whole run (first post to last completion), the
message rate, and the peak bandwidth, taken here as the best rate over any
run of consecutive completions spanning a tenth of the run and at least
``peak_window`` messages (one window of outstanding work).  Completions
arrive in bursts (one acknowledgement covers many messages), so a shorter
span would report the burst, not the bandwidth.  MB means 10**6
bytes, as in perftest's MB/sec.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

NS_PER_US = 1_000
NS_PER_S = 1_000_000_000


class _Figures:
    """The ``--json`` view shared by both summaries."""

    def as_dict(self) -> dict[str, float]:
        """Return the figures keyed as in ``--json`` output (without ``iterations``)."""
        d = asdict(self)  # type: ignore[call-overload]
        del d["iterations"]
        return d  # type: ignore[no-any-return]


@dataclass(frozen=True)
class LatencyStats(_Figures):
    """Half-round-trip latency summary in microseconds (perftest's columns)."""

    iterations: int
    t_min_us: float
    t_max_us: float
    t_typical_us: float
    t_avg_us: float
    t_stdev_us: float
    p99_us: float
    p999_us: float


@dataclass(frozen=True)
class BandwidthStats(_Figures):
    """Bandwidth summary: MB/s with MB = 10**6 bytes, message rate in Mpps."""

    iterations: int
    bw_peak_MBps: float
    bw_avg_MBps: float
    msg_rate_Mpps: float


def _nearest_rank(ordered: Sequence[float], fraction: float) -> float:
    # Nearest-rank percentile: the smallest sample with at least `fraction`
    # of the samples at or below it.
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


def latency_stats(half_rtt_ns: Sequence[int]) -> LatencyStats:
    """Summarize half-round-trip samples.

    Takes: the samples in nanoseconds (one per measured iteration).
    Returns: a :class:`LatencyStats` in microseconds; the typical value is the
    median (perftest's t_typical), the deviation is the population one.
    Raises: ValueError if there is no sample.
    """
    if not half_rtt_ns:
        raise ValueError("latency_stats needs at least one sample")
    ordered = sorted(s / NS_PER_US for s in half_rtt_ns)
    n = len(ordered)
    mid = n // 2
    median = ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    mean = math.fsum(ordered) / n
    var = math.fsum((x - mean) ** 2 for x in ordered) / n
    return LatencyStats(
        iterations=n,
        t_min_us=ordered[0],
        t_max_us=ordered[-1],
        t_typical_us=median,
        t_avg_us=mean,
        t_stdev_us=math.sqrt(var),
        p99_us=_nearest_rank(ordered, 0.99),
        p999_us=_nearest_rank(ordered, 0.999),
    )


def bandwidth_stats(
    size: int, start_ns: int, completions_ns: Sequence[int], peak_window: int
) -> BandwidthStats:
    """Summarize a bandwidth run.

    Takes: the message size in bytes, the time the first message was posted,
    the completion time of every message in completion order (ns, same
    clock), and the fewest messages over which the peak rate is taken.
    Returns: a :class:`BandwidthStats`.
    Raises: ValueError if there is no completion or the clock went backwards.
    """
    n = len(completions_ns)
    if n == 0:
        raise ValueError("bandwidth_stats needs at least one completion")
    elapsed_ns = completions_ns[-1] - start_ns
    if elapsed_ns <= 0:
        raise ValueError("the last completion is not after the start")
    avg_bps = size * n * NS_PER_S / elapsed_ns
    rate_pps = n * NS_PER_S / elapsed_ns
    peak_bps = avg_bps
    k = min(max(1, peak_window, math.ceil(n / 10)), n - 1)
    if n > 1:
        best_ns = min(completions_ns[i + k] - completions_ns[i] for i in range(n - k))
        if best_ns > 0:
            peak_bps = max(avg_bps, size * k * NS_PER_S / best_ns)
    return BandwidthStats(
        iterations=n,
        bw_peak_MBps=peak_bps / 1e6,
        bw_avg_MBps=avg_bps / 1e6,
        msg_rate_Mpps=rate_pps / 1e6,
    )


def both_directions(mine: BandwidthStats, peer: BandwidthStats) -> BandwidthStats:
    """Return what perftest's ``-b`` reports: both directions' bandwidths and rates added up.

    Takes: this side's figures and the peer's (each for its own stream).
    Returns: the sums; ``iterations`` stays this side's count, as perftest prints it.
    """
    return BandwidthStats(
        iterations=mine.iterations,
        bw_peak_MBps=mine.bw_peak_MBps + peer.bw_peak_MBps,
        bw_avg_MBps=mine.bw_avg_MBps + peer.bw_avg_MBps,
        msg_rate_Mpps=mine.msg_rate_Mpps + peer.msg_rate_Mpps,
    )
