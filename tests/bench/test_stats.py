"""Statistics: exact figures on hand-made samples."""

from __future__ import annotations

import math

import pytest

from udpverbs.bench.stats import BandwidthStats, both_directions, bandwidth_stats, latency_stats


def test_latency_stats_exact() -> None:
    # 1..1000 µs in ns, shuffled: min 1, max 1000, median 500.5, mean 500.5
    samples = [((i * 7919) % 1000 + 1) * 1000 for i in range(1000)]
    s = latency_stats(samples)
    assert s.iterations == 1000
    assert (s.t_min_us, s.t_max_us) == (1.0, 1000.0)
    assert s.t_typical_us == 500.5
    assert s.t_avg_us == pytest.approx(500.5)
    assert s.t_stdev_us == pytest.approx(math.sqrt((1000**2 - 1) / 12))
    # nearest rank: the 990th and 999th smallest
    assert (s.p99_us, s.p999_us) == (990.0, 999.0)


def test_latency_stats_odd_count_median_and_single_sample() -> None:
    assert latency_stats([3000, 1000, 2000]).t_typical_us == 2.0
    one = latency_stats([4500])
    assert (one.t_min_us, one.t_max_us, one.p999_us, one.t_stdev_us) == (4.5, 4.5, 4.5, 0.0)


def test_latency_stats_needs_samples() -> None:
    with pytest.raises(ValueError):
        latency_stats([])


def test_bandwidth_average_and_rate() -> None:
    # 10 messages of 1 MB completing every 1 ms from t=0: 1000 MB/s, 0.001 Mpps
    comps = [(i + 1) * 1_000_000 for i in range(10)]
    s = bandwidth_stats(1_000_000, 0, comps, peak_window=2)
    assert s.iterations == 10
    assert s.bw_avg_MBps == pytest.approx(1000.0)
    assert s.msg_rate_Mpps == pytest.approx(0.001)
    assert s.bw_peak_MBps == pytest.approx(1000.0)


def test_bandwidth_peak_is_best_window_not_best_burst() -> None:
    # 20 messages of 1000 B; completions in bursts of 5 at the same instant,
    # bursts 1 ms apart, except a 10 ms stall after the second burst.
    comps = []
    t = 0
    for burst in range(4):
        t += 1_000_000 if burst != 2 else 10_000_000
        comps += [t] * 5
    s = bandwidth_stats(1000, 0, comps, peak_window=5)
    # peak over >= 5 messages: 5 messages per 1 ms = 5 MB/s, never "infinite"
    assert s.bw_peak_MBps == pytest.approx(5.0)
    assert s.bw_avg_MBps == pytest.approx(20 * 1000 / 13e-3 / 1e6)


def test_bandwidth_stats_rejects_empty_or_backwards() -> None:
    with pytest.raises(ValueError):
        bandwidth_stats(1, 0, [], 1)
    with pytest.raises(ValueError):
        bandwidth_stats(1, 10, [5], 1)


def test_both_directions_add_up_as_perftest_reports_them() -> None:
    mine = BandwidthStats(iterations=100, bw_peak_MBps=300.0, bw_avg_MBps=200.0, msg_rate_Mpps=0.003)
    peer = BandwidthStats(iterations=90, bw_peak_MBps=250.0, bw_avg_MBps=150.0, msg_rate_Mpps=0.002)
    both = both_directions(mine, peer)
    assert both.iterations == 100  # this side's count, as perftest prints it
    assert (both.bw_peak_MBps, both.bw_avg_MBps) == (550.0, 350.0)
    assert both.msg_rate_Mpps == pytest.approx(0.005)
