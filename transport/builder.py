"""Datagram building: which queued messages leave now, and their bytes (sans-IO).

Theory of operation
-------------------
The sender's queue is message numbers: ``_next_n`` is the number the next
queued message gets, ``_snd_nxt`` the lowest never transmitted; the
recovery table (``recovery.py``) holds the payloads and what is in flight
or lost.  :meth:`Builder.bursts_to_send` sends, while the congestion window
(RFC 5681 byte counting: a packet may overshoot it), the peer's receive
window and the pacer (``pacer.py``) allow, the lost messages first and then
new ones, each in a DATA packet that also carries our ACK, window and SACK
blocks (``Receiver.feedback``) and the timestamp echo; with no DATA to
carry an ACK that is due, an ACK alone.

A run of messages queued in one buffer (``Link.send_run``, laid out by
:func:`run_slots`) is framed in place by the compiled framer
(``wire/native.py``) when it leaves in order: :func:`admit` works out how
many of its packets the send loop would admit, with the same float
operations, and one compiled call writes their headers and CRCs around the
bodies.  The run leaves as one :class:`Burst`, the form a UDP_SEGMENT send
takes; the bytes are those the per-packet loop would build.

A ping-pong's message is sent the moment it is queued and the bookkeeping
done after the datagram has left: :meth:`Builder.frame_alone` /
:meth:`Builder.frame_run_alone` frame it if ``send`` then ``bursts_to_send``
would send exactly that (one admission check, :meth:`Builder._leaves_alone`),
and :meth:`Builder.sent_alone` / :meth:`Builder.sent_run_alone` then do
what the send loop does after sending (:meth:`Builder._data_sent`).

:class:`Builder` is a base class of ``link.Link``, not an object the link
holds: the send path's public methods are called on every datagram of a
ping-pong, where a forwarding call each would cost a measurable share of
the path.  It keeps the send queue's state itself and reads the link's
attributes listed in its class body.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from ..wire import link as wl
from ..wire.crc import crc32c
from .congestion.base import INF, CongestionController
from .gather import Gather, Gathered, native_crc
from .pacer import Pacer
from .receiver import Receiver
from .records import LinkConfig, LinkState, LinkStats
from .recovery import Recovery, RttEstimator

_U32 = 0xFFFFFFFF
_DATA = wl.PacketType.DATA
_ACK = wl.PacketType.ACK
_ACK_NOW = int(wl.LinkFlags.ACK_NOW)
_RETX = int(wl.LinkFlags.RETRANSMISSION)
_ESTABLISHED = LinkState.ESTABLISHED
_encode_fields = wl.encode_fields
_encode_parts = wl.encode_fields_parts

#: a queued run: (first n, end n, buffer, stride, last length, DDP header length built in place or 0)
Run = tuple[int, int, "bytearray | memoryview", int, int, int]


class Burst:
    """Datagrams of ``size`` bytes back to back in ``view`` (the last may be
    shorter): a run the framer built in one buffer, the form a UDP_SEGMENT
    send takes as it is.  Cutting it into one view per datagram costs the
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
    """``out`` (what ``Link.bursts_to_send`` returns) with each
    :class:`Burst` cut into its datagrams."""
    flat: list[bytes | memoryview] = []
    for d in out:
        if type(d) is Burst:
            flat.extend(d.datagrams())
        else:
            flat.append(d)
    return flat


def run_slots(stride: int) -> tuple[int, int]:
    """Where ``Link.send_run`` wants a run's messages of ``stride`` bytes:
    (the first's offset, the distance from one to the next), leaving each
    packet's header before it and its CRC after it."""
    return wl.HEADER_LEN, stride + wl.OVERHEAD


def fit_sack(sack: tuple[tuple[int, int], ...], size: int, cap: int) -> tuple[tuple[int, int], ...]:
    """The first of ``sack`` that a packet of ``size`` bytes without them
    may carry and stay within ``cap`` bytes, the path's (``pmtud.py``):
    SACK blocks are advisory, and the first holds the latest news (RFC 2018 §4)."""
    return sack[:max(0, (cap - size) // 8)]


def admit(m: int, full: int, tail: int, cwnd: float, inflight: int, rate: float, nxt: float, floor: float,
          now: float) -> tuple[int, float, int]:
    """How many of ``m`` packets of ``full`` bytes, the last ``tail``, the
    send loop would admit now, the pacer's next time after them, and their
    bytes.

    ``cwnd`` and ``inflight`` are the congestion window and the bytes in
    flight, ``rate``, ``nxt`` and ``floor`` the pacer's rate, next time and
    credit cap (``Pacer.floor``; any value if the rate is infinite).  This
    is the loop's admission test and ``Pacer.on_sent``, packet by packet,
    with the same float operations in the same order (the pacer's state
    must not depend on which path sent), but only those that can change.
    Packet i is checked with i full packets in flight before it (only the
    last may be shorter, and its size counts after its own check), so the
    window's count is worked out once; past the first packet the pacer's
    next time is above ``floor``, so each packet just adds full / rate."""
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


class Builder:
    """The send half of ``link.Link``: the send queue, and the datagrams it
    becomes (see the module docstring).

    Args:
        framer: the compiled module (``wire/native.py``) that frames runs,
            or None: every packet is framed in Python (the same bytes).
    """

    # The link's state the builder reads (set by ``Link.__init__`` and the handshake).
    config: LinkConfig
    state: LinkState
    stats: LinkStats
    path_id: int
    isn: int
    peer_tag: int
    peer_rwnd: int
    recovery: Recovery
    receiver: Receiver
    cc: CongestionController
    _cc_on_sent: bool  # cc implements the optional on_packet_sent hook
    pacer: Pacer
    rtt: RttEstimator
    _out: list[Any]  # control packets queued (handshake, keep-alive, ABORT)
    _last_rx_ts: int
    _last_rx_time: float
    _rto_deadline: float | None
    _pto_deadline: float | None
    _tlp_out: bool
    _pto_extra: float
    _rto_backoff: float
    _packet_cap: int  # the longest DATA packet, SACK blocks included (pmtud.py)

    def __init__(self, framer: Any) -> None:
        self._framer = framer
        self._frame = framer.ffi.new("udpv_tx_frame *") if framer is not None else None
        # the CRC over a Gather's payload where it lies: the framer's (it folds 64 bytes a step)
        self._crc = crc32c if framer is None else native_crc(framer)
        # each send_run() batch not yet wholly transmitted, oldest first
        self._runs: deque[Run] = deque()
        self.framed_datagrams = 0  # DATA packets the framer built (not a LinkStats field: the bytes are the same)
        self._next_n = 0  # number the next send() gets
        self._snd_nxt = 0  # lowest never-transmitted message
        # a message queued since the last ACK_NOW left wants its ACK at once
        # (every message but one queued with ack_now=False)
        self._want_ack_now = False
        self._poor_carrier = False  # a message queued with ack_carrier=False has not left yet
        self._pace_deadline: float | None = None
        self._persist = False  # the retransmission timer runs as the persist timer (a closed window)
        self._tlp_send = False  # a tail loss probe is due: one packet leaves whatever the window
        # Not limited by the window when we run out of data or of the peer's
        # window with the window less than half used (RFC 7661): then ACKs
        # must not grow it, or an idle-ish link accumulates a window it
        # never tested.
        self._cwnd_limited = True

    @property
    def next_n(self) -> int:
        """The number the next queued message gets."""
        return self._next_n

    @property
    def snd_nxt(self) -> int:
        """The lowest message number never transmitted."""
        return self._snd_nxt

    @property
    def queued_runs(self) -> list[Run]:
        """The runs queued by ``send_run`` that the framer may still send, oldest first."""
        return list(self._runs)

    # --- the general path ---------------------------------------------------

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
        rec = self.recovery
        rx = self.receiver
        d = rx.ack_deadline
        if (not self._out and self._snd_nxt >= self._next_n and not rec.lost and not rx.ack_now
                and (d is None and not rx.ack_count or d is not None and now < d) and self.state == _ESTABLISHED):
            # Nothing to send and no ACK due: the data loop's idle pass, kept to these tests.
            self._pace_deadline = None
            self._cwnd_limited = rec.bytes_in_flight * 2 >= self.cc.cwnd_bytes
            return []
        out = self._out  # control packets first
        self._out = []
        self._pace_deadline = None
        stats = self.stats
        if self.state == _ESTABLISHED and not self._send_data(out, now, clock):
            d = rx.ack_deadline
            if rx.ack_now or d is not None and now >= d:  # no DATA carries the ACK that is due: alone
                out.append(self._control(_ACK, 0, now))
                stats.acks_sent += 1
                if rx.ack_sent_alone():
                    stats.ack_holds_expired += 1
            elif rx.ack_count and d is None:
                rx.arm_delayed_ack(now)
        stats.datagrams_sent += len(out)
        return out

    def _send_data(self, out: list[Any], now: float, clock: Any) -> int:
        """Append to ``out`` the DATA packets that may leave now: lost messages
        first, then new ones up to the peer's window.  Returns how many left
        (their bookkeeping done); 0: the ACK, if due, still has to go."""
        rec = self.recovery
        lost, snd_nxt, limit = rec.lost, self._snd_nxt, self._next_n
        if limit > rec.una + self.peer_rwnd:
            limit = rec.una + self.peer_rwnd  # the peer's receive window
        cwnd, pacer = self.cc.cwnd_bytes if not self._tlp_send else self._probe_window(), self.pacer
        if not lost and snd_nxt >= limit or rec.bytes_in_flight >= cwnd or now < pacer.next_send_s:
            # Nothing waits, or nothing may leave: build no headers (SACK blocks cost most) to find that out.
            if (lost or snd_nxt < limit) and rec.bytes_in_flight < cwnd:
                self._pace_deadline = pacer.next_send_s
            elif not lost and limit <= snd_nxt < self._next_n and self._rto_deadline is None:
                self._arm_persist(now)  # the peer's window holds back all we have queued
            self._cwnd_limited = rec.bytes_in_flight * 2 >= cwnd
            return 0
        ack, rwnd, sack = self.receiver.feedback()
        ts, echo = int(now * 1e6) & _U32, self._echo(now)
        path_id, peer_tag, isn, next_n, runs = self.path_id, self.peer_tag, self.isn, self._next_n, self._runs
        limited, sent, sent_bytes = False, 0, 0  # limited: the window itself holds data back
        while True:
            n = rec.next_lost() if lost else None  # retransmissions first
            retx = n is not None
            if not retx:
                if snd_nxt >= limit:
                    break
                n = snd_nxt
            if not retx and runs and not sack:  # a run's packets carry no SACK blocks
                k, nbytes = self._frame_run(out, n, limit, now, clock, ack, rwnd)
                if k:
                    snd_nxt = n + k
                    sent += k
                    sent_bytes += nbytes
                    continue
            body = rec.message(n)
            size = len(body) + wl.OVERHEAD
            # Send while the window is not full (a packet may overshoot it,
            # RFC 5681 byte counting): a window of 1.5 packets then means 1.5
            # packets per RTT via the pacer, not 1.
            cwnd_ok = rec.bytes_in_flight < cwnd
            if not cwnd_ok or now < pacer.next_send_s:
                if retx:
                    lost.appendleft(n)
                if cwnd_ok:  # only the pacer holds it back: wake then
                    self._pace_deadline = pacer.next_send_s
                limited = not cwnd_ok
                break
            if retx:
                self.stats.retransmits += 1
                flags = _RETX | _ACK_NOW
            else:
                snd_nxt = n + 1
                # ACK_NOW on the last queued message, so the peer does not
                # hold the ACK of a burst's tail for max_ack_delay_s.
                flags = 0
                if snd_nxt >= next_n and self._want_ack_now:
                    flags = _ACK_NOW
                    self._want_ack_now = False
            if clock is not None:
                t = clock()
                ts = int(t * 1e6) & _U32
                echo = self._echo(t)
            s = sack if not sack or size + 8 * len(sack) <= self._packet_cap else fit_sack(sack, size, self._packet_cap)
            encode = _encode_fields if type(body) is not Gather else self._gathered
            out.append(encode(_DATA, flags, path_id, peer_tag, (isn + n) & _U32, ack, ts, echo, rwnd, body, s))
            rec.on_sent(n, size, retx, now)
            pacer.on_sent(size, now)
            sent += 1
            sent_bytes += size
        self._snd_nxt = snd_nxt
        while runs and runs[0][1] <= snd_nxt:
            runs.popleft()  # sent, by the framer or (SACK blocks to carry) by the loop: let it go
        if not sent:
            self._cwnd_limited = limited or rec.bytes_in_flight * 2 >= cwnd
            return 0
        poor = self._poor_carrier
        if poor and snd_nxt >= next_n:
            self._poor_carrier = False  # such a message left: not an answer worth holding for
        self._data_sent(sent, sent_bytes, limited, poor, now)
        return sent

    def _gathered(self, ptype: int, flags: int, path_id: int, conn_tag: int, seq: int, ack: int, ts: int, echo: int,
                  rwnd: int, body: Gather, sack: tuple[tuple[int, int], ...]) -> Gathered | bytes:
        """``wire.link.encode_fields`` for a :class:`Gather`: its first
        transmission in parts (the payload not copied), a retransmission
        (RETRANSMISSION set) as one packet from the memory read again now
        (see :class:`Gather` for why)."""
        if flags & _RETX:
            return _encode_fields(ptype, flags, path_id, conn_tag, seq, ack, ts, echo, rwnd, body.join(), sack)
        return Gathered(_encode_parts(ptype, flags, path_id, conn_tag, seq, ack, ts, echo, rwnd, body.lead,
                                      body.payload, body.tail, sack, self._crc))

    def _arm_pto(self, now: float) -> None:
        """Start the tail loss probe's timer: 2 x SRTT and the peer's delayed
        ACK from ``now`` (RFC 8985 §7.2), unless the RTO comes first."""
        srtt = self.rtt.srtt_s
        d = self._rto_deadline
        if srtt is None or d is None:
            self._pto_deadline = None
            return
        p = now + 2 * srtt + self._pto_extra
        self._pto_deadline = p if p < d else None

    def _probe_window(self) -> float:
        """The window for a tail loss probe's pass: one packet leaves whatever
        the congestion window (a run's framer sees the real one: the probe
        goes through the loop, alone)."""
        self._tlp_send = False
        cwnd = self.cc.cwnd_bytes
        inflight = self.recovery.bytes_in_flight
        return cwnd if cwnd > inflight else inflight + 1

    def _arm_persist(self, now: float) -> None:
        """The persist timer: the retransmission timer, run while the peer's
        closed window holds back all we have queued and nothing is in
        flight.  Its expiries probe the window and count against the
        retransmission budget (``Link._on_rto``), so a window that stays
        shut fails the link as unacknowledged data would."""
        self._persist = True
        self._rto_deadline = now + self.rtt.rto_s * self._rto_backoff

    def _data_sent(self, count: int, nbytes: int, limited: bool, poor_carrier: bool, now: float) -> None:
        """``count`` DATA packets of ``nbytes`` in all left, carrying our
        ACK (``limited``: the congestion window held more back;
        ``poor_carrier``: one was queued with ``ack_carrier=False``): the
        bookkeeping after every send, by the loop or alone."""
        cc = self.cc
        if self._cc_on_sent:
            cc.on_packet_sent(nbytes, now)
        self._cwnd_limited = limited or self.recovery.bytes_in_flight * 2 >= cc.cwnd_bytes
        self.stats.data_sent += count
        self.receiver.ack_carried(now, poor_carrier)
        if self._rto_deadline is None or self._persist:  # (the persist timer ends: data is in flight)
            self._persist = False
            self._rto_deadline = now + self.rtt.rto_s * self._rto_backoff  # RFC 6298 §5.1
        if not self._tlp_out:
            self._arm_pto(now)  # RFC 8985 §7.2: the probe timer restarts as data leaves

    # --- loss detection's timers and what it found ----------------------------

    def _loss_timers(self, now: float) -> None:
        """The reorder timer (RACK's window has passed: what it now finds
        lost) and the tail loss probe's, if due at ``now``."""
        rec = self.recovery
        if rec.reorder_deadline is not None and now >= rec.reorder_deadline:
            nlost = len(rec.lost)
            lost = rec.detect_lost(now)
            if lost:
                self._found_lost(lost, nlost, now)
                self.pacer.rate_Bps = self.cc.pacing_rate_Bps(self.rtt.srtt_s)
        if self._pto_deadline is not None and now >= self._pto_deadline:
            self._on_pto(now)

    def _found_lost(self, lost: int, nlost: int, now: float) -> None:
        """Loss detection declared ``lost`` bytes lost (``nlost``: the
        retransmission queue's length before): count them, open a recovery
        episode if none is open, tell the congestion controller."""
        rec = self.recovery
        self.stats.fast_retransmits += len(rec.lost) - nlost
        episode = rec.una >= rec.recovery_point
        if episode:
            rec.start_episode(self._snd_nxt)
        self.cc.on_packets_lost(lost, now, episode)

    def _on_pto(self, now: float) -> None:
        """The tail loss probe's timer expired (RFC 8985 §7.3): nothing was
        acknowledged for two round trips with data in flight.  A loss with
        nothing sent behind it (a tail, or a lost retransmission) leaves no
        later packet whose delivery would reveal it: send one packet, new
        data if there is some the peer's window takes, else the last one
        sent again, whatever the congestion window, so its ACK's SACK
        blocks let RACK find the loss; the RTO stays armed behind it.  One
        probe until something is acknowledged."""
        self._pto_deadline = None
        rec = self.recovery
        if self._tlp_out or self._persist or not rec.has_inflight():
            return
        limit = self._next_n
        if limit > rec.una + self.peer_rwnd:
            limit = rec.una + self.peer_rwnd
        if self._snd_nxt >= limit and not rec.probe_last():
            return
        self._tlp_out = True
        self._tlp_send = True
        self.stats.tlp_probes += 1
        if self.pacer.next_send_s > now:
            self.pacer.next_send_s = now

    # --- framing ------------------------------------------------------------

    def _echo(self, now: float) -> int:
        """The echo rule: the ts we last received plus how long we held it."""
        return (self._last_rx_ts + int((now - self._last_rx_time) * 1e6)) & _U32

    def _control(self, ptype: int, flags: int, now: float) -> bytes:
        """A packet without a body (ACK, KEEPALIVE, ABORT) at ``now``."""
        ack, rwnd, sack = self.receiver.feedback()
        return _encode_fields(ptype, flags, self.path_id, self.peer_tag, (self.isn + self._snd_nxt) & _U32, ack,
                              int(now * 1e6) & _U32, self._echo(now), rwnd, b"", sack)

    def _frame_run(self, out: list[Any], n: int, limit: int, now: float, clock: Any, ack: int,
                   rwnd: int) -> tuple[int, int]:
        """First transmission of messages ``n``, ``n + 1``, ... if they are in
        a queued run: as many as the window and the pacer let the send loop
        send, framed in one compiled call into one :class:`Burst` (the same
        bytes as the loop's, a clock read once for the whole run).  Returns
        how many and their bytes; 0 messages: the loop's own code sends
        message ``n``, or decides what holds it back."""
        runs = self._runs
        while runs and runs[0][1] <= n:
            runs.popleft()  # wholly transmitted
        if not runs or runs[0][0] > n:
            return 0, 0
        run = runs[0]
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
        self.recovery.on_sent_run(n, k, full, last_len + wl.OVERHEAD if k == m else full, now)
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

    def _frame_packets(self, buf: bytearray | memoryview, first: int, n: int, k: int, stride: int, last_len: int,
                       now: float, ack: int, rwnd: int, flag_at: int, flag: int, built: int,
                       path: Any = None) -> None:
        """Write the headers and CRCs of DATA packets ``n`` .. ``n + k - 1``
        around their bodies in ``buf`` from ``first`` (``run_slots``'
        layout; bodies ``stride`` bytes, the k-th ``last_len``), in one
        compiled call: the packet at ``flag_at`` carries ``flag``; ``built``
        as for ``Link.send_run``; ``path``: the path of a multi-path link
        they leave on (its id and its echo, ``scheduler.Path``)."""
        f = self._frame
        f.path_id = self.path_id if path is None else path.id
        f.conn_tag = self.peer_tag
        f.seq = (self.isn + n) & _U32
        f.ack = ack
        f.ts = int(now * 1e6) & _U32
        f.echo = self._echo(now) if path is None else path.echo(now)
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
        """:func:`admit` for a run of ``count`` messages to be queued next, on this link's state now."""
        pacer = self.pacer
        rate = pacer.rate_Bps
        return admit(count, stride + wl.OVERHEAD, last_len + wl.OVERHEAD, self.cc.cwnd_bytes,
                     self.recovery.bytes_in_flight, rate, pacer.next_send_s,
                     pacer.floor(now) if rate != INF else 0.0, now)

    # --- alone: sent at once, bookkeeping after -----------------------------

    def _leaves_alone(self, count: int, longest: int, now: float) -> bool:
        """True if ``count`` messages queued next, none longer than
        ``longest`` bytes, would leave first and alone from
        ``bursts_to_send`` now: nothing else queued, lost or owed a SACK
        block, room in the peer's window and in the send buffer (as
        ``send_space`` asks of the owner), and the first of them admitted
        by the send loop's own test (the rest of a run: :func:`admit`)."""
        rec = self.recovery
        end = self._next_n + count
        una = rec.una
        config = self.config
        return (self.state == _ESTABLISHED and not self._out and self._snd_nxt + count == end and not rec.lost
                and not self.receiver.ranges and end <= una + self.peer_rwnd
                and end - una <= config.send_buffer_packets and longest <= config.max_payload
                and rec.bytes_in_flight < self.cc.cwnd_bytes and now >= self.pacer.next_send_s)

    def frame_alone(self, message: bytes | bytearray, now: float, ack_now: bool = True) -> bytes | None:
        """The packet that ``send`` then :meth:`bursts_to_send` would
        send for ``message`` right now, if it would be the only one; else
        None.  Changes nothing but the record of the receive window the
        packet advertises: the caller sends the packet and then calls
        :meth:`sent_alone` with it, so the link's bookkeeping comes after
        the datagram has left (a ping-pong's peer waits on the datagram,
        not on the bookkeeping)."""
        if not self._leaves_alone(1, len(message), now):
            return None
        rx = self.receiver  # no SACK blocks to carry: _leaves_alone saw no ranges
        # ACK_NOW as the usual path sets it on the last message queued (with
        # every earlier one sent, the flag of a queued message has gone out);
        # the ACK field and the echo rule (_echo) written out: a ping-pong's every message
        return _encode_fields(_DATA, _ACK_NOW if ack_now else 0, self.path_id, self.peer_tag,
                              (self.isn + self._next_n) & _U32, (rx.peer_isn + rx.rcv_nxt) & _U32,
                              int(now * 1e6) & _U32, (self._last_rx_ts + int((now - self._last_rx_time) * 1e6)) & _U32,
                              rx.advertise(), message, ())

    def sent_alone(self, message: bytes | bytearray, size: int, now: float, ack_carrier: bool = True) -> int:
        """``message`` left in the packet :meth:`frame_alone` returned, of
        ``size`` bytes: the bookkeeping of ``send`` and
        :meth:`bursts_to_send` for it.  Returns its number."""
        n = self._next_n
        rec = self.recovery
        rec.add(n, message)
        rec.on_sent(n, size, False, now)
        self.pacer.on_sent(size, now)
        # the queue as send() then the send loop leave it: all sent
        self._next_n = self._snd_nxt = n + 1
        self._pace_deadline = None
        poor = not ack_carrier or self._poor_carrier
        self._poor_carrier = False
        self.stats.datagrams_sent += 1
        self._data_sent(1, size, False, poor, now)
        return n

    def frame_run_alone(self, buf: bytearray | memoryview, stride: int, count: int, last_len: int, built: int,
                        now: float) -> memoryview | None:
        """As :meth:`frame_alone` for a run: the packets that ``send_run``
        then :meth:`bursts_to_send` would send for the run in ``buf`` right
        now, if they would be all that leaves and all of it leaves; else
        None.  The framer writes their headers and CRCs into ``buf``, and
        nothing else changes but the record of the advertised window: the
        caller sends the view returned and then calls
        :meth:`sent_run_alone`, so the bookkeeping of a ping-pong's message
        of several datagrams comes after they have left."""
        if (self._framer is None
                or not self._leaves_alone(count, stride if count > 1 and stride > last_len else last_len, now)
                or count > 1 and self._admit_run(stride, count, last_len, now)[0] != count):
            return None
        rx = self.receiver
        # ACK_NOW on the last, as on the last message queued
        self._frame_packets(buf, 0, self._next_n, count, stride, last_len, now, (rx.peer_isn + rx.rcv_nxt) & _U32,
                            rx.advertise(), count - 1, _ACK_NOW, built)
        full = stride + wl.OVERHEAD
        return memoryview(buf)[:(count - 1) * full + last_len + wl.OVERHEAD].toreadonly()

    def sent_run_alone(self, buf: bytearray | memoryview, stride: int, count: int, last_len: int, now: float,
                       ack_carrier: bool = True) -> int:
        """The run :meth:`frame_run_alone` framed has left: the bookkeeping
        of ``send_run`` and :meth:`bursts_to_send` for it.  Returns its
        first message's number."""
        _, nxt, total = self._admit_run(stride, count, last_len, now)  # as framed: nothing has moved since
        n = self._next_n
        rec = self.recovery
        full = stride + wl.OVERHEAD
        rec.add_run(n, count, memoryview(buf), stride, last_len, wl.HEADER_LEN, full)  # run_slots(stride)
        rec.on_sent_run(n, count, full, last_len + wl.OVERHEAD, now)
        self.pacer.next_send_s = nxt
        runs = self._runs
        while runs and runs[0][1] <= n:
            runs.popleft()  # sent before: let go, as bursts_to_send does
        self.framed_datagrams += count
        # the queue as send_run() then the send loop leave it: all sent
        self._next_n = self._snd_nxt = n + count
        self._pace_deadline = None
        poor = not ack_carrier or self._poor_carrier
        self._poor_carrier = False
        self.stats.datagrams_sent += count
        self._data_sent(count, total, False, poor, now)
        return n
