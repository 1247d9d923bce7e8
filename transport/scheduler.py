"""The sending half of a multi-path link: which path each packet takes (sans-IO).

Theory of operation
-------------------
``paths.py`` tells the whole design; this is its sender.  :class:`Path`
holds one path's state (RTT estimator, congestion controller, pacer,
flight, liveness, counters).  :class:`Scheduler` (a base of
``paths.Paths``) builds what leaves: control packets bound to a path,
then DATA, lost messages first (lowest number first, so the receiver's
hole closes first), then new ones up to the peer's window, each on the
path :meth:`Scheduler._pick` names: the usable path of lowest smoothed RTT
whose window has room and whose pacer lets it leave now (MPTCP's default
scheduler), so each path carries what its window over its RTT allows.  A
retransmission avoids the path it was lost on when another has room.
Then the ACK, if one is due, on every path owed one (DATA arrived on it
since our last packet there) that no DATA of ours leaves on.  New
messages of a run queued by ``Link.send_run`` leave as the compiled framer
builds them, a stretch per path (``pathlanes.py``).
"""

from __future__ import annotations

import heapq
from typing import Any

from ..wire import link as wl
from .builder import Burst, fit_sack
from .gather import Gather
from .congestion.base import CongestionController
from .pacer import Pacer
from .pathlanes import PathLanes
from .records import LinkState
from .recovery import RttEstimator

_U32 = 0xFFFFFFFF
_DATA = wl.PacketType.DATA
_ACK = wl.PacketType.ACK
_KEEPALIVE = wl.PacketType.KEEPALIVE
_ACK_NOW = int(wl.LinkFlags.ACK_NOW)
_RETX = int(wl.LinkFlags.RETRANSMISSION)
_ESTABLISHED = LinkState.ESTABLISHED
_encode_fields = wl.encode_fields
PROBING, UP, DOWN = "probing", "up", "down"
_UP, _DOWN = UP, DOWN


class Path:
    """One path of a multi-path link: its estimator, controller, pacer,
    flight and liveness (see the module docstring)."""

    __slots__ = ("id", "state", "rtt", "cc", "cc_on_sent", "pacer", "flight", "bytes_in_flight", "tx_next", "max_tx",
                 "rack_rtt", "episode_tx", "reorder_deadline", "rto_deadline", "backoff", "suspect", "out",
                 "last_heard", "unanswered", "next_probe", "owed", "last_rx_ts", "last_rx_time", "cwnd_limited",
                 "datagrams_sent", "bytes_sent", "datagrams_received", "bytes_received", "retransmissions",
                 "times_down", "pmtud", "probe_id", "mtu_reported", "rto_streak")

    def __init__(self, pid: int, state: str, rtt: RttEstimator, cc: CongestionController, pacer: Pacer,
                 now: float) -> None:
        self.id = pid
        self.state = state
        self.rtt = rtt
        self.cc = cc
        self.cc_on_sent = type(cc).on_packet_sent is not CongestionController.on_packet_sent
        self.pacer = pacer
        #: n -> (transmission id on this path, size, retransmission, time sent), in send order
        self.flight: dict[int, tuple[int, int, bool, float]] = {}
        self.bytes_in_flight = 0
        self.tx_next = 0
        self.max_tx = -1  # RACK: the latest-sent packet of this path delivered
        self.rack_rtt = 0.0
        self.episode_tx = 0  # a recovery episode lasts while max_tx is below this
        self.reorder_deadline: float | None = None
        self.rto_deadline: float | None = None
        self.backoff = 1.0
        self.suspect = False  # its retransmission timer expired: no data until heard
        self.out: list[Any] = []  # control packets to leave on it
        self.last_heard = now
        self.unanswered: float | None = None  # since when something waits for an answer on it
        self.next_probe: float | None = None
        self.owed = False  # DATA arrived on it since our last packet on it
        self.last_rx_ts = -1  # nothing heard on it yet
        self.last_rx_time = 0.0
        self.cwnd_limited = True
        self.datagrams_sent = 0
        self.bytes_sent = 0
        self.datagrams_received = 0
        self.bytes_received = 0
        self.retransmissions = 0
        self.times_down = 0
        self.pmtud: Any = None  # its path MTU search (pmtud.Plpmtud) while up, if the link searches
        self.probe_id = 0  # of its PROBE in flight
        self.mtu_reported = False  # its search's end was reported
        self.rto_streak = 0  # timeouts since its data was last acknowledged (a black hole?)

    def echo(self, now: float) -> int:
        """The echo rule, per path: the latest timestamp heard on it plus the
        time held; 0 before anything was heard on it (no sample: see
        ``Paths._path_rtt_sample``)."""
        if self.last_rx_ts < 0:
            return 0
        return (self.last_rx_ts + int((now - self.last_rx_time) * 1e6)) & _U32

    def usable(self) -> bool:
        return self.state == _UP and not self.suspect

    def srtt(self) -> float:
        s = self.rtt.srtt_s
        return s if s is not None else self.rtt.rto_s


class Scheduler(PathLanes):
    """What leaves a multi-path link, and on which path (see the module docstring)."""

    config: Any
    stats: Any
    state: LinkState
    recovery: Any
    receiver: Any
    rtt: Any
    isn: int
    peer_tag: int
    peer_rwnd: int
    _mp: dict[int, Path] | None
    _where: dict[int, Path]
    _lost: list[int]
    _lost_on: dict[int, int]
    _out: Any
    _next_n: int
    _snd_nxt: int
    _runs: Any
    _pace_deadline: float | None
    _rto_deadline: float | None
    _rto_backoff: float
    _want_ack_now: bool
    _poor_carrier: bool
    _packet_cap: int

    def _probe(self, p: Path, now: float) -> None:
        """A KEEPALIVE asking for an ACK at once, on ``p``; again after ``path_probe_s``."""
        p.out.append(_encode_fields(_KEEPALIVE, _ACK_NOW, p.id, self.peer_tag, (self.isn + self._snd_nxt) & _U32,
                                    *self._feedback_fields(p, now)))
        self.stats.keepalives_sent += 1
        if p.unanswered is None:
            p.unanswered = now
        p.next_probe = now + self.config.path_probe_s

    def _feedback_fields(self, p: Path, now: float) -> tuple[int, int, int, int]:
        ack, rwnd, _ = self.receiver.feedback()
        return ack, int(now * 1e6) & _U32, p.echo(now), rwnd


    def _best(self) -> Path:
        """The path for what is not bound to one: the usable one of lowest RTT, else path 0."""
        assert self._mp is not None
        best = None
        for p in self._mp.values():
            if p.usable() and (best is None or p.srtt() < best.srtt()):
                best = p
        return best if best is not None else self._mp[0]

    def bursts_by_path(self, now: float, clock: Any = None) -> list[tuple[int, list[Any]]]:
        """While multi-path: each path id with the link packets that leave on
        it now (control packets included), instead of ``bursts_to_send``.
        ``clock``: as for ``bursts_to_send``."""
        paths = self._mp
        if paths is None:
            return [(0, self.bursts_to_send(now, clock))]  # type: ignore[attr-defined]
        if self._out:
            self._best().out.extend(self._out)
            self._out = []
        rx = self.receiver
        d = rx.ack_deadline
        due = rx.ack_now or d is not None and now >= d
        self._pace_deadline = None
        outs: dict[Path, list[Any]] = {}
        for p in paths.values():
            if p.out:
                outs[p] = p.out
                p.out = []
        if self.state == _ESTABLISHED:
            sent = self._mp_send_data(outs, now, clock)
            for p in sent:
                p.owed = False  # (the ACK rode on our DATA)
            if due:
                self._acks_alone(outs, sent, now)
            elif rx.ack_count and d is None:
                rx.arm_delayed_ack(now)
        result = []
        nsent = 0
        for p, out in outs.items():
            if out:
                p.datagrams_sent += len(out)
                p.bytes_sent += sum(len(x.view) if type(x) is Burst else len(x) for x in out)
                nsent += len(out)
                result.append((p.id, out))
        self.stats.datagrams_sent += nsent
        return result

    def _acks_alone(self, outs: dict[Path, list[Any]], carried: dict[Path, int], now: float) -> None:
        """An ACK is due: alone on every path owed one that no DATA of ours
        left on (``carried``), or on the best one if none is owed and no
        DATA left.  (A control packet built before is no answer: its ACK
        fields are older than what is owed.)"""
        assert self._mp is not None
        owed = [p for p in self._mp.values() if p.owed and p.state != _DOWN]
        if not owed and not carried:
            owed = [self._best()]
        for p in owed:
            p.owed = False
            ack, ts, echo, rwnd = self._feedback_fields(p, now)
            sack = self.receiver.sack_blocks() if self.receiver.ranges else ()
            outs.setdefault(p, []).append(_encode_fields(_ACK, 0, p.id, self.peer_tag,
                                                         (self.isn + self._snd_nxt) & _U32, ack, ts, echo, rwnd,
                                                         b"", sack))
            self.stats.acks_sent += 1
        if owed and not carried and self.receiver.ack_sent_alone():
            self.stats.ack_holds_expired += 1

    def _pick(self, now: float, avoid: int) -> Path | None:
        """The usable path of lowest RTT whose window has room and whose
        pacer lets a packet leave now (not ``avoid`` if another qualifies)."""
        assert self._mp is not None
        best = alt = None
        for p in self._mp.values():
            if not p.usable() or p.bytes_in_flight >= p.cc.cwnd_bytes or now < p.pacer.next_send_s:
                continue
            if p.id == avoid:
                alt = p
            elif best is None or p.srtt() < best.srtt():
                best = p
        return best if best is not None else alt

    def _next_lost(self) -> int | None:
        heap, rec = self._lost, self.recovery
        while heap:
            n = heapq.heappop(heap)
            if n >= rec.una and n not in rec.sacked and n not in self._where:
                return n
        return None

    def _mp_send_data(self, outs: dict[Path, list[Any]], now: float, clock: Any) -> dict[Path, int]:
        """The DATA that may leave now, lost messages first, each on the path
        ``_pick`` names; their bookkeeping.  Returns the paths it left on
        (and its bytes on each)."""
        rec = self.recovery
        limit = min(self._next_n, rec.una + self.peer_rwnd)
        snd_nxt, next_n = self._snd_nxt, self._next_n
        ack = rwnd = -1
        sack: tuple[tuple[int, int], ...] = ()
        sent: dict[Path, int] = {}
        count = 0
        runs = self._runs
        while True:
            n = self._next_lost() if self._lost else None
            retx = n is not None
            if n is None:
                if snd_nxt >= limit:
                    break
                n = snd_nxt
            p = self._pick(now, self._lost_on.get(n, -1) if retx else -1)
            if p is None:
                if retx:
                    heapq.heappush(self._lost, n)
                self._pace_wait()
                break
            if ack < 0:
                ack, rwnd, sack = self.receiver.feedback()
            if not retx and runs and not sack:  # a run's packets carry no SACK blocks
                k, nbytes = self._path_frame_run(outs, p, n, limit, now, clock, ack, rwnd)
                if k:
                    snd_nxt = n + k
                    sent[p] = sent.get(p, 0) + nbytes
                    count += k
                    continue
            body = rec.message(n)
            if type(body) is Gather:
                body = body.join()  # queued before the link had several paths: sent as a plain copy
            size = len(body) + wl.OVERHEAD
            if retx:
                flags = _RETX | _ACK_NOW
                self.stats.retransmits += 1
                p.retransmissions += 1
            else:
                snd_nxt = n + 1
                flags = 0
                if snd_nxt >= next_n and self._want_ack_now:
                    flags = _ACK_NOW
                    self._want_ack_now = False
            t = clock() if clock is not None else now
            s = sack if not sack or size + 8 * len(sack) <= self._packet_cap else fit_sack(sack, size, self._packet_cap)
            outs.setdefault(p, []).append(_encode_fields(_DATA, flags, p.id, self.peer_tag, (self.isn + n) & _U32, ack,
                                                         int(t * 1e6) & _U32, p.echo(t), rwnd, body, s))
            p.flight[n] = (p.tx_next, size, retx, now)
            p.tx_next += 1
            p.bytes_in_flight += size
            rec.bytes_in_flight += size
            self._where[n] = p
            p.pacer.on_sent(size, now)
            sent[p] = sent.get(p, 0) + size
            count += 1
        self._snd_nxt = snd_nxt
        while runs and runs[0][1] <= snd_nxt:
            runs.popleft()  # sent, by the framer or (SACK blocks to carry) packet by packet: let it go
        waiting = bool(self._lost) or snd_nxt < limit
        for p in self._mp.values():  # type: ignore[union-attr]
            p.cwnd_limited = waiting and p.bytes_in_flight >= p.cc.cwnd_bytes or p.bytes_in_flight * 2 >= p.cc.cwnd_bytes
        if sent:
            self._data_left(sent, count, now)
        return sent

    def _pace_wait(self) -> None:
        """Data waits and no path may send it now: wake when the first pacer
        with window room allows (an ACK wakes the link for the others)."""
        assert self._mp is not None
        t = None
        for p in self._mp.values():
            if p.usable() and p.bytes_in_flight < p.cc.cwnd_bytes and (t is None or p.pacer.next_send_s < t):
                t = p.pacer.next_send_s
        self._pace_deadline = t

    def _data_left(self, sent: dict[Path, int], count: int, now: float) -> None:
        """``count`` DATA packets left on the paths of ``sent`` (path ->
        bytes): the bookkeeping of ``Builder._data_sent``, per path."""
        for p, nbytes in sent.items():
            if p.cc_on_sent:
                p.cc.on_packet_sent(nbytes, now)
            if p.rto_deadline is None:
                p.rto_deadline = now + p.rtt.rto_s * p.backoff
            if p.unanswered is None:
                p.unanswered = now
        self.stats.data_sent += count
        poor = self._poor_carrier
        if poor and self._snd_nxt >= self._next_n:
            self._poor_carrier = False
        self.receiver.ack_carried(now, poor)
        if self._rto_deadline is None:
            self._rto_deadline = now + self.rtt.rto_s * self._rto_backoff


def none(*args: Any, **kwargs: Any) -> None:
    """What ``frame_alone``, ``frame_run_alone`` and ``run_receivable`` say while multi-path."""
    return None
