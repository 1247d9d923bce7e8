"""The congestion-controller interface and the registry of implementations.

Theory of operation
-------------------
A :class:`transport.link.Link` owns one controller.  The link tells it what
happened (bytes sent, bytes newly acknowledged together with the RTT sample
that acknowledgement carried, bytes declared lost, a retransmission timeout)
and reads back two numbers: ``cwnd_bytes`` (how many bytes may be in flight)
and ``pacing_rate_Bps(srtt_s)`` (how fast they may leave).  Controllers never
see packets, sequence numbers or clocks of their own, only ``now`` floats, so
they are as deterministic as the link (the aioquic split between
``recovery`` and ``congestion``).

Loss detection and its timers are the link's (``recovery.py``: RACK and
the tail loss probe); a controller hears of losses found and of recovery
episodes.  Callbacks are per ACK, not per packet (``on_packets_acked`` receives the sum
of bytes one ACK newly acknowledged): the link runs in Python once per
datagram and every call counts.

Implementations register under a name (``"efe"``, ``"aimd"``, ``"fixed"``)
and :func:`create` builds one from ``LinkConfig.cc`` and ``cc_params``.
"""

from __future__ import annotations

import abc
from typing import Any, Callable

INF = float("inf")


class CongestionController(abc.ABC):
    """Abstract congestion controller; subclasses set ``cwnd_bytes``.

    Args:
        mss: the largest link packet in bytes (one "packet" of window).
        params: implementation-specific tunables (unknown keys raise TypeError).
    """

    name = "abstract"

    def __init__(self, mss: int, **params: Any) -> None:
        if params:
            raise TypeError(f"{type(self).__name__}: unknown parameters {sorted(params)}")
        self.mss = mss
        self.cwnd_bytes: float = 10.0 * mss

    def on_packet_sent(self, size: int, now: float) -> None:  # noqa: B027 - optional hook
        """``size`` bytes of DATA left at ``now`` (new or retransmitted).

        Called once per burst (one ``datagrams_to_send``), not per packet,
        to keep the per-packet path lean.
        """

    @abc.abstractmethod
    def on_packets_acked(self, acked_bytes: int, rtt_s: float | None, now: float, limited: bool = True) -> None:
        """One ACK newly acknowledged ``acked_bytes`` (cumulatively or by SACK).

        ``rtt_s`` is the RTT sample that ACK carried (timestamp echo), or
        None.  ``limited``: the window was what limited the sender; if not,
        the window must not grow (RFC 7661), but the bytes were delivered.
        """

    @abc.abstractmethod
    def on_packets_lost(self, lost_bytes: int, now: float, episode: bool = True) -> None:
        """Loss detection declared ``lost_bytes`` lost.

        ``episode``: these losses start a recovery episode (RFC 6675: the
        first loss after everything sent before the previous episode began
        was acknowledged); a window reduction belongs to an episode, the
        losses within it are one congestion event (RFC 5681 §3.2's "once per
        window").
        """

    @abc.abstractmethod
    def on_rto(self, now: float) -> None:
        """The retransmission timer expired: the path may be gone or badly congested."""

    def pacing_rate_Bps(self, srtt_s: float | None) -> float:
        """Bytes per second the pacer lets out; ``INF`` means unpaced."""
        return INF


_REGISTRY: dict[str, type[CongestionController]] = {}

_C = Callable[[type[CongestionController]], type[CongestionController]]


def register(name: str) -> _C:
    """Class decorator: make a controller available to :func:`create` as ``name``."""

    def deco(cls: type[CongestionController]) -> type[CongestionController]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def create(name: str, mss: int, params: dict[str, Any] | None = None) -> CongestionController:
    """Build the controller registered as ``name``.

    Raises:
        ValueError: no controller has that name.
        TypeError: ``params`` holds a key the controller does not take.
    """
    # Importing the implementations registers them (late, to avoid a cycle).
    from . import aimd, efe, fixed  # noqa: F401

    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown congestion controller {name!r}; have {sorted(_REGISTRY)}") from None
    return cls(mss, **(params or {}))


def names() -> list[str]:
    """Names of the registered controllers."""
    from . import aimd, efe, fixed  # noqa: F401

    return sorted(_REGISTRY)
