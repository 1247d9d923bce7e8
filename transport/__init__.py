"""udpverbs.transport: sans-IO reliable, congestion-controlled links between daemons.

Theory of operation
-------------------
``link.Link`` is the connection's core (handshake, states, input, ACK
processing, timers, events); ``receiver`` its receive side and ACK policy,
``builder`` the datagrams it sends, ``records`` its config, state, events
and counters.  ``recovery`` holds the RTT estimator, sent-packet table and
loss detection, ``congestion/`` the pluggable controllers (``efe``,
``efe-host``, ``aimd``, ``fixed``), ``pacer`` the release clock,
``ackhold`` the rule for holding an ACK for an answer, ``netsim`` a
deterministic simulator that drives real Links, and ``impair`` the model of
a bad network that ``udpverbsd --impair`` puts in front of its socket.  Each module imports only
those before it in ``tests/test_layering.py``'s ``TRANSPORT_ORDER``.  Nothing here
reads a clock or touches a socket: time comes in as ``now``.
"""

from .link import (
    Link, LinkClosed, LinkConfig, LinkEvent, LinkFailed, LinkState, LinkStats, LinkUp,
)

__all__ = ["Link", "LinkClosed", "LinkConfig", "LinkEvent", "LinkFailed", "LinkState",
           "LinkStats", "LinkUp"]
