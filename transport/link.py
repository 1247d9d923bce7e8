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
exponential back-off and fail after ``max_init_retransmits``.  An INIT with a
different *incarnation* from an established peer means the peer restarted:
``LinkFailed("peer_restarted")``; the same incarnation with a new tag means
the peer dropped its end of the link: ``LinkFailed("peer_reset")``.  (INIT
is unauthenticated, as SCTP's: a spoofer who knows the addresses can reset
a link, but cannot inject data without the 32-bit tag.)

Data: message ``n`` travels as wire sequence ``isn + n mod 2**32``; numbers
are unwrapped against the current window (half the sequence space either
side), so the wrap is invisible above.  The receiver accepts ``n`` in
``[rcv_nxt, rcv_nxt + window)`` where the window is ``rwnd_packets`` minus
what the owner has not drained yet (bounded memory), buffers out-of-order
packets, delivers in order exactly once and advertises the window it has
left.  ACKs are cumulative (``ack`` = next expected sequence) plus up to 4
SACK blocks (RFC 2018; the block holding the latest arrival first, then the
lowest ones, which name the holes the sender must fill first).

ACK policy (RFC 5681 §4.2 / RFC 1122): ACK every ``ack_every`` in-order
packets, or after ``max_ack_delay_s``; at once for an out-of-order,
duplicate or out-of-window packet, for a filled hole, and when the sender set
ACK_NOW (it does on the last packet of a burst, so a small message is not
held by the delayed-ACK timer).  Any DATA we send piggybacks the ACK.

An ACK the sender asked for with ACK_NOW is held, for at most
``max_ack_delay_s``, while the exchange is a ping-pong: nothing of ours is
in flight, and the last such ACK our own DATA carried within that time (or
could have carried: it left alone and our DATA followed in time).  Held,
the ACK rides on the answer, and neither side spends a datagram and a pass
on an ACK alone.  A hold that runs out sends the ACK and ends the holding
until an answer comes in time again, so a peer whose messages we never
answer waits for an ACK once, not each time (``ack_holds_expired``).  An
answer queued with ``send(ack_carrier=False)`` ends the holding too.  The
rule is ``ackhold.py``'s, which a QP's Modified ACK follows as well.

Timestamps and the echo rule: every packet carries ``ts_us`` (our clock, µs
mod 2**32).  ``ts_echo_us`` returns the ts of the latest packet received from
the peer *plus the time we held it* before this packet left.  So the peer's
``now - ts_echo`` is exactly the network round trip (forward and return
path, queues included) without our ACK delay, whatever the two clocks'
offsets.  That is the delay signal of EFE congestion control, and RFC 6298's
RTT sample.  A sample is taken from an ACK that newly acknowledges data
(RFC 7323 §4), so idle-time echoes do not pollute it.

Loss recovery (``recovery.py``): SACK + transmission-id threshold for fast
retransmit, RFC 6298 RTO with exponential back-off; ``max_retransmits``
consecutive RTOs without progress fail the link.  Congestion control
(``congestion/``) gives ``cwnd_bytes`` and a pacing rate (``pacer.py``); the
window grows only while it is what limits the sender (RFC 7661).

Liveness: after ``keepalive_idle_s`` without hearing from the peer we send
KEEPALIVE (answered by an immediate ACK), again every ``keepalive_idle_s``;
after ``dead_peer_s`` of silence: ``LinkFailed("dead_peer")``.
"""

from __future__ import annotations

import bisect
import enum
import math
import random
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

from ..wire import link as wl
from ..wire.errors import WireError
from .ackhold import AckHold
from .congestion.base import INF, create
from .pacer import Pacer
from .recovery import Recovery, RttEstimator

_U32 = 0xFFFFFFFF
_HALF = 1 << 31
_FULL = 1 << 32
_DATA = wl.PacketType.DATA
_ACK = wl.PacketType.ACK
_INIT = wl.PacketType.INIT
_INIT_ACK = wl.PacketType.INIT_ACK
_KEEPALIVE = wl.PacketType.KEEPALIVE
_ABORT = wl.PacketType.ABORT
_ACK_NOW = int(wl.LinkFlags.ACK_NOW)
_RETX = int(wl.LinkFlags.RETRANSMISSION)
_encode_fields = wl.encode_fields
_decode = wl.decode_untrusted


class LinkState(enum.IntEnum):
    IDLE = 0  #: created, nothing sent or received
    INIT_SENT = 1  #: active open, waiting for INIT_ACK
    INIT_RECEIVED = 2  #: peer's tag known, waiting for proof the peer knows ours
    ESTABLISHED = 3
    CLOSED = 4  #: close() called
    FAILED = 5  #: sticky; see the LinkFailed event for the reason


_ESTABLISHED = LinkState.ESTABLISHED


@dataclass(frozen=True)
class LinkUp:
    """The link is established; ``peer_incarnation`` identifies the peer's daemon run."""

    peer_incarnation: int


@dataclass(frozen=True)
class LinkFailed:
    """The link is dead for good: ``handshake_timeout``, ``retransmit_budget``,
    ``dead_peer``, ``peer_restarted`` (INIT with a new incarnation),
    ``peer_reset`` (INIT with the same incarnation but a new tag: the peer
    dropped the link) or ``abort_received``."""

    reason: str


@dataclass(frozen=True)
class LinkClosed:
    """``close()`` was called; an ABORT went to the peer."""


LinkEvent = LinkUp | LinkFailed | LinkClosed


@dataclass
class LinkConfig:
    """Tunables of one link.  Defaults suit a data-centre or loopback path
    (RTT 20 µs - 1 ms)."""

    #: largest message (link body); 1472-byte UDP payloads by default
    max_payload: int = 1472 - wl.OVERHEAD
    #: receive window in packets (buffered out of order + undrained)
    rwnd_packets: int = 256
    #: messages the owner may queue beyond ``acked`` (send_space bound)
    send_buffer_packets: int = 512
    ack_every: int = 2
    max_ack_delay_s: float = 200e-6
    initial_rto_s: float = 0.05
    min_rto_s: float = 0.004
    max_rto_s: float = 2.0
    #: consecutive RTOs without progress before LinkFailed("retransmit_budget")
    max_retransmits: int = 10
    #: INIT / INIT_ACK retransmissions before LinkFailed("handshake_timeout")
    max_init_retransmits: int = 8
    keepalive_idle_s: float = 1.0
    dead_peer_s: float = 5.0
    #: packets sent after a loss before it is declared lost (RFC 9002 §6.1.1)
    reorder_threshold: int = 3
    cc: str = "efe"
    cc_params: dict[str, Any] = field(default_factory=dict)
    #: burst the pacer allows after idle, in packets...
    pacing_burst_packets: float = 2.0
    #: ...or in time at the pacing rate, if that is more (see pacer.py)
    pacing_burst_s: float = 0.0


@dataclass(slots=True)
class LinkStats:
    """Counters; garbage from the network ends up here, never as an exception."""

    datagrams_received: int = 0
    datagrams_sent: int = 0
    data_sent: int = 0
    data_received: int = 0
    acks_sent: int = 0
    truncated: int = 0
    bad_crc: int = 0
    malformed: int = 0  #: other WireError (version, ptype, SACK count, init body)
    bad_tag: int = 0
    unexpected: int = 0  #: valid packet that does not fit the state (e.g. after failure)
    duplicate: int = 0
    out_of_window: int = 0
    bad_ack: int = 0  #: ACK for data never sent
    bad_init: int = 0  #: INIT/INIT_ACK inconsistent with the peer we know
    retransmits: int = 0
    fast_retransmits: int = 0  #: packets declared lost from SACK information
    rto_count: int = 0
    keepalives_sent: int = 0
    ack_holds_expired: int = 0  #: ACK_NOW ACKs held for an answer that did not come in time

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Burst:
    """Datagrams of ``size`` bytes back to back in ``view`` (the last may be
    shorter): a run the framer built in one buffer, the form a UDP_SEGMENT
    send takes as it is.  Cutting it into one view per datagram cost the
    sender more per datagram than framing it."""

    __slots__ = ("view", "size")

    def __init__(self, view: memoryview, size: int) -> None:
        self.view = view
        self.size = size

    def datagrams(self) -> list[memoryview]:
        """One read-only view per datagram."""
        view, size = self.view, self.size
        return [view[i:i + size] for i in range(0, len(view), size)]


def one_per_datagram(out: list[Any]) -> list[bytes | memoryview]:
    """``out`` (what :meth:`Link.bursts_to_send` returns) with each
    :class:`Burst` cut into its datagrams."""
    flat: list[bytes | memoryview] = []
    for d in out:
        if type(d) is Burst:
            flat.extend(d.datagrams())
        else:
            flat.append(d)
    return flat


def _admit(m: int, full: int, tail: int, cwnd: float, inflight: int, rate: float, nxt: float, floor: float,
           now: float) -> tuple[int, float, int]:
    """How many of ``m`` packets of ``full`` bytes, the last ``tail``, the
    send loop would admit now, the pacer's next time after them, and their
    bytes: the loop's admission test and ``Pacer.on_sent``, packet by
    packet, with the same float operations in the same order (the pacer's
    state must not depend on which path sent), but only those that can
    change.  Packet i is checked with i full packets in flight before it
    (only the last may be shorter, and its size counts after its own
    check), so the window's count is worked out once; past the first
    packet the pacer's next time is above ``floor``, the credit cap, so
    each packet just adds full / rate."""
    if now < nxt or inflight >= cwnd:
        return 0, nxt, 0
    k = math.ceil((cwnd - inflight) / full)  # then exact, in integers against cwnd
    while k > 1 and inflight + (k - 1) * full >= cwnd:
        k -= 1
    while k < m and inflight + k * full < cwnd:
        k += 1
    if k > m:
        k = m
    if rate != INF:
        last = m - 1
        nxt = (nxt if nxt > floor else floor) + (tail if last == 0 else full) / rate
        allowed, k = k, 1
        step = full / rate
        stop = allowed if allowed < last else last
        while k < stop and now >= nxt:
            nxt += step
            k += 1
        if k == last < allowed and now >= nxt:
            nxt += tail / rate
            k += 1
    return k, nxt, (k - 1) * full + tail if k == m else k * full


def run_slots(stride: int) -> tuple[int, int]:
    """Where :meth:`Link.send_run` wants a run's messages of ``stride`` bytes:
    (the first's offset, the distance from one to the next), leaving each
    packet's header before it and its CRC after it."""
    return wl.HEADER_LEN, stride + wl.OVERHEAD


class Link:
    """One reliable link to one peer daemon (see the module docstring).

    Args:
        config: tunables.
        rng: source of the tag and ISN (and nothing else).
        incarnation: this daemon's run identifier, sent in INIT/INIT_ACK.
        path_id: carried in every header (multi-path: one Link per path).
        framer: the compiled module (``wire/native.py``) that frames runs of
            messages queued by :meth:`send_run`, or None: every packet is
            framed in Python (the same bytes either way).
    """

    def __init__(self, config: LinkConfig, *, rng: random.Random, incarnation: int,
                 path_id: int = 0, framer: Any = None) -> None:
        self.config = config
        self._framer = framer
        self._frame = framer.ffi.new("udpv_tx_frame *") if framer is not None else None
        # (first n, end n, buffer, stride, last length, built) of each send_run()
        # batch not yet wholly transmitted, oldest first
        self._runs: deque[tuple[int, int, bytearray | memoryview, int, int, int]] = deque()
        self.framed_datagrams = 0  # DATA packets the framer built (not a LinkStats field: the bytes are the same)
        self.incarnation = incarnation
        self.path_id = path_id
        self.state = LinkState.IDLE
        self.stats = LinkStats()
        self.tag = rng.randrange(1, _FULL)
        self.isn = rng.randrange(_FULL)
        self.peer_tag = 0
        self.peer_isn = 0
        self.peer_incarnation: int | None = None
        self.peer_max_payload = config.max_payload
        self._events: deque[LinkEvent] = deque()
        self._out: list[bytes] = []
        mss = config.max_payload + wl.OVERHEAD
        self.cc = create(config.cc, mss, config.cc_params)
        self.pacer = Pacer(config.pacing_burst_packets * mss, config.pacing_burst_s)
        self.rtt = RttEstimator(config.initial_rto_s, config.min_rto_s, config.max_rto_s)
        # sender
        self.recovery = Recovery(config.reorder_threshold)
        self._next_n = 0  # number the next send() gets
        # a message queued since the last ACK_NOW left wants its ACK at once
        # (every message but one queued with ack_now=False)
        self._want_ack_now = False
        self._snd_nxt = 0  # lowest never-transmitted message
        self.peer_rwnd = 0
        self._rto_deadline: float | None = None
        self._rto_backoff = 1
        self._consecutive_rto = 0
        self._pace_deadline: float | None = None
        self._cwnd_limited = True
        self._last_ack_field = -1  # the ack field last processed (fast path)
        # receiver
        self.rcv_nxt = 0
        self._ooo: dict[int, bytes] = {}
        self._ranges: list[list[int]] = []  # sorted disjoint [start, end) above rcv_nxt
        self._starts: list[int] = []  # the ranges' starts, for bisect on plain ints
        self._recent: list[int] = []  # out-of-order arrivals, most recent first (<= 4)
        self._delivered: list[bytes] = []
        self._ack_count = 0
        self._ack_now = False
        self._ack_deadline: float | None = None
        # an ACK_NOW ACK may wait (until _ack_deadline too) for our DATA to carry it
        self._hold = AckHold()
        self._poor_carrier = False  # a message queued with ack_carrier=False has not left yet
        self._last_rx_ts = 0
        self._last_rx_time = 0.0
        self._arrived = 0.0  # arrival time of the datagram being processed
        self._adv_rwnd = config.rwnd_packets  # the window we last advertised
        # handshake and liveness
        self._hs_deadline: float | None = None
        self._hs_tries = 0
        self._last_heard = 0.0
        self._last_keepalive = -INF

    # --- public properties --------------------------------------------------

    @property
    def acked(self) -> int:
        """All messages numbered below this are acknowledged by the peer."""
        return self.recovery.una

    @property
    def srtt_s(self) -> float | None:
        return self.rtt.srtt_s

    @property
    def cwnd_bytes(self) -> float:
        return self.cc.cwnd_bytes

    @property
    def bytes_in_flight(self) -> int:
        return self.recovery.bytes_in_flight

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

    def _init_body(self) -> bytes:
        c = self.config
        return wl.encode_init(wl.LinkInit(self.tag, self.isn, c.max_payload,
                                          min(c.rwnd_packets, 0xFFFF), self.incarnation))

    def _handshake_packet(self, ptype: int, now: float) -> bytes:
        # INIT goes to an unknown tag (0) and echoes nothing; INIT_ACK
        # answers an INIT, so it is addressed with the peer's tag and echoes.
        init = ptype == _INIT
        return _encode_fields(ptype, 0, self.path_id, 0 if init else self.peer_tag, self.isn, 0,
                              int(now * 1e6) & _U32, 0 if init else self._echo(now),
                              min(self.config.rwnd_packets, 0xFFFF), self._init_body())

    def _send_handshake(self, now: float) -> None:
        # INIT while we do not know the peer; INIT_ACK (which also carries our
        # tag and ISN) once we do.  Retransmitted with back-off by the timer.
        ptype = _INIT if self.state == LinkState.INIT_SENT else _INIT_ACK
        self._out.append(self._handshake_packet(ptype, now))
        self._hs_deadline = now + self.config.initial_rto_s * (1 << self._hs_tries)

    def _learn_peer(self, init: wl.LinkInit, is_init: bool) -> bool:
        """Record the peer's INIT body; False if it contradicts what we know."""
        if self.peer_incarnation is not None:
            if init.incarnation != self.peer_incarnation:
                self._fail("peer_restarted")
                return False
            if init.tag != self.peer_tag or init.isn != self.peer_isn:
                if is_init:
                    # Same daemon run, new tag: the peer dropped its end of
                    # the link (it failed there) and opens afresh.  Our state
                    # is stale; the owner builds a new Link for the INIT.
                    self._fail("peer_reset")
                else:
                    self.stats.bad_init += 1
                return False
            return True
        if init.tag == 0:
            self.stats.bad_init += 1
            return False
        self.peer_tag = init.tag
        self.peer_isn = init.isn
        self.peer_incarnation = init.incarnation
        self.peer_max_payload = min(init.max_payload, self.config.max_payload)
        self.peer_rwnd = init.rwnd
        return True

    def _establish(self, now: float) -> None:
        self.state = LinkState.ESTABLISHED
        self._hs_deadline = None
        self._hs_tries = 0
        self._events.append(LinkUp(self.peer_incarnation or 0))

    # --- input --------------------------------------------------------------

    def datagram_received(self, data: bytes | bytearray | memoryview, now: float,
                          arrived: float | None = None) -> None:
        """Process one datagram from the peer.  Never raises on bad input.

        ``arrived`` (≤ ``now``, default ``now``) is when the datagram reached
        this host, if the owner knows (a kernel receive timestamp).  The time
        it then waited for us to run is host scheduling, not the path:
        congestion control's delay signal leaves it out, and so does the
        echo we return (the peer's signal leaves it out too).  The RTO
        estimator keeps it: a retransmission timer must outlast a daemon
        that was not running.
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
        if state != LinkState.ESTABLISHED:
            if state == LinkState.INIT_RECEIVED:
                self._establish(now)  # the peer used our tag: it knows us
            else:
                stats.unexpected += 1
                return
        if ptype == _ABORT:
            self._fail("abort_received")
            return
        self._heard(h.ts_us, now)
        self._process_ack(h.ack, h.rwnd, h.ts_echo_us, h.sack, now)
        if ptype == _DATA:
            self._data_received(h, body, now)
        elif ptype == _KEEPALIVE:
            self._ack_now = True

    def run_receivable(self) -> tuple[int, int, int] | None:
        """``(our tag, next wire sequence, window room)`` when a run of
        in-order DATA may be consumed by the owner and reported with
        ``data_run_received``; None when each datagram must come through
        ``datagram_received`` (not established, a hole to fill, undrained
        messages that must reach the owner first, or no RTT sample yet, so
        ACK processing is not yet the same for every packet)."""
        if (self.state != _ESTABLISHED or self._ranges or self._delivered
                or self.rtt.srtt_s is None):
            return None
        return self.tag, (self.peer_isn + self.rcv_nxt) & _U32, self.config.rwnd_packets

    def data_run_received(self, count: int, ack: int, ts_us: int, ts_echo_us: int, rwnd: int, flags: int,
                          last_ts_us: int, last_rwnd: int, flags_any: int, now: float,
                          arrived: float | None = None) -> None:
        """Account for ``count`` DATA packets the owner consumed itself.

        The packets are the next ``count`` in order (from the sequence
        ``run_receivable`` gave), with our tag, no SACK blocks, and one ACK
        field ``ack``; the first carried ``ts_us``, ``ts_echo_us``, ``rwnd``
        and ``flags``, the last ``last_ts_us`` and ``last_rwnd``;
        ``flags_any`` is the OR of all their flags.  The state afterwards is
        what ``datagram_received`` of each would have left, except that the
        messages are not delivered (the owner has handled them).
        """
        self._arrived = now if arrived is None else arrived
        stats = self.stats
        stats.datagrams_received += count
        stats.data_received += count
        self._heard(last_ts_us, now)
        self._process_ack(ack, rwnd, ts_echo_us, (), now)
        if count > 1:
            # later packets repeat the ACK field: the fast case of _process_ack
            self.peer_rwnd = last_rwnd
        self.rcv_nxt += count
        self._ack_count += count
        if self._ack_count >= self.config.ack_every:
            self._ack_now = True
        elif flags_any & _ACK_NOW:
            self._ack_asked(flags_any, now)

    def _ack_asked(self, flags: int, now: float) -> None:
        """In-order DATA with ACK_NOW (``flags``) arrived: ACK at once, or hold
        the ACK for our answer (see the module docstring).  Never held when
        another rule already ACKs at once (a filled hole, say): the hold
        would only count as expired and stop the holding."""
        hold_s = self.config.max_ack_delay_s
        h = self._hold
        if not self._ack_now and not flags & _RETX and not self.recovery.has_inflight() and h.owe(now, hold_s):
            if self._ack_deadline is None or h.until < self._ack_deadline:  # type: ignore[operator]
                self._ack_deadline = h.until
            return
        self._ack_now = True
        h.acking_now(now, hold_s)

    def _handshake_received(self, h: wl.LinkHeader, body: memoryview, now: float) -> None:
        stats = self.stats
        state = self.state
        if state >= LinkState.CLOSED:
            stats.unexpected += 1
            return
        try:
            init = wl.decode_init_untrusted(body)
        except WireError:
            stats.malformed += 1
            return
        if h.ptype == _INIT:
            if h.conn_tag != 0:
                stats.bad_tag += 1
                return
            if not self._learn_peer(init, True):
                return
            self._heard(h.ts_us, now)
            if state == LinkState.ESTABLISHED:
                # Our INIT_ACK was lost (or crossed): answer again, no timer.
                self._out.append(self._handshake_packet(_INIT_ACK, now))
                return
            if state != LinkState.INIT_RECEIVED or self._hs_deadline is None:
                self._hs_tries = 0
            self.state = LinkState.INIT_RECEIVED
            self._send_handshake(now)
            return
        # INIT_ACK: addressed with our tag, so the peer knows us.
        if h.conn_tag != self.tag:
            stats.bad_tag += 1
            return
        if state == LinkState.IDLE:
            stats.unexpected += 1
            return
        if not self._learn_peer(init, False):
            return
        self._heard(h.ts_us, now)
        if state != LinkState.ESTABLISHED:
            # INIT_ACK always echoes the INIT it answers.  The handshake
            # crossed the path before our data queued on it: the best
            # base-RTT sample a delay-based controller will get.
            s = self._rtt_sample(h.ts_echo_us, now)
            if s is not None:
                self.cc.on_packets_acked(0, s, now)
            self._establish(now)
        # An ACK proves to the peer that we know its tag (it may be waiting
        # in INIT_RECEIVED).
        self._ack_now = True

    def _heard(self, ts_us: int, now: float) -> None:
        # Liveness, and what the next echo will return (the echo rule).
        self._last_heard = now
        self._last_rx_ts = ts_us
        self._last_rx_time = self._arrived

    def _rtt_sample(self, echo: int, now: float) -> float | None:
        """Feed the RTO estimator the round trip up to ``now``; return the
        congestion signal's sample, which ends at arrival (see datagram_received)."""
        d = (int(now * 1e6) - echo) & _U32
        if d >= _HALF:
            return None
        self.rtt.update(d * 1e-6)
        path = (int(self._arrived * 1e6) - echo) & _U32
        return path * 1e-6 if path <= d else d * 1e-6

    def _process_ack(self, ack: int, rwnd: int, ts_echo_us: int, sack: tuple[tuple[int, int], ...],
                     now: float) -> None:
        """The ACK fields of a received packet (taken apart by the caller: the
        compiled lane's runs have no header object to pass)."""
        if ack == self._last_ack_field and not sack and self.rtt.srtt_s is not None:
            # The common case on the receiving side of a bulk transfer: the
            # peer's ACK field has not moved, and nothing is SACKed.
            self.peer_rwnd = rwnd
            return
        self._last_ack_field = ack
        rec = self.recovery
        una = rec.una
        base = self.isn + una
        cum = una + ((ack - base) & _U32)
        snd_nxt = self._snd_nxt
        if cum > snd_nxt:
            d = (ack - base) & _U32
            if d >= _HALF:
                cum = una  # an old ACK, reordered: nothing new
            else:
                self.stats.bad_ack += 1
                return
        self.peer_rwnd = rwnd
        sacks: list[tuple[int, int]] = []
        if sack:
            for s, e in sack:
                ds = (s - base) & _U32
                de = (e - base) & _U32
                if ds < de <= snd_nxt - una:
                    sacks.append((una + ds, una + de))
        if cum == una and not sacks:
            if self.rtt.srtt_s is None:
                s = self._rtt_sample(ts_echo_us, now)  # the passive opener's first sample
                if s is not None:
                    self.cc.on_packets_acked(0, s, now)
            return
        nlost = len(rec.lost)
        acked, lost = rec.on_ack(cum, sacks)
        if not acked and not lost:
            return
        rtt_s = None
        if acked:
            rtt_s = self._rtt_sample(ts_echo_us, now)
        cc = self.cc
        if lost:
            self.stats.fast_retransmits += len(rec.lost) - nlost
            cc.on_packets_lost(lost, now)
        if acked:
            # Growth only when the window was what limited us (RFC 7661); the
            # RTT sample still counts (EFE's decrease, the base-RTT filter).
            cc.on_packets_acked(acked if self._cwnd_limited else 0, rtt_s, now)
        self.pacer.rate_Bps = cc.pacing_rate_Bps(self.rtt.srtt_s)
        if cum > una:
            # RFC 6298 §5.3: restart the timer on new cumulative ACK; progress
            # ends any back-off (§5.7) and the consecutive-RTO count.
            self._rto_backoff = 1
            self._consecutive_rto = 0
            self._rto_deadline = now + self.rtt.rto_s if rec.has_inflight() else None
        elif not rec.has_inflight():
            self._rto_deadline = None

    def _data_received(self, h: wl.LinkHeader, body: memoryview, now: float) -> None:
        stats = self.stats
        rcv_nxt = self.rcv_nxt
        d = (h.seq - self.peer_isn - rcv_nxt) & _U32
        window = self.config.rwnd_packets - len(self._delivered)
        if d >= _HALF:
            stats.duplicate += 1  # below rcv_nxt: already delivered
            self._ack_now = True
            return
        if d >= window:
            stats.out_of_window += 1
            self._ack_now = True
            return
        stats.data_received += 1
        asked = h.flags & _ACK_NOW
        if d == 0:
            delivered = self._delivered
            # A view of an immutable datagram is handed on as it is (the
            # common in-order case costs no copy); anything that may change
            # under us is copied.
            delivered.append(body if body.readonly else bytes(body))
            rcv_nxt += 1
            ranges = self._ranges
            if ranges and ranges[0][0] == rcv_nxt:
                # Filled a hole: hand over the run behind it, ACK at once
                # (RFC 5681 §4.2) so the sender learns quickly.
                end = ranges.pop(0)[1]
                del self._starts[0]
                ooo = self._ooo
                for n in range(rcv_nxt, end):
                    delivered.append(ooo.pop(n))
                rcv_nxt = end
                self._ack_now = True
            self.rcv_nxt = rcv_nxt
            self._ack_count += 1
            if self._ack_count >= self.config.ack_every:
                self._ack_now = True
            elif asked:
                self._ack_asked(h.flags, now)
            return
        if asked:
            self._ack_now = True
        n = rcv_nxt + d
        ooo = self._ooo
        ranges = self._ranges
        recent = self._recent
        if ranges and ranges[-1][1] == n:
            # Continues the highest run beyond a hole: nothing the sender
            # does not already know (the hole was reported when it opened),
            # so the normal every-`ack_every` rule applies; this halves the
            # ACKs of a lossy bulk transfer.
            ooo[n] = bytes(body)
            ranges[-1][1] = n + 1
            if recent and recent[0] == n - 1:
                recent[0] = n
            else:
                self._note_recent(n)
            self._ack_count += 1
            if self._ack_count >= self.config.ack_every:
                self._ack_now = True
            return
        self._note_recent(n)
        self._ack_now = True  # out of order: ACK at once with SACK (RFC 5681 §4.2)
        if n in ooo:
            stats.duplicate += 1  # a D-SACK-like hint: its block is reported first
            return
        ooo[n] = bytes(body)
        starts = self._starts
        i = bisect.bisect_left(starts, n + 1)  # first range starting after n
        if i and ranges[i - 1][1] == n:
            ranges[i - 1][1] = n + 1
            if i < len(ranges) and starts[i] == n + 1:
                ranges[i - 1][1] = ranges.pop(i)[1]
                del starts[i]
        elif i < len(ranges) and starts[i] == n + 1:
            ranges[i][0] = n
            starts[i] = n
        else:
            ranges.insert(i, [n, n + 1])
            starts.insert(i, n)

    def _note_recent(self, n: int) -> None:
        recent = self._recent
        if n in recent:
            recent.remove(n)
        recent.insert(0, n)
        if len(recent) > wl.MAX_SACK_BLOCKS:
            recent.pop()

    # --- the receive side's outputs -----------------------------------------

    def drain_received(self) -> list[bytes | memoryview]:
        """Messages delivered in order, exactly once, since the last call.

        Read-only: a message received in order from an immutable datagram
        (``bytes``, or a view of one) is a view into that datagram.
        """
        out = self._delivered
        if not out:
            return out
        self._delivered = []
        # If the window we last advertised was small (the sender may be
        # stalled on it), or much has been freed, tell the peer it reopened;
        # otherwise a lost or absent update would stall it until keep-alive.
        if self._adv_rwnd * 4 < self.config.rwnd_packets or len(out) * 2 >= self.config.rwnd_packets:
            self._ack_now = True
        return out

    def _echo(self, now: float) -> int:
        # The echo rule: the ts we last received plus how long we held it.
        return (self._last_rx_ts + int((now - self._last_rx_time) * 1e6)) & _U32

    def _sack_blocks(self) -> tuple[tuple[int, int], ...]:
        # RFC 2018 §4: the first block holds the most recent arrival, the
        # others repeat the most recently reported ranges, so each range is
        # reported in several ACKs and survives ACK loss.  Then the lowest
        # ranges (the holes the sender must fill first).
        ranges = self._ranges
        starts = self._starts
        blocks: list[tuple[int, int]] = []
        seen: list[int] = []
        base = self.peer_isn
        for n in self._recent:
            i = bisect.bisect_right(starts, n) - 1
            if i < 0 or i in seen:
                continue
            r = ranges[i]
            if r[1] <= n:
                continue  # n has since been delivered
            seen.append(i)
            blocks.append(((base + r[0]) & _U32, (base + r[1]) & _U32))
        i = 0
        while len(blocks) < wl.MAX_SACK_BLOCKS and i < len(ranges):
            if i not in seen:
                r = ranges[i]
                blocks.append(((base + r[0]) & _U32, (base + r[1]) & _U32))
            i += 1
        return tuple(blocks)

    def _advertised_window(self) -> int:
        w = self.config.rwnd_packets - len(self._delivered)
        w = 0 if w < 0 else 0xFFFF if w > 0xFFFF else w
        self._adv_rwnd = w
        return w

    def _control(self, ptype: int, flags: int, now: float) -> bytes:
        return _encode_fields(ptype, flags, self.path_id, self.peer_tag, (self.isn + self._snd_nxt) & _U32,
                              (self.peer_isn + self.rcv_nxt) & _U32, int(now * 1e6) & _U32, self._echo(now),
                              self._advertised_window(), b"", self._sack_blocks() if self._ranges else ())

    # --- sending ------------------------------------------------------------

    def send(self, message: bytes | bytearray | memoryview, now: float, ack_now: bool = True,
             ack_carrier: bool = True) -> int:
        """Queue one message; returns its number n (0, 1, 2, ...).

        A ``bytearray`` is kept, not copied: the caller must not change it
        afterwards (it may be retransmitted).

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
        self.recovery.add(n, message if t is bytes or t is bytearray else bytes(message))
        self._next_n = n + 1
        if ack_now:
            self._want_ack_now = True
        if not ack_carrier:
            self._poor_carrier = True
        return n

    def send_run(self, buf: bytearray | memoryview, stride: int, count: int, last_len: int, ack_carrier: bool = True,
                 built: int = 0) -> int:
        """Queue ``count`` messages held in ``buf``, ``stride`` bytes long, the
        last ``last_len``, each in the place its packet will have
        (:func:`run_slots`); return the first one's number.

        As :meth:`send` for each (``ack_carrier`` too), but the link keeps
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

    def frame_alone(self, message: bytes | bytearray, now: float, ack_now: bool = True) -> bytes | None:
        """The packet that :meth:`send` then :meth:`bursts_to_send` would
        send for ``message`` right now, if it would be the only one; else
        None.  Changes nothing but the record of the receive window the
        packet advertises: the caller sends the packet and then calls
        :meth:`sent_alone` with it, so the link's bookkeeping comes after
        the datagram has left (a ping-pong's peer waits on the datagram,
        not on the bookkeeping)."""
        rec = self.recovery
        n = self._next_n
        if (self.state != _ESTABLISHED or self._out or self._snd_nxt != n or rec.lost or self._ranges
                or n >= rec.una + self.peer_rwnd or n - rec.una >= self.config.send_buffer_packets
                or rec.bytes_in_flight >= self.cc.cwnd_bytes or now < self.pacer.next_send_s
                or len(message) > self.config.max_payload):
            return None
        # ACK_NOW as the usual path sets it on the last message queued (with
        # every earlier one sent, the flag of a queued message has gone out).
        return _encode_fields(_DATA, _ACK_NOW if ack_now else 0, self.path_id,
                              self.peer_tag, (self.isn + n) & _U32, (self.peer_isn + self.rcv_nxt) & _U32,
                              int(now * 1e6) & _U32, self._echo(now), self._advertised_window(), message, ())

    def sent_alone(self, message: bytes | bytearray, size: int, now: float, ack_carrier: bool = True) -> int:
        """``message`` left in the packet :meth:`frame_alone` returned, of
        ``size`` bytes: the bookkeeping of :meth:`send` and
        :meth:`bursts_to_send` for it.  Returns its number."""
        n = self._next_n
        rec = self.recovery
        rec.add(n, message)
        self._next_n = self._snd_nxt = n + 1
        self._pace_deadline = None
        rec.on_sent(n, size, False)
        self.pacer.on_sent(size, now)
        cc = self.cc
        cc.on_packet_sent(size, now)
        self._cwnd_limited = rec.bytes_in_flight * 2 >= cc.cwnd_bytes
        stats = self.stats
        stats.data_sent += 1
        stats.datagrams_sent += 1
        poor = not ack_carrier or self._poor_carrier
        self._poor_carrier = False  # nothing else is queued: it has left
        self._data_left(now, poor)
        return n

    def frame_run_alone(self, buf: bytearray | memoryview, stride: int, count: int, last_len: int, built: int,
                        now: float) -> memoryview | None:
        """As :meth:`frame_alone` for a run: the packets that
        :meth:`send_run` then :meth:`bursts_to_send` would send for the run
        in ``buf`` right now, if they would be all that leaves and all of it
        leaves; else None.  The framer writes their headers and CRCs into
        ``buf``, and nothing else changes but the record of the advertised
        window: the caller sends the view returned and then calls
        :meth:`sent_run_alone`, so the bookkeeping of a ping-pong's message
        of several datagrams comes after they have left."""
        rec = self.recovery
        n = self._next_n
        if (self._framer is None or self.state != _ESTABLISHED or self._out or self._snd_nxt != n or rec.lost
                or self._ranges or n + count > rec.una + self.peer_rwnd
                or max(stride if count > 1 else 0, last_len) > self.config.max_payload):
            return None
        k, _, total = self._admit_run(stride, count, last_len, now)
        if k != count:
            return None
        # ACK_NOW on the last, as on the last message queued (send_run sets
        # _want_ack_now and the framing clears it: with everything queued
        # gone, as here, it is already clear)
        self._frame_packets(buf, 0, n, count, stride, last_len, now, (self.peer_isn + self.rcv_nxt) & _U32,
                            self._advertised_window(), count - 1, _ACK_NOW, built)
        return memoryview(buf)[:total].toreadonly()

    def _frame_packets(self, buf: bytearray | memoryview, first: int, n: int, k: int, stride: int, last_len: int,
                       now: float, ack: int, rwnd: int, flag_at: int, flag: int, built: int) -> None:
        """Write the headers and CRCs of DATA packets ``n`` .. ``n + k - 1``
        around their bodies in ``buf`` from ``first`` (``run_slots``'
        layout; bodies ``stride`` bytes, the k-th ``last_len``), in one
        compiled call: the packet at ``flag_at`` carries ``flag``; ``built``
        as for :meth:`send_run`."""
        f = self._frame
        f.path_id = self.path_id
        f.conn_tag = self.peer_tag
        f.seq = (self.isn + n) & _U32
        f.ack = ack
        f.ts = int(now * 1e6) & _U32
        f.echo = self._echo(now)
        f.rwnd = rwnd
        f.flag_at = flag_at
        f.flag = flag
        f.prefix = built
        ffi = self._framer.ffi
        dst = ffi.from_buffer("uint8_t[]", buf)
        try:
            self._framer.lib.udpv_tx_frame_slots(f, dst + first, k, stride, last_len)
        finally:
            ffi.release(dst)

    def _admit_run(self, stride: int, count: int, last_len: int, now: float) -> tuple[int, float, int]:
        """``_admit`` for a run of ``count`` messages to be queued next, on this link's state now."""
        pacer = self.pacer
        rate = pacer.rate_Bps
        return _admit(count, stride + wl.OVERHEAD, last_len + wl.OVERHEAD, self.cc.cwnd_bytes,
                      self.recovery.bytes_in_flight, rate, pacer.next_send_s,
                      pacer.floor(now) if rate != INF else 0.0, now)

    def sent_run_alone(self, buf: bytearray | memoryview, stride: int, count: int, last_len: int, now: float,
                       ack_carrier: bool = True) -> int:
        """The run :meth:`frame_run_alone` framed has left: the bookkeeping
        of :meth:`send_run` and :meth:`bursts_to_send` for it.  Returns its
        first message's number."""
        _, nxt, total = self._admit_run(stride, count, last_len, now)  # as framed: nothing has moved since
        n = self._next_n
        rec = self.recovery
        rec.add_run(n, count, memoryview(buf), stride, last_len, *run_slots(stride))
        self._next_n = self._snd_nxt = n + count
        runs = self._runs
        while runs and runs[0][1] <= n:
            runs.popleft()  # sent before: let go, as bursts_to_send does
        self._pace_deadline = None
        self.pacer.next_send_s = nxt
        full = stride + wl.OVERHEAD
        rec.on_sent_run(n, count, full, last_len + wl.OVERHEAD)
        cwnd = self.cc.cwnd_bytes
        self.cc.on_packet_sent(total, now)
        self._cwnd_limited = rec.bytes_in_flight * 2 >= cwnd
        self.framed_datagrams += count
        stats = self.stats
        stats.datagrams_sent += count
        stats.data_sent += count
        poor = not ack_carrier or self._poor_carrier
        self._poor_carrier = False  # nothing else is queued: it has left
        self._data_left(now, poor)
        return n

    def _data_left(self, now: float, poor_carrier: bool) -> None:
        """DATA left, carrying our ACK: nothing is owed any more, a held ACK
        was carried (or, ``poor_carrier``, such answers are no use for
        holding), and the retransmission timer runs."""
        self._ack_count = 0
        self._ack_now = False
        self._ack_deadline = None
        hold = self._hold
        if poor_carrier:
            hold.stop()
        else:
            hold.answered(now, hold.until is not None)  # a held ACK: carried, as hoped
        if self._rto_deadline is None:
            self._rto_deadline = now + self.rtt.rto_s * self._rto_backoff

    def send_space(self) -> int:
        """How many more messages the link wants queued now."""
        s = self.config.send_buffer_packets - (self._next_n - self.recovery.una)
        return s if s > 0 else 0

    def datagrams_to_send(self, now: float, clock: Any = None) -> list[bytes | memoryview]:
        """Complete link packets that may leave now (cwnd, rwnd and pacing respected):
        bytes, or read-only views of one buffer for a run the framer built.

        ``clock``: as for :meth:`bursts_to_send`.
        """
        out = self.bursts_to_send(now, clock)
        return one_per_datagram(out) if self.framed_datagrams else out  # type: ignore[return-value]

    def bursts_to_send(self, now: float, clock: Any = None) -> list[bytes | Burst]:
        """As :meth:`datagrams_to_send`, but a run the framer built is one
        :class:`Burst`, not one view per datagram.

        ``clock``, if given, returns the time (as ``now``) and stamps each
        DATA packet as it is built: a burst takes a while to build, and its
        last packet (the one whose timestamp the peer echoes) would otherwise
        carry the time the burst began and inflate the peer's RTT samples by
        the whole build.
        """
        out = self._out
        rec = self.recovery
        if (not out and self._snd_nxt >= self._next_n and not rec.lost and not self._ack_now
                and (self._ack_deadline is None and not self._ack_count
                     or self._ack_deadline is not None and now < self._ack_deadline)
                and self.state == _ESTABLISHED):
            # Nothing to send and no ACK due: the data loop's idle pass.
            self._pace_deadline = None
            self._cwnd_limited = rec.bytes_in_flight * 2 >= self.cc.cwnd_bytes
            return []
        self._out = []
        self._pace_deadline = None
        if self.state != LinkState.ESTABLISHED:
            self.stats.datagrams_sent += len(out)
            return out
        lost = rec.lost
        snd_nxt = self._snd_nxt
        limit = self._next_n
        if limit > rec.una + self.peer_rwnd:
            limit = rec.una + self.peer_rwnd  # the peer's receive window
        stats = self.stats
        sent = 0
        cwnd = self.cc.cwnd_bytes
        pacer = self.pacer
        if (lost or snd_nxt < limit) and (rec.bytes_in_flight >= cwnd or now < pacer.next_send_s):
            # Data waits but nothing may leave: skip building headers (the
            # SACK blocks are the costly part) just to find that out.
            if rec.bytes_in_flight < cwnd:
                self._pace_deadline = pacer.next_send_s
            self._cwnd_limited = rec.bytes_in_flight * 2 >= cwnd
        elif lost or snd_nxt < limit:
            overhead = wl.OVERHEAD
            ts = int(now * 1e6) & _U32
            ack = (self.peer_isn + self.rcv_nxt) & _U32
            echo = self._echo(now)
            rwnd = self._advertised_window()
            sack = self._sack_blocks() if self._ranges else ()
            path_id = self.path_id
            peer_tag = self.peer_tag
            isn = self.isn
            next_n = self._next_n
            # Not limited by the window when we run out of data or of the
            # peer's window with the window less than half used (RFC 7661):
            # then ACKs must not grow it, or an idle-ish link accumulates a
            # window it never tested.
            limited = False
            sent_bytes = 0
            runs = self._runs
            while True:
                retx = False
                if lost:
                    n = rec.next_lost()
                    if n is not None:
                        retx = True
                    elif snd_nxt < limit:
                        n = snd_nxt
                    else:
                        break
                elif snd_nxt < limit:
                    n = snd_nxt
                else:
                    break
                if not retx and runs and not sack:
                    while runs and runs[0][1] <= n:
                        runs.popleft()  # wholly transmitted
                    if runs and runs[0][0] <= n:
                        k, nbytes = self._frame_run(out, runs[0], n, limit, now, clock, ack, rwnd)
                        if k:
                            snd_nxt = n + k
                            sent += k
                            sent_bytes += nbytes
                            continue
                body = rec.message(n)
                size = len(body) + overhead
                inflight = rec.bytes_in_flight
                # Send while the window is not full (a packet may overshoot
                # it, RFC 5681 byte counting): a window of 1.5 packets then
                # means 1.5 packets per RTT via the pacer, not 1.
                cwnd_ok = inflight < cwnd
                if not cwnd_ok or now < pacer.next_send_s:
                    if retx:
                        lost.appendleft(n)
                    if cwnd_ok:  # only the pacer holds it back: wake then
                        self._pace_deadline = pacer.next_send_s
                    limited = not cwnd_ok  # the window itself holds data back
                    break
                if retx:
                    stats.retransmits += 1
                    flags = _RETX | _ACK_NOW
                else:
                    snd_nxt = n + 1
                    # ACK_NOW on the last queued message, so the peer does
                    # not hold the ACK of a burst's tail for max_ack_delay_s.
                    if snd_nxt >= next_n and self._want_ack_now:
                        flags = _ACK_NOW
                        self._want_ack_now = False
                    else:
                        flags = 0
                if clock is not None:
                    t = clock()
                    ts = int(t * 1e6) & _U32
                    echo = self._echo(t)
                out.append(_encode_fields(_DATA, flags, path_id, peer_tag, (isn + n) & _U32, ack, ts, echo, rwnd,
                                          body, sack))
                rec.on_sent(n, size, retx)
                pacer.on_sent(size, now)
                sent += 1
                sent_bytes += size
            self._snd_nxt = snd_nxt
            while runs and runs[0][1] <= snd_nxt:
                runs.popleft()  # sent, by the lane or (SACK blocks to carry) by the loop: let it go
            if sent_bytes:
                self.cc.on_packet_sent(sent_bytes, now)
            self._cwnd_limited = limited or rec.bytes_in_flight * 2 >= cwnd
        else:
            self._cwnd_limited = rec.bytes_in_flight * 2 >= self.cc.cwnd_bytes
        if sent:
            stats.data_sent += sent
            poor = self._poor_carrier
            if poor and self._snd_nxt >= self._next_n:
                self._poor_carrier = False  # such a message left: not an answer worth holding for
            self._data_left(now, poor)
        elif self._ack_now or (self._ack_deadline is not None and now >= self._ack_deadline):
            out.append(self._control(_ACK, 0, now))
            stats.acks_sent += 1
            self._ack_count = 0
            self._ack_now = False
            self._ack_deadline = None
            if self._hold.until is not None:
                # The hold ran out (or something else needed an ACK first):
                # ACK at once until an answer comes in time again.
                self._hold.stop()
                stats.ack_holds_expired += 1
        elif self._ack_count and self._ack_deadline is None:
            self._ack_deadline = now + self.config.max_ack_delay_s
        stats.datagrams_sent += len(out)
        return out

    def _frame_run(self, out: list[Any], run: tuple[int, int, bytearray | memoryview, int, int, int], n: int,
                   limit: int, now: float, clock: Any, ack: int, rwnd: int) -> tuple[int, int]:
        """First transmission of messages ``n``, ``n + 1``, ... of ``run``: as
        many as the window and the pacer let ``bursts_to_send``'s loop send,
        framed in one compiled call into one :class:`Burst` (the same bytes
        as that loop's, a clock read once for the whole run).  Returns how
        many and their bytes; 0 messages: the loop's own code decides what
        holds message ``n`` back."""
        n0, end, buf, stride, last_len, built = run
        if end > limit:
            end = limit
        if end != run[1]:
            last_len = stride  # the batch's last message may be shorter, not this part's
        m = end - n
        k, nxt, total = self._admit_run(stride, m, last_len, now)
        if not k:
            return 0, 0
        full = stride + wl.OVERHEAD
        self.pacer.next_send_s = nxt
        self.recovery.on_sent_run(n, k, full, last_len + wl.OVERHEAD if k == m else full)
        if clock is not None:
            now = clock()
        first = (n - n0) * full  # the packets' places in buf (run_slots)
        # ACK_NOW on the last message queued (as the loop sets it)
        self._frame_packets(buf, first, n, k, stride, total - (k - 1) * full - wl.OVERHEAD, now, ack, rwnd,
                            self._next_n - 1 - n, _ACK_NOW if self._want_ack_now else 0, built)
        if n + k >= self._next_n:
            self._want_ack_now = False
        self.framed_datagrams += k
        # no copy: the owner sends that part of buf as it is
        out.append(Burst(memoryview(buf)[first:first + total].toreadonly(), full))
        self.stats.datagrams_sent += k - 1  # the caller counts the Burst as one
        return k, total

    # --- timers -------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """The earliest time ``timer_fired`` must be called, or None."""
        state = self.state
        if state == _ESTABLISHED:
            c = self.config
            heard = self._last_heard
            t = heard + c.dead_peer_s
            k = self._last_keepalive
            k = (k if k > heard else heard) + c.keepalive_idle_s
            if k < t:
                t = k
            d = self._rto_deadline
            if d is not None and d < t:
                t = d
            d = self._ack_deadline
            if d is not None and d < t:
                t = d
            d = self._pace_deadline
            if d is not None and d < t:
                t = d
            return t
        if state in (LinkState.INIT_SENT, LinkState.INIT_RECEIVED):
            return self._hs_deadline
        return None

    def timer_fired(self, now: float) -> None:
        """Handle every deadline that has passed at ``now``."""
        state = self.state
        c = self.config
        if state in (LinkState.INIT_SENT, LinkState.INIT_RECEIVED):
            if self._hs_deadline is not None and now >= self._hs_deadline:
                if self._hs_tries >= c.max_init_retransmits:
                    self._fail("handshake_timeout")
                    return
                self._hs_tries += 1
                self._send_handshake(now)
            return
        if state != LinkState.ESTABLISHED:
            return
        if now >= self._last_heard + c.dead_peer_s:
            self._fail("dead_peer")
            return
        if now >= max(self._last_heard, self._last_keepalive) + c.keepalive_idle_s:
            self._last_keepalive = now
            self._out.append(self._control(_KEEPALIVE, _ACK_NOW, now))
            self.stats.keepalives_sent += 1
        if self._ack_deadline is not None and now >= self._ack_deadline:
            self._ack_now = True
        if self._rto_deadline is not None and now >= self._rto_deadline:
            self._on_rto(now)

    def _on_rto(self, now: float) -> None:
        self._rto_deadline = None
        if self._consecutive_rto >= self.config.max_retransmits:
            self._fail("retransmit_budget")
            return
        self._consecutive_rto += 1
        self._rto_backoff *= 2  # RFC 6298 §5.5
        self.stats.rto_count += 1
        self.recovery.on_rto()
        self.cc.on_rto(now)
        self.pacer.rate_Bps = self.cc.pacing_rate_Bps(self.rtt.srtt_s)
        self.pacer.next_send_s = -INF  # the retransmission leaves at once (§5.4)

    # --- events -------------------------------------------------------------

    @property
    def has_events(self) -> bool:
        """True if ``next_event`` has something (cheaper than popping)."""
        return bool(self._events)

    def next_event(self) -> LinkEvent | None:
        """Pop the next control event, or None."""
        return self._events.popleft() if self._events else None
