"""``Link.frame_alone`` and ``Link.sent_alone`` against ``send`` then ``bursts_to_send``.

A daemon sends a ping-pong's message the moment it is queued, and does the
link's bookkeeping after the datagram has left (``PeerLink.send_alone``).
That is only allowed where the usual path would have sent exactly that one
packet at that time.  Twin pairs of links get the same random traffic (sizes,
ACK_NOW or not, requests, loss, delays, timers), one sending through the
usual path only, the other trying ``frame_alone`` first: every datagram
either sends and the whole state of both links must stay equal.
"""

from __future__ import annotations

import random
from typing import Any, Callable

import pytest
from hypothesis import event, given, settings, strategies as st

from udpverbs.transport.link import Link, LinkConfig, run_slots
from udpverbs.wire import native

from .test_link_timers import D, establish, feed

#: attributes that hold no state of the protocol (or cannot be compared)
_SKIP = {"config", "rng", "_rng"}


def _state(obj: Any, depth: int = 0) -> Any:
    """A comparable copy of ``obj``'s state, following attributes."""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return bytes(obj)
    if isinstance(obj, (int, float, str, type(None), bool)):
        return obj
    if isinstance(obj, dict):
        return {k: _state(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) or type(obj).__name__ == "deque":
        return [_state(v, depth + 1) for v in obj]
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        names += [n for n in getattr(cls, "__slots__", ()) if hasattr(obj, n)]
    if depth > 6 or not names:
        return repr(type(obj))
    return {n: _state(getattr(obj, n), depth + 1) for n in names if n not in _SKIP}


def _pair(seed: int, framer: Any = None) -> tuple[Link, Link]:
    # A small window and buffers, and keep-alives within a few steps: every
    # reason for a message not to leave alone comes up.
    c = LinkConfig(initial_rto_s=0.05, min_rto_s=0.01, max_rto_s=1.0, max_retransmits=50, keepalive_idle_s=0.003,
                   dead_peer_s=30.0, max_ack_delay_s=0.0002, cc="efe", send_buffer_packets=12, rwnd_packets=6)
    return (Link(c, rng=random.Random(seed), incarnation=1, framer=framer),
            Link(c, rng=random.Random(seed + 1), incarnation=2, framer=framer))


Send = Callable[[Link, Link, float, random.Random], tuple[list[bytes], list[bytes], int]]


def _twins_agree(seed: int, steps: int, send: Send, framer: Any = None) -> int:
    """Drive twin pairs of links with the same random traffic, ``send``
    queueing each step's messages on one side's twins (the usual path on
    the first, the path under test on the second) and returning what each
    sent and how many went alone; after every step both twins must have
    sent the same datagrams and be in the same state.  Returns how many
    went alone."""
    plain, alone = _pair(seed, framer), _pair(seed, framer)
    t = establish(*plain)
    assert establish(*alone) == t
    rng = random.Random(seed)
    in_flight: list[tuple[float, int, bytes]] = []  # (arrival, to which side, datagram): the same for both twins
    sent_alone = 0
    for step in range(steps):
        t += rng.choice((1e-6, 1e-6, 20e-6, D, 3 * D, 10 * D))
        # deliver what has arrived (to a: 0, to b: 1), through both twins
        due = [x for x in in_flight if x[0] <= t]
        in_flight = [x for x in in_flight if x[0] > t]
        for _, side, d in sorted(due, key=lambda x: x[0]):
            feed(plain[side], [d], t)
            feed(alone[side], [d], t)
        if rng.random() < 0.7:  # the application takes what was delivered (else the window closes)
            for link in (*plain, *alone):
                link.drain_received()
        for link in (*plain, *alone):
            dl = link.next_deadline()
            if dl is not None and dl <= t:
                link.timer_fired(t)
        for side in (0, 1):
            lp, la = plain[side], alone[side]
            out_plain, out_alone, went = send(lp, la, t, rng)
            sent_alone += went
            out_plain += [bytes(x) for x in lp.datagrams_to_send(t)]
            out_alone += [bytes(x) for x in la.datagrams_to_send(t)]
            assert out_plain == out_alone, f"step {step}"
            for d in out_plain:
                if rng.random() >= 0.1:  # 10% loss
                    in_flight.append((t + D * rng.choice((1, 1, 1, 3)), 1 - side, d))
            assert _state(lp) == _state(la), f"step {step}"
    return sent_alone


def _send_messages(lp: Link, la: Link, t: float, rng: random.Random) -> tuple[list[bytes], list[bytes], int]:
    out_plain: list[bytes] = []
    out_alone: list[bytes] = []
    went = 0
    for _ in range(rng.choice((0, 0, 1, 1, 1, 2, 3, 6))):
        if lp.send_space() == 0:
            break
        message = bytearray(rng.randbytes(rng.choice((2, 40, 1000, 1400))))
        ack_now, carrier = rng.random() < 0.7, rng.random() < 0.8
        lp.send(message, t, ack_now, carrier)
        d = la.frame_alone(message, t, ack_now)
        if d is None:
            la.send(message, t, ack_now, carrier)
        else:
            out_alone.append(d)
            assert la.sent_alone(message, len(d), t, carrier) == lp.next_n - 1
            went += 1
            # the usual path sends that packet, and only it, now
            out_plain += [bytes(x) for x in lp.datagrams_to_send(t)]
            assert out_plain[-1:] == [d]
    return out_plain, out_alone, went


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), steps=st.integers(20, 120))
def test_sending_alone_leaves_the_link_as_the_usual_path_does(seed: int, steps: int) -> None:
    sent_alone = _twins_agree(seed, steps, _send_messages)
    event(f"sent alone: {min(sent_alone, 10) // 5 * 5}+")  # ``pytest --hypothesis-show-statistics``


def test_a_ping_pong_sends_every_message_alone() -> None:
    a, b = _pair(3)
    t = establish(a, b)
    for i in range(20):
        for src, dst in ((a, b), (b, a)):
            d = src.frame_alone(b"x" * 8, t)
            assert d is not None, f"exchange {i}"
            src.sent_alone(b"x" * 8, len(d), t)
            assert src.datagrams_to_send(t) == []
            t += D
            feed(dst, [d], t)
            assert dst.drain_received() == [b"x" * 8]
            t += 20e-6
    assert a.recovery.una == 20 and b.recovery.una == 19  # each answer carried the ACK of the message before it


def test_nothing_goes_alone_past_what_is_queued_or_held_back() -> None:
    a, b = _pair(5)
    t = establish(a, b)
    a.send(b"first", t)
    assert a.frame_alone(b"second", t) is None  # "first" is queued: it leaves first
    a.datagrams_to_send(t)
    for _ in range(a.config.send_buffer_packets):  # fill the congestion window (bounded by the send buffer)
        if a.recovery.bytes_in_flight >= a.cc.cwnd_bytes:
            break
        a.send(b"y" * 1400, t)
        a.datagrams_to_send(t)
    assert a.recovery.bytes_in_flight >= a.cc.cwnd_bytes
    assert a.frame_alone(b"z", t) is None  # the window is full
    assert b.frame_alone(b"w" * (b.config.max_payload + 1), t) is None  # too long for a packet


def _run(rng: random.Random, count: int) -> tuple[bytearray, int, int]:
    """A run of ``count`` messages as the send lane lays it out (each where
    its packet will be: ``run_slots``): the buffer, the stride, the last's length."""
    stride = rng.choice((40, 600, 1400))
    last_len = rng.randint(1, stride)
    head, slot = run_slots(stride)
    buf = bytearray(rng.randbytes((count - 1) * slot + slot - stride + last_len))
    return buf, stride, last_len


def _send_runs(lp: Link, la: Link, t: float, rng: random.Random) -> tuple[list[bytes], list[bytes], int]:
    out_plain: list[bytes] = []
    out_alone: list[bytes] = []
    went = 0
    for _ in range(rng.choice((0, 1, 1, 1, 2, 3))):
        space = lp.send_space()
        if space == 0:
            break
        carrier = rng.random() < 0.8
        if rng.random() < 0.3:  # a message of its own between the runs
            message = bytearray(rng.randbytes(rng.choice((2, 40, 1000))))
            lp.send(message, t, True, carrier)
            la.send(message, t, True, carrier)
            continue
        count = rng.randint(1, min(space, 5))
        buf, stride, last_len = _run(rng, count)
        lp.send_run(bytearray(buf), stride, count, last_len, carrier)
        view = la.frame_run_alone(buf, stride, count, last_len, 0, t)
        if view is None:
            la.send_run(buf, stride, count, last_len, carrier)
            continue
        packets = bytes(view)
        assert la.sent_run_alone(buf, stride, count, last_len, t, carrier) == lp.next_n - count
        went += 1
        # the usual path sends those packets, and only them, now
        got = [bytes(x) for x in lp.datagrams_to_send(t)]
        assert b"".join(got) == packets and len(got) == count
        out_plain += got
        out_alone += got
    return out_plain, out_alone, went


@pytest.mark.skipif(native.load() is None, reason="no C compiler here: runs are framed in Python")
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), steps=st.integers(20, 120))
def test_a_run_sent_alone_leaves_the_link_as_the_usual_path_does(seed: int, steps: int) -> None:
    # As above, with runs of messages (``send_run``) beside single ones: a
    # run that ``frame_run_alone`` frames leaves with the bytes, and leaves
    # the link in the state, of ``send_run`` then ``datagrams_to_send``.
    sent_alone = _twins_agree(seed, steps, _send_runs, native.load())
    event(f"runs sent alone: {min(sent_alone, 4)}")
