"""Congestion controllers and the pacer, unit by unit, plus EFE's targets on
a small shared-bottleneck scenario (so a regression fails CI)."""

from __future__ import annotations

import pytest

from udpverbs.transport.congestion import base
from udpverbs.transport.congestion.aimd import Aimd
from udpverbs.transport.congestion.efe import Efe
from udpverbs.transport.congestion.fixed import FixedWindow
from udpverbs.transport.netsim import dumbbell, jain_index, percentile
from udpverbs.transport.pacer import Pacer

MSS = 1000


def test_registry() -> None:
    assert base.names() == ["aimd", "efe", "efe-host", "fixed"]
    assert isinstance(base.create("efe", MSS), Efe)
    assert base.create("fixed", MSS, {"window_packets": 3}).cwnd_bytes == 3 * MSS
    with pytest.raises(ValueError):
        base.create("cubic", MSS)
    with pytest.raises(TypeError):
        base.create("aimd", MSS, {"no_such_knob": 1})


def test_aimd_slow_start_loss_and_rto() -> None:
    cc = Aimd(MSS, initial_window_packets=2)
    cc.on_packets_acked(2 * MSS, 0.001, 0.0)
    assert cc.cwnd_bytes == 4 * MSS  # slow start: +acked
    cc.on_packets_lost(MSS, 0.010)
    assert cc.cwnd_bytes == 2 * MSS and cc.ssthresh == 2 * MSS
    cc.on_packets_lost(MSS, 0.0105)  # same episode (within one RTT): no second cut
    assert cc.cwnd_bytes == 2 * MSS
    cc.on_packets_acked(2 * MSS, 0.001, 0.012)  # congestion avoidance: +MSS per window
    assert cc.cwnd_bytes == pytest.approx(3 * MSS)
    cc.on_rto(0.02)
    assert cc.cwnd_bytes == MSS and cc.ssthresh == 1.5 * MSS


def test_fixed_window_ignores_feedback() -> None:
    cc = FixedWindow(MSS, window_packets=5)
    cc.on_packets_lost(MSS, 0.0)
    cc.on_rto(0.0)
    cc.on_packets_acked(MSS, 0.001, 0.0)
    assert cc.cwnd_bytes == 5 * MSS and cc.pacing_rate_Bps(0.001) == base.INF


def efe(**kw) -> Efe:
    params = dict(initial_window_packets=10, target_queue_s=10e-6, fs_range_s=0.0, beta=1.0,
                  max_mdf=0.5, ai_packets=1.0, ai_fraction=0.0, mi_gain=0.25, hai_packets=0.5, probe_rtts=100,
                  first_probe_rtts=1000)
    params.update(kw)
    return Efe(MSS, **params)


def test_efe_fast_ramp_then_swift_decrease_once_per_rtt() -> None:
    cc = efe()
    cc.on_packets_acked(0, 100e-6, 0.0)  # handshake sample: base RTT 100 µs
    cc.on_packets_acked(10 * MSS, 100e-6, 0.0001)
    assert cc.startup and cc.cwnd_bytes == 20 * MSS  # doubles per RTT
    # RTT 140 µs against a target of 110 µs: cut by beta x 30/140.
    cc.on_packets_acked(MSS, 140e-6, 0.0002)
    assert not cc.startup
    assert cc.cwnd_bytes == pytest.approx(20 * MSS * (1 - 30 / 140))
    after = cc.cwnd_bytes
    cc.on_packets_acked(MSS, 140e-6, 0.0002 + 100e-6)  # less than one RTT later
    assert cc.cwnd_bytes == after
    cc.on_packets_acked(MSS, 400e-6, 0.0002 + 400e-6)  # large excess: bounded by max_mdf
    assert cc.cwnd_bytes == pytest.approx(after * 0.5)


def test_efe_increase_modes() -> None:
    cc = efe()
    cc.on_packets_acked(0, 100e-6, 0.0)
    cc.on_packets_acked(MSS, 200e-6, 0.001)  # leave startup
    w = cc.cwnd_bytes
    cc.on_packets_acked(MSS, 102e-6, 0.002)  # q = 2 µs < target/2: +0.5 MSS +25% per RTT
    assert cc.cwnd_bytes == pytest.approx(w + (0.5 * MSS + 0.25 * w) * MSS / w)
    w = cc.cwnd_bytes
    cc.on_packets_acked(MSS, 108e-6, 0.003)  # target/2 <= q <= target: +1 MSS per window
    assert cc.cwnd_bytes == pytest.approx(w + MSS * MSS / w)


def test_efe_probe_expires_a_stale_base_rtt() -> None:
    cc = efe(probe_rtts=10, first_probe_rtts=10)
    cc.on_packets_acked(0, 100e-6, 0.0)
    cc.on_packets_acked(MSS, 300e-6, 0.0001)  # out of startup; first probe due at 1 ms
    assert cc.base_rtt_s == 100e-6
    # The path changes: from now on the RTT is never below 250 µs.
    now = 0.0001
    for _ in range(400):
        now += 50e-6
        cc.on_packets_acked(MSS, 250e-6, now)
    assert cc.probes >= 2
    assert cc.base_rtt_s == 250e-6  # the 100 µs minimum expired after two probes


def test_efe_probe_halves_the_window_for_two_rtts() -> None:
    cc = efe(probe_rtts=10, first_probe_rtts=10)
    cc.on_packets_acked(0, 100e-6, 0.0)
    cc.on_packets_acked(MSS, 200e-6, 0.0001)
    w = cc.cwnd_bytes
    cc.on_packets_acked(MSS, 105e-6, 0.0011)  # probe due
    assert cc.probes == 1 and cc.cwnd_bytes == pytest.approx(w / 2)
    cc.on_packets_acked(MSS, 100e-6, 0.0011 + 100e-6)  # held during the probe
    assert cc.cwnd_bytes == pytest.approx(w / 2)


def test_efe_probes_no_more_often_than_the_minimum_interval() -> None:
    # On a host the window moves once per daemon pass, not once per (short,
    # kernel-stamped) base RTT: probes every 10 base RTTs would come every
    # 1 ms here; the host preset spaces them by at least min_probe_interval_s.
    cc = efe(probe_rtts=10, first_probe_rtts=10, min_probe_interval_s=0.05)
    cc.on_packets_acked(0, 100e-6, 0.0)
    cc.on_packets_acked(MSS, 200e-6, 0.0001)  # out of startup
    now = 0.0001
    while now < 0.2:
        now += 50e-6
        cc.on_packets_acked(MSS, 105e-6, now)
    assert cc.probes == 3  # at 50, 100 and 150 ms
    assert base.create("efe-host", MSS).min_probe_interval_s > 0


def test_efe_sub_packet_window_is_a_rate() -> None:
    cc = efe(min_window_packets=0.1)
    cc.on_packets_acked(0, 100e-6, 0.0)
    for i in range(20):  # sustained huge queueing delay, one ACK per 2 RTTs
        cc.on_packets_acked(MSS, 1e-3, 0.002 * (i + 1))
        assert cc.cwnd_bytes == pytest.approx(max(0.1, 10 * 0.5 ** (i + 1)) * MSS)
    assert cc.probes == 0
    assert cc.pacing_rate_Bps(1e-3) == pytest.approx(0.1 * MSS / 1e-3)


def test_pacer_release_times() -> None:
    p = Pacer(burst_bytes=2000)
    assert p.can_send(0.0)
    p.rate_Bps = 1e6  # 1 byte per µs
    for _ in range(3):  # idle credit: two packets at once, then paced
        assert p.can_send(0.0)
        p.on_sent(1000, 0.0)
    assert p.next_send_s == pytest.approx(0.001)
    assert not p.can_send(0.0009) and p.can_send(0.001)


def test_pacer_credit_can_be_a_time_at_the_rate() -> None:
    # A sender that acts every 10 ms keeps 10 ms of credit at the rate: 10,000 B,
    # so 11 packets of 1,000 B leave at once (as 3 do for 2,000 B above).
    p = Pacer(burst_bytes=2000, burst_s=0.01)
    p.rate_Bps = 1e6
    for _ in range(11):
        assert p.can_send(1.0)
        p.on_sent(1000, 1.0)
    assert not p.can_send(1.0) and p.next_send_s == pytest.approx(1.001)
    assert p.floor(2.0) == pytest.approx(1.99)
    # the byte cap rules where it is the larger: 5,000 B against 1 ms (1,000 B)
    p = Pacer(burst_bytes=5000, burst_s=0.001)
    p.rate_Bps = 1e6
    assert p.floor(1.0) == pytest.approx(0.995)


def test_metrics_helpers() -> None:
    assert jain_index([1.0, 1.0, 1.0]) == 1.0
    assert jain_index([1.0, 0.0]) == 0.5
    assert percentile(list(range(1, 101)), 99) == 99 and percentile([], 50) == 0.0


def test_efe_meets_its_targets_on_four_flows() -> None:
    # A shorter run of the bench's scenario: 10 Gb/s, 100 µs, buffer = 1 BDP.
    kw = dict(duration_s=0.05, warmup_s=0.02, seed=3)
    e = dumbbell("efe", 4, **kw)
    a = dumbbell("aimd", 4, **kw)
    assert e.utilization >= 0.90
    assert e.jain >= 0.95
    assert e.loss_rate == 0.0
    assert a.loss_rate > 0.0  # the baseline does fill the buffer
    assert e.queue_p99_us <= a.queue_p99_us / 4


def _noisy_path_utilization(params: dict) -> float:
    """One EFE flow over 1 Gb/s, 50 µs, with up to 100 µs of FIFO host noise."""
    import random

    from udpverbs.transport.link import Link, LinkConfig
    from udpverbs.transport.netsim import Bottleneck, Channel, Endpoint, Impairments, Simulator

    rate, rtt, dur = 1.25e8, 50e-6, 0.1
    sim = Simulator(random.Random(1))
    cfg = LinkConfig(cc="efe", cc_params=params)
    la = Link(cfg, rng=random.Random(2), incarnation=1)
    lb = Link(cfg, rng=random.Random(3), incarnation=2)
    got = [0]
    payload = bytes(cfg.max_payload)
    a = Endpoint(sim, la, source=[payload] * int(rate * dur / len(payload) * 1.5))
    b = Endpoint(sim, lb, on_delivery=lambda ep, msgs, now: got.__setitem__(0, got[0] + sum(map(len, msgs))))
    noise = Impairments(fifo_jitter_s=100e-6)
    a.channel = Channel(sim, b, rtt / 2, bottleneck=Bottleneck(rate, int(4 * rate * rtt)), impairments=noise)
    b.channel = Channel(sim, a, rtt / 2, impairments=noise)
    a.connect()
    sim.run(dur)
    return got[0] / dur / rate


def test_efe_host_preset_survives_host_noise() -> None:
    from udpverbs.transport.congestion.efe import EFE_HOST_PARAMS

    # The fabric defaults read host noise as queueing and collapse; the host
    # preset filters it and keeps the path busy.
    assert _noisy_path_utilization({}) < 0.1
    assert _noisy_path_utilization(dict(EFE_HOST_PARAMS)) > 0.8
    host = base.create("efe-host", MSS)
    assert host.noise_filter and host.target_queue_s == EFE_HOST_PARAMS["target_queue_s"]
