"""The link's timers: when it must be woken, and what each deadline does (a mixin of Link).

Theory of operation
-------------------
A link is woken at the earliest of its deadlines (``next_deadline``):
silence (``dead_peer_s``), keep-alive, the retransmission timer, the tail
loss probe and the RACK reorder timer (``builder.py``, ``recovery.py``), the
delayed ACK (``receiver.py``), pacing, an unproven restart claim's probe
(``handshake.py``), the path-MTU search (``pmtud.py``), or, while opening,
the handshake's retransmission.  ``timer_fired`` handles every deadline
that has passed.  The RTO's budget is the link's promise that it never
hangs: see ``_on_rto`` and the module docstring of ``link.py``.
"""

from __future__ import annotations

from typing import Any

from ..wire import link as wl
from .congestion.base import INF
from .records import LinkState

_KEEPALIVE = wl.PacketType.KEEPALIVE
_ACK_NOW = int(wl.LinkFlags.ACK_NOW)
_ESTABLISHED = LinkState.ESTABLISHED


class Timers:
    """Deadlines and their handlers (needs the link's state; see the module docstring)."""

    config: Any
    stats: Any
    state: LinkState
    receiver: Any
    recovery: Any
    rtt: Any
    cc: Any
    pacer: Any
    _out: Any
    _claim: Any
    _hs_deadline: float | None
    _hs_tries: int
    _last_heard: float
    _last_keepalive: float
    _rto_deadline: float | None
    _pto_deadline: float | None
    _pace_deadline: float | None
    _pmtu_deadline: float | None
    _tlp_out: bool
    _persist: bool
    _rto_backoff: float
    _consecutive_rto: int
    _next_n: int

    # and the link's _fail (link.py), _send_handshake, _probe_restart (handshake.py),
    # _control, _loss_timers (builder.py), _pmtud_timer, _pmtud_rto (pmtud.py)

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
            d = self._pto_deadline
            if d is not None and d < t:
                t = d
            d = self.recovery.reorder_deadline
            if d is not None and d < t:
                t = d
            d = self.receiver.ack_deadline
            if d is not None and d < t:
                t = d
            d = self._pace_deadline
            if d is not None and d < t:
                t = d
            if self._claim is not None and self._claim[2] < t:
                t = self._claim[2]
            d = self._pmtu_deadline
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
        claim = self._claim
        if claim is not None and now >= claim[2]:
            if now >= claim[1]:
                self._fail(claim[0])  # nothing of the old association answered: the claim holds
                return
            self._probe_restart(now)
        if now >= max(self._last_heard, self._last_keepalive) + c.keepalive_idle_s:
            self._last_keepalive = now
            self._out.append(self._control(_KEEPALIVE, _ACK_NOW, now))
            self.stats.keepalives_sent += 1
        rx = self.receiver
        if rx.ack_deadline is not None and now >= rx.ack_deadline:
            rx.ack_now = True
        self._loss_timers(now)
        if self._rto_deadline is not None and now >= self._rto_deadline:
            self._on_rto(now)
        if self._pmtu_deadline is not None and now >= self._pmtu_deadline:
            self._pmtud_timer(now)

    def _on_rto(self, now: float) -> None:
        """The retransmission timer expired: the cumulative ACK has not moved
        for an RTO while data waited on the peer.  ``max_retransmits``
        expiries in a row fail the link, whatever the peer says meanwhile: a
        peer that answers but acknowledges nothing is no better than a
        silent one."""
        self._rto_deadline = None
        rtt = self.rtt
        if self.recovery.una >= self._next_n:
            return  # nothing waits on the peer after all
        if self._consecutive_rto >= self.config.max_retransmits:
            self._fail("retransmit_budget")
            return
        self._consecutive_rto += 1
        # RFC 6298 §5.5, up to max_rto_s (§2.5 allows a maximum): the budget
        # then lasts at most (max_retransmits + 1) * max_rto_s.
        backoff = self._rto_backoff * 2
        self._rto_backoff = backoff if rtt.rto_s * backoff <= rtt.max_rto_s else max(1.0, rtt.max_rto_s / rtt.rto_s)
        self.stats.rto_count += 1
        self._pto_deadline = None
        self._tlp_out = False
        self._pmtud_rto(now)  # a black hole? (pmtud.py)
        if not self.recovery.on_rto():
            # Nothing to resend: the peer's closed window holds our data back
            # (the persist timer).  Ask for the window: the answer to a
            # KEEPALIVE carries it (RFC 9293 §3.8.6.1's probe, without data).
            self._persist = True
            self._rto_deadline = now + rtt.rto_s * self._rto_backoff
            self._out.append(self._control(_KEEPALIVE, _ACK_NOW, now))
            self.stats.keepalives_sent += 1
            return
        self.cc.on_rto(now)
        self.pacer.rate_Bps = self.cc.pacing_rate_Bps(rtt.srtt_s)
        self.pacer.next_send_s = -INF  # the retransmission leaves at once (§5.4)
