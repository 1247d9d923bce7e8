"""The daemon's egress through an impairment (daemon/impaired.py, ``udpverbsd --impair``).

What the model does to a datagram is ``tests/transport/test_impair.py``'s;
these check that every way the daemon sends goes through it, over real
loopback sockets, that what it holds leaves on time in a real daemon, and
that nothing it meets raises into the send path.
"""

from __future__ import annotations

import collections
import os
import random
import select
import socket
import statistics
import sys
import tempfile
import time
from typing import Iterator

import pytest

from udpverbs import verbs
from udpverbs.daemon import config
from udpverbs.daemon.impaired import ImpairedSocket
from udpverbs.daemon.udp import SOL_UDP, UDP_SEGMENT, UdpPort
from udpverbs.transport.impair import Impairment, ImpairSpec, parse_spec
from udpverbs.transport.link import Burst
from udpverbs.verbs.enums import IBV_SEND_SIGNALED, IBV_WC_SUCCESS, IBV_WR_RDMA_WRITE

from ..integration.conftest import Side, connect_manual
from ..integration.daemons import DaemonProc


class Clock:
    """A clock that is a number the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def receiver() -> Iterator[socket.socket]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.7", 0))
    try:
        yield s
    finally:
        s.close()


def _arrived(rx: socket.socket, wait_s: float = 0.2) -> list[bytes]:
    """What waits on ``rx`` (each datagram alone: no UDP_GRO on this socket), waiting ``wait_s`` for the first."""
    out = []
    while select.select([rx], [], [], wait_s if not out else 0.05)[0]:
        out.append(rx.recv(65536))
    return out


def _port(spec: str, clock: Clock, seed: int = 1) -> tuple[UdpPort, ImpairedSocket]:
    """A device's UDP port with GSO if the kernel has it, its socket behind the impairment ``spec``."""
    udp = UdpPort(collections.Counter())
    udp.bind("127.0.0.6", 0, batching=True)
    imp = ImpairedSocket(udp.sock, Impairment(parse_spec(spec), random.Random(seed)), clock, udp.stats, udp.gso)
    udp.sock = imp  # type: ignore[assignment]
    return udp, imp


# -- configuration ---------------------------------------------------------------------------


def test_flags_and_toml_configure_the_impairment(tmp_path) -> None:
    assert config.load([])["impair"] is None
    assert config.load(["--impair", "loss=0.1,delay=1ms"])["impair"] == ImpairSpec(loss=0.1, delay_s=1e-3)
    toml = tmp_path / "d.toml"
    toml.write_text('[impair]\nloss = 0.02\ndelay = "200us"\nrate = "1gbit"\n')
    assert config.load(["--config", str(toml)])["impair"] == ImpairSpec(loss=0.02, delay_s=200e-6, rate_bps=1e9)
    # the flag replaces the whole table
    assert config.load(["--config", str(toml), "--impair", "dup=0.5"])["impair"] == ImpairSpec(dup=0.5)
    assert config.DeviceConfig(impair=ImpairSpec(loss=0.5)).impair == ImpairSpec(loss=0.5)
    for bad, fragment in [('[impair]\nloss = 2\n', "from 0 to 1"), ('[impair]\nlos = 0.1\n', "unknown key 'los'"),
                          ('[impair]\ndelay = 5\n', "unit"), ('impair = "loss=0.1"\n', "must be a table")]:
        toml.write_text(bad)
        with pytest.raises(ValueError, match=fragment):
            config.load(["--config", str(toml)])
    with pytest.raises(ValueError, match="impair rate='fast'"):
        config.load(["--impair", "rate=fast"])


# -- every way the device sends --------------------------------------------------------------


def test_every_send_path_of_the_device_goes_through_it(receiver: socket.socket) -> None:
    clock = Clock()
    udp, imp = _port("loss=1", clock)  # everything lost: whatever arrives went around it
    to = receiver.getsockname()
    try:
        udp.sendto(b"a" * 100, to)
        udp.send_each([b"b" * 100, memoryview(b"c" * 100)], to)
        run = memoryview(bytes(range(250)) * 20)  # 5000 B: five datagrams of 1000
        udp.send_segmented([Burst(run, 1000)], to)  # a run the framer built
        udp.send_segmented([b"d" * 300, b"e" * 300, b"f" * 200], to)  # loose datagrams, grouped
        udp.send_run([b"g" * 500, b"h" * 500], 500, to)
        assert _arrived(receiver, 0.1) == []
        assert imp.counters()["impair_offered"] == imp.counters()["impair_lost"] == 1 + 2 + 5 + 3 + 2
        assert udp.stats["tx_oserror"] == udp.stats["tx_dropped"] == 0
    finally:
        udp.close()


def test_a_run_is_cut_into_its_datagrams_which_arrive_whole_and_in_order(receiver: socket.socket) -> None:
    clock = Clock()
    udp, imp = _port("dup=0", clock)  # on, and doing nothing
    to = receiver.getsockname()
    try:
        data = random.Random(3).randbytes(10 * 1000 + 500)
        udp.send_segmented([Burst(memoryview(data), 1000)], to)
        got = _arrived(receiver)
        assert got == [data[i:i + 1000] for i in range(0, len(data), 1000)]
        # and as the device's own sendmsg asks for a run, in two buffers
        imp.sendmsg([data[:4000], data[4000:6000]], [(SOL_UDP, UDP_SEGMENT, (2000).to_bytes(2, sys.byteorder))],
                    0, to)
        assert _arrived(receiver) == [data[0:2000], data[2000:4000], data[4000:6000]]
        assert imp.counters()["impair_released"] == 14 and imp.counters()["impair_held"] == 0
    finally:
        udp.close()


def test_corruption_reaches_the_wire_as_one_flipped_bit(receiver: socket.socket) -> None:
    udp, imp = _port("corrupt=1", Clock(), seed=4)
    to = receiver.getsockname()
    try:
        sent = [random.Random(i).randbytes(1400) for i in range(20)]
        udp.send_segmented(list(sent), to)
        got = _arrived(receiver)
        assert len(got) == 20
        for s, g in zip(sent, got):
            assert sum(bin(a ^ b).count("1") for a, b in zip(s, g)) == 1
        assert imp.counters()["impair_corrupted"] == 20
    finally:
        udp.close()


def test_a_held_datagram_leaves_when_released_and_not_before(receiver: socket.socket) -> None:
    clock = Clock()
    udp, imp = _port("delay=50ms", clock)
    to = receiver.getsockname()
    try:
        udp.sendto(b"late", to)
        assert imp.next_deadline() == pytest.approx(100.05)
        clock.now = 100.049
        assert not imp.release(clock.now) and _arrived(receiver, 0.05) == []
        assert imp.counters()["impair_held"] == 1
        clock.now = 100.05
        assert imp.release(clock.now) and _arrived(receiver) == [b"late"]
        assert imp.next_deadline() is None and imp.counters()["impair_held"] == 0
        udp.sendto(b"at close", to)  # a device that closes lets what it holds go first
        assert imp.release(float("inf")) and _arrived(receiver) == [b"at close"]
    finally:
        udp.close()


def test_nothing_raises_into_the_send_path(receiver: socket.socket) -> None:
    clock = Clock()
    udp, imp = _port("delay=1ms", clock)
    try:
        udp.sendto(b"x" * 100, receiver.getsockname())
        imp.sendto(object(), receiver.getsockname())  # type: ignore[arg-type]  # no bytes at all: counted
        assert udp.stats["impair_errors"] == 1
        udp.sock.sock.close()  # type: ignore[union-attr]  # the socket went away under a held datagram
        clock.now += 1
        assert imp.release(clock.now)
        assert udp.stats["tx_oserror"] == 1
    finally:
        udp.close()


# -- in a daemon ----------------------------------------------------------------------------


def test_a_daemon_says_it_is_impaired_and_its_held_datagrams_leave_on_time() -> None:
    # 20 ms each way on both daemons: a Write's round trip (the Write, its
    # ACK) takes 40 ms.  Held datagrams leave from the data loop's timer; a
    # loop that slept past them would wait for its next rescan (250 ms) or
    # a retransmission timer, and the round trip would take far longer.
    delay = 0.02
    with tempfile.TemporaryDirectory(prefix="udpverbs-imp-") as d:
        extra = ("--impair", f"delay={delay * 1000:g}ms", "--log-level", "INFO")
        with DaemonProc("uvIa", "127.0.0.2", d, seed=21, extra=extra) as da, \
                DaemonProc("uvIb", "127.0.0.3", d, seed=22, extra=extra) as db:
            a, b = Side(da), Side(db)
            try:
                connect_manual(a, a.qp, b, b.qp)
                times = []
                for i in range(7):
                    a.mr.write(os.urandom(64))
                    wr = verbs.SendWR(wr_id=i, opcode=IBV_WR_RDMA_WRITE, send_flags=IBV_SEND_SIGNALED,
                                      sg=[verbs.SGE(a.mr.buf, 64, a.mr.lkey)])
                    wr.set_wr_rdma(b.mr.rkey, b.mr.buf)
                    t0 = time.monotonic()
                    a.qp.post_send(wr)
                    (wc,) = a.cq.poll_blocking(1, timeout=10)
                    times.append(time.monotonic() - t0)
                    assert wc.status == IBV_WC_SUCCESS and b.mr.read(64, 0) == a.mr.read(64, 0)
                assert 2 * delay <= statistics.median(times[1:]) < 2 * delay + 0.04, times
                stats = a.ctx.query_stats()
                assert stats["impair_offered"] >= 7 and stats["impair_released"] == stats["impair_offered"]
                assert stats["impair_held"] == 0 and "impair_lost" in stats
            finally:
                a.close()
                b.close()
            log = da.log_text()
            assert "WARNING IMPAIRED" in log and "delay=20000us (seed 21)" in log, log
