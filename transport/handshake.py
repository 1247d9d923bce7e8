"""The link's handshake: INIT, INIT_ACK, the passive side's cookie, and an unproven restart claim.

Theory of operation
-------------------
A mixin of :class:`transport.link.Link` (as the daemon's QP roles are of
``QueuePair``): the state, timers and output queue are the link's, and the
link's module docstring tells the handshake's rules.  Here are the packets
that open a link (INIT while the peer is unknown, INIT_ACK once it is; an
INIT sent again with the cookie a passive daemon answered with), what the
peer's INIT body teaches, and what an INIT that contradicts it does to an
established link: it is a claim that the peer restarted, believed only when
a probe with the old tag goes unanswered (``restart_probes`` RTOs).
"""

from __future__ import annotations

from typing import Any

from ..wire import link as wl
from ..wire.errors import WireError
from .records import LinkState, LinkUp

_U32 = 0xFFFFFFFF
_INIT = wl.PacketType.INIT
_INIT_ACK = wl.PacketType.INIT_ACK
_KEEPALIVE = wl.PacketType.KEEPALIVE
_ACK_NOW = int(wl.LinkFlags.ACK_NOW)
_ESTABLISHED = LinkState.ESTABLISHED
_encode_fields = wl.encode_fields


class Handshake:
    """Opening the link and judging INITs (needs the link's state; see the module docstring)."""

    config: Any
    stats: Any
    state: LinkState
    tag: int
    isn: int
    incarnation: int
    path_id: int
    peer_tag: int
    peer_incarnation: int | None
    peer_max_payload: int
    peer_rwnd: int
    local_addresses: tuple[tuple[str, int], ...]
    peer_addresses: tuple[tuple[str, int], ...]
    receiver: Any
    rtt: Any
    cc: Any
    _out: Any
    _events: Any
    _cookie: bytes
    _claim: Any
    _hs_deadline: float | None
    _hs_tries: int

    # and the link's _fail, _heard, _rtt_sample (link.py), _echo, _control (builder.py),
    # _pmtud_start (pmtud.py)

    def _init_body(self, cookie: bytes = b"") -> bytes:
        c = self.config
        return wl.encode_init(wl.LinkInit(self.tag, self.isn, c.max_payload,
                                          min(c.rwnd_packets, 0xFFFF), self.incarnation, cookie,
                                          self.local_addresses))

    def _handshake_packet(self, ptype: int, now: float) -> bytes:
        # INIT goes to an unknown tag (0) and echoes nothing; INIT_ACK
        # answers an INIT, so it is addressed with the peer's tag and echoes.
        init = ptype == _INIT
        return _encode_fields(ptype, 0, self.path_id, 0 if init else self.peer_tag, self.isn, 0,
                              int(now * 1e6) & _U32, 0 if init else self._echo(now),
                              min(self.config.rwnd_packets, 0xFFFF), self._init_body(self._cookie if init else b""))

    def _send_handshake(self, now: float) -> None:
        # INIT while we do not know the peer; INIT_ACK (which also carries our
        # tag and ISN) once we do.  Retransmitted with back-off by the timer.
        ptype = _INIT if self.state == LinkState.INIT_SENT else _INIT_ACK
        self._out.append(self._handshake_packet(ptype, now))
        self._hs_deadline = now + self.config.initial_rto_s * (1 << self._hs_tries)

    def _learn_peer(self, init: wl.LinkInit, is_init: bool, now: float) -> bool:
        """Record the peer's INIT body; False if it contradicts what we know."""
        if self.peer_incarnation is not None:
            if init.incarnation != self.peer_incarnation:
                self._claim_restart("peer_restarted", now)
                return False
            if init.tag != self.peer_tag or init.isn != self.peer_isn:
                if is_init:
                    # Same daemon run, new tag: the peer dropped its end of
                    # the link (it failed there) and opens afresh, or so
                    # the INIT says.  If so our state is stale; the owner
                    # builds a new Link for the next INIT.
                    self._claim_restart("peer_reset", now)
                else:
                    self.stats.bad_init += 1
                return False
            return True
        if init.tag == 0:
            self.stats.bad_init += 1
            return False
        self.peer_tag = init.tag
        self.receiver.peer_isn = init.isn
        self.peer_incarnation = init.incarnation
        self.peer_max_payload = min(init.max_payload, self.config.max_payload)
        self.peer_rwnd = init.rwnd
        self.peer_addresses = init.addresses
        return True

    def _claim_restart(self, reason: str, now: float) -> None:
        # An unproven claim (see the module docstring): only an established
        # link has an old association to ask; before, fail as the claim says.
        self.stats.bad_init += 1
        if self.state != _ESTABLISHED:
            self._fail(reason)
        elif self._claim is None:
            rto = self.rtt.rto_s
            self._claim = (reason, now + self.config.restart_probes * rto, now)
            self._probe_restart(now)

    def _probe_restart(self, now: float) -> None:
        assert self._claim is not None
        reason, deadline, _ = self._claim
        self._claim = (reason, deadline, now + self.rtt.rto_s)
        self._out.append(self._control(_KEEPALIVE, _ACK_NOW, now))
        self.stats.keepalives_sent += 1

    def _establish(self, now: float) -> None:
        self.state = LinkState.ESTABLISHED
        self._hs_deadline = None
        self._hs_tries = 0
        self._events.append(LinkUp(self.peer_incarnation or 0))
        if self.config.base_payload:
            self._pmtud_start(now)  # the peer's largest body is known: path MTU discovery (pmtud.py)

    def _cookie_received(self, body: memoryview, now: float) -> None:
        # The passive daemon keeps nothing until our INIT echoes its cookie:
        # send it again at once, with the cookie (the timer goes on as it was).
        if self.state != LinkState.INIT_SENT:
            self.stats.unexpected += 1
            return
        try:
            self._cookie = wl.decode_cookie_untrusted(body)
        except WireError:
            self.stats.malformed += 1
            return
        self._out.append(self._handshake_packet(_INIT, now))

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
            if not self._learn_peer(init, True, now):
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
        if not self._learn_peer(init, False, now):
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
        self.receiver.ack_now = True
