"""The compiled lanes on a multi-path link (``transport/pathlanes.py``) against the scheduler packet by packet.

Sending: twin pairs of links over two paths get the same random traffic
(runs queued by ``send_run`` and single messages, loss, delays that
differ per path, timers); one twin has no framer, so the scheduler
builds every packet in Python, the other frames the runs' stretches per
path in one compiled call.  Every step both must send the same bytes on
the same paths and hold the same state.

Receiving: one sender over two paths feeds two twin receivers; one takes
every datagram through ``datagram_received(..., path=p)``, the other
takes what a compiled receive lane would (in-order DATA of one ACK field,
no SACK blocks: ``run_receivable``) as runs through
``data_run_received(..., path=p)``, the rest datagram by datagram, as the
daemon does.  Both must deliver the same messages, answer with the same
bytes, and hold the same state but for how many times the same RTT
sample was heard (once per run, not once per packet).

In the simulator (the issue's 10 and 2.5 Gb/s paths, one lossy, the fast
one cut for a while), a stream of runs puts the same datagrams on the
wire at the same times whether the framer frames them or not.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import event, given, settings, strategies as st

from udpverbs.transport.builder import Burst, one_per_datagram
from udpverbs.transport.link import Link, LinkConfig, LinkState, run_slots
from udpverbs.transport.netsim import Impairments, PathSpec, Simulator, multipath, set_path_up
from udpverbs.wire import link as wl
from udpverbs.wire import native
from udpverbs.wire.errors import WireError

from .test_link_alone import _state
from .test_link_timers import D, establish
from .test_multipath import FAST, JUMBO, SIM as MP_SIM, SLOW

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler here: runs are framed in Python")

CFG = LinkConfig(initial_rto_s=0.05, min_rto_s=0.01, max_rto_s=1.0, max_retransmits=50, keepalive_idle_s=0.01,
                 dead_peer_s=30.0, max_ack_delay_s=0.0002, cc="efe", send_buffer_packets=48, rwnd_packets=32,
                 path_dead_s=0.02, path_probe_s=0.005)
#: one-way delay of each path: the second is slower, so the paths reorder
DELAY = (D, 2.5 * D)
#: what the framer's twin holds that the Python twin does not: the runs it frames, and how many it did
_FRAMER_ONLY = {"_framer", "_frame", "_runs", "framed_datagrams"}
#: what a receiver that took runs heard fewer times (the same sample once per
#: run), and the ACK hold's record of when an answer could have carried an
#: ACK: a run tells the receiver the OR of its packets' flags, not which
#: packet asked for an ACK (``Receiver.run_received``, as with one path)
_SAMPLED = {"rtt", "cc", "pacer", "answer_by"}


def _strip(state: Any, skip: set[str]) -> Any:
    """``state`` (``_state``'s) without the attributes named in ``skip``, at any depth."""
    if isinstance(state, dict):
        return {k: _strip(v, skip) for k, v in state.items() if k not in skip}
    if isinstance(state, list):
        return [_strip(v, skip) for v in state]
    return state


def _multipath(seed: int, framer: Any) -> tuple[Link, Link, float]:
    """Two links, established, each with a second path (up once its probe is answered)."""
    a = Link(CFG, rng=random.Random(seed), incarnation=1, framer=framer)
    b = Link(CFG, rng=random.Random(seed + 1), incarnation=2, framer=framer)
    t = establish(a, b)
    assert a.add_path(t) == 1 and b.add_path(t) == 1
    return a, b, t


def _by_path(link: Link, t: float) -> tuple[list[tuple[int, bytes]], int]:
    """What ``link`` sends now: (path, datagram) in order, and how many datagrams left in Bursts."""
    out = []
    bursts = 0
    for pid, ds in link.bursts_by_path(t):
        bursts += sum(len(d.datagrams()) for d in ds if type(d) is Burst)
        out += [(pid, bytes(d)) for d in one_per_datagram(ds)]
    return out, bursts


def _a_run(rng: random.Random, count: int) -> tuple[bytearray, int, int]:
    """A run as the send lane lays it out (``run_slots``): the buffer, the stride, the last's length."""
    stride = rng.choice((40, 600, 1400))
    last_len = rng.randint(1, stride)
    _, slot = run_slots(stride)
    return bytearray(rng.randbytes((count - 1) * slot + slot - stride + last_len)), stride, last_len


def _queue(links: tuple[Link, ...], t: float, rng: random.Random) -> None:
    """Queue the same random messages and runs on each of ``links``."""
    for _ in range(rng.choice((0, 1, 1, 2, 3))):
        space = links[0].send_space()
        if space == 0:
            return
        if rng.random() < 0.25:
            message = bytearray(rng.randbytes(rng.choice((2, 40, 1000))))
            for link in links:
                link.send(bytes(message), t)
            continue
        count = rng.randint(1, min(space, 24))
        buf, stride, last_len = _a_run(rng, count)
        carrier = rng.random() < 0.8
        for link in links:
            link.send_run(bytearray(buf), stride, count, last_len, carrier)


def _tick(links: tuple[Link, ...], t: float) -> None:
    for link in links:
        dl = link.next_deadline()
        if dl is not None and dl <= t:
            link.timer_fired(t)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), steps=st.integers(20, 100))
def test_runs_framed_per_path_are_the_schedulers_packets(seed: int, steps: int) -> None:
    py, fr = _multipath(seed, None), _multipath(seed, native.load())
    t = py[2]
    assert fr[2] == t
    rng = random.Random(seed)
    wire: list[tuple[float, int, int, bytes]] = []  # (arrival, to which side, path, datagram)
    framed = 0
    for step in range(steps):
        t += rng.choice((1e-6, 20e-6, D, 3 * D, 10 * D))
        due = sorted((x for x in wire if x[0] <= t), key=lambda x: x[0])
        wire = [x for x in wire if x[0] > t]
        for _, side, pid, d in due:
            py[side].datagram_received(d, t, path=pid)
            fr[side].datagram_received(d, t, path=pid)
        for side in (0, 1):
            assert [bytes(m) for m in py[side].drain_received()] == [bytes(m) for m in fr[side].drain_received()]
        _tick((*py[:2], *fr[:2]), t)
        for side in (0, 1):
            _queue((py[side], fr[side]), t, rng)
            out_py, _ = _by_path(py[side], t)
            out_fr, bursts = _by_path(fr[side], t)
            framed += bursts
            assert out_py == out_fr, f"step {step}"
            for pid, d in out_py:
                if rng.random() >= 0.05:
                    wire.append((t + DELAY[pid] * rng.choice((1, 1, 1, 2)), 1 - side, pid, d))
            assert _strip(_state(py[side]), _FRAMER_ONLY) == _strip(_state(fr[side]), _FRAMER_ONLY), f"step {step}"
    event(f"datagrams framed: {min(framed, 200) // 50 * 50}+")


# --- receiving -----------------------------------------------------------------


def _lane(link: Link, datagrams: list[bytes], pid: int, now: float) -> tuple[int, list[bytes]]:
    """What the compiled receive lane takes of ``datagrams`` (arrived on
    ``pid``) from the first, accounted as one run: how many, and their messages."""
    expect = link.run_receivable()
    if expect is None:
        return 0, []
    tag, seq, room = expect
    heads: list[wl.LinkHeader] = []
    bodies: list[bytes] = []
    for d in datagrams[:room]:
        try:
            h, body = wl.decode_untrusted(d)
        except WireError:
            break
        if (h.ptype != wl.PacketType.DATA or h.sack or h.conn_tag != tag or h.seq != (seq + len(heads)) & 0xFFFFFFFF
                or heads and h.ack != heads[0].ack):
            break
        heads.append(h)
        bodies.append(bytes(body))
    k = len(heads)
    if k:
        first, last = heads[0], heads[-1]
        flags = 0
        for h in heads:
            flags |= h.flags
        link.data_run_received(k, first.ack, first.ts_us, first.ts_echo_us, first.rwnd, first.flags, last.ts_us,
                               last.rwnd, flags, now, now, pid, sum(len(d) for d in datagrams[:k]))
    return k, bodies


def _receive_as_the_daemon(link: Link, datagrams: list[bytes], pid: int, now: float) -> tuple[list[bytes], int]:
    """Runs to the lane where it takes them, the rest datagram by datagram
    (what each delivers taken at once, as the daemon dispatches): the
    messages in order, and how many datagrams the lane took."""
    got: list[bytes] = []
    taken = i = 0
    while i < len(datagrams):
        k, bodies = _lane(link, datagrams[i:], pid, now)
        if k:
            got += bodies
            taken += k
            i += k
            continue
        link.datagram_received(datagrams[i], now, path=pid)
        got += [bytes(m) for m in link.drain_received()]
        i += 1
    return got, taken


def _batches(due: list[tuple[float, int, bytes]]) -> list[tuple[int, list[bytes]]]:
    """Datagrams arrived, in order of arrival, as the buffers a daemon reads:
    those of one path arriving at one time together (a GRO buffer's)."""
    out: list[tuple[float, int, list[bytes]]] = []
    for at, pid, d in sorted(due, key=lambda x: x[0]):
        if out and out[-1][:2] == (at, pid):
            out[-1][2].append(d)
        else:
            out.append((at, pid, [d]))
    return [(pid, ds) for _, pid, ds in out]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), steps=st.integers(20, 100), loss=st.sampled_from([0.0, 0.03, 0.1]))
def test_runs_received_per_path_leave_the_link_as_each_datagram_does(seed: int, steps: int, loss: float) -> None:
    # b takes each datagram alone; its twin c, runs where the lane would.
    # a hears b; c's answers must be b's, byte for byte.
    a, b, t = _multipath(seed, native.load())
    _, c, _ = _multipath(seed, native.load())
    rng = random.Random(seed)
    to_a: list[tuple[float, int, bytes]] = []
    to_b: list[tuple[float, int, bytes]] = []
    taken = 0
    for step in range(steps):
        t += rng.choice((1e-6, 20e-6, D, 3 * D))
        for _, pid, d in sorted((x for x in to_a if x[0] <= t), key=lambda x: x[0]):
            a.datagram_received(d, t, path=pid)
        to_a = [x for x in to_a if x[0] > t]
        a.drain_received()
        for pid, ds in _batches([x for x in to_b if x[0] <= t]):
            got_b: list[bytes] = []
            for d in ds:
                b.datagram_received(d, t, path=pid)
                got_b += [bytes(m) for m in b.drain_received()]
            got_c, k = _receive_as_the_daemon(c, ds, pid, t)
            taken += k
            assert got_b == got_c, f"step {step}"
        to_b = [x for x in to_b if x[0] > t]
        _tick((a, b, c), t)
        _queue((a,), t, rng)
        for pid, d in _by_path(a, t)[0]:
            if rng.random() >= loss:
                to_b.append((t + DELAY[pid] * rng.choice((1, 1, 1, 2)), pid, d))
        out_b, out_c = _by_path(b, t)[0], _by_path(c, t)[0]
        assert out_b == out_c, f"step {step}"
        for pid, d in out_b:
            if rng.random() >= loss:
                to_a.append((t + DELAY[pid], pid, d))
        assert _strip(_state(b), _SAMPLED) == _strip(_state(c), _SAMPLED), f"step {step}"
    event(f"datagrams taken as runs: {min(taken, 200) // 50 * 50}+")


def test_a_stream_over_two_paths_is_framed_and_taken_in_runs_on_both() -> None:
    # Runs streamed over two paths: each path's share leaves as Bursts, and
    # the receiver takes most of what arrives on either path as runs.
    a, b, t = _multipath(11, native.load())
    rng = random.Random(2)
    framed, taken, arrived = [0, 0], [0, 0], [0, 0]
    sent: list[bytes] = []
    got: list[bytes] = []
    for _ in range(300):
        if a.send_space() >= 16:
            buf, stride, last_len = _a_run(rng, 16)
            a.send_run(buf, stride, 16, last_len)
            slot = stride + wl.OVERHEAD
            sent += [bytes(buf[wl.HEADER_LEN + i * slot:wl.HEADER_LEN + i * slot + (stride if i < 15 else last_len)])
                     for i in range(16)]
        for pid, ds in a.bursts_by_path(t):
            framed[pid] += sum(len(d.datagrams()) for d in ds if type(d) is Burst)
            datagrams = [bytes(d) for d in one_per_datagram(ds)]
            arrived[pid] += len(datagrams)
            messages, k = _receive_as_the_daemon(b, datagrams, pid, t + DELAY[pid])
            got += messages
            taken[pid] += k
        for pid, ds in b.bursts_by_path(t + 3 * D):
            for d in one_per_datagram(ds):
                a.datagram_received(d, t + 3 * D, path=pid)
        t += 3 * D
        _tick((a, b), t)
    assert got == sent[:len(got)] and len(got) > 2000
    assert framed[0] > 500 and framed[1] > 500, framed
    assert taken[0] > arrived[0] // 2 and taken[1] > arrived[1] // 2, (taken, arrived)
    assert a.stats.datagrams_sent == sum(s.datagrams_sent for s in a.path_stats(t))
    assert b.stats.datagrams_received == sum(s.datagrams_received for s in b.path_stats(t))
    assert sum(s.bytes_received for s in b.path_stats(t)) == sum(s.bytes_sent for s in a.path_stats(t))


# --- the simulator -------------------------------------------------------------


def _simulated(framer: Any, seed: int, specs: list[Any], cut_at: float | None) -> tuple[list[Any], list[bytes], int]:
    """A stream of runs (``send_run``) over ``specs`` in the simulator, the
    first path cut from ``cut_at`` to 5 ms later: every datagram on the
    wire (time, channel, bytes), what b received, and how many were framed."""
    rng = random.Random(seed)
    sim = Simulator(rng)
    la = Link(MP_SIM, rng=random.Random(rng.getrandbits(64)), incarnation=1, framer=framer)
    lb = Link(MP_SIM, rng=random.Random(rng.getrandbits(64)), incarnation=2, framer=framer)
    trace: list[Any] = []
    a, b, nets = multipath(sim, la, lb, specs, trace=trace)
    data = random.Random(seed).randbytes(2000 * JUMBO)
    queued = [0]

    def top_up(_: Any) -> None:
        while queued[0] < len(data) and la.state == LinkState.ESTABLISHED and la.send_space() >= 16:
            part = data[queued[0]:queued[0] + 16 * JUMBO - 100]
            count = -(-len(part) // JUMBO)
            head, slot = run_slots(JUMBO)
            buf = bytearray((count - 1) * slot + slot)
            for i in range(count):
                body = part[i * JUMBO:(i + 1) * JUMBO]
                buf[head + i * slot:head + i * slot + len(body)] = body
            la.send_run(buf, JUMBO, count, len(part) - (count - 1) * JUMBO)
            queued[0] += len(part)
            a.service()
        if queued[0] < len(data):
            sim.schedule(sim.now + 20e-6, top_up)

    sim.schedule(0.0, lambda _: a.connect())
    sim.schedule(0.0, top_up)
    if cut_at is not None:
        sim.schedule(cut_at, lambda _: set_path_up(nets, 0, False))
        sim.schedule(cut_at + 5e-3, lambda _: set_path_up(nets, 0, True))
    sim.run(2.0, stop=lambda: sum(len(m) for m in b.received) >= len(data))
    assert b"".join(bytes(m) for m in b.received) == data
    return trace, b.received, la.framed_datagrams


@pytest.mark.parametrize("cut_at", [None, 3e-3], ids=["both-paths", "fast-path-cut"])
def test_the_simulators_stream_of_runs_is_the_same_framed_or_not(cut_at: float | None) -> None:
    # The paths (10 and 2.5 Gb/s), one lossy: the framer changes no
    # datagram and no time on the wire, and frames most of them.
    lossy = PathSpec(SLOW.rate_Bps, SLOW.rtt_s, impairments=Impairments(loss=0.01))
    specs = [FAST, lossy]
    trace_py, got_py, framed_py = _simulated(None, 5, specs, cut_at)
    trace_fr, got_fr, framed_fr = _simulated(native.load(), 5, specs, cut_at)
    assert framed_py == 0 and framed_fr > len(trace_fr) // 3
    assert [(t, ch, bytes(d)) for t, ch, d in trace_py] == [(t, ch, bytes(d)) for t, ch, d in trace_fr]
    assert {ch for _, ch, _ in trace_fr} >= {"a>b0", "a>b1"}
