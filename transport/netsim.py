"""A deterministic network simulator that drives real :class:`Link` objects.

Theory of operation
-------------------
Discrete events on a fake clock: a heap of ``(time, sequence, callback,
argument)``; the sequence number breaks ties in scheduling order, so a run
is a pure function of its inputs and its one ``random.Random``.

* :class:`Endpoint` owns a real ``transport.Link`` (one side of one flow).
  After every input (a delivered datagram or its timer) it does what the
  daemon does after every input: drain delivered messages, top up the send
  queue from its source while ``send_space()`` allows, hand
  ``datagrams_to_send(now)`` to its outbound channel, and re-arm one timer at
  ``next_deadline()``.
* :class:`Channel` is one direction of a path: propagation delay, optional
  :class:`Impairments` (loss, duplication, reordering, corruption, jitter;
  every draw from the simulator's rng) and an optional shared
  :class:`Bottleneck`.
* :class:`Bottleneck` is a drop-tail FIFO in front of a link of ``rate_Bps``
  with a buffer of ``buffer_bytes``, computed lazily (the queue is
  ``busy_until - now`` seconds of work), so it costs no events; it records the
  queueing delay of every packet it admits, its drops and its busy time.

:func:`dumbbell` is the shared-bottleneck scenario (N bulk flows, one
queue); :func:`lossy_path` one flow over a bottleneck with random loss,
duplication and reordering on both directions, timed to its last ACK.

A path may carry datagrams only up to a size (``Channel.mtu``: a hop that
drops larger ones silently, DF set and no ICMP) or the sending host may
know the limit (``Channel.local_mtu``: its stack refuses a larger datagram,
``EMSGSIZE``, and the endpoint tells its link, as the daemon does).  A
DATA packet longer than the link's ``fragment_above`` leaves fragmented (DF
clear, as the daemon sends it) and crosses either limit.

Corruption flips one byte of the datagram, which the link's CRC32c must
catch (the test counts ``bad_crc``).  ``trace`` (a list) records every
delivery as ``(time, channel, bytes)`` so two runs can be compared byte for
byte.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass
from typing import Any, Callable

from .link import Link, LinkConfig, LinkEvent, LinkState, LinkUp, one_per_datagram
from .pmtud import fragmentable


@dataclass
class Impairments:
    """Per-datagram impairment probabilities (independent draws)."""

    loss: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    corrupt: float = 0.0
    #: a reordered datagram is held back by uniform(0, reorder_delay_s) extra
    reorder_delay_s: float = 50e-6
    #: every datagram gets uniform(0, jitter_s) extra delay (also reorders)
    jitter_s: float = 0.0
    #: host noise: uniform(0, fifo_jitter_s) extra delay, but never overtaking
    #: the previous datagram (a descheduled receiver delays, it does not reorder)
    fifo_jitter_s: float = 0.0


class Simulator:
    """Event heap and fake clock."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = 0
        self.events_run = 0

    def schedule(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` at time ``t`` (not before now)."""
        self._seq += 1
        heapq.heappush(self._heap, (t if t > self.now else self.now, self._seq, fn, arg))

    def run(self, until: float, *, max_events: int = 50_000_000,
            stop: Callable[[], bool] | None = None) -> bool:
        """Run events up to time ``until``.

        Returns True if ``stop()`` became true (checked after each event),
        False when time or events ran out.

        Raises:
            RuntimeError: more than ``max_events`` events (a livelock guard).
        """
        heap = self._heap
        pop = heapq.heappop
        n = 0
        while heap and heap[0][0] <= until:
            t, _, fn, arg = pop(heap)
            self.now = t
            fn(arg)
            n += 1
            if stop is not None and stop():
                self.events_run += n
                return True
            if n >= max_events:
                raise RuntimeError(f"simulator: {n} events by t={t}")
        self.events_run += n
        if self.now < until:
            self.now = until
        return False


class Bottleneck:
    """A drop-tail FIFO queue feeding a link of ``rate_Bps``."""

    def __init__(self, rate_Bps: float, buffer_bytes: int) -> None:
        self.rate_Bps = rate_Bps
        self.buffer_bytes = buffer_bytes
        self.busy_until = 0.0
        self.arrivals = 0
        self.drops = 0
        self.queue_delays_s: list[float] = []
        #: (start, end) of the measurement window; delays/bytes outside are not recorded
        self.window = (0.0, float("inf"))
        self.bytes_out = 0  # inside the window
        self.window_arrivals = 0
        self.window_drops = 0

    def admit(self, size: int, now: float) -> float | None:
        """A packet of ``size`` bytes arrives at ``now``: its departure time
        (end of transmission), or None if the buffer is full (dropped)."""
        self.arrivals += 1
        wait = self.busy_until - now
        if wait < 0.0:
            wait = 0.0
        inw = self.window[0] <= now < self.window[1]
        if inw:
            self.window_arrivals += 1
        if wait * self.rate_Bps + size > self.buffer_bytes:
            self.drops += 1
            if inw:
                self.window_drops += 1
            return None
        done = now + wait + size / self.rate_Bps
        self.busy_until = done
        if inw:
            self.queue_delays_s.append(wait)
            self.bytes_out += size
        return done


class Channel:
    """One direction of a path to ``dst``: delay, impairments, bottleneck."""

    def __init__(self, sim: Simulator, dst: Endpoint, delay_s: float, *,
                 impairments: Impairments | None = None, bottleneck: Bottleneck | None = None,
                 trace: list[tuple[float, str, bytes]] | None = None, name: str = "", net: int = 0) -> None:
        self.sim = sim
        self.dst = dst
        #: which of the endpoints' network paths this is (``multipath``; 0: the first)
        self.net = net
        #: False while the path is cut: every datagram put on it vanishes
        self.up = True
        self.cut = 0  # datagrams lost to a cut
        self.delay_s = delay_s
        self.imp = impairments
        self.bottleneck = bottleneck
        self.trace = trace
        self.name = name
        self.sent = 0
        self.lost = 0
        self._last_arrival = 0.0
        #: 0, or the longest datagram a hop of the path carries (longer: dropped, no signal)
        self.mtu = 0
        #: 0, or the longest datagram the sender's own stack sends (longer: refused)
        self.local_mtu = 0
        self.too_big = 0  # datagrams dropped by ``mtu``

    def send(self, data: bytes, fragmented: bool = False) -> None:
        """Put one datagram on the path (``fragmented``: DF clear, so no MTU stops it)."""
        sim = self.sim
        self.sent += 1
        if not self.up:
            self.cut += 1
            return
        if self.mtu and len(data) > self.mtu and not fragmented:
            self.too_big += 1
            return
        imp = self.imp
        t = sim.now
        if self.bottleneck is not None:
            done = self.bottleneck.admit(len(data), t)
            if done is None:
                self.lost += 1
                return
            t = done
        t += self.delay_s
        if imp is None:
            sim.schedule(t, self._arrive, data)
            return
        rnd = sim.rng.random
        copies = 2 if rnd() < imp.duplicate else 1
        for _ in range(copies):
            if rnd() < imp.loss:
                self.lost += 1
                continue
            d = data
            if rnd() < imp.corrupt:
                b = bytearray(d)
                b[sim.rng.randrange(len(b))] ^= sim.rng.randrange(1, 256)
                d = bytes(b)
            at = t
            if imp.jitter_s:
                at += rnd() * imp.jitter_s
            if imp.fifo_jitter_s:
                at += rnd() * imp.fifo_jitter_s
                if at < self._last_arrival:
                    at = self._last_arrival
                self._last_arrival = at
            if rnd() < imp.reorder:
                at += rnd() * imp.reorder_delay_s
            sim.schedule(at, self._arrive, d)

    def _arrive(self, data: bytes) -> None:
        if not self.up:
            self.cut += 1  # on the wire when the path was cut
            return
        if self.trace is not None:
            self.trace.append((self.sim.now, self.name, data))
        self.dst.deliver(data, self.net)


class Endpoint:
    """One side of one flow: a real Link plus the daemon's per-input duty.

    Args:
        sim: the simulator.
        link: the Link to drive.
        source: messages to send, in order (topped up lazily).
        on_delivery: called with (endpoint, messages, now) for every batch of
            delivered messages; by default they are appended to ``received``.
    """

    def __init__(self, sim: Simulator, link: Link, *, source: list[bytes] | None = None,
                 on_delivery: Callable[[Endpoint, list[bytes], float], None] | None = None,
                 name: str = "", stream: bytes = b"") -> None:
        self.sim = sim
        self.link = link
        self.name = name
        self.channel: Channel | None = None
        #: more network paths to the peer, by index (``multipath``): the
        #: active side adds them to its link once it is up, the passive side
        #: when a datagram first arrives on one (as the daemon pairs them)
        self.channels: dict[int, Channel] = {}
        self._net_of: dict[int, int] = {0: 0}  # the link's path id -> network path
        self._path_of: dict[int, int] = {0: 0}  # network path -> the link's path id
        self.source = source or []
        self.source_pos = 0
        #: bytes to send after ``source``, cut into messages of the link's
        #: ``payload_limit`` as they are queued (as the daemon cuts)
        self.stream = stream
        self.stream_pos = 0
        self.received: list[bytes] = []
        self.on_delivery = on_delivery
        self.events: list[LinkEvent] = []
        self._active = False
        self._timer_at: float | None = None
        self._timer_gen = 0

    def connect(self) -> None:
        """Active open at the current simulated time."""
        self._active = True
        self.link.connect(self.sim.now)
        self.service()

    def deliver(self, data: bytes, net: int = 0) -> None:
        """A datagram arrived from the network (on network path ``net``)."""
        link = self.link
        if not net:
            link.datagram_received(data, self.sim.now)
        else:
            pid = self._path_of.get(net)
            if pid is None and link.state == LinkState.ESTABLISHED:
                pid = self._map_path(net)
            link.datagram_received(data, self.sim.now, path=pid or 0)
        self.service()

    def _map_path(self, net: int) -> int:
        pid = self.link.add_path(self.sim.now)
        self._path_of[net] = pid
        self._net_of[pid] = net
        return pid

    def _on_timer(self, gen: int) -> None:
        if gen != self._timer_gen:
            return  # superseded by an earlier re-arm
        self._timer_at = None
        dl = self.link.next_deadline()
        if dl is not None and dl > self.sim.now:
            self._arm(dl)  # the deadline moved later since we armed: not due yet
            return
        self.link.timer_fired(self.sim.now)
        self.service()

    def _arm(self, dl: float) -> None:
        self._timer_at = dl
        self._timer_gen += 1
        self.sim.schedule(dl, self._on_timer, self._timer_gen)

    def service(self) -> None:
        """Drain, top up, send, re-arm: what the daemon does after each input."""
        link = self.link
        now = self.sim.now
        got = link.drain_received()
        if got:
            if self.on_delivery is None:
                self.received += got
            else:
                self.on_delivery(self, got, now)
        src = self.source
        pos = self.source_pos
        if pos < len(src):
            space = link.send_space()
            end = min(len(src), pos + space)
            send = link.send
            for i in range(pos, end):
                send(src[i], now)
            self.source_pos = end
        self._top_up_stream(now)
        self._send(now)
        ev = link.next_event()
        while ev is not None:
            self.events.append(ev)
            if type(ev) is LinkUp and self.channels and self._active:
                for net in sorted(self.channels):
                    if net not in self._path_of:
                        self._map_path(net)
                self._send(now)
            ev = link.next_event()
        dl = link.next_deadline()
        # Re-arm only when the deadline moved earlier: a timer that fires
        # early re-checks next_deadline() (cheaper than a heap entry per input).
        if dl is not None and (self._timer_at is None or dl < self._timer_at):
            self._arm(dl)


    def _top_up_stream(self, now: float) -> None:
        link, stream = self.link, self.stream
        pos = self.stream_pos
        if pos >= len(stream) or self.source_pos < len(self.source):
            return
        for _ in range(link.send_space()):
            end = min(len(stream), pos + link.payload_limit)
            link.send(stream[pos:end], now)
            pos = end
            if pos >= len(stream):
                break
        self.stream_pos = pos

    def _send(self, now: float) -> None:
        """Hand what the link lets leave to the channel; a datagram the
        sender's stack refuses goes back to the link, which may then have
        more to send (the next probe), up to a bound."""
        link, ch = self.link, self.channel
        if link.multipath:
            self._send_by_path(now)
            return
        for _ in range(64):
            out = link.datagrams_to_send(now)
            if not out:
                return
            assert ch is not None
            refused = False
            frag = link.fragment_above
            for d in out:
                n = len(d)
                if frag and fragmentable(d, frag):
                    ch.send(d, fragmented=True)
                elif ch.local_mtu and n > ch.local_mtu:
                    link.datagram_refused(n, now)
                    refused = True
                else:
                    ch.send(d)
            if not refused:
                return

    def _send_by_path(self, now: float) -> None:
        """``_send`` for a multi-path link: each path's datagrams on its channel."""
        link = self.link
        for _ in range(64):
            by_path = link.bursts_by_path(now)
            if not by_path:
                return
            refused = False
            frag = link.fragment_above
            for pid, out in by_path:
                net = self._net_of[pid]
                ch = self.channel if not net else self.channels[net]
                assert ch is not None
                for d in one_per_datagram(out):
                    n = len(d)
                    if frag and fragmentable(d, frag):
                        ch.send(d, fragmented=True)
                    elif ch.local_mtu and n > ch.local_mtu:
                        link.datagram_refused(n, now, pid)
                        refused = True
                    else:
                        ch.send(d)
            if not refused:
                return


@dataclass
class PathSpec:
    """One network path of :func:`multipath`: a drop-tail bottleneck of
    ``rate_Bps`` each way (a buffer of ``buffer_bdp`` x its bandwidth-delay
    product), ``rtt_s`` of propagation, and ``impairments`` both ways."""

    rate_Bps: float
    rtt_s: float
    buffer_bdp: float = 1.0
    impairments: Impairments | None = None


def multipath(sim: Simulator, link_a: Link, link_b: Link, specs: list[PathSpec], *,
              trace: list[tuple[float, str, bytes]] | None = None,
              ) -> tuple[Endpoint, Endpoint, list[tuple[Channel, Channel]]]:
    """Two endpoints joined by several network paths, the first the one the
    handshake runs on; ``a`` (the side that connects) adds the others to
    its link once it is up, ``b`` when something first arrives on one.
    Returns the endpoints and each path's channels (a to b, b to a), which
    :func:`set_path_up` cuts and restores."""
    a = Endpoint(sim, link_a, name="a")
    b = Endpoint(sim, link_b, name="b")
    nets = []
    for k, sp in enumerate(specs):
        chans = []
        for src, dst, tag in ((a, b, "a>b"), (b, a, "b>a")):
            neck = Bottleneck(sp.rate_Bps, int(sp.rate_Bps * sp.rtt_s * sp.buffer_bdp))
            ch = Channel(sim, dst, sp.rtt_s / 2, impairments=sp.impairments, bottleneck=neck, trace=trace,
                         name=f"{tag}{k}", net=k)
            if k:
                src.channels[k] = ch
            else:
                src.channel = ch
            chans.append(ch)
        nets.append((chans[0], chans[1]))
    return a, b, nets


def set_path_up(nets: list[tuple[Channel, Channel]], k: int, up: bool) -> None:
    """Cut (``up`` False) or restore network path ``k`` of :func:`multipath`, both ways."""
    for ch in nets[k]:
        ch.up = up


def pair(sim: Simulator, link_a: Link, link_b: Link, delay_s: float, *,
         impairments: Impairments | None = None,
         trace: list[tuple[float, str, bytes]] | None = None) -> tuple[Endpoint, Endpoint]:
    """Two endpoints joined by a symmetric path (same impairments both ways)."""
    a = Endpoint(sim, link_a, name="a")
    b = Endpoint(sim, link_b, name="b")
    a.channel = Channel(sim, b, delay_s, impairments=impairments, trace=trace, name="a>b")
    b.channel = Channel(sim, a, delay_s, impairments=impairments, trace=trace, name="b>a")
    return a, b


# --- a shared-bottleneck scenario (used by bench/netsim.py and the tests) ----


@dataclass
class DumbbellResult:
    """What one dumbbell run measured (inside the measurement window)."""

    cc: str
    flows: int
    utilization: float  #: bottleneck busy fraction
    jain: float  #: Jain's fairness index of per-flow goodput
    queue_p50_us: float
    queue_p99_us: float
    loss_rate: float  #: bottleneck drops / arrivals
    goodput_Bps: list[float]
    retransmits: int
    rto_count: int
    events: int

    def row(self) -> dict[str, Any]:
        """The bench's JSON row."""
        return {"cc": self.cc, "flows": self.flows, "utilization": round(self.utilization, 4),
                "jain": round(self.jain, 4), "queue_p50_us": round(self.queue_p50_us, 2),
                "queue_p99_us": round(self.queue_p99_us, 2), "loss_rate": round(self.loss_rate, 6)}


def jain_index(xs: list[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n * sum x^2); 1.0 is perfectly fair."""
    s = sum(xs)
    q = sum(x * x for x in xs)
    return s * s / (len(xs) * q) if q else 0.0


def percentile(xs: list[float], p: float) -> float:
    """The p-th percentile (nearest rank) of ``xs``; 0.0 for an empty list."""
    if not xs:
        return 0.0
    s = sorted(xs)
    k = min(len(s) - 1, max(0, math.ceil(p / 100.0 * len(s)) - 1))
    return s[k]


def dumbbell(cc: str, flows: int, *, rate_Bps: float = 1.25e9, rtt_s: float = 100e-6,
             buffer_bdp: float = 1.0, duration_s: float = 0.1, warmup_s: float = 0.02,
             seed: int = 1, cc_params: dict[str, Any] | None = None,
             config: LinkConfig | None = None) -> DumbbellResult:
    """``flows`` bulk senders share one drop-tail bottleneck to their receivers.

    The forward path is bottleneck (``rate_Bps``, buffer ``buffer_bdp`` x
    bandwidth-delay product) then half the base RTT of propagation; ACKs
    return over the other half without a queue.  Flows start at random
    times in the first 1 ms; metrics cover ``[warmup_s, duration_s)``.
    """
    rng = random.Random(seed)
    sim = Simulator(rng)
    bdp = rate_Bps * rtt_s
    neck = Bottleneck(rate_Bps, int(bdp * buffer_bdp))
    neck.window = (warmup_s, duration_s)
    base = config or LinkConfig()
    cfg = LinkConfig(**{**base.__dict__, "cc": cc, "cc_params": dict(cc_params or {})})
    payload = bytes(cfg.max_payload)
    # Enough messages that no flow runs dry before the end.
    count = int(rate_Bps * duration_s / len(payload) * 1.2) + 1000
    source = [payload] * count
    goodput = [0] * flows
    w0, w1 = warmup_s, duration_s

    def make_sink(i: int) -> Callable[[Endpoint, list[bytes], float], None]:
        def sink(ep: Endpoint, msgs: list[bytes], now: float) -> None:
            if w0 <= now < w1:
                goodput[i] += sum(len(m) for m in msgs)
        return sink

    senders = []
    for i in range(flows):
        ls = Link(cfg, rng=random.Random(rng.random()), incarnation=2 * i + 1)
        lr = Link(cfg, rng=random.Random(rng.random()), incarnation=2 * i + 2)
        s = Endpoint(sim, ls, source=source, name=f"s{i}")
        r = Endpoint(sim, lr, on_delivery=make_sink(i), name=f"r{i}")
        s.channel = Channel(sim, r, rtt_s / 2, bottleneck=neck, name=f"s{i}>r{i}")
        r.channel = Channel(sim, s, rtt_s / 2, name=f"r{i}>s{i}")
        sim.schedule(rng.random() * 1e-3, lambda ep: ep.connect(), s)
        senders.append(s)
    sim.run(duration_s)
    span = w1 - w0
    return DumbbellResult(
        cc=cc, flows=flows,
        utilization=neck.bytes_out / (rate_Bps * span),
        jain=jain_index([float(g) for g in goodput]),
        queue_p50_us=percentile(neck.queue_delays_s, 50) * 1e6,
        queue_p99_us=percentile(neck.queue_delays_s, 99) * 1e6,
        loss_rate=neck.window_drops / neck.window_arrivals if neck.window_arrivals else 0.0,
        goodput_Bps=[g / span for g in goodput],
        retransmits=sum(s.link.stats.retransmits for s in senders),
        rto_count=sum(s.link.stats.rto_count for s in senders),
        events=sim.events_run,
    )


# --- one flow over a lossy path (used by bench/netsim.py --lossy and the tests) ----


@dataclass
class PathResult:
    """What one :func:`lossy_path` transfer measured."""

    cc: str
    messages: int
    seconds: float  #: simulated time until the last message was delivered and acknowledged
    goodput_Bps: float  #: payload bytes over ``seconds``
    exact: bool  #: every message delivered once, in order, byte for byte
    lost: int  #: data datagrams the path dropped (bottleneck and impairments)
    retransmits: int
    rto_count: int
    tlp_probes: int
    spurious: int  #: retransmissions found unneeded (the original arrived)

    def row(self) -> dict[str, Any]:
        """The bench's JSON row."""
        return {"cc": self.cc, "messages": self.messages, "seconds": round(self.seconds, 6),
                "goodput_MBps": round(self.goodput_Bps / 1e6, 2), "exact": self.exact, "lost": self.lost,
                "retransmits": self.retransmits, "rto": self.rto_count, "tlp": self.tlp_probes,
                "spurious": self.spurious}


def lossy_path(cc: str, messages: int, *, impairments: Impairments | None = None, rate_Bps: float = 1.25e8,
               rtt_s: float = 100e-6, buffer_bdp: float = 1.0, seed: int = 1, config: LinkConfig | None = None,
               cc_params: dict[str, Any] | None = None, time_limit_s: float = 600.0) -> PathResult:
    """One bulk flow of ``messages`` full-size, numbered messages over a path
    of ``rate_Bps`` (a drop-tail bottleneck of ``buffer_bdp`` x the
    bandwidth-delay product) and ``rtt_s``, with ``impairments`` on both
    directions, data and ACKs, after the bottleneck.  Runs until the last
    message is delivered and acknowledged (at most ``time_limit_s``
    simulated)."""
    rng = random.Random(seed)
    sim = Simulator(rng)
    base = config or LinkConfig()
    cfg = LinkConfig(**{**base.__dict__, "cc": cc, "cc_params": dict(cc_params or {})})
    la = Link(cfg, rng=random.Random(rng.getrandbits(64)), incarnation=1)
    lb = Link(cfg, rng=random.Random(rng.getrandbits(64)), incarnation=2)
    size = cfg.max_payload
    msgs = [i.to_bytes(4, "big") * (size // 4) for i in range(messages)]
    a = Endpoint(sim, la, source=msgs, name="a")
    b = Endpoint(sim, lb, name="b")
    neck = Bottleneck(rate_Bps, int(rate_Bps * rtt_s * buffer_bdp))
    a.channel = Channel(sim, b, rtt_s / 2, impairments=impairments, bottleneck=neck, name="a>b")
    b.channel = Channel(sim, a, rtt_s / 2, impairments=impairments, name="b>a")
    sim.schedule(0.0, lambda _: a.connect())
    sim.run(time_limit_s, max_events=400 * messages + 100_000,
            stop=lambda: len(b.received) >= messages and la.acked >= messages)
    s = la.stats
    return PathResult(cc=cc, messages=messages, seconds=sim.now, goodput_Bps=messages * size / sim.now,
                      exact=b.received == msgs, lost=a.channel.lost, retransmits=s.retransmits,
                      rto_count=s.rto_count, tlp_probes=s.tlp_probes, spurious=la.recovery.spurious)
