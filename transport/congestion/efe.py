"""EFE-style delay-based congestion control.

Theory of operation
-------------------
ExpEther's Ether Forwarding Engine (``docs/DESIGN.md``, "Where the ideas
come from") keeps a lossless fabric by end-to-end, *delay-based* control:
it probes the path, keeps a *predicted* round-trip time, ramps quickly
while the measured RTT matches the prediction, and backs off as soon as
switch queues build.  No EFE algorithm
is published, so this controller combines that description with two
published delay-based schemes for data centres:

* from **TIMELY** (Mittal et al., SIGCOMM 2015): RTT measured end to end from
  timestamps is a good enough congestion signal in a data centre; grow
  faster while the delay is well below the threshold (its "hyperactive
  increase" becomes our multiplicative ramp, ``mi_gain``).  We do not use
  TIMELY's RTT gradient: with paced senders and one drop-tail queue the
  absolute queueing delay is the steadier signal.
* from **Swift** (Kumar et al., SIGCOMM 2020): a *target delay* instead of a
  threshold pair; additive increase below it; a multiplicative decrease in
  proportion to the excess, ``cwnd *= 1 - beta * (rtt - target) / rtt``,
  bounded by ``max_mdf`` and at most once per RTT (with ``beta = 1`` the cut
  removes exactly the excess queue: window/RTT is the rate, so the bytes cut
  are rate x excess delay); *flow scaling*, a target that grows like
  ``1/sqrt(cwnd)`` as the window shrinks (``fs_range_s``), so small flows
  gain on large ones and many flows converge to a fair share; and windows
  below one packet, made real by pacing at ``cwnd / rtt``, so 64 flows fit a
  short path without a standing queue.

The *predicted RTT* is ``base_rtt + target (+ flow scaling)``, where
``base_rtt`` is the minimum RTT of a two-bucket min filter.  The filter
rotates at every *probe*: for two RTTs the window is halved (BBR's ProbeRTT
idea), so the queue this flow feeds drains and the new bucket sees (close to)
the empty path; the older bucket expires, so a minimum from before a path
change is forgotten after two probes.  Probes matter beyond path changes: a
flow that joined a queue measured an inflated base and would hold the queue
at *its* higher target, starving the others.  The first probe comes
``first_probe_rtts`` after startup (flows that arrived together leave
startup together, so their first probes coincide and drain the queue), and
the gap doubles up to ``probe_rtts``.  The handshake's RTT sample, taken
before our data queued anywhere, seeds the filter.

Per ACK, from the queueing delay ``q = rtt - base_rtt``:

* startup, until the first time the RTT exceeds the prediction: the window
  doubles per RTT (``+acked``), paced at 2x: the fast ramp;
* ``q < target/2``, near the prediction: ``+hai_packets + mi_gain x cwnd``
  per RTT: an additive part (TIMELY's hyperactive increase), which also
  pulls flows towards equal shares, and a multiplicative part, which refills
  capacity released by a departing flow or a probe in a few RTTs;
* ``q`` up to the target: ``+ai_packets + ai_fraction x cwnd`` per RTT.  The
  fixed part makes AIMD converge to fairness; keeping it small and the
  proportional part small keeps the aggregate increase of N flows per RTT
  well below the target queue even at 64 flows;
* ``q`` above the target: Swift's proportional decrease, once per RTT.

Loss is a congestion signal only with evidence of congestion: a delay-based
controller keeps queues short, so a loss it meets with no queue in front of
it is the path's (a bad link, a corrupted datagram), and answering each such
loss with a cut collapses the window: at 5% random loss a window of a few
dozen packets loses one nearly every round trip.  So a loss cuts at most
once per recovery episode (the link's, RFC 6675: one round trip's losses
are one event), and by ``max_mdf`` scaled by the queueing delay measured
against the target (``q / target queue``): a full target queue behind the
loss, a full cut; no queue, none.  Heavy loss is congestion whatever the
delay says (a drop-tail buffer shallower than the target queue overflows
before the delay can grow): when the share of bytes lost over about the
last ``loss_window_packets`` reaches ``loss_threshold``, the cut is
``max_mdf``.  Startup ends at a loss only when the loss is taken for
congestion, a loss behind at least half the target queue.  An RTO cuts
to at most one packet.

Defaults are tuned on the simulated data-centre path of ``bench/netsim.py``
(10 Gb/s, 100 µs, 1-BDP buffer): a 3 µs target queue plus up to 8 µs of flow
scaling.  The 3 µs target is below one packet's serialization time on slower
links (12 µs at 1 Gb/s), and on a real host RTT samples carry the daemons'
scheduling noise (tens to hundreds of µs, which adds delay but is no queue):
there the defaults collapse the window.  ``EFE_HOST_PARAMS`` is the preset
for real hosts: a 200 µs target and ``noise_filter``, which takes as the
delay signal the minimum sample of each RTT-long window of at least
``noise_samples`` samples (noise is additive and transient, a queue
persists).  The daemon removes most of that noise at the source: it gives
the link kernel arrival stamps, so samples end when a datagram reached the
host, not when the daemon got to it (``Link.datagram_received``).  The
preset also spaces probes by ``min_probe_interval_s``: a daemon's window
moves once per pass of its loop, however short the base RTT.  Hosts whose
noise still exceeds the target are better served by AIMD.
"""

from __future__ import annotations

import math
from typing import Any

from .base import INF, CongestionController, register


#: Parameters for real hosts (daemons on loopback or a LAN), where RTT samples
#: carry scheduling noise of tens to hundreds of µs that is not a queue: a
#: target above that noise, the RTT-window minimum as the signal, and no
#: sub-packet windows.  The defaults suit the simulated 10 Gb/s fabric.
EFE_HOST_PARAMS: dict[str, float | bool] = {
    "noise_filter": True,
    "target_queue_s": 200e-6,
    "fs_range_s": 200e-6,
    "min_window_packets": 0.5,
    # Here the window changes once per pass of the daemon's loop (about a
    # millisecond on a loaded host), however short the base RTT; a probe
    # every 200 base RTTs (every few ms on loopback, where the base RTT is
    # tens of µs) halves the window again before it has grown back.
    "min_probe_interval_s": 0.1,
}


@register("efe")
class Efe(CongestionController):
    """Delay-based controller: fast ramp to a predicted RTT, Swift-like decrease."""

    def __init__(
        self,
        mss: int,
        *,
        initial_window_packets: float = 4,
        target_queue_s: float = 3e-6,
        fs_range_s: float = 8e-6,
        fs_min_packets: float = 0.5,
        fs_max_packets: float = 100.0,
        ai_packets: float = 0.05,
        ai_fraction: float = 0.005,
        mi_gain: float = 0.1,
        hai_packets: float = 0.3,
        beta: float = 1.0,
        max_mdf: float = 0.5,
        min_window_packets: float = 0.05,
        max_window_packets: float = 10000.0,
        probe_rtts: float = 200.0,
        first_probe_rtts: float = 20.0,
        max_probe_interval_s: float = 1.0,
        min_probe_interval_s: float = 0.0,
        probe_fraction: float = 0.5,
        pacing_gain: float = 1.25,
        small_window_packets: float = 4.0,
        noise_filter: bool = False,
        noise_samples: int = 8,
        loss_threshold: float = 0.15,
        loss_window_packets: float = 64.0,
        loss_mdf: float = 0.125,
    ) -> None:
        super().__init__(mss)
        self.cwnd_bytes = initial_window_packets * mss
        self.target_queue_s = target_queue_s
        self.fs_range_s = fs_range_s
        # Swift's flow scaling: target grows like 1/sqrt(cwnd) between the bounds.
        self._fs_a = 1.0 / math.sqrt(fs_min_packets) - 1.0 / math.sqrt(fs_max_packets)
        self._fs_b = 1.0 / math.sqrt(fs_max_packets)
        self.ai_bytes = ai_packets * mss
        self.ai_fraction = ai_fraction
        self.mi_gain = mi_gain
        self.hai_bytes = hai_packets * mss
        self.beta = beta
        self.max_mdf = max_mdf
        self.min_cwnd = min_window_packets * mss
        self.max_cwnd = max_window_packets * mss
        self.probe_rtts = probe_rtts
        self.first_probe_rtts = first_probe_rtts
        self._probe_gap_rtts = first_probe_rtts
        self.max_probe_interval_s = max_probe_interval_s
        self.min_probe_interval_s = min_probe_interval_s
        self.probe_fraction = probe_fraction
        self._next_probe = INF  # set when startup ends
        self.pacing_gain = pacing_gain
        self.small_window_packets = small_window_packets
        self.noise_filter = noise_filter
        self.noise_samples = noise_samples
        self.loss_threshold = loss_threshold
        self.loss_mdf = loss_mdf
        self._loss_window = loss_window_packets * mss
        self._acked_b = 0.0  # bytes delivered and lost lately (decayed at losses): the loss rate
        self._lost_b = 0.0
        self.loss_cuts = 0
        self._win_n = 0
        self._win_min = INF
        self._win_end = -INF
        self._signal = 0.0
        self.startup = True
        self.base_rtt_s = INF  #: min RTT over the filter window: the path without queues
        self._bucket_min = INF  # min of the current bucket
        self._prev_bucket_min = INF
        self._probe_until = -INF
        self._last_decrease = -INF
        self.rtt_s = 0.0  #: latest RTT sample
        self.probes = 0
        self.decreases = 0

    # --- the predicted RTT --------------------------------------------------

    def target_rtt_s(self) -> float:
        """base RTT + target queueing delay (+ flow scaling): the predicted RTT."""
        pk = self.cwnd_bytes / self.mss
        fs = (1.0 / math.sqrt(pk) - self._fs_b) / self._fs_a if pk > 0 else 1.0
        fs = 0.0 if fs < 0.0 else 1.0 if fs > 1.0 else fs
        return self.base_rtt_s + self.target_queue_s + self.fs_range_s * fs

    def _filter(self, rtt_s: float, now: float) -> float:
        # Host noise (a descheduled daemon, a late timer) only ever adds
        # delay, and comes and goes within an RTT; a queue persists.  So the
        # signal is the minimum sample of the previous RTT-long window.
        # A window also spans a few samples, so a small window (one packet
        # per RTT) still filters.
        if rtt_s < self._win_min:
            self._win_min = rtt_s
        self._win_n += 1
        if now >= self._win_end and self._win_n >= self.noise_samples:
            self._signal = self._win_min
            self._win_min = INF
            self._win_n = 0
            self._win_end = now + self._signal
        return self._signal or rtt_s

    def _sample(self, rtt_s: float, now: float) -> None:
        if rtt_s < self._bucket_min:
            self._bucket_min = rtt_s
            if rtt_s < self.base_rtt_s:
                self.base_rtt_s = rtt_s
        if now >= self._next_probe and not self.startup:
            self._probe(now, rtt_s)

    def _probe(self, now: float, rtt_s: float) -> None:
        # Rotate the min filter: the older bucket's minimum expires, so a
        # minimum from before a path change is forgotten after two probes,
        # and a base measured over somebody's queue gets corrected.
        self._prev_bucket_min = self._bucket_min
        self._bucket_min = INF
        self.base_rtt_s = self._prev_bucket_min
        # Shrink for two RTTs so the queue we contribute drains and the new
        # bucket sees (close to) the empty-queue RTT.  A flow that owns most
        # of the queue, the one whose inflated base would starve the others,
        # is exactly the one whose probe empties it.
        self.probes += 1
        self.cwnd_bytes = max(self.min_cwnd, self.cwnd_bytes * self.probe_fraction)
        self._probe_until = now + 2 * rtt_s
        self._probe_gap_rtts = min(2 * self._probe_gap_rtts, self.probe_rtts)
        self._next_probe = now + self._probe_gap_s()

    def _probe_gap_s(self) -> float:
        gap = self._probe_gap_rtts * self.base_rtt_s
        if gap > self.max_probe_interval_s:
            return self.max_probe_interval_s
        return gap if gap > self.min_probe_interval_s else self.min_probe_interval_s

    # --- controller callbacks -----------------------------------------------

    def on_packets_acked(self, acked_bytes: int, rtt_s: float | None, now: float, limited: bool = True) -> None:
        self._acked_b += acked_bytes
        if not limited:
            acked_bytes = 0  # RFC 7661: no growth; the delay still counts
        if rtt_s is not None and rtt_s > 0.0:
            if self.noise_filter:
                rtt_s = self._filter(rtt_s, now)
            self.rtt_s = rtt_s
            self._sample(rtt_s, now)
        rtt = self.rtt_s
        if rtt <= 0.0 or self.base_rtt_s == INF:
            return
        if now < self._probe_until:
            return  # hold the probe window
        # After a probe the window is not restored at once (that would be a
        # burst into the queue we just drained): the empty queue puts us in
        # the multiplicative ramp, which regains it in a few RTTs.
        cwnd = self.cwnd_bytes
        target = self.target_rtt_s()
        if rtt > target:
            if self.startup:
                self._leave_startup(now)
            if now - self._last_decrease >= rtt:
                # Swift: decrease in proportion to the excess delay, once per RTT.
                mdf = self.beta * (rtt - target) / rtt
                if mdf > self.max_mdf:
                    mdf = self.max_mdf
                cwnd *= 1.0 - mdf
                self._last_decrease = now
                self.decreases += 1
        elif self.startup:
            cwnd += acked_bytes  # fast ramp: x2 per RTT while on prediction
        elif rtt - self.base_rtt_s < 0.5 * (target - self.base_rtt_s):
            # Near the prediction: +hai packets (TIMELY's hyperactive
            # increase, additive, so it also equalizes flows) and +mi_gain of
            # the window per RTT (multiplicative, so a large share freed by a
            # departing flow or a probe is refilled in a few RTTs).
            # The additive part is for windows of several packets: with many
            # flows of a packet or two it would add N x hai at once.
            hai = self.hai_bytes if cwnd >= self.small_window_packets * self.mss else 0.0
            cwnd += (hai + self.mi_gain * cwnd) * acked_bytes / cwnd
        else:
            # +ai packets +ai_fraction of the window per RTT.  The fixed part
            # is what makes AIMD converge to fairness; keeping it small and
            # adding a part proportional to the window keeps the *aggregate*
            # increase of N flows per RTT near ai_fraction x BDP instead of
            # N x ai, so 64 flows do not overrun the target queue.  Below one
            # packet the same law holds (the window is a rate, paced).
            cwnd += (self.ai_bytes + self.ai_fraction * cwnd) * acked_bytes / cwnd
        if cwnd < self.min_cwnd:
            cwnd = self.min_cwnd
        elif cwnd > self.max_cwnd:
            cwnd = self.max_cwnd
        self.cwnd_bytes = cwnd

    def _leave_startup(self, now: float) -> None:
        self.startup = False
        # The first probe comes soon: flows that joined a queue measured an
        # inflated base RTT, and they all leave startup at about the same
        # time, so their early probes coincide and drain the queue.  The gap
        # then doubles up to probe_rtts.
        self._probe_gap_rtts = self.first_probe_rtts
        self._next_probe = now + self._probe_gap_s()

    def loss_rate(self) -> float:
        """The share of bytes lost lately (about the last ``loss_window_packets``)."""
        total = self._acked_b + self._lost_b
        return self._lost_b / total if total else 0.0

    def on_packets_lost(self, lost_bytes: int, now: float, episode: bool = True) -> None:
        self._lost_b += lost_bytes
        rate = self.loss_rate()
        total = self._acked_b + self._lost_b
        if total > self._loss_window:  # forget the older past, keeping the rate
            k = self._loss_window / total
            self._acked_b *= k
            self._lost_b *= k
        if not episode:
            return
        base = self.base_rtt_s
        if rate >= self.loss_threshold or self.rtt_s <= 0.0 or base == INF:
            mdf = self.max_mdf  # heavy loss, or no delay measured yet to tell
        else:
            mdf = self.max_mdf * (self.rtt_s - base) / (0.5 * self.target_queue_s)
            if mdf > self.max_mdf:
                mdf = self.max_mdf
        if mdf >= 0.5 * self.max_mdf and self.startup:
            self._leave_startup(now)  # the ramp met a queue
        if mdf < self.loss_mdf:
            mdf = self.loss_mdf
        if now - self._last_decrease >= self.rtt_s:
            self.cwnd_bytes = max(self.min_cwnd, self.cwnd_bytes * (1.0 - mdf))
            self._last_decrease = now
            self.loss_cuts += 1

    def on_rto(self, now: float) -> None:
        if self.startup:
            self._leave_startup(now)
        # At most one packet, as RFC 5681's loss window; not the sub-packet
        # floor, from which a flow would take hundreds of RTTs to return.
        self.cwnd_bytes = max(self.min_cwnd, min(self.cwnd_bytes * (1.0 - self.max_mdf), self.mss))
        self._last_decrease = now

    def pacing_rate_Bps(self, srtt_s: float | None) -> float:
        rtt = self.rtt_s or srtt_s
        if not rtt:
            return INF
        gain = 2.0 if self.startup else self.pacing_gain
        if self.cwnd_bytes < self.small_window_packets * self.mss:
            # Swift: a window of a few packets (or less) is exactly a rate;
            # the window check lets one packet overshoot, the pacer does not.
            gain = 1.0
        return gain * self.cwnd_bytes / rtt


@register("efe-host")
class EfeHost(Efe):
    """EFE with ``EFE_HOST_PARAMS`` as defaults: the choice for real daemons,
    selectable by name alone (``LinkConfig(cc="efe-host")``)."""

    def __init__(self, mss: int, **params: Any) -> None:
        super().__init__(mss, **{**EFE_HOST_PARAMS, **params})  # type: ignore[arg-type]
