"""The records a link's owner handles: its tunables, state, events and counters.

Theory of operation
-------------------
Plain data, apart from ``link.Link`` so that every part of the link
(``builder.py``, ``link.py``) and its owner can name them without importing
the state machine.  ``LinkConfig`` is read, never changed, by a link;
``LinkStats`` only grows; an event is popped once by ``Link.next_event``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any

from ..wire import link as wl


class LinkState(enum.IntEnum):
    """Where a link is in its life (see ``link.py`` for the handshake)."""

    IDLE = 0  #: created, nothing sent or received
    INIT_SENT = 1  #: active open, waiting for INIT_ACK
    INIT_RECEIVED = 2  #: peer's tag known, waiting for proof the peer knows ours
    ESTABLISHED = 3
    CLOSED = 4  #: close() called
    FAILED = 5  #: sticky; see the LinkFailed event for the reason



@dataclass(frozen=True)
class LinkUp:
    """The link is established; ``peer_incarnation`` identifies the peer's daemon run."""

    peer_incarnation: int


@dataclass(frozen=True)
class LinkFailed:
    """The link is dead for good: ``handshake_timeout``, ``retransmit_budget``,
    ``dead_peer``, ``peer_restarted`` (INIT with a new incarnation, and the
    old association silent), ``peer_reset`` (INIT with the same incarnation
    but a new tag: the peer dropped the link; proven the same way) or
    ``abort_received``."""

    reason: str


@dataclass(frozen=True)
class LinkClosed:
    """``close()`` was called; an ABORT went to the peer."""


@dataclass(frozen=True)
class PathMtu:
    """Path MTU discovery (``pmtud.py``) changed the largest message the
    owner should queue, ``payload`` (a link body: ``Link.payload_limit``),
    or ended a search below ``LinkConfig.max_payload``.  ``state``: the
    search's state (``PmtudState`` name); ``path_max``: the largest body
    it may find, ours and the peer's ``max_payload`` (INIT / INIT_ACK)."""

    payload: int
    state: str
    path_max: int


@dataclass(frozen=True)
class PathChanged:
    """Path ``path`` of a multi-path link (``paths.py``) went to ``state``
    (``"probing"``, ``"up"`` or ``"down"``); ``reason`` says why
    (``"added"``, ``"answered"``, ``"silent"``)."""

    path: int
    state: str
    reason: str


LinkEvent = LinkUp | LinkFailed | LinkClosed | PathMtu | PathChanged


@dataclass
class LinkConfig:
    """Tunables of one link.  Defaults suit a data-centre or loopback path
    (RTT 20 µs - 1 ms)."""

    #: largest message (link body); 1472-byte UDP payloads by default
    max_payload: int = 1472 - wl.OVERHEAD
    #: path MTU discovery (``pmtud.py``): the body every path is assumed to
    #: carry, where the link starts and searches up to ``max_payload``
    #: from; 0: no discovery, every path carries ``max_payload``
    base_payload: int = 0
    #: ...and the body it falls to when a path does not carry even that
    #: (0: ``base_payload``)
    min_payload: int = 0
    #: receive window in packets (buffered out of order + undrained)
    rwnd_packets: int = 256
    #: messages the owner may queue beyond ``acked`` (send_space bound)
    send_buffer_packets: int = 512
    ack_every: int = 2
    max_ack_delay_s: float = 200e-6
    initial_rto_s: float = 0.05
    min_rto_s: float = 0.004
    max_rto_s: float = 2.0
    #: retransmission timeouts in a row without the cumulative ACK moving
    #: before LinkFailed("retransmit_budget"); each waits the RTO, doubled
    #: every time and at most ``max_rto_s``.  The timer runs whenever data
    #: waits on the peer: sent and unacknowledged, or held back by its
    #: closed window (then each timeout probes the window).
    max_retransmits: int = 10
    #: INIT / INIT_ACK retransmissions before LinkFailed("handshake_timeout")
    max_init_retransmits: int = 8
    #: RTOs a restart claimed by an INIT waits for the old association to answer a probe
    restart_probes: int = 3
    keepalive_idle_s: float = 1.0
    dead_peer_s: float = 5.0
    #: packets sent after a loss before it is declared lost (RFC 9002 §6.1.1),
    #: until the path has shown reordering (then RACK's time rule alone, RFC 8985)
    reorder_threshold: int = 3
    #: tail loss probes (RFC 8985 §7): a packet two SRTTs after the last
    #: progress, so a tail loss is found by RACK, not the RTO
    tlp: bool = True
    cc: str = "efe"
    cc_params: dict[str, Any] = field(default_factory=dict)
    #: burst the pacer allows after idle, in packets...
    pacing_burst_packets: float = 2.0
    #: ...or in time at the pacing rate, if that is more (see pacer.py)
    pacing_burst_s: float = 0.0
    #: a path of a multi-path link (``paths.py``) that hears nothing for
    #: this long while something it carried waits for an answer is down:
    #: what it carried is sent again on the others
    path_dead_s: float = 1.0
    #: how often a down path is probed (it is up again when answered)
    path_probe_s: float = 0.25


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
    bad_ack: int = 0  #: ACK for data never sent (the packet is dropped)
    bad_seq: int = 0  #: sequence number far outside the receive window (the packet is dropped)
    bad_sack: int = 0  #: SACK block outside what is in flight (the packet is dropped)
    bad_init: int = 0  #: INIT/INIT_ACK inconsistent with the peer we know
    retransmits: int = 0
    fast_retransmits: int = 0  #: packets declared lost from SACK information (RACK)
    rto_count: int = 0
    tlp_probes: int = 0  #: tail loss probes sent (a packet to draw an ACK, instead of waiting for the RTO)
    keepalives_sent: int = 0
    ack_holds_expired: int = 0  #: ACK_NOW ACKs held for an answer that did not come in time
    pmtu_probes_sent: int = 0  #: path MTU probes sent (pmtud.py)
    pmtu_probes_acked: int = 0  #: ...answered by the peer: that size is carried
    pmtu_probes_lost: int = 0  #: ...unanswered within the retransmission timeout
    pmtu_probes_answered: int = 0  #: the peer's probes answered
    pmtu_too_big: int = 0  #: datagrams the local stack refused as too big (EMSGSIZE)
    pmtu_black_holes: int = 0  #: times larger messages stopped getting through: back to the base size

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class PathStats:
    """One path of a link, as ``Link.path_stats`` reports it (``paths.py``)."""

    path: int
    state: str  #: "probing", "up" or "down"
    datagrams_sent: int = 0
    bytes_sent: int = 0
    datagrams_received: int = 0
    bytes_received: int = 0
    retransmissions: int = 0  #: DATA packets sent on it again (lost on it or elsewhere)
    srtt_s: float | None = None
    min_rtt_s: float | None = None
    cwnd_bytes: float = 0.0
    pacing_rate: float = 0.0  #: bytes/s (inf: unpaced)
    times_down: int = 0
    plpmtu: int = 0  #: the largest link body known to cross it
