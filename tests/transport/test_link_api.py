"""The names the daemon imports from ``transport.link`` stay there, whichever module defines them."""

from __future__ import annotations

import inspect

from udpverbs.transport import builder, link, receiver, records


def test_link_exports_what_the_daemon_imports() -> None:
    for name in ("Burst", "Link", "LinkConfig", "LinkFailed", "LinkState", "LinkUp", "LinkClosed", "LinkStats",
                 "LinkEvent", "one_per_datagram", "run_slots", "admit"):
        assert name in link.__all__ and hasattr(link, name), name
    assert link.Burst is builder.Burst and link.LinkStats is records.LinkStats


def test_the_link_keeps_its_public_methods() -> None:
    for name in ("connect", "close", "send", "send_run", "quiet", "frame_alone", "sent_alone", "frame_run_alone",
                 "sent_run_alone", "bursts_to_send", "datagrams_to_send", "datagram_received", "drain_received",
                 "run_receivable", "data_run_received", "next_deadline", "timer_fired", "next_event", "send_space"):
        assert callable(getattr(link.Link, name)), name
    params = list(inspect.signature(link.Link).parameters)
    assert params == ["config", "rng", "incarnation", "path_id", "framer"]
    assert isinstance(inspect.getattr_static(link.Link, "rcv_nxt"), property)
    assert issubclass(link.Link, builder.Builder) and receiver.Receiver.__slots__
