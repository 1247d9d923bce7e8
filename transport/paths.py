"""Several paths under one link: per-path congestion control, scheduling and liveness (sans-IO).

Theory of operation
-------------------
A daemon with several addresses reaches its peer over several *paths* (an
address pair each, the owner's business).  One :class:`Link` runs over all
of them: one sequence space, one table of unacknowledged messages, one
receiver, so the layers above see one ordered, exactly-once stream whatever
the paths do.  Path 0 is the pair the handshake ran on; ``Link.add_path``
adds the others (MPTCP's subflows, RFC 8684, and QUIC's multipath paths,
without their per-path sequence spaces: a message's number is its place in
the stream, and the sender remembers which path carried it).

What is per path (:class:`Path`): the RTT estimator, the congestion
controller (the link's ``LinkConfig.cc``) and its pacer, the packets in
flight on it (message number -> its transmission on this path), RACK's
loss detection over them (RFC 8985: a packet is lost when one sent *on the
same path* after it was delivered, by the packet threshold or a reordering
window later), a retransmission timer and liveness.  Across paths the
receiver sees reordering all the time, so loss detection must not compare
packets of different paths: a loss cuts the window of the path that
carried the packet, and only that one.

ACKs and RTT samples.  Every packet echoes a timestamp (``link.py``'s echo
rule); here the echo is per path: a packet leaving on path p echoes the
latest one received *on p*, plus the time held.  So the peer's sample from
a packet arriving on p is p's round trip both ways, its own RTT.  The
receiver owes each path on which DATA arrived since its last packet there
an ACK: when an ACK is due it goes on every such path, on our DATA if some
leaves on it, alone otherwise.  A path's data is thus acknowledged on the
path itself (its ACK clock and RTT samples), and also by the cumulative ACK
and SACK blocks of packets on the others (never waited for).  Since the
echo is exact (the time held is added), every packet arriving on p is a
sample of p's round trip, whether or not it acknowledges anything new:
the ACK on a slow path usually repeats what a copy on a fast one already
said, and p's delay-based controller needs its delay all the same.

Scheduling (MPTCP's default, the lowest-RTT path with room): each packet,
first transmission or retransmission, goes on the usable path with the
lowest smoothed RTT whose window has room and whose pacer lets it leave
now.  A path carries what its window over its RTT allows, so the share of
each is its rate, not a turn.  A retransmission avoids the path it was lost
on when another one has room.

Liveness.  A path with something outstanding on it (data in flight, or a
probe) that hears nothing for ``path_dead_s`` is *down*: what was in flight
on it is declared lost and re-sent on the others at once, not at the RTO.
Hearing is any valid packet of this link arriving on it, or its data being
acknowledged.  A down path is probed (KEEPALIVE with ACK_NOW, answered at
once on the path it arrived on) every ``path_probe_s`` and comes back *up*,
with a fresh congestion controller, when something arrives on it.  A path
added by ``add_path`` is *probing* until it is heard, and down if it is not
within ``path_dead_s``.  Each path's retransmission timer (RFC 6298 on its
own RTT) declares its flight lost and makes it *suspect*: it carries no
data, only a probe per (backed-off) timeout, until it is heard again, so a
path that fails quickly loses only its window.

The link as a whole keeps its promise as with one path (``timers.py``): its
retransmission timer runs while data waits on the peer and its expiries in
a row without the cumulative ACK moving fail the link
(``retransmit_budget``).  While one path works the cumulative ACK moves, so
the link fails only when every path has failed for the whole budget.

What leaves, and on which path, is ``scheduler.py``'s (:class:`Scheduler`,
the base of :class:`Paths`); here are the paths' life, the input and the
acknowledgements, and the timers.

Path MTU (``pmtud.py``, RFC 8899), per path: each up path runs its own
search (path 0 goes on with the link's), its PROBEs leaving on it and
answered on it; a datagram its socket refused (``datagram_refused(...,
path=p)``) and a black hole (its timer expiring twice with none of its
data acknowledged, larger messages lost) are its own.  The link's largest
message (``payload_limit``) is the smallest PLPMTU of the paths up: what
every one of them carries, whichever the scheduler picks.  A path coming
up starts from the base size, so the link's size falls to it until that
path's search has found more; a path going down no longer counts.

Cost: a link is single-path until ``add_path``, and nothing here runs
before.  The first ``add_path`` moves what is in flight to path 0 and puts
the multi-path versions of the per-datagram entry points on the instance
(``_mp_start``), so a single-path link pays no test per datagram.  While
multi-path, ``frame_alone`` / ``frame_run_alone`` return None (every
packet goes through the scheduler) and the owner drains ``bursts_by_path``;
the compiled lanes go on, per path (``pathlanes.py``).
"""

from __future__ import annotations

import copy
import heapq
from typing import Any

from ..wire import link as wl
from .congestion.base import INF, create
from ..wire.errors import WireError
from .pacer import Pacer
from .pmtud import BLACK_HOLE_RTOS, Plpmtud, PmtudState
from .records import LinkState, PathChanged, PathStats
from .recovery import RttEstimator
from .scheduler import DOWN, PROBING, UP, Path, Scheduler, none

_U32 = 0xFFFFFFFF
_DATA = wl.PacketType.DATA
_KEEPALIVE = wl.PacketType.KEEPALIVE
_PROBE_ACK = wl.PacketType.PROBE_ACK
_ESTABLISHED = LinkState.ESTABLISHED
_PROBING, _UP, _DOWN = PROBING, UP, DOWN
#: the header's path_id is a byte: path ids 0 .. 255
MAX_PATHS = 256


class Paths(Scheduler):
    """The link's multi-path part (a mixin of ``link.Link``; see the module
    docstring).  Needs the link's state, as its base :class:`Scheduler`
    lists, and these."""

    cc: Any
    pacer: Any
    payload_limit: int
    _events: Any
    _last_heard: float
    _last_rx_ts: int
    _last_rx_time: float
    _pto_deadline: float | None
    _consecutive_rto: int
    _last_ack_field: int
    _max_rtt_us: int
    _arrived: float

    def _paths_init(self) -> None:
        #: our addresses, carried in INIT / INIT_ACK (the owner sets them before the handshake)
        self.local_addresses: tuple[tuple[str, int], ...] = ()
        #: the peer's, from its INIT / INIT_ACK
        self.peer_addresses: tuple[tuple[str, int], ...] = ()
        self._mp: dict[int, Path] | None = None

    @property
    def multipath(self) -> bool:
        """More than one path exists (``add_path`` was called)."""
        return self._mp is not None

    # --- the owner's calls ------------------------------------------------------

    def add_path(self, now: float) -> int:
        """A new path (the owner knows its address pair): its id, 1, 2, ...
        It is *probing* (a probe leaves on it now) until a valid packet of
        this link arrives on it.

        A passive link may take a path as soon as the peer has proven it
        knows our tag (INIT_RECEIVED), as a packet on the new path may: the
        owner adds the path, then hands it the packet.

        Raises:
            RuntimeError: the link is not established (nor INIT_RECEIVED), or
                has 256 paths.
        """
        if self.state != _ESTABLISHED and self.state != LinkState.INIT_RECEIVED:
            raise RuntimeError(f"add_path() in state {self.state.name}")
        if self._mp is None:
            self._mp_start(now)
        paths = self._mp
        assert paths is not None
        pid = len(paths)
        if pid >= MAX_PATHS:
            raise RuntimeError("a link has at most 256 paths")
        p = paths[pid] = self._new_path(pid, _PROBING, now)
        self._events.append(PathChanged(pid, _PROBING, "added"))
        self._probe(p, now)
        return pid

    def path_stats(self, now: float) -> list[PathStats]:
        """Each path's state and counters (one, path 0, while single-path:
        its bytes are counted from the moment the link has several paths)."""
        if self._mp is None:
            s = self.stats
            return [PathStats(0, _UP if self.state == _ESTABLISHED else _PROBING, s.datagrams_sent, 0,
                              s.datagrams_received, 0, s.retransmits, self.rtt.srtt_s, self._min_rtt(self.rtt),
                              self.cc.cwnd_bytes, self.pacer.rate_Bps, 0, self.payload_limit)]
        return [PathStats(p.id, p.state, p.datagrams_sent, p.bytes_sent, p.datagrams_received, p.bytes_received,
                          p.retransmissions, p.rtt.srtt_s, self._min_rtt(p.rtt), p.cc.cwnd_bytes, p.pacer.rate_Bps,
                          p.times_down, self._plpmtu(p)) for p in self._mp.values()]

    def _plpmtu(self, p: Path) -> int:
        """What ``p`` is known to carry: its search's PLPMTU; 0 while it has
        none (down or probing) and the link searches; without discovery,
        the link's size."""
        if p.pmtud is not None:
            return int(p.pmtud.plpmtu)
        return 0 if self.config.base_payload else self.payload_limit

    @staticmethod
    def _min_rtt(rtt: RttEstimator) -> float | None:
        return rtt.min_s if rtt.min_s != INF else None

    # --- becoming multi-path ------------------------------------------------------

    def _new_path(self, pid: int, state: str, now: float) -> Path:
        c = self.config
        mss = self.payload_limit + wl.OVERHEAD
        return Path(pid, state, RttEstimator(c.initial_rto_s, c.min_rto_s, c.max_rto_s), create(c.cc, mss, c.cc_params),
                    Pacer(c.pacing_burst_packets * mss, c.pacing_burst_s), now)

    def _mp_start(self, now: float) -> None:
        """Path 0 takes over the link's controller, pacer, RTT estimate and
        what is in flight; the multi-path entry points go on the instance."""
        p = Path(0, _UP, copy.copy(self.rtt), self.cc, self.pacer, self._last_heard)
        s = self.stats
        p.datagrams_sent, p.datagrams_received, p.retransmissions = s.datagrams_sent, s.datagrams_received, s.retransmits
        p.last_rx_ts, p.last_rx_time = self._last_rx_ts, self._last_rx_time
        self._mp = {0: p}
        self._where: dict[int, Path] = {}  # message n in flight -> the path carrying it
        self._lost: list[int] = []  # a heap of message numbers to send again, lowest first
        self._lost_on: dict[int, int] = {}  # n -> the path it was lost on (its retransmission goes elsewhere)
        self._sack_seen: dict[int, int] = {}  # SACK block start -> the end already applied
        self._mp_rx = p  # the path of the datagram being processed
        rec = self.recovery
        for n, _, size, retx, t in rec.take_flight():
            p.flight[n] = (p.tx_next, size, retx, t)
            p.tx_next += 1
            p.bytes_in_flight += size
            self._where[n] = p
        self._lost = sorted({n for n in rec.lost if n >= rec.una and n not in rec.sacked and n not in self._where})
        rec.lost.clear()
        if p.flight:
            p.rto_deadline = now + p.rtt.rto_s
            p.unanswered = now
        self._pto_deadline = None  # (tail loss probes are the single path's; a path has its timer)
        if self.pmtud.state != PmtudState.DISABLED:
            # the link's search goes on as path 0's
            p.pmtud, p.probe_id, p.mtu_reported = self.pmtud, self._probe_id, self._search_reported
            self._pmtu_deadline = None
        # The multi-path versions, on the instance: a single-path link never tests for them.
        self.datagram_received = self._mp_datagram_received  # type: ignore[method-assign]
        self.data_run_received = self._mp_data_run_received  # type: ignore[method-assign]
        self._process_ack = self._mp_process_ack  # type: ignore[method-assign]
        self._loss_timers = self._mp_loss_timers  # type: ignore[method-assign]
        self._on_rto = self._mp_on_rto  # type: ignore[method-assign]
        self.next_deadline = self._mp_next_deadline  # type: ignore[method-assign]
        self.timer_fired = self._mp_timer_fired  # type: ignore[method-assign]
        self.bursts_to_send = self._mp_flat  # type: ignore[method-assign]
        self.datagrams_to_send = self._mp_datagrams  # type: ignore[method-assign]
        self.frame_alone = self.frame_run_alone = none  # type: ignore[method-assign]
        self._probe_packet = self._mp_probe_packet  # type: ignore[method-assign]
        self.datagram_refused = self._mp_datagram_refused  # type: ignore[method-assign]

    def _mp_flat(self, now: float, clock: Any = None) -> list[Any]:
        """``bursts_to_send`` while multi-path: everything, whatever its path
        (an owner that does not know the paths; ``bursts_by_path`` is the call)."""
        return [d for _, out in self.bursts_by_path(now, clock) for d in out]

    # --- input ----------------------------------------------------------------

    def _mp_datagram_received(self, data: bytes | bytearray | memoryview, now: float, arrived: float | None = None,
                              path: int = 0) -> None:
        """``datagram_received`` while multi-path: the link's, on the path it arrived on."""
        p = self._arrival(path, len(data))
        heard = self._last_heard
        self._last_heard = -1.0  # set again by a valid packet
        nout = len(self._out)
        type(self).datagram_received(self, data, now, arrived)  # type: ignore[attr-defined]
        # DATA and KEEPALIVE ask for an ACK: it goes back on the path they came by
        self._arrived_on(p, heard, nout, len(data) > 1 and (data[1] == _DATA or data[1] == _KEEPALIVE), now)

    def _arrival(self, path: int, size: int) -> Path:
        paths = self._mp
        assert paths is not None
        p = paths.get(path)
        if p is None:
            self.stats.unexpected += 1  # a path the owner never added: count it on path 0
            p = paths[0]
        p.datagrams_received += 1
        p.bytes_received += size
        self._mp_rx = p
        return p

    def _arrived_on(self, p: Path, heard: float, nout: int, asks: bool, now: float) -> None:
        """After the link processed a datagram that arrived on ``p``: a valid
        one is news of the path (and the echo's), and what the link queued
        in answer leaves on it, as does the ACK it asks for (``asks``)."""
        if self._last_heard == -1.0:
            self._last_heard = heard  # not a valid packet of this link: no news of the path
        else:
            p.last_rx_ts = self._last_rx_ts
            p.last_rx_time = self._last_rx_time
            if asks:
                p.owed = True
            self._heard_on(p, now, "answered")
        out = self._out
        if len(out) > nout:
            p.out.extend(out[nout:])
            del out[nout:]

    def _heard_on(self, p: Path, now: float, reason: str) -> None:
        """``p`` is alive: a packet arrived on it, or its data was acknowledged."""
        p.last_heard = now
        p.unanswered = now if p.flight else None
        if p.suspect:
            p.suspect = False
            p.backoff = 1.0
            p.rto_deadline = now + p.rtt.rto_s if p.flight else None
        if p.state != _UP:
            p.state = _UP
            p.next_probe = None
            self._events.append(PathChanged(p.id, _UP, reason))
            if self.config.base_payload and p.pmtud is None:
                self._path_pmtud_start(p, now)

    # --- acknowledgements -------------------------------------------------------

    def _mp_process_ack(self, ack: int, rwnd: int, ts_echo_us: int, sack: tuple[tuple[int, int], ...],
                        now: float) -> bool:
        """``_process_ack`` while multi-path: the same checks, then each
        acknowledged packet leaves the flight of the path that carried it,
        and each path's RACK, controller and timer hear of their own."""
        p = self._mp_rx
        if ack == self._last_ack_field and not sack:
            self.peer_rwnd = rwnd
            self._path_delay(p, ts_echo_us, now)
            return True
        rec = self.recovery
        una = rec.una
        snd_nxt = self._snd_nxt
        d = (ack - self.isn - una) & _U32
        if d <= snd_nxt - una:
            cum = una + d
        elif d >= (1 << 32) - (1 << 16):
            cum = una  # an old ACK, reordered
        else:
            self.stats.bad_ack += 1
            return False
        sacks: list[tuple[int, int]] | None = []
        if sack:
            sacks = self._sack_ranges(sack, una, cum, snd_nxt)  # type: ignore[attr-defined]
            if sacks is None:
                self.stats.bad_sack += 1
                return False
        self._last_ack_field = ack
        self.peer_rwnd = rwnd
        acked: dict[Path, list[Any]] = {}  # path -> [bytes, highest tx delivered, its send time]
        if cum > una:
            self._ack_range(una, cum, acked, now)
            rec.release(cum)
        for s, e in sacks:
            lo = self._sack_seen.get(s, s)
            if lo < cum:
                lo = cum
            if lo < e:
                self._ack_range(lo, e, acked, now, True)
            self._sack_seen[s] = e if e > lo else lo
        if len(self._sack_seen) > 64:
            self._sack_seen = {k: v for k, v in self._sack_seen.items() if v > cum}
        s = self._path_delay(p, ts_echo_us, now) if p not in acked else self._path_rtt_sample(p, ts_echo_us, now)
        for q, (nbytes, maxtx, maxts) in acked.items():
            self._path_acked(q, nbytes, maxtx, maxts, s if q is p else None, now)
        if cum > una:
            self._rto_backoff = 1.0
            self._consecutive_rto = 0
            self._rto_deadline = now + self.rtt.rto_s if cum < self._next_n else None
        return True

    def _ack_range(self, lo: int, hi: int, acked: dict[Path, list[Any]], now: float, sacked: bool = False) -> None:
        """Messages ``lo`` .. ``hi - 1`` are acknowledged (cumulatively, or
        by SACK if ``sacked``): out of their paths' flights."""
        where = self._where
        rec_sacked = self.recovery.sacked
        for n in range(lo, hi):
            if sacked:
                rec_sacked.add(n)
            else:
                rec_sacked.discard(n)
            q = where.pop(n, None)
            if q is None:
                continue
            self._lost_on.pop(n, None)
            tx, size, retx, t = q.flight.pop(n)
            q.bytes_in_flight -= size
            self.recovery.bytes_in_flight -= size
            a = acked.get(q)
            if a is None:
                a = acked[q] = [0, -1, 0.0]
            a[0] += size
            # Karn: a retransmission delivered sooner than the path's minimum
            # RTT after it left was the original's arrival (RFC 8985 §6.2)
            if tx > a[1] and (not retx or now - t >= q.rtt.min_s):
                a[1], a[2] = tx, t

    def _path_delay(self, p: Path, echo: int, now: float) -> float | None:
        """A packet on ``p`` that acknowledges nothing of ``p``'s still
        measures its round trip (the echo is exact, see the module
        docstring): its controller hears the delay.  Without this a path
        whose data the others' ACKs acknowledge first would get no samples."""
        s = self._path_rtt_sample(p, echo, now)
        if s is not None:
            p.cc.on_packets_acked(0, s, now)
        return s

    def _path_rtt_sample(self, p: Path, echo: int, now: float) -> float | None:
        """``Link._rtt_sample`` for path ``p`` (the echo is of a packet sent on
        it); the link's estimator hears it too (its retransmission budget)."""
        d = (int(now * 1e6) - echo) & _U32
        if d > self._max_rtt_us or not echo:
            # (0: the peer had heard nothing on this path when it sent the
            # packet, so the echo is of none of ours; a real echo of 0 is
            # one in 2**32, and only costs a sample)
            return None
        p.rtt.update(d * 1e-6)
        self.rtt.update(d * 1e-6)
        path = (int(self._arrived * 1e6) - echo) & _U32
        return path * 1e-6 if path <= d else d * 1e-6

    def _path_acked(self, q: Path, nbytes: int, maxtx: int, maxts: float, rtt_s: float | None, now: float) -> None:
        """``nbytes`` of ``q``'s flight were acknowledged (``maxtx``: the
        latest-sent of them that counts for RACK, sent at ``maxts``)."""
        if maxtx > q.max_tx:
            q.max_tx = maxtx
            q.rack_rtt = now - maxts
        self._detect(q, now)
        q.cc.on_packets_acked(nbytes, rtt_s, now, q.cwnd_limited and q.max_tx >= q.episode_tx)
        q.pacer.rate_Bps = q.cc.pacing_rate_Bps(q.rtt.srtt_s)
        q.backoff = 1.0
        q.rto_streak = 0
        q.rto_deadline = now + q.rtt.rto_s if q.flight else None
        if q is not self._mp_rx:
            self._heard_on(q, now, "acknowledged")

    def _detect(self, q: Path, now: float) -> None:
        """RACK over ``q``'s flight (RFC 8985 §6): lost, oldest first, what was
        sent on ``q`` before its latest-sent delivered packet and is past
        the packet threshold or the reordering window."""
        maxtx = q.max_tx
        q.reorder_deadline = None
        if maxtx < 0:
            return
        threshold = maxtx - self.config.reorder_threshold
        wait = q.rack_rtt + q.rtt.min_s * 0.25 if q.rtt.srtt_s is not None else INF
        lost = []
        for n, (tx, _, _, t) in q.flight.items():
            if tx >= maxtx:
                break
            if tx > threshold and t + wait > now:
                if t + wait < INF:
                    q.reorder_deadline = t + wait
                break
            lost.append(n)
        if lost:
            nbytes = self._path_lost(q, lost)
            episode = q.max_tx >= q.episode_tx
            if episode:
                q.episode_tx = q.tx_next
            self.stats.fast_retransmits += len(lost)
            q.cc.on_packets_lost(nbytes, now, episode)
            q.pacer.rate_Bps = q.cc.pacing_rate_Bps(q.rtt.srtt_s)

    def _path_lost(self, q: Path, lost: list[int]) -> int:
        """Messages ``lost`` of ``q``'s flight are lost: out of it, queued to be
        sent again.  Returns their bytes."""
        where, heap, lost_on = self._where, self._lost, self._lost_on
        nbytes = 0
        for n in lost:
            nbytes += q.flight.pop(n)[1]
            del where[n]
            heapq.heappush(heap, n)
            lost_on[n] = q.id
        q.bytes_in_flight -= nbytes
        self.recovery.bytes_in_flight -= nbytes
        return nbytes

    # --- timers -----------------------------------------------------------------

    def _mp_next_deadline(self) -> float | None:
        t = type(self).next_deadline(self)  # type: ignore[attr-defined]
        if self.state != _ESTABLISHED or self._mp is None:
            return t
        dead = self.config.path_dead_s
        for p in self._mp.values():
            for d in (p.rto_deadline, p.reorder_deadline, p.next_probe,
                      p.unanswered + dead if p.unanswered is not None and p.state != _DOWN else None,
                      p.pmtud.deadline if p.pmtud is not None else None):
                if d is not None and (t is None or d < t):
                    t = d
        return t

    def _mp_timer_fired(self, now: float) -> None:
        type(self).timer_fired(self, now)  # type: ignore[attr-defined]  (its loss timers and RTO: the ones below)
        if self.state != _ESTABLISHED or self._mp is None:
            return
        c = self.config
        for p in self._mp.values():
            if p.state != _DOWN and p.unanswered is not None and now >= p.unanswered + c.path_dead_s:
                self._path_down(p, now)
            elif p.next_probe is not None and now >= p.next_probe:
                self._probe(p, now)
            m = p.pmtud
            if m is not None and m.deadline is not None and now >= m.deadline:
                lost = m.lost
                size = m.timer(now, p.rtt.rto_s)
                self.stats.pmtu_probes_lost += m.lost - lost
                self._path_pmtud_did(p, size, now)

    def _mp_loss_timers(self, now: float) -> None:
        """Each path's reorder timer and retransmission timer."""
        assert self._mp is not None
        for p in self._mp.values():
            if p.reorder_deadline is not None and now >= p.reorder_deadline:
                self._detect(p, now)
            if p.rto_deadline is not None and now >= p.rto_deadline:
                self._path_rto(p, now)

    def _path_rto(self, p: Path, now: float) -> None:
        """``p``'s retransmission timer expired: its flight is lost (sent
        again elsewhere if another path has room), its window falls, and it
        is suspect until heard: a probe leaves on it each backed-off timeout."""
        p.rto_deadline = None
        if p.flight:
            p.rto_streak += 1
            self._black_hole(p, max(size for _, size, _, _ in p.flight.values()) - wl.OVERHEAD, now)
            self._path_lost(p, list(p.flight))
            p.cc.on_rto(now)
            p.pacer.rate_Bps = p.cc.pacing_rate_Bps(p.rtt.srtt_s)
        elif not p.suspect:
            return
        p.suspect = True
        p.backoff = min(p.backoff * 2, max(1.0, p.rtt.max_rto_s / p.rtt.rto_s))
        self._probe(p, now)
        p.next_probe = None
        p.rto_deadline = now + p.rtt.rto_s * p.backoff

    def _path_down(self, p: Path, now: float) -> None:
        """``p`` heard nothing for ``path_dead_s`` with something waiting: down.
        Its flight goes to the other paths at once; it is probed from now on."""
        if p.flight:
            self._path_lost(p, list(p.flight))
        c = self.config
        mss = self.payload_limit + wl.OVERHEAD
        p.cc = create(c.cc, mss, c.cc_params)  # what it had learnt is of a path that failed
        p.pacer = Pacer(c.pacing_burst_packets * mss, c.pacing_burst_s)
        p.rtt = RttEstimator(c.initial_rto_s, c.min_rto_s, c.max_rto_s)
        p.max_tx, p.episode_tx, p.reorder_deadline, p.rto_deadline = -1, p.tx_next, None, None
        p.suspect, p.backoff, p.unanswered = False, 1.0, None
        p.state = _DOWN
        p.times_down += 1
        self._events.append(PathChanged(p.id, _DOWN, "silent"))
        self._probe(p, now)
        if p.pmtud is not None:
            p.pmtud = None  # searched again when it is back; the others' limit holds meanwhile
            for q in self._mp.values():  # type: ignore[union-attr]
                if q.state == _UP and q.pmtud is not None:
                    self._path_pmtud_did(q, 0, now)
                    break

    def _mp_on_rto(self, now: float) -> None:
        """The link's retransmission timer while multi-path: the budget alone
        (the paths resend, each on its own timer).  Expiries in a row
        without the cumulative ACK moving fail the link as with one path; a
        closed peer window is probed on the best path."""
        self._rto_deadline = None
        rtt = self.rtt
        if self.recovery.una >= self._next_n:
            return
        if self._consecutive_rto >= self.config.max_retransmits:
            self._fail("retransmit_budget")  # type: ignore[attr-defined]
            return
        self._consecutive_rto += 1
        backoff = self._rto_backoff * 2
        self._rto_backoff = backoff if rtt.rto_s * backoff <= rtt.max_rto_s else max(1.0, rtt.max_rto_s / rtt.rto_s)
        self.stats.rto_count += 1
        if not self._where and not self._lost:
            self._probe(self._best(), now)  # the peer's window holds our data back: ask for it
        self._rto_deadline = now + rtt.rto_s * self._rto_backoff

    # --- path MTU, per path -------------------------------------------------------

    def _path_pmtud_start(self, p: Path, now: float) -> None:
        """``p`` is up: its own search (``pmtud.py``), from the base size."""
        c = self.config
        base = min(c.base_payload, c.max_payload)
        p.pmtud = Plpmtud(c.min_payload or base, base, c.max_payload)
        p.mtu_reported = False
        self._path_pmtud_did(p, p.pmtud.start(self.peer_max_payload, now, p.rtt.rto_s), now)

    def _path_pmtud_did(self, p: Path, size: int, now: float) -> None:
        """``p``'s search moved: its probe leaves on it, and the link's largest
        message is what every up path carries."""
        if size:
            p.probe_id = (p.probe_id + 1) & _U32
            p.out.append(self._probe_datagram(size, p.probe_id, p.id, p.echo(now), now))  # type: ignore[attr-defined]
            self.stats.pmtu_probes_sent += 1
        limit = None
        for q in self._mp.values():  # type: ignore[union-attr]
            if q.state == _UP and q.pmtud is not None and (limit is None or q.pmtud.plpmtu < limit):
                limit = q.pmtud.plpmtu
        if limit is not None:
            p.mtu_reported = self._pmtud_limit(min(limit, self.peer_max_payload), p.pmtud,  # type: ignore[attr-defined]
                                               p.mtu_reported)

    def _mp_probe_packet(self, ptype: int, body: memoryview, now: float) -> None:
        """``_probe_packet`` while multi-path: a PROBE_ACK answers the probe
        of the path it arrived on (a PROBE is answered on it, as any)."""
        if ptype != _PROBE_ACK:
            type(self)._probe_packet(self, ptype, body, now)  # type: ignore[attr-defined]
            return
        p = self._mp_rx
        m = p.pmtud
        try:
            probe_id, size = wl.decode_probe_ack_untrusted(body)
        except WireError:
            self.stats.malformed += 1
            return
        if m is None or probe_id != p.probe_id or not m.probed or size != m.probed:
            self.stats.unexpected += 1
            return
        self.stats.pmtu_probes_acked += 1
        self._path_pmtud_did(p, m.probe_acked(size, now, p.rtt.rto_s), now)

    def _mp_datagram_refused(self, size: int, now: float, path: int = 0) -> None:
        """``datagram_refused`` while multi-path: the PTB of that path's search."""
        p = self._mp.get(path) if self._mp is not None else None
        if p is None or p.pmtud is None or p.pmtud.state == PmtudState.DISABLED:
            return
        self.stats.pmtu_too_big += 1
        self._path_pmtud_did(p, p.pmtud.too_big(size - wl.OVERHEAD, now, p.rtt.rto_s), now)

    def _black_hole(self, p: Path, largest: int, now: float) -> None:
        """``p``'s timer expired again with nothing of it acknowledged, the
        largest message lost on it larger than the base size: it stopped
        carrying what its search found (``pmtud.py``'s black hole)."""
        m = p.pmtud
        if m is not None and p.rto_streak >= BLACK_HOLE_RTOS and m.plpmtu > m.base and largest > m.base:
            self.stats.pmtu_black_holes += 1
            p.rto_streak = 0
            self._path_pmtud_did(p, m.black_hole(now, p.rtt.rto_s), now)
