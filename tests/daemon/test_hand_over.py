"""The hand-over after a datagram sent alone (``Device.handed_over``, ``loop.hand_over``).

Right after a message leaves in a datagram of its own, the daemon arms the
receive lane for the answer and lets the processes sharing its vCPU run,
until one of them has had a turn clearly longer than its idle ones (it took
our data and answered), the socket has something, or ``hand_over_s`` is
up.  Which turn ends it is decided here with a fake clock and a fake
``sched_yield`` (the devices' ``LoopPolicy``) whose turns take what each
test says once the test starts them; the arming, with real
sockets on loopback.  A message of several datagrams on a link with
nothing queued or unacknowledged (a ping-pong's) leaves as soon as it is
queued and is followed by a hand-over too.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import AsyncIterator

import pytest
import trio

from udpverbs.bench.inprocess import Host, complete, connected
from udpverbs.daemon.device import Device, DeviceConfig
from udpverbs.daemon.policy import LoopPolicy
from udpverbs.wire import native
from udpverbs.wire.shm import WcStatus as W


class Turns:
    """A clock that only moves when we yield, once ``start`` is called:
    each yield then takes the next of ``turns_us`` (the last one repeats),
    as the other processes' turns would.  Until then, the real ones."""

    def __init__(self) -> None:
        self.t = 100.0
        self.turns: list[float] | None = None
        self.yields = 0

    def start(self, turns_us: list[float]) -> "Turns":
        self.turns = list(turns_us)
        return self

    def clock(self) -> float:
        return time.perf_counter() if self.turns is None else self.t

    def yield_cpu(self) -> None:
        if self.turns is None:
            os.sched_yield()
            return
        self.yields += 1
        turn = self.turns.pop(0) if len(self.turns) > 1 else self.turns[0]
        self.t += turn * 1e-6


def quiet(a: Host, b: Host) -> None:
    """Turn both loops until neither socket has anything left to read."""
    for _ in range(100):
        a.dev.poll_once()
        b.dev.poll_once()
        if not (a.dev.udp.rx_epoll.poll(0) or b.dev.udp.rx_epoll.poll(0)):
            return
    raise AssertionError("the link does not settle")


@pytest.fixture
async def turned() -> AsyncIterator[tuple[Turns, Host, Host]]:
    """Two connected hosts whose hand-overs run on one :class:`Turns`, settled."""
    fake = Turns()
    policy = LoopPolicy(turn_clock=fake.clock, yield_cpu=fake.yield_cpu)
    async with connected(Host("127.0.0.2", gso=True, policy=policy),
                         Host("127.0.0.3", gso=True, policy=policy)) as (a, b):
        quiet(a, b)
        yield fake, a, b


@pytest.mark.parametrize("turns_us, yields", [
    ([1.5, 1.6, 1.4, 6.0, 1.5], 4),  # an application spinning on a byte, then answering
    ([3.5, 3.4, 3.6, 3.5, 12.0, 3.5], 5),  # one polling a CQ in Python: longer idle turns
    ([6.0, 1.5], 2),  # it answered in its first turn: known once a turn shows what idle is
])
async def test_the_hand_over_ends_after_a_turn_that_did_work(turned, turns_us: list[float], yields: int) -> None:
    fake, a, b = turned
    fake.start(turns_us)
    a.dev.handed_over(a.qp.link)
    assert fake.yields == yields
    assert a.dev.stats["hand_over_answered"] == 1


async def test_quick_yields_do_not_end_the_hand_over_before_its_time(turned) -> None:
    # Yields that return at once: nobody else runs, or the scheduler does not
    # pick one that had more than its share.  Only the time limit ends it.
    fake, a, b = turned
    fake.start([0.3])
    start = fake.t
    a.dev.handed_over(a.qp.link)
    assert a.dev.hand_over_s <= fake.t - start < a.dev.hand_over_s + 0.5e-6
    assert a.dev.stats["hand_over_answered"] == 0


async def test_a_readable_socket_ends_the_hand_over(turned) -> None:
    fake, a, b = turned
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
        stranger.bind(("127.0.0.4", 0))
        stranger.sendto(b"\x01" * 40, a.dev.udp.sock.getsockname())
        for _ in range(200):
            if a.dev.udp.rx_epoll.poll(0):
                break
            await trio.sleep(0.001)
        fake.start([1.5])
        a.dev.handed_over(a.qp.link)
    assert fake.yields == 1


def test_a_daemon_that_does_not_spin_does_not_hand_over() -> None:
    dev = Device(DeviceConfig(spin_us=0))
    try:
        assert dev.hand_over_s == 0
    finally:
        dev.close()
    dev = Device(DeviceConfig())
    try:
        assert 0 < dev.hand_over_s <= dev.config.spin_s
    finally:
        dev.close()


async def test_no_yield_without_a_hand_over_time() -> None:
    fake = Turns()
    policy = LoopPolicy(hand_over_s=0, turn_clock=fake.clock, yield_cpu=fake.yield_cpu)
    async with connected(Host("127.0.0.2", gso=True, policy=policy)) as (a, b):
        quiet(a, b)
        fake.start([1.5])
        a.dev.handed_over(a.qp.link)
        assert fake.yields == 0


@pytest.mark.skipif(native.load() is None, reason="no C compiler here: nothing to arm")
async def test_a_write_sent_alone_arms_its_daemon_for_the_answer() -> None:
    # B's Write to A leaves alone; in that same pass B arms the lane for A's
    # answer (the pass's own end does not: B's applications are taken to be
    # on other vCPUs), and A's answer is then read by the armed read.
    async with connected() as (a, b):
        b.dev.yield_on_delivery = False
        a.mr.view[:4] = b"ping"
        a.post_write(1, 0, 4, b, 0)
        assert complete(a, b, 1) == [(1, W.IBV_WC_SUCCESS)]  # B's hint: A's Writes
        for _ in range(20):
            b.dev.poll_once()  # ACKs settle; nothing is sent alone
        assert b.dev.lane.armed is None
        alone = b.dev.stats["tx_alone"]
        b.mr.view[64:68] = b"pong"
        b.post_write(2, 64, 4, a, 64)
        b.dev.poll_once()
        assert b.dev.stats["tx_alone"] == alone + 1
        armed = b.dev.lane.armed
        assert armed is not None and armed[0] is b.qp.link and armed[3] == b.qp.link.link.rcv_nxt
        a.mr.view[128:132] = b"back"
        a.post_write(3, 128, 4, b, 128)
        for _ in range(2000):
            a.dev.poll_once()
            b.dev.poll_once()
            if b.dev.stats["rx_armed"]:
                break
        assert b.dev.stats["rx_armed"] == 1
        assert bytes(b.mr.view[128:132]) == b"back"


@pytest.mark.skipif(native.load() is None, reason="no C compiler here: runs of segments take the Python path")
async def test_a_message_of_several_datagrams_on_a_quiet_link_leaves_at_once_and_hands_over(turned) -> None:
    # A ping-pong's Write of three datagrams leaves while its QP is pumped,
    # before the link records it, and the vCPU is handed over then, as after
    # a message of one datagram; the link's bookkeeping comes after.
    fake, a, b = turned
    fake.start([1.5, 6.0])
    at_hand_over = []
    hand_over = a.dev.handed_over
    link = a.qp.link.link
    next_n = link.next_n

    def recording(pl):  # type: ignore[no-untyped-def]
        at_hand_over.append((bool(b.dev.udp.rx_epoll.poll(0)), link.next_n))
        hand_over(pl)

    a.dev.handed_over = recording  # type: ignore[method-assign]
    a.mr.view[:3000] = bytes(range(250)) * 12
    a.post_write(1, 0, 3000, b, 0)
    a.dev.poll_once()
    assert a.dev.stats["tx_run_alone"] == 1
    assert at_hand_over == [(True, next_n)]  # at B's socket already; not recorded yet
    assert link.next_n == link.snd_nxt == next_n + 3
    assert fake.yields == 2 and a.dev.stats["hand_over_answered"] == 1
    assert complete(a, b, 1) == [(1, W.IBV_WC_SUCCESS)]
    assert bytes(b.mr.view[:3000]) == bytes(a.mr.view[:3000])


@pytest.mark.skipif(native.load() is None, reason="no C compiler here: runs of segments take the Python path")
async def test_a_message_behind_one_in_flight_waits_for_the_flush(turned) -> None:
    # Two such Writes posted together: the first leaves at once, the second
    # finds it in flight (a stream, not a ping-pong) and goes with the flush,
    # with no second hand-over.
    fake, a, b = turned
    fake.start([1.5, 6.0])
    a.post_write(1, 0, 3000, b, 0)
    a.post_write(2, 4096, 3000, b, 4096)
    a.dev.poll_once()
    assert a.dev.stats["tx_run_alone"] == 1
    assert fake.yields == 2
    assert complete(a, b, 2) == [(1, W.IBV_WC_SUCCESS), (2, W.IBV_WC_SUCCESS)]
