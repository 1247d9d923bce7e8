"""udpverbs.transport: sans-IO reliable, congestion-controlled links between daemons.

Theory of operation
-------------------
``link.Link`` is the state machine (handshake, sequence/ACK/SACK, delivery,
keep-alive), ``recovery`` holds the RTT estimator, sent-packet table and
loss detection, ``congestion/`` the pluggable controllers (``efe``,
``efe-host``, ``aimd``, ``fixed``), ``pacer`` the release clock, and
``netsim`` a deterministic simulator that drives real Links.  Nothing here
reads a clock or touches a socket: time comes in as ``now``.
"""

from .link import (
    Link, LinkClosed, LinkConfig, LinkEvent, LinkFailed, LinkState, LinkStats, LinkUp,
)

__all__ = ["Link", "LinkClosed", "LinkConfig", "LinkEvent", "LinkFailed", "LinkState",
           "LinkStats", "LinkUp"]
