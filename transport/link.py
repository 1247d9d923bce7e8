"""The reliable, congestion-controlled link between two daemons (sans-IO).

Theory of operation
-------------------
A :class:`Link` is one direction-pair of reliable, ordered, exactly-once
message delivery over datagrams that may be lost, duplicated, reordered or
corrupted.  It does no I/O: the owner feeds it ``datagram_received(data,
now)`` and ``timer_fired(now)``, queues messages with ``send``, and drains
``datagrams_to_send(now)``, ``drain_received()``, ``next_event()`` and
``next_deadline()`` (aioquic's shape).  Time is a float ``now`` in seconds.
An owner that can send a buffer as several datagrams at once (UDP_SEGMENT)
drains ``bursts_to_send(now)`` instead: the same datagrams, where a run the
framer built stays one :class:`Burst`.

Opening (a 2-way handshake with a proof of tag, as SCTP's verification tag):
each side picks a random 32-bit *tag* and ISN.  INIT carries ours (conn_tag
0); the peer answers INIT_ACK carrying its own, addressed with our tag.  A
side is ESTABLISHED when it knows the peer's tag+ISN *and* the peer proved it
knows ours (a packet with ``conn_tag == our tag``: the INIT_ACK for the
active side, the first ACK/DATA for the passive side).  Simultaneous opens
converge: an INIT received while INIT_SENT is answered with INIT_ACK and both
sides finish on the other's INIT_ACK.  INIT/INIT_ACK retransmit with
exponential back-off and fail after ``max_init_retransmits``.  A passive
daemon that keeps no link for the initiator answers its INIT with a COOKIE
instead (``cookie.py``, the daemon's part); the initiator sends its INIT
again at once, carrying the cookie.

An INIT with a different *incarnation* from an established peer claims the
peer restarted; the same incarnation with a new tag, that the peer dropped
its end of the link.  INIT is unauthenticated, so a claim is believed only
once proven (RFC 9260 §5.2.4 checks a restart too): we probe the old
association (KEEPALIVE with the old tag, ACK_NOW), and if nothing of it is
heard within ``restart_probes`` RTOs the link fails
(``LinkFailed("peer_restarted")`` / ``("peer_reset")``) and the owner builds a
new one for the next INIT.  A live old peer answers, and a blind spoofed
INIT changes nothing.

Parts: this module is the connection's core (states, input dispatch, ACK
processing, events, send queueing); the handshake is ``handshake.py``'s,
the deadlines and what each expiry does ``timers.py``'s, the path-MTU
search ``pmtud.py``'s, several paths under one link ``paths.py``'s
(mixins of :class:`Link`; off until ``add_path``).  The receive side
and the ACK policy are ``receiver.py``'s (a :class:`Receiver`, the
``receiver`` attribute); building the datagrams that leave is
``builder.py``'s (:class:`Builder`, a base class); the sent-packet table,
loss detection and RTT estimation ``recovery.py``'s; the plain records
(config, state, events, counters) ``records.py``'s.

Data: message ``n`` travels as wire sequence ``isn + n mod 2**32``; numbers
are unwrapped against the current window (half the sequence space either
side), so the wrap is invisible above.  The receiver delivers in order,
exactly once, within the window it advertises; ACKs are cumulative plus up
to 4 SACK blocks (RFC 2018), sent by the ACK policy of ``receiver.py``
(RFC 5681 §4.2), and any DATA we send piggybacks the ACK.

Timestamps and the echo rule: every packet carries ``ts_us`` (our clock, µs
mod 2**32).  ``ts_echo_us`` returns the ts of the latest packet received from
the peer *plus the time we held it* before this packet left.  So the peer's
``now - ts_echo`` is exactly the network round trip (forward and return
path, queues included) without our ACK delay, whatever the two clocks'
offsets.  That is the delay signal of EFE congestion control, and RFC 6298's
RTT sample.  A sample is taken from an ACK that newly acknowledges data
(RFC 7323 §4), so idle-time echoes do not pollute it.

Loss recovery (``recovery.py``): SACK and RACK (RFC 8985), with its
reorder timer and tail loss probe (``builder.py``), and the RFC 6298 RTO
with exponential back-off up to ``max_rto_s``.
The timer runs whenever data waits on the peer: sent and not cumulatively
acknowledged (SACKed or not), or held back by a closed window (then it is
the persist timer, and each expiry probes the window).  ``max_retransmits``
expiries in a row without the cumulative ACK moving fail the link
(``retransmit_budget``), whatever else the peer sends: a peer that talks
but acknowledges nothing fails like a silent one, within
``(max_retransmits + 1) * max_rto_s``.  Congestion control
(``congestion/``) gives ``cwnd_bytes`` and a pacing rate (``pacer.py``); the
window grows only while it is what limits the sender (RFC 7661).

Forged packets: the tag is in the clear, so whoever saw one datagram can
send packets that pass the tag check.  A packet whose sequence number lies
far from the receive window, whose ACK field acknowledges data we never
sent, or whose SACK blocks lie outside what is in flight cannot be the
peer's: it is dropped whole and counted (``bad_seq``, ``bad_ack``,
``bad_sack``; RFC 5961's checks), its timestamp and window unread.  An RTT
sample longer than ``max_rto_s`` is not believed either.

Liveness: after ``keepalive_idle_s`` without hearing from the peer we send
KEEPALIVE (answered by an immediate ACK), again every ``keepalive_idle_s``;
after ``dead_peer_s`` of silence: ``LinkFailed("dead_peer")``.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from ..wire import link as wl
from ..wire.errors import WireError
from .builder import Builder, Burst, admit, one_per_datagram, run_slots
from .gather import Gather, Gathered
from .handshake import Handshake
from .congestion.base import INF, CongestionController, create
from .pacer import Pacer
from .paths import Paths
from .pmtud import PathProbing
from .receiver import Receiver
from .timers import Timers
from .records import (LinkClosed, LinkConfig, LinkEvent, LinkFailed, LinkState, LinkStats, LinkUp, PathChanged, PathMtu,
                      PathStats)
from .recovery import Recovery, RttEstimator

__all__ = ["Burst", "Gather", "Gathered", "Link", "LinkClosed", "LinkConfig", "LinkEvent", "LinkFailed", "LinkState", "LinkStats", "LinkUp",
           "PathChanged", "PathMtu", "PathStats", "admit", "one_per_datagram", "run_slots"]

_U32 = 0xFFFFFFFF
_HALF = 1 << 31
_FULL = 1 << 32
#: how far (in messages) from our receive window a sequence number, or
#: below our oldest unacknowledged message an ACK field, may lie and still
#: come from the peer: the largest window a header can advertise.  Farther
#: is forged or corrupt.
_SLACK = 1 << 16
_SLACK_SPAN = 2 * _SLACK
_DATA = wl.PacketType.DATA
_INIT = wl.PacketType.INIT
_INIT_ACK = wl.PacketType.INIT_ACK
_KEEPALIVE = wl.PacketType.KEEPALIVE
_ABORT = wl.PacketType.ABORT
_COOKIE = wl.PacketType.COOKIE
_PROBE = wl.PacketType.PROBE
_ESTABLISHED = LinkState.ESTABLISHED
_decode = wl.decode_untrusted


class Link(Handshake, PathProbing, Timers, Paths, Builder):
    """One reliable link to one peer daemon (see the module docstring).

    The send queue and the datagrams it becomes are :class:`Builder`'s
    (``builder.py``), its deadlines :class:`Timers`' (``timers.py``), the
    receive side and the ACK policy the :class:`Receiver`'s (``receiver.py``,
    the ``receiver`` attribute).

    Args:
        config: tunables.
        rng: source of the tag and ISN (and nothing else).
        incarnation: this daemon's run identifier, sent in INIT/INIT_ACK.
        path_id: carried in every header of a single-path link (a
            multi-path link writes the path each packet leaves on, its own
            numbering: the receiver goes by the path its owner names).
        framer: the compiled module (``wire/native.py``) that frames runs of
            messages queued by :meth:`send_run`, or None: every packet is
            framed in Python (the same bytes either way).
    """

    def __init__(self, config: LinkConfig, *, rng: random.Random, incarnation: int,
                 path_id: int = 0, framer: Any = None) -> None:
        super().__init__(framer)
        self.config = config
        self.incarnation = incarnation
        self.path_id = path_id
        self.state = LinkState.IDLE
        self.stats = LinkStats()
        self.tag = rng.randrange(1, _FULL)
        self.isn = rng.randrange(_FULL)
        self.peer_tag = 0
        self.peer_incarnation: int | None = None
        self.peer_max_payload = config.max_payload
        self._events: deque[LinkEvent] = deque()
        self._out: list[bytes] = []  # control packets queued (handshake, keep-alive, ABORT)
        self._pmtud_init()
        self._paths_init()
        # a "packet" of window is one of the size the link starts with (RFC 9002 §7.2)
        mss = self.payload_limit + wl.OVERHEAD
        self.cc = create(config.cc, mss, config.cc_params)
        # on_packet_sent is an optional hook: a controller without it costs no call per send
        self._cc_on_sent = type(self.cc).on_packet_sent is not CongestionController.on_packet_sent
        self.pacer = Pacer(config.pacing_burst_packets * mss, config.pacing_burst_s)
        self.rtt = RttEstimator(config.initial_rto_s, config.min_rto_s, config.max_rto_s)
        self.recovery = Recovery(config.reorder_threshold, self.rtt)
        self.receiver = Receiver(config.rwnd_packets, config.ack_every, config.max_ack_delay_s, self.recovery,
                                 self.stats)
        # the sender's timers and what the peer told us
        self.peer_rwnd = 0
        self._rto_deadline: float | None = None
        self._pto_deadline: float | None = None  # the tail loss probe's timer
        self._tlp_out = False  # a probe left and nothing has been acknowledged since
        # what the probe timeout adds to 2 x SRTT: the peer's delayed ACK (INF: no probes)
        self._pto_extra = config.max_ack_delay_s if config.tlp else INF
        self._rto_backoff = 1.0
        self._consecutive_rto = 0
        self._last_ack_field = -1  # the ack field last processed (fast path)
        self._max_rtt_us = min(int(config.max_rto_s * 1e6), _HALF - 1)  # the longest RTT sample believed
        # timestamps: what the next echo returns (the echo rule)
        self._last_rx_ts = 0
        self._last_rx_time = 0.0
        self._arrived = 0.0  # arrival time of the datagram being processed
        # handshake and liveness
        self._hs_deadline: float | None = None
        self._hs_tries = 0
        self._last_heard = 0.0
        self._last_keepalive = -INF
        self._cookie = b""  # the passive side's cookie, echoed in our INIT
        # a restart claimed by an INIT, not yet proven: (reason, deadline, next probe)
        self._claim: tuple[str, float, float] | None = None

    # --- public properties --------------------------------------------------

    @property
    def acked(self) -> int:
        """All messages numbered below this are acknowledged by the peer."""
        return self.recovery.una

    @property
    def srtt_s(self) -> float | None:
        """The smoothed RTT (RFC 6298 §2), or None before the first sample."""
        return self.rtt.srtt_s

    @property
    def cwnd_bytes(self) -> float:
        """The congestion window, in bytes (may be under one packet: then paced)."""
        return self.cc.cwnd_bytes

    @property
    def bytes_in_flight(self) -> int:
        """Bytes of DATA sent and neither acknowledged nor declared lost."""
        return self.recovery.bytes_in_flight

    @property
    def rcv_nxt(self) -> int:
        """All messages numbered below this were received in order."""
        return self.receiver.rcv_nxt

    @property
    def peer_isn(self) -> int:
        """The peer's initial sequence number (0 until the handshake names it)."""
        return self.receiver.peer_isn

    @property
    def last_ack_field(self) -> int:
        """The peer's ACK field as last processed (-1: none yet)."""
        return self._last_ack_field

    @property
    def last_rx_ts(self) -> int:
        """The peer's timestamp (µs) of the latest packet heard: what our echo returns."""
        return self._last_rx_ts

    @property
    def arrived(self) -> float:
        """When the datagram processed last reached this host (see :meth:`datagram_received`)."""
        return self._arrived

    # --- opening and closing ------------------------------------------------

    def connect(self, now: float) -> None:
        """Active open: send INIT.

        Raises:
            RuntimeError: the link was already opened, closed or failed.
        """
        if self.state != LinkState.IDLE:
            raise RuntimeError(f"connect() in state {self.state.name}")
        self.state = LinkState.INIT_SENT
        self._last_heard = now
        self._send_handshake(now)

    def close(self, now: float) -> None:
        """Abortive close: send ABORT (if the peer is known) and emit LinkClosed.
        Safe to call twice."""
        if self.state in (LinkState.CLOSED, LinkState.FAILED):
            return
        if self.peer_tag:
            self._out.append(self._control(_ABORT, 0, now))
        self.state = LinkState.CLOSED
        self._events.append(LinkClosed())

    def _fail(self, reason: str) -> None:
        if self.state in (LinkState.CLOSED, LinkState.FAILED):
            return
        self.state = LinkState.FAILED
        self._events.append(LinkFailed(reason))

    # --- input --------------------------------------------------------------

    def datagram_received(self, data: bytes | bytearray | memoryview, now: float,
                          arrived: float | None = None, path: int = 0) -> None:
        """Process one datagram from the peer.  Never raises on bad input.

        ``arrived`` (≤ ``now``, default ``now``) is when the datagram reached
        this host, if the owner knows (a kernel receive timestamp).  The time
        it then waited for us to run is host scheduling, not the path:
        congestion control's delay signal leaves it out, and so does the
        echo we return (the peer's signal leaves it out too).  The RTO
        estimator keeps it: a retransmission timer must outlast a daemon
        that was not running.

        ``path``: the path it arrived on (``add_path``; 0 while single-path).
        """
        self._arrived = now if arrived is None else arrived
        stats = self.stats
        stats.datagrams_received += 1
        try:
            h, body = _decode(data)
        except WireError as e:
            if e.reason == "bad_crc":
                stats.bad_crc += 1
            elif e.reason == "truncated":
                stats.truncated += 1
            else:
                stats.malformed += 1
            return
        ptype = h.ptype
        state = self.state
        if ptype == _INIT or ptype == _INIT_ACK:
            self._handshake_received(h, body, now)
            return
        if h.conn_tag != self.tag:
            stats.bad_tag += 1
            return
        if ptype == _COOKIE:
            self._cookie_received(body, now)
            return
        if state != LinkState.ESTABLISHED and state != LinkState.INIT_RECEIVED:
            stats.unexpected += 1
            return
        # The tag is in the clear: whoever saw one datagram can forge the
        # rest.  A sequence number far from our receive window, or an ACK
        # field for data we never sent, cannot come from the peer, so the
        # packet is dropped before any of it is believed (RFC 5961 §5).
        rx = self.receiver
        if (h.seq - rx.peer_isn - rx.rcv_nxt + _SLACK) & _U32 >= _SLACK_SPAN:
            stats.bad_seq += 1
            return
        if ptype == _ABORT:
            if state == LinkState.INIT_RECEIVED:
                self._establish(now)
            self._fail("abort_received")
            return
        if not self._process_ack(h.ack, h.rwnd, h.ts_echo_us, h.sack, now):
            return
        if state == LinkState.INIT_RECEIVED:
            self._establish(now)  # the peer used our tag: it knows us
        if self._claim is not None:
            self._claim = None  # the old association answered: no restart
        # _heard, written out: every datagram's path
        self._last_heard = now
        self._last_rx_ts = h.ts_us
        self._last_rx_time = self._arrived
        if ptype == _DATA:
            self.receiver.data_received(h.seq, h.flags, body, now)
        elif ptype == _KEEPALIVE:
            self.receiver.ack_now = True  # answered at once
        elif ptype >= _PROBE:
            self._probe_packet(ptype, body, now)  # pmtud.py

    def run_receivable(self) -> tuple[int, int, int] | None:
        """``(our tag, next wire sequence, window room)`` when a run of
        in-order DATA may be consumed by the owner and reported with
        ``data_run_received``; None when each datagram must come through
        ``datagram_received`` (not established, a hole to fill, undrained
        messages that must reach the owner first, or no RTT sample yet, so
        ACK processing is not yet the same for every packet)."""
        rx = self.receiver
        if self.state != _ESTABLISHED or rx.ranges or rx.delivered or self.rtt.srtt_s is None:
            return None
        return self.tag, (rx.peer_isn + rx.rcv_nxt) & _U32, self.config.rwnd_packets

    def data_run_received(self, count: int, ack: int, ts_us: int, ts_echo_us: int, rwnd: int, flags: int,
                          last_ts_us: int, last_rwnd: int, flags_any: int, now: float,
                          arrived: float | None = None, path: int = 0, size: int = 0) -> None:
        """Account for ``count`` DATA packets the owner consumed itself.

        The packets are the next ``count`` in order (from the sequence
        ``run_receivable`` gave), with our tag, no SACK blocks, and one ACK
        field ``ack``; the first carried ``ts_us``, ``ts_echo_us``, ``rwnd``
        and ``flags``, the last ``last_ts_us`` and ``last_rwnd``;
        ``flags_any`` is the OR of all their flags.  The state afterwards is
        what ``datagram_received`` of each would have left, except that the
        messages are not delivered (the owner has handled them).  ``path``:
        the path they arrived on, ``size``: their bytes (a multi-path link's
        per-path counters, ``pathlanes.py``).
        """
        self._arrived = now if arrived is None else arrived
        stats = self.stats
        stats.datagrams_received += count
        stats.data_received += count
        # (the owner has taken the packets in; with an ACK field we never
        # sent, their timestamps and windows are not believed)
        if self._process_ack(ack, rwnd, ts_echo_us, (), now):
            self._heard(last_ts_us, now)
            if count > 1:
                # later packets repeat the ACK field: the fast case of _process_ack
                self.peer_rwnd = last_rwnd
        self.receiver.run_received(count, flags_any, now)

    def _heard(self, ts_us: int, now: float) -> None:
        # Liveness, and what the next echo will return (the echo rule).
        self._last_heard = now
        self._last_rx_ts = ts_us
        self._last_rx_time = self._arrived

    def _rtt_sample(self, echo: int, now: float) -> float | None:
        """Feed the RTO estimator the round trip up to ``now``; return the
        congestion signal's sample, which ends at arrival (see datagram_received)."""
        d = (int(now * 1e6) - echo) & _U32
        if d > self._max_rtt_us:
            # An echo from the future, or a round trip the retransmission
            # timer would have outlasted: forged (a wild timestamp the peer
            # echoed), or a host that stopped.  Believed, it would stall the
            # pacer for as long as it claims.
            return None
        self.rtt.update(d * 1e-6)
        path = (int(self._arrived * 1e6) - echo) & _U32
        return path * 1e-6 if path <= d else d * 1e-6

    def _process_ack(self, ack: int, rwnd: int, ts_echo_us: int, sack: tuple[tuple[int, int], ...],
                     now: float) -> bool:
        """The ACK fields of a received packet (taken apart by the caller: the
        compiled lane's runs have no header object to pass).  Returns False,
        having counted it, if they cannot be the peer's: the caller drops
        the packet."""
        if ack == self._last_ack_field and not sack and self.rtt.srtt_s is not None:
            # The common case on the receiving side of a bulk transfer: the
            # peer's ACK field has not moved, and nothing is SACKed.
            self.peer_rwnd = rwnd
            return True
        rec = self.recovery
        una = rec.una
        base = self.isn + una
        snd_nxt = self._snd_nxt
        d = (ack - base) & _U32
        if d <= snd_nxt - una:
            cum = una + d
        elif d >= _FULL - _SLACK:
            cum = una  # an old ACK, reordered: nothing new
        else:
            self.stats.bad_ack += 1  # data we never sent (RFC 5961 §5.2)
            return False
        sacks: list[tuple[int, int]] | None = []
        if sack:
            sacks = self._sack_ranges(sack, una, cum, snd_nxt)
            if sacks is None:
                self.stats.bad_sack += 1
                return False
        self._last_ack_field = ack
        self.peer_rwnd = rwnd
        if cum == una and not sacks:
            if self.rtt.srtt_s is None:
                s = self._rtt_sample(ts_echo_us, now)  # the passive opener's first sample
                if s is not None:
                    self.cc.on_packets_acked(0, s, now)
            return True
        nlost = len(rec.lost)
        acked, lost = rec.on_ack(cum, sacks, now)
        if not acked and not lost:
            return True
        rtt_s = None
        if acked:
            rtt_s = self._rtt_sample(ts_echo_us, now)
        cc = self.cc
        if lost:
            self._found_lost(lost, nlost, now)
        if acked:
            self._tlp_out = False  # the probe drew its answer: another may go (RFC 8985 §7.4)
            # Growth only when the window was what limited us (RFC 7661), not in
            # a recovery episode (RFC 6675); the RTT sample counts anyway.
            cc.on_packets_acked(acked, rtt_s, now, self._cwnd_limited and rec.una >= rec.recovery_point)
        self.pacer.rate_Bps = cc.pacing_rate_Bps(self.rtt.srtt_s)
        if cum > una:
            # RFC 6298 §5.3: restart the timer on new cumulative ACK; progress
            # ends any back-off (§5.7) and the consecutive-RTO count.
            self._rto_backoff = 1.0
            self._consecutive_rto = 0
            # The timer runs on while data is sent and unacknowledged, even
            # if all of it was SACKed: only its expiry ends that wait.
            self._rto_deadline = (now + self.rtt.rto_s if rec.has_inflight()
                                  or snd_nxt > cum and not rec.retransmission_pending() else None)
            self._arm_pto(now)  # RFC 8985 §7.2: progress restarts the probe timer
        elif not (rec.has_inflight() or snd_nxt > una and not rec.retransmission_pending()):
            self._rto_deadline = None  # a retransmission is due: it starts the timer again as it leaves
        return True

    def _sack_ranges(self, sack: tuple[tuple[int, int], ...], una: int, cum: int,
                     snd_nxt: int) -> list[tuple[int, int]] | None:
        """The SACK blocks as ranges ``[start, end)`` of message numbers,
        leaving out those wholly below the cumulative ACK ``cum`` (an old
        ACK's, reordered: old news).  None if a block cannot be the peer's:
        empty, beyond what we sent (``snd_nxt``), or holding the message the
        cumulative ACK says is missing (RFC 2018 §3: blocks lie above it)."""
        base = self.isn + una
        out: list[tuple[int, int]] = []
        for s, e in sack:
            s = una + ((s - base + _HALF) & _U32) - _HALF  # signed: an old block may lie below una
            e = una + ((e - base + _HALF) & _U32) - _HALF
            if not una - _SLACK <= s < e <= snd_nxt:
                return None
            if e <= cum:
                continue
            if s <= cum:
                return None
            out.append((s, e))
        return out

    # --- the receive side's outputs -----------------------------------------

    def drain_received(self) -> list[bytes | memoryview]:
        """Messages delivered in order, exactly once, since the last call.

        Read-only: a message received in order from an immutable datagram
        (``bytes``, or a view of one) is a view into that datagram.
        """
        rx = self.receiver
        return rx.drain() if rx.delivered else rx.delivered  # nothing delivered: the common poll, no call

    # --- sending ------------------------------------------------------------

    def send(self, message: bytes | bytearray | memoryview | Gather, now: float, ack_now: bool = True,
             ack_carrier: bool = True) -> int:
        """Queue one message; returns its number n (0, 1, 2, ...).

        A ``bytearray`` is kept, not copied: the caller must not change it
        afterwards (it may be retransmitted).  So is a :class:`Gather`, whose
        first transmission is a :class:`Gathered` datagram (its payload not
        copied), and whose retransmissions are plain ones.

        ``ack_now=False``: the message does not ask the peer to ACK it at
        once (the last packet of a burst sets ACK_NOW only if a message in
        the burst asked), so its ACK waits for the peer's next DATA or its
        delayed-ACK timer.  For a message whose sender waits on nothing but
        the link's retransmission state, e.g. a Modified ACK: answering it
        with an ACK of its own costs both daemons a datagram.

        ``ack_carrier=False``: the peer must process the ACK this message
        would carry before it can answer the message (a request its owner
        answers at once, such as an RDMA Read Request), so an ACK held for
        our answer would only move that work onto the peer's reply: while
        such messages are the answers, ACK_NOW ACKs are not held.

        Raises:
            ValueError: longer than ``config.max_payload``.
            RuntimeError: the link is closed or failed.
        """
        if len(message) > self.config.max_payload:
            raise ValueError(f"message of {len(message)} bytes > max_payload {self.config.max_payload}")
        if self.state >= LinkState.CLOSED:
            raise RuntimeError(f"send() on a {self.state.name} link")
        n = self._next_n
        # bytes and bytearray are kept by reference (the caller hands them
        # over: a segment is built once per send); a view may alias memory
        # that changes, so it is copied.
        t = type(message)
        self.recovery.add(n, message if t is bytes or t is bytearray or t is Gather else bytes(message))
        self._next_n = n + 1
        if ack_now:
            self._want_ack_now = True
        if not ack_carrier:
            self._poor_carrier = True
        return n

    def send_run(self, buf: bytearray | memoryview, stride: int, count: int, last_len: int, ack_carrier: bool = True,
                 built: int = 0, ack_now: bool = True) -> int:
        """Queue ``count`` messages held in ``buf``, ``stride`` bytes long, the
        last ``last_len``, each in the place its packet will have
        (:func:`run_slots`); return the first one's number.

        As :meth:`send` for each (``ack_carrier`` and ``ack_now`` too), but the link keeps
        ``buf`` itself (the caller must not change the messages) and, with a
        framer, writes the packets' headers and CRCs around them in one
        compiled call when they leave in order, and sends that part of
        ``buf``: the payload is copied once on its way from the caller to
        the socket.

        ``built``: the messages' DDP header length if the framer's
        ``udpv_tx_bodies`` built them in place (a long payload's CRC register
        then waits in its packet's CRC field), else 0.

        Raises:
            ValueError: a message longer than ``config.max_payload``.
            RuntimeError: the link is closed or failed.
        """
        longest = max(stride if count > 1 else 0, last_len)
        if longest > self.config.max_payload:
            raise ValueError(f"message of {longest} bytes > max_payload {self.config.max_payload}")
        if self.state >= LinkState.CLOSED:
            raise RuntimeError(f"send_run() on a {self.state.name} link")
        n0 = self._next_n
        self.recovery.add_run(n0, count, memoryview(buf), stride, last_len, *run_slots(stride))
        self._next_n = n0 + count
        if ack_now:
            self._want_ack_now = True
        if not ack_carrier:
            self._poor_carrier = True
        if self._framer is not None:
            self._runs.append((n0, n0 + count, buf, stride, last_len, built))
        return n0

    def quiet(self) -> bool:
        """Nothing queued, nothing unacknowledged: what is queued next would
        leave alone (a ping-pong's answer)."""
        return (self.state == _ESTABLISHED and not self._out and self._snd_nxt == self._next_n
                and not self.recovery.bytes_in_flight)

    def send_space(self) -> int:
        """How many more messages the link wants queued now."""
        s = self.config.send_buffer_packets - (self._next_n - self.recovery.una)
        return s if s > 0 else 0

    # --- events -------------------------------------------------------------

    @property
    def has_events(self) -> bool:
        """True if ``next_event`` has something (cheaper than popping)."""
        return bool(self._events)

    def next_event(self) -> LinkEvent | None:
        """Pop the next control event, or None."""
        return self._events.popleft() if self._events else None
