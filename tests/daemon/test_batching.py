"""Datagram batching: UDP_SEGMENT sends, UDP_GRO receives, and what happens without them.

Two real ``Device`` objects in one process, on loopback, with a QP each in
RTS towards the other; the test posts RDMA Writes into the SQ ring by hand
and turns both data loops (``poll_once``) itself, so nothing depends on
scheduling.  The grouping rules of ``UdpPort.send_segmented`` and its fallback are
checked against a recording socket.
"""

from __future__ import annotations

import errno
import random
import socket
from typing import Any

import pytest
import trio

from udpverbs.bench.inprocess import Host, complete, connected, establish
from udpverbs.daemon import receive, udp
from udpverbs.daemon.device import Device, DeviceConfig
from udpverbs.transport.link import Burst, one_per_datagram
from udpverbs.transport.sockbuf import skb_truesize
from udpverbs.wire import segment
from udpverbs.wire.rdmap import Opcode
from udpverbs.wire.shm import QPState as S, WcStatus as W, WrOpcode


def record_lane_calls(dev: Device) -> list[int]:
    """From now on, what each of ``dev``'s compiled-lane calls (``ReceiveLane.place_run``) consumed, in bytes."""
    calls: list[int] = []
    if dev.lane is None:
        return calls  # no lane: no calls
    place_run = dev.lane.place_run

    def counted(*args: Any) -> int:
        used = place_run(*args)
        calls.append(used)
        return used

    dev.lane.place_run = counted  # type: ignore[method-assign,union-attr]
    return calls


async def _write_and_check(*, gso: bool, mtu: int, length: int) -> tuple[Host, Host]:
    a, b = Host("127.0.0.2", gso=gso, mtu=mtu), Host("127.0.0.3", gso=gso, mtu=mtu)
    a.connect(b)
    b.connect(a)
    rng = random.Random(length)
    a.mr.view[:length] = rng.randbytes(length)
    await establish(a, b)
    a.post_write(7, 0, length, b, 4096)
    done: list[tuple[int, int]] = []
    for _ in range(20000):
        a.dev.poll_once()
        b.dev.poll_once()
        done += a.completions()
        if done:
            break
    assert done == [(7, W.IBV_WC_SUCCESS)]
    assert bytes(b.mr.view[4096:4096 + length]) == bytes(a.mr.view[:length])
    assert bytes(b.mr.view[:4096]) == bytes(4096)  # nothing outside the target range
    return a, b


async def test_a_write_crosses_in_gso_batches_and_arrives_byte_exact() -> None:
    a, b = await _write_and_check(gso=True, mtu=1472, length=300_000)
    if not (a.dev.udp.gso and b.dev.udp.gro):
        pytest.skip("this kernel has no UDP_SEGMENT / UDP_GRO")
    assert a.dev.stats["tx_gso_sends"] > 0
    assert b.dev.stats["rx_gro_batches"] > 0  # several datagrams arrived in one receive
    assert a.dev.dump_stats().get("link_retransmits", 0) == 0


async def test_without_gso_every_datagram_is_its_own_system_call() -> None:
    a, b = await _write_and_check(gso=False, mtu=1472, length=100_000)
    assert not a.dev.udp.gso and not b.dev.udp.gro
    assert a.dev.stats["tx_gso_sends"] == 0 and b.dev.stats["rx_gro_batches"] == 0


@pytest.mark.parametrize("budget, parts", [(8, [8, 8]), (5, [5, 5, 5, 1]), (0, [16])])
async def test_a_batch_of_requests_is_answered_in_parts(budget: int, parts: list[int]) -> None:
    # 16 Read Requests leave in one GSO send and arrive in one GRO buffer.
    # The responder works through at most `budget` of them per pass, and
    # each pass sends the answers to its part before the next pass takes
    # the rest, so the requester can start on them (0: all in one pass).
    a, b = (Host(ip, gso=True, rx_dispatch_budget=budget) for ip in ("127.0.0.2", "127.0.0.3"))
    a.connect(b)
    b.connect(a)
    for h in (a, b):
        h.qp.attrs["max_rd_atomic"] = h.qp.attrs["max_dest_rd_atomic"] = 16
    b.mr.view[:16 * 64] = bytes(range(256)) * 4
    await establish(a, b)
    if not (a.dev.udp.gso and b.dev.udp.gro):
        pytest.skip("this kernel has no UDP_SEGMENT / UDP_GRO")
    for i in range(16):
        a.post_write(i, 4096 + 64 * i, 2, b, 64 * i, opcode=WrOpcode.IBV_WR_RDMA_READ)
    gso_before = a.dev.stats["tx_gso_sends"]
    framed = a.qp.link.link.framed_datagrams
    a.dev.poll_once()
    assert a.dev.stats["tx_gso_sends"] == gso_before + 1  # one batch of 16
    # queued on the link as one run, which the compiled framer frames in one call
    assert a.qp.link.link.framed_datagrams == framed + 16
    lane_calls = record_lane_calls(b.dev)
    sent, answered = [], 0
    def answers() -> int:
        # a's ACKs are not read here: a tail loss probe may go out too
        s = b.dev.dump_stats()
        return s["link_data_sent"] - s.get("link_tlp_probes", 0)

    base = answers()
    for _ in range(200):
        b.dev.poll_once()
        n = answers() - base - answered
        if n:
            sent.append(n)
            answered += n
        if answered >= 16:
            break
        await trio.sleep(0.001)
    assert sent == parts
    # The first request sets the lane's hint; the lane takes the rest of
    # each part in one call.
    assert b.dev.stats["rx_native_requests"] == 15
    assert len(lane_calls) == len(parts)
    done = complete(a, b, 16)
    assert sorted(done) == [(i, W.IBV_WC_SUCCESS) for i in range(16)]
    assert all(bytes(a.mr.view[4096 + 64 * i:4096 + 64 * i + 2]) == bytes(b.mr.view[64 * i:64 * i + 2]) for i in range(16))
    a.close()
    b.close()


@pytest.mark.parametrize("native", [True, False])
async def test_a_bad_request_in_a_batch_ends_it_alike(native: bool) -> None:
    # The sixth and the eighth of 16 Read Requests name an STag the
    # responder does not have.  Through the lane (which takes the rest of
    # the pass's part in one call) or not, the five before the first are
    # answered, it draws the one Terminate, and nothing after it is taken.
    a, b = Host("127.0.0.2", gso=True), Host("127.0.0.3", gso=True, native=native)
    a.connect(b)
    b.connect(a)
    for h in (a, b):
        h.qp.attrs["max_rd_atomic"] = h.qp.attrs["max_dest_rd_atomic"] = 16
    try:
        await establish(a, b)
        if not (a.dev.udp.gso and b.dev.udp.gro):
            pytest.skip("this kernel has no UDP_SEGMENT / UDP_GRO")
        for i in range(16):
            a.post_write(i, 4096 + 64 * i, 2, b, 64 * i, b.mr.stag + (1 << 8) if i in (5, 7) else None,
                         opcode=WrOpcode.IBV_WR_RDMA_READ)
        done = complete(a, b, 16)
        assert done[:6] == [(i, W.IBV_WC_SUCCESS) for i in range(5)] + [(5, W.IBV_WC_REM_ACCESS_ERR)]
        assert done[6:] == [(i, W.IBV_WC_WR_FLUSH_ERR) for i in range(6, 16)]
        assert b.dev.stats["terminate_sent"] == 1 and b.qp.state == S.IBV_QPS_ERR
        # the first pass's part (the budget, 8) but its first, which set the
        # hint; the QP failed in that part, and takes nothing more
        assert b.dev.stats["rx_native_requests"] == (7 if native else 0)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("sinks", ["one region", "two regions"])
async def test_a_batch_of_small_read_responses_completes_alike(native: bool, sinks: str) -> None:
    # 16 two-byte Reads in flight; their responses come back in one GRO
    # buffer.  The lane places the Reads one after another in one call
    # while their sinks are in one region ("two regions": every third Read
    # lands in another, which ends such a series); with it or without it,
    # the same bytes land and the same Reads complete, in order.
    a = Host("127.0.0.2", gso=True, native=native)
    async with connected(a) as (a, b):
        for h in (a, b):
            h.qp.attrs["max_rd_atomic"] = h.qp.attrs["max_dest_rd_atomic"] = 16
        if not (a.dev.udp.gso and a.dev.udp.gro):
            pytest.skip("this kernel has no UDP_SEGMENT / UDP_GRO")
        other = a.dev.stags.lookup(a.spare_stag())
        b.mr.view[:64] = bytes(range(64))
        lane_calls = record_lane_calls(a.dev)
        for rnd in range(2):  # the first round's first response sets the lane's hint
            for i in range(16):
                elsewhere = sinks == "two regions" and i % 3 == 2
                a.post_write(16 * rnd + i, 4096 + 2 * i, 2, b, 2 * i, opcode=WrOpcode.IBV_WR_RDMA_READ,
                             local=other if elsewhere else None, sges=[(2 * i if elsewhere else 4096 + 2 * i, 2)])
            done = complete(a, b, 16)
            assert done == [(16 * rnd + i, W.IBV_WC_SUCCESS) for i in range(16)]
        for i in range(16):
            got = bytes(other.view[2 * i:2 * i + 2]) if sinks == "two regions" and i % 3 == 2 else \
                bytes(a.mr.view[4096 + 2 * i:4096 + 2 * i + 2])
            assert got == bytes([2 * i, 2 * i + 1])
        if native:
            # all but the very first (with the Read batch at the responder,
            # the first of its first window, answered apart from the rest,
            # leaves in a send of its own: then the first two)
            assert a.dev.stats["rx_native_reads"] >= 30
            # a batch arrives in a buffer or two, and one call takes a series
            assert len(lane_calls) < (16 if sinks == "one region" else 24)


@pytest.mark.parametrize("native", [True, False])
async def test_requests_keep_their_place_among_other_messages(native: bool) -> None:
    # Requests wait in the PeerLink to go on the link as one run; a Write
    # and a Send posted between them still take their places in the
    # link's message order, as posted.
    a = Host("127.0.0.2", gso=True, native=native)
    async with connected(a) as (a, b):
        for h in (a, b):
            h.qp.attrs["max_rd_atomic"] = h.qp.attrs["max_dest_rd_atomic"] = 16
        b.post_recv(50, 8192, 64)
        link = a.qp.link.link
        first = link.next_n
        a.post_write(0, 4096, 4, b, 0, opcode=WrOpcode.IBV_WR_RDMA_READ)
        a.post_write(1, 4100, 4, b, 16, opcode=WrOpcode.IBV_WR_RDMA_READ)
        a.post_write(2, 0, 4, b, 0)
        a.post_write(3, 4104, 4, b, 32, opcode=WrOpcode.IBV_WR_RDMA_READ)
        a.post_write(4, 4, 4, b, 0, opcode=WrOpcode.IBV_WR_SEND)
        a.post_write(5, 4112, 8, b, 8, opcode=WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD, compare_add=1)
        a.post_write(6, 4120, 8, b, 16, opcode=WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD, compare_add=1)
        a.dev.poll_once()
        assert not a.qp.link.requests
        kinds = [segment.decode_untrusted(bytes(link.recovery.message(n)))[1].opcode
                 for n in range(first, link.next_n)]
        assert kinds == [Opcode.RDMA_READ_REQUEST, Opcode.RDMA_READ_REQUEST, Opcode.RDMA_WRITE,
                         Opcode.RDMA_READ_REQUEST, Opcode.SEND, Opcode.ATOMIC_REQUEST, Opcode.ATOMIC_REQUEST]
        assert complete(a, b, 7) == [(i, W.IBV_WC_SUCCESS) for i in range(7)]


async def test_requests_queued_for_a_link_that_ended_are_dropped() -> None:
    async with connected() as (a, b):
        pl = a.qp.link
        pl.send_request(bytearray(54))
        pl.send_request(bytearray(54))
        pl.link.close(a.dev.now)
        pl.flush()  # no exception: the link's end fails its QPs instead
        assert pl.requests == []


async def test_the_rest_of_a_batch_goes_with_its_link() -> None:
    # a link that ends between two passes takes the part of a batch it left
    a, b = (Host(ip, gso=True, rx_dispatch_budget=4) for ip in ("127.0.0.2", "127.0.0.3"))
    a.connect(b)
    b.connect(a)
    for h in (a, b):
        h.qp.attrs["max_rd_atomic"] = h.qp.attrs["max_dest_rd_atomic"] = 16
    await establish(a, b)
    if not (a.dev.udp.gso and b.dev.udp.gro):
        pytest.skip("this kernel has no UDP_SEGMENT / UDP_GRO")
    for i in range(16):
        a.post_write(i, 4096 + 64 * i, 2, b, 64 * i, opcode=WrOpcode.IBV_WR_RDMA_READ)
    a.dev.poll_once()
    for _ in range(200):
        b.dev.poll_once()
        if b.dev.receiver.rest is not None:
            break
        await trio.sleep(0.001)
    assert b.dev.receiver.rest is not None
    pl = b.dev.receiver.rest[0]
    del b.dev.links[pl.addr]
    received = pl.link.stats.data_received
    b.dev.poll_once()
    assert b.dev.receiver.rest is None and pl.link.stats.data_received == received
    a.close()
    b.close()


def test_the_dispatch_budget_is_not_negative() -> None:
    with pytest.raises(ValueError, match="rx_dispatch_budget"):
        DeviceConfig(rx_dispatch_budget=-1)


class RecordingSocket:
    """Stands in for the UDP socket in ``UdpPort.send_segmented``: records each send."""

    def __init__(self, refuse_gso: bool = False, refuse_errno: int = errno.EIO) -> None:
        self.sends: list[tuple[str, list[bytes], int]] = []
        self.refuse_gso = refuse_gso
        self.refuse_errno = refuse_errno

    def sendto(self, data: bytes, addr: Any) -> int:
        self.sends.append(("sendto", [data], len(data)))
        return len(data)

    def sendmsg(self, buffers: list[bytes], anc: list[tuple[int, int, bytes]], flags: int, addr: Any) -> int:
        if self.refuse_gso:
            raise OSError(self.refuse_errno, "no segmentation here")
        ((level, kind, data),) = anc
        assert (level, kind) == (udp.SOL_UDP, udp.UDP_SEGMENT)
        self.sends.append(("gso", list(buffers), int.from_bytes(data, "little")))
        return sum(map(len, buffers))


def _datagrams(*sizes: int) -> list[bytes]:
    return [bytes([i % 251]) * size for i, size in enumerate(sizes)]


@pytest.mark.parametrize(("sizes", "expect"), [
    # equal sizes: runs of at most 64 datagrams
    ((1000,) * 70, [("gso", 64, 1000), ("gso", 6, 1000)]),
    # a shorter datagram ends a run; a run of one goes by sendto
    ((1000, 1000, 500, 1000), [("gso", 3, 1000), ("sendto", 1, 1000)]),
    ((500, 1000, 1000), [("sendto", 1, 500), ("gso", 2, 1000)]),
    # at most GSO_MAX_BYTES in one send: 44 × 1472 fits, 45 do not
    ((1472,) * 45, [("gso", 44, 1472), ("sendto", 1, 1472)]),
    # a lone ACK between data
    ((1472, 1472, 40, 40, 40), [("gso", 3, 1472), ("gso", 2, 40)]),
])
def test_segmented_sends_group_equal_sizes(sizes: tuple[int, ...], expect: list[tuple[str, int, int]]) -> None:
    dev = Device(DeviceConfig(port=0))
    rec = RecordingSocket()
    dev.udp.sock = rec  # type: ignore[assignment]
    out = _datagrams(*sizes)
    dev.udp.send_segmented(out, ("127.0.0.9", 9))
    assert [(kind, len(bufs), size) for kind, bufs, size in rec.sends] == expect
    assert [d for _, bufs, _ in rec.sends for d in bufs] == out  # every datagram once, in order
    dev.udp.sock = None
    dev.close()


def test_a_kernel_that_refuses_segmentation_gets_every_datagram_one_by_one() -> None:
    dev = Device(DeviceConfig(port=0))
    dev.udp.gso = True
    rec = RecordingSocket(refuse_gso=True)
    dev.udp.sock = rec  # type: ignore[assignment]
    out = _datagrams(100, 1000, 1000, 1000, 40)
    dev.udp.send_segmented(out, ("127.0.0.9", 9))
    assert [bufs[0] for _, bufs, _ in rec.sends] == out
    assert all(kind == "sendto" for kind, _, _ in rec.sends)
    assert dev.udp.gso is False  # and it stays off
    dev.udp.sock = None
    dev.close()


def _burst(count: int, size: int, last: int, fill: int) -> Burst:
    """``count`` datagrams of ``size`` bytes in one buffer, the last ``last`` long."""
    data = b"".join(bytes([(fill + i) % 251]) * (size if i < count - 1 else last) for i in range(count))
    return Burst(memoryview(data).toreadonly(), size)


def _sent_datagrams(rec: RecordingSocket) -> list[bytes]:
    """What left, cut as the kernel cuts a UDP_SEGMENT send."""
    out = []
    for kind, bufs, size in rec.sends:
        data = b"".join(bytes(b) for b in bufs)
        step = size if kind == "gso" else len(data)
        out += [data[i:i + step] for i in range(0, len(data), step)]
    return out


def _flat(out: list[Any]) -> list[bytes]:
    return [bytes(d) for d in one_per_datagram(out)]


@pytest.mark.parametrize(("items", "expect"), [
    # a framer's run goes as it is, in as many sends as the GSO limits need
    ([(31, 1500, 1500)], [("gso", 31, 1500)]),
    ([(45, 1500, 700)], [("gso", 43, 1500), ("gso", 2, 1500)]),
    ([(70, 900, 900)], [("gso", 64, 900), ("gso", 6, 900)]),
    ([(44, 1500, 1500)], [("gso", 43, 1500), ("sendto", 1, 1500)]),
    # datagrams larger than a GSO send may carry: one sendto each
    ([(3, 65300, 900)], [("sendto", 1, 65300), ("sendto", 1, 65300), ("sendto", 1, 900)]),
    # queued datagrams around a run are grouped apart from it
    ([1500, 1500, (3, 1500, 1500), 40], [("gso", 2, 1500), ("gso", 3, 1500), ("sendto", 1, 40)]),
    # runs of whole datagrams of one size share a send, up to one that ends shorter
    ([(2, 1100, 1100)] * 3, [("gso", 6, 1100)]),
    ([(2, 1100, 1100), (2, 1100, 600), (2, 1100, 1100)], [("gso", 4, 1100), ("gso", 2, 1100)]),
    ([(2, 1100, 1100), (2, 1000, 1000)], [("gso", 2, 1100), ("gso", 2, 1000)]),
    ([(2, 1100, 1100), 1100, (2, 1100, 1100)], [("gso", 2, 1100), ("sendto", 1, 1100), ("gso", 2, 1100)]),
    # within the limits: 59 datagrams of 1100 bytes fit GSO_MAX_BYTES
    ([(2, 1100, 1100)] * 30, [("gso", 58, 1100), ("gso", 2, 1100)]),
    ([(60, 1000, 1000), (2, 1000, 1000), (2, 1000, 1000)], [("gso", 64, 1000)]),
    ([(40, 1000, 1000), (30, 1000, 1000)], [("gso", 40, 1000), ("gso", 30, 1000)]),
])
def test_a_burst_leaves_in_as_few_sends_as_the_limits_allow(items: list[Any],
                                                            expect: list[tuple[str, int, int]]) -> None:
    dev = Device(DeviceConfig(port=0))
    rec = RecordingSocket()
    dev.udp.sock = rec  # type: ignore[assignment]
    out = [_burst(*it, fill=i) if isinstance(it, tuple) else bytes([i]) * it for i, it in enumerate(items)]
    dev.udp.send_segmented(out, ("127.0.0.9", 9))
    got = [(kind, -(-sum(map(len, bufs)) // size) if kind == "gso" else 1, size) for kind, bufs, size in rec.sends]
    assert got == expect
    assert _sent_datagrams(rec) == _flat(out)  # every datagram once, in order
    dev.udp.sock = None
    dev.close()


@pytest.mark.parametrize("refused", [errno.EIO, errno.EINVAL])
def test_a_refused_burst_goes_one_by_one(refused: int) -> None:
    dev = Device(DeviceConfig(port=0))
    dev.udp.gso = True
    rec = RecordingSocket(refuse_gso=True, refuse_errno=refused)
    dev.udp.sock = rec  # type: ignore[assignment]
    out = [_burst(50, 1500, 300, fill=0), bytes(40), _burst(3, 1000, 1000, fill=7), _burst(2, 1000, 1000, fill=9)]
    dev.udp.send_segmented(out, ("127.0.0.9", 9))
    assert all(kind == "sendto" for kind, _, _ in rec.sends)
    assert _sent_datagrams(rec) == _flat(out)
    assert dev.udp.gso is (refused == errno.EINVAL)
    # EIO: asked once, then never again; EINVAL: each send is tried (the
    # first burst takes two, the last two share one)
    assert dev.stats["tx_gso_refused"] == (1 if refused == errno.EIO else 3)
    dev.udp.sock = None
    dev.close()


@pytest.mark.parametrize(("error", "counter"), [(BlockingIOError, "tx_dropped"), (OSError, "tx_oserror")])
def test_a_send_that_fails_counts_every_datagram_it_carried(error: type[OSError], counter: str) -> None:
    dev = Device(DeviceConfig(port=0))
    rec = RecordingSocket(refuse_gso=True, refuse_errno=errno.ENOBUFS)

    def fail(*args: Any) -> int:
        raise error(errno.EAGAIN if error is BlockingIOError else errno.ENOBUFS, "full")

    rec.sendmsg = fail  # type: ignore[method-assign]
    rec.sendto = fail  # type: ignore[method-assign]
    dev.udp.sock = rec  # type: ignore[assignment]
    out = [_burst(3, 1000, 1000, fill=0), _burst(2, 1000, 400, fill=3), bytes(40), _burst(5, 900, 900, fill=5)]
    dev.udp.send_segmented(out, ("127.0.0.9", 9))
    assert dev.stats[counter] == 11  # the link retransmits what the kernel did not take
    dev.udp.sock = None
    dev.close()


class BacklogSocket:
    """A socket with ``n`` datagrams (garbage from an unknown peer) waiting."""

    def __init__(self, n: int, size: int = 40) -> None:
        self.left = n
        self.size = size

    def recvfrom(self, size: int) -> tuple[bytes, tuple[str, int]]:
        if not self.left:
            raise BlockingIOError
        self.left -= 1
        return b"\x00" * self.size, ("127.0.0.9", 9)

    def recvmsg(self, size: int, anc: int) -> tuple[bytes, list[Any], int, tuple[str, int]]:
        data, addr = self.recvfrom(size)
        return data, [], 0, addr


async def test_a_pass_reads_a_bounded_number_of_datagrams() -> None:
    # A backlog is worked off over several passes, each ending with ACKs and
    # sends, instead of in one pass that would overrun the link's receive
    # window and hold every ACK past the sender's RTO.
    dev = Device(DeviceConfig(port=0))
    dev.udp.sock = BacklogSocket(300)  # type: ignore[assignment]
    dev.poll_once()
    assert dev.stats["rx_garbage"] + dev.stats["rx_unknown_peer"] == receive.RX_BUDGET
    dev.poll_once()
    dev.poll_once()
    assert dev.stats["rx_garbage"] + dev.stats["rx_unknown_peer"] == 300
    dev.udp.sock = None
    dev.close()


async def test_a_pass_reads_a_bounded_number_of_bytes() -> None:
    # 128 datagrams of 64 KB would be 8 MB of copying, CRC and placement in
    # one pass, with every ACK waiting for its end: past the sender's RTO.
    dev = Device(DeviceConfig(port=0))
    dev.udp.sock = BacklogSocket(100, size=65_000)  # type: ignore[assignment]
    dev.poll_once()
    read = dev.stats["rx_garbage"] + dev.stats["rx_unknown_peer"]
    assert read == -(-receive.RX_BYTE_BUDGET // 65_000) < receive.RX_BUDGET
    dev.udp.sock = None
    dev.close()


class CountingSocket:
    """The device's socket, counting its reads and the ones that found nothing."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reads = 0
        self.empty = 0

    def recvmsg(self, size: int, anc: int) -> tuple[bytes, list[Any], int, Any]:
        self.reads += 1
        try:
            return self.sock.recvmsg(size, anc)
        except BlockingIOError:
            self.empty += 1
            raise

    def recvfrom(self, size: int) -> tuple[bytes, Any]:
        data, _, _, addr = self.recvmsg(size, 0)
        return data, addr

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


@pytest.mark.parametrize("waiting", [1, 3])
async def test_a_pass_reads_what_waits_and_no_more(waiting: int) -> None:
    # The socket's epoll, not a read that fails with EAGAIN, says that the
    # socket is drained: that read and its exception were about 1 us of
    # every receiving pass.  Whenever the datagrams arrive, no read finds
    # the socket empty.
    dev = Device(DeviceConfig(addr="127.0.0.2", port=0))
    addr = dev.bind()
    counting = CountingSocket(dev.udp.sock)  # type: ignore[arg-type]
    dev.udp.sock = counting  # type: ignore[assignment]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as peer:
        peer.bind(("127.0.0.9", 0))
        for _ in range(waiting):
            peer.sendto(b"\x00" * 40, addr)
        passes = 0
        while dev.stats["rx_garbage"] + dev.stats["rx_unknown_peer"] < waiting and passes < 1000:
            dev.poll_once()
            passes += 1
            await trio.sleep(0)
    assert dev.stats["rx_garbage"] + dev.stats["rx_unknown_peer"] == waiting
    assert counting.empty == 0 and 1 <= counting.reads <= waiting  # GRO may coalesce them
    reads = counting.reads
    dev.poll_once()  # nothing waits: no read at all
    assert counting.reads == reads
    dev.udp.sock = counting.sock
    dev.close()


@pytest.mark.parametrize("mtu", [1472, 8972, 65507])
def test_the_receive_window_fits_in_the_socket_buffer(mtu: int) -> None:
    # Flow control keeps what a peer may have in flight inside our socket
    # buffer: 256 datagrams of 64 KB (16 MB) would overflow it.
    dev = Device(DeviceConfig(addr="127.0.0.1", port=0, mtu=mtu))
    dev.bind()
    try:
        rcvbuf = dev.udp.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        rwnd = dev.link_config.rwnd_packets
        assert 4 <= rwnd <= 256
        assert rwnd * skb_truesize(mtu) <= rcvbuf
        if mtu == 1472 and rcvbuf >= 4 << 20:
            assert rwnd == 256  # small datagrams keep the full window
    finally:
        dev.close()


@pytest.mark.parametrize(("mtu", "measured"), [(1472, 2304), (8972, 16644), (65507, 66576)])
def test_truesize_estimate_covers_what_the_kernel_charged(mtu: int, measured: int) -> None:
    assert measured <= skb_truesize(mtu) <= 2 * measured


async def test_a_datagram_carries_its_kernel_arrival_time_to_the_link() -> None:
    # The receiver ran 20 ms after the datagram arrived: the link is told
    # when it arrived (so congestion control does not see our lateness).
    a, b = await _write_and_check(gso=True, mtu=1472, length=1000)
    if not b.dev.udp.rx_stamps:
        pytest.skip("no SO_TIMESTAMPNS here")
    a.post_write(8, 0, 1000, b, 4096)
    sender = a.qp.link.link.stats
    sent = sender.data_sent
    for _ in range(100):  # the pacer may hold it for a pass or two
        a.dev.poll_once()
        if sender.data_sent > sent:
            break
    assert sender.data_sent > sent
    await trio.sleep(0.02)  # the lateness under test, not a wait for a condition
    b.dev.poll_once()
    link = b.qp.link.link
    assert link.stats.data_received >= 2
    assert b.dev.now - 0.5 < link.arrived <= b.dev.now - 0.015


def test_arrival_stamps_outside_the_last_second_are_not_trusted() -> None:
    assert udp.arrival(9.5, 10.0) == 9.5
    assert udp.arrival(10.5, 10.0) == 10.0  # from the future: a wall-clock step
    assert udp.arrival(8.0, 10.0) == 10.0


def test_einval_on_one_run_sends_it_one_by_one_and_keeps_batching() -> None:
    # EINVAL is about this run (say, a route whose MTU is too small for the
    # segment size): the run still goes out, and later runs are tried again.
    dev = Device(DeviceConfig(port=0))
    dev.udp.gso = True
    rec = RecordingSocket(refuse_gso=True, refuse_errno=errno.EINVAL)
    dev.udp.sock = rec  # type: ignore[assignment]
    out = _datagrams(1000, 1000, 1000, 40, 40, 40)  # runs: 3 x 1000 + 40, then 2 x 40
    dev.udp.send_segmented(out, ("127.0.0.9", 9))
    assert [bufs[0] for _, bufs, _ in rec.sends] == out
    assert dev.udp.gso is True and dev.stats["tx_gso_refused"] == 2
    dev.udp.sock = None
    dev.close()


class GroSocket:
    """Hands out one receive, as the kernel would with UDP_GRO on."""

    def __init__(self, data: bytes, anc: list[tuple[int, int, bytes]], flags: int = 0) -> None:
        self.queue = [(data, anc, flags, ("127.0.0.9", 9))]

    def recvmsg(self, size: int, anc: int) -> tuple[bytes, list[Any], int, tuple[str, int]]:
        if not self.queue:
            raise BlockingIOError
        return self.queue.pop()


def _gro(seg: int) -> list[tuple[int, int, bytes]]:
    return [(udp.SOL_UDP, udp.UDP_GRO, seg.to_bytes(4, "little"))]


@pytest.mark.parametrize(("data", "anc", "flags", "datagrams", "batches"), [
    (bytes(300), _gro(100), 0, 3, 1),  # three 100-byte datagrams
    (bytes(250), _gro(100), 0, 3, 1),  # the last one shorter
    (bytes(300), [(0, udp.UDP_GRO, (100).to_bytes(4, "little"))], 0, 1, 0),  # not UDP's: one datagram
    (bytes(300), [(udp.SOL_UDP, udp.UDP_GRO, b"\x64")], 0, 1, 0),  # too short to be a size
    (bytes(300), _gro(300), 0, 1, 0),  # nothing was coalesced
    (bytes(300), _gro(100), socket.MSG_CTRUNC, 0, 0),  # the size may be cut off: dropped, counted
])
async def test_gro_receives_are_split_by_the_size_the_kernel_gave(
        data: bytes, anc: list[tuple[int, int, bytes]], flags: int, datagrams: int, batches: int) -> None:
    dev = Device(DeviceConfig(port=0))
    dev.udp.gro = True
    dev.udp.sock = GroSocket(data, anc, flags)  # type: ignore[assignment]
    dev.poll_once()
    # Zeros from an unknown peer: each datagram is counted and dropped.
    assert dev.stats["rx_garbage"] + dev.stats["rx_unknown_peer"] == datagrams
    assert dev.stats["rx_gro_batches"] == batches
    assert dev.stats["rx_truncated"] == (1 if flags else 0)
    dev.udp.sock = None
    dev.close()
