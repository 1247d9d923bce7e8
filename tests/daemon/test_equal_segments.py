"""Equal segments: a stream's messages cut evenly, and sent together.

A message of several segments used to be cut into ``max_data``-byte
segments and a shorter last one.  A UDP_SEGMENT sendmsg can only end with
a shorter datagram, so every such message took a system call (and a GRO
batch at the receiver) of its own.  Cut evenly (``equal_segment_size``),
consecutive messages of one size are datagrams of one size, and the
device joins them in one sendmsg (``UdpPort.send_segmented``).  Two real
devices in one process on loopback, loops turned by hand
(``test_batching``'s hosts); what leaves is recorded at the socket.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, strategies as st

from udpverbs.daemon.peer import EQUAL_EXTRA, equal_segment_size
from udpverbs.daemon.udp import GSO_MAX_BYTES, GSO_MAX_SEGMENTS
from udpverbs.wire import envelope, link as wire_link, segment
from udpverbs.wire.shm import WcStatus as W, WrOpcode

from udpverbs.bench.inprocess import Host, complete, connected

#: what a tagged segment's datagram adds to its payload
OVERHEAD = wire_link.OVERHEAD + segment.TAGGED_PREFIX_LEN


@pytest.mark.parametrize(("total", "max_data", "seg"), [
    (2048, 1418, 1024),    # two equal segments, as few as max_data-sized ones (1418: MTU 1472)
    (2889, 1418, 963),     # three
    (4096, 1418, 1024),    # three would leave the last shorter: a fourth makes them equal
    (8192, 1418, 1024),    # six become eight
    (16384, 1418, 1418),   # twelve would have to become sixteen: no
    (4331, 1418, 1418),    # 61 × 71: no count from four to six divides it
    (2836, 1418, 1418),    # max_data-sized already
    (1000, 1418, 1418),    # one segment: nothing to cut
    (0, 1418, 1418),
    (65536, 65453, 65453),  # two halves (the loopback MTU), but two such messages cannot share a send
    (24000, 8946, 8000),   # three of 8000: two messages fit in 65000 bytes
    (40000, 8946, 8946),   # five of 8000 would not
    (4000, 100, 100),      # 40 segments: two messages are more than one send may carry
    (3100, 100, 100),      # 31, 32 do not divide it and 33 would be too many
    (3200, 100, 100),      # 32 of 100 (max_data already)
])
def test_a_streams_message_is_cut_evenly_where_two_can_share_a_send(total: int, max_data: int, seg: int) -> None:
    assert equal_segment_size(total, max_data, OVERHEAD) == seg


@pytest.mark.parametrize(("total", "seg"), [
    (2048, 1024),  # halves: no datagram added
    (2889, 963),
    (4096, 1414),  # quarters would add one: a Send's cut stays
    (8192, 1414),
])
def test_a_sends_even_cut_adds_no_datagram(total: int, seg: int) -> None:
    overhead = wire_link.OVERHEAD + segment.UNTAGGED_PREFIX_LEN
    assert equal_segment_size(total, 1414, overhead, 0) == seg  # 1414: an untagged max_data at MTU 1472


@given(total=st.integers(0, 1 << 23), max_data=st.integers(1, 65000), extra=st.sampled_from([0, EQUAL_EXTRA]))
def test_equal_segments_stay_within_max_data_the_extra_and_one_send_for_two(total: int, max_data: int,
                                                                            extra: int) -> None:
    seg = equal_segment_size(total, max_data, OVERHEAD, extra)
    fewest = -(-total // max_data)
    assert 0 < seg <= max_data
    if seg == max_data:
        return
    n = total // seg
    assert n * seg == total and fewest <= n <= fewest + extra
    assert 2 * n <= GSO_MAX_SEGMENTS and 2 * (total + n * OVERHEAD) <= GSO_MAX_BYTES
    assert all(total % m for m in range(fewest, n))  # the fewest that divide it


class WireTap:
    """The device's socket, passed through; records each send as it leaves:
    a ``sendto``'s datagram size, or a UDP_SEGMENT ``sendmsg``'s segment
    size and buffer sizes."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self.log: list[int | tuple[int, list[int]]] = []

    def sendto(self, data: Any, addr: Any) -> int:
        self.log.append(len(data))
        return self._sock.sendto(data, addr)

    def sendmsg(self, buffers: list[Any], anc: list[Any], flags: int, addr: Any) -> int:
        self.log.append((int.from_bytes(anc[0][2], "little"), [len(b) for b in buffers]))
        return self._sock.sendmsg(buffers, anc, flags, addr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    @property
    def sizes(self) -> list[int]:
        """Every datagram, as the kernel cuts a UDP_SEGMENT send."""
        out: list[int] = []
        for e in self.log:
            if type(e) is int:
                out.append(e)
            else:
                size, total = e[0], sum(e[1])  # type: ignore[index]
                out += [min(size, total - at) for at in range(0, total, size)]
        return out

    @property
    def calls(self) -> int:
        """System calls that carried data (datagrams over 200 bytes)."""
        return sum((e if type(e) is int else e[0]) > 200 for e in self.log)  # type: ignore[index, operator]


def _payloads(rec: WireTap, prefix: int = segment.TAGGED_PREFIX_LEN) -> list[int]:
    """The DDP payload of each data segment that left, ``prefix`` its DDP/RDMAP
    header (tagged by default; a Modified ACK trailer counts as payload);
    ACKs and other short datagrams left out."""
    return [n - wire_link.OVERHEAD - prefix for n in rec.sizes if n > 200]


def _record(h: Host) -> WireTap:
    rec = WireTap(h.dev.udp.sock)
    h.dev.udp.sock = rec  # type: ignore[assignment]
    return rec


def _restore(*recs: tuple[Host, WireTap]) -> None:
    for h, rec in recs:
        h.dev.udp.sock = rec._sock  # type: ignore[assignment]


@pytest.mark.parametrize("native", [True, False])
async def test_a_stream_of_writes_is_cut_evenly_and_sent_together(native: bool) -> None:
    # 16 Writes of 4096 bytes posted at once.  The first is alone when
    # the pump takes it (no other WR outstanding): three segments, the
    # last shorter.  The other 15 are a stream's: four of 1024 each.
    # Through the send lane or not, the same datagrams leave, and with
    # the lane (runs of equal datagrams) the stream's messages share
    # system calls.  Every byte lands where it should.
    a = Host("127.0.0.2", gso=True, native=native)
    async with connected(a) as (a, b):
        if not (a.dev.udp.gso and b.dev.udp.gro):
            pytest.skip("this kernel has no UDP_SEGMENT / UDP_GRO")
        max_data = a.qp.link.max_data
        assert max_data == 1418  # the test's arithmetic is for MTU 1472
        data = random.Random(1).randbytes(16 * 4096)
        a.mr.view[:len(data)] = data
        rec = _record(a)
        try:
            for i in range(16):
                a.post_write(i, 4096 * i, 4096, b, 65536 + 4096 * i)
            done = complete(a, b, 16)
        finally:
            _restore((a, rec))
        assert done == [(i, W.IBV_WC_SUCCESS) for i in range(16)]
        assert bytes(b.mr.view[65536:65536 + len(data)]) == data
        assert bytes(b.mr.view[:65536]) == bytes(65536)  # nothing outside the targets
        assert _payloads(rec) == [1418, 1418, 1260] + [1024] * 60
        if native:
            assert rec.calls < 16  # messages joined in system calls
        assert a.dev.dump_stats().get("link_retransmits", 0) == 0


async def test_a_ping_pongs_message_takes_no_extra_datagram() -> None:
    # One Write at a time, each completed before the next is posted: each
    # is alone, and takes the fewest datagrams (3 for 4096 bytes).
    async with connected() as (a, b):
        rec = _record(a)
        try:
            for i in range(3):
                a.post_write(i, 0, 4096, b, 0)
                assert complete(a, b, 1) == [(i, W.IBV_WC_SUCCESS)]
        finally:
            _restore((a, rec))
        assert _payloads(rec) == [1418, 1418, 1260] * 3


@pytest.mark.parametrize("native", [True, False])
async def test_a_stream_of_read_responses_is_cut_evenly(native: bool) -> None:
    # 8 Reads of 2048 and 8 of 4096 bytes in flight: the responder cuts a
    # response evenly (2 KiB in halves, no datagram added; 4 KiB in
    # quarters, one added) when other responses are queued ahead of it,
    # with the send lane or without; the first, queued alone, as before.
    a = Host("127.0.0.2", gso=True, native=native)
    b = Host("127.0.0.3", gso=True, native=native)
    async with connected(a, b) as (a, b):
        for h in (a, b):
            h.qp.attrs["max_rd_atomic"] = h.qp.attrs["max_dest_rd_atomic"] = 16
        data = random.Random(2).randbytes(8 * 2048 + 8 * 4096)
        b.mr.view[:len(data)] = data
        rec = _record(b)
        try:
            at = 0
            for i in range(16):
                n = 2048 if i < 8 else 4096
                a.post_write(i, 131072 + at, n, b, at, opcode=WrOpcode.IBV_WR_RDMA_READ)
                at += n
            done = complete(a, b, 16)
        finally:
            _restore((b, rec))
        assert done == [(i, W.IBV_WC_SUCCESS) for i in range(16)]
        assert bytes(a.mr.view[131072:131072 + len(data)]) == data
        got = _payloads(rec)
        uneven = []
        for i in range(16):
            cuts = ([1418, 630], [1024, 1024]) if i < 8 else ([1418, 1418, 1260], [1024] * 4)
            cut = next((c for c in cuts if got[:len(c)] == c), None)
            assert cut is not None, (i, got[:4])
            uneven += [i] if cut is cuts[0] else []
            got = got[len(cut):]
        assert got == []
        # Uneven only when nothing was queued ahead: the first, and (with
        # the lane, whose requests come in the dispatch budget's parts of
        # 8) at most the first of the second part.
        assert uneven in ([0], [0, 8])


@pytest.mark.parametrize("native", [True, False])
async def test_a_stream_of_sends_is_cut_evenly_unless_it_owes_a_modified_ack(native: bool) -> None:
    # A owes B a Modified ACK (B's Send reached A) when it takes four Sends
    # of its own: 2,828 bytes (two full segments: no room for the ACK's
    # trailer), then three of 2,048.  The first is alone (full-size cut).
    # The second is a stream's but still owes the ACK: cut as before, its
    # last segment carrying it.  The last two, owing nothing, are cut into
    # halves (a Send takes no extra datagram for an even cut).  With the
    # send lane or without, every byte lands.
    a = Host("127.0.0.2", gso=True, native=native)
    b = Host("127.0.0.3", gso=True, native=native)
    async with connected(a, b) as (a, b):
        if not (a.dev.udp.gso and b.dev.udp.gro):
            pytest.skip("this kernel has no UDP_SEGMENT / UDP_GRO")
        max_data = a.qp.link.max_data - (segment.UNTAGGED_PREFIX_LEN - segment.TAGGED_PREFIX_LEN)
        assert max_data == 1414  # the test's arithmetic is for MTU 1472
        # a stream's 4 KiB Write is cut in quarters, a Send not (a datagram more)
        link = a.qp.link
        assert (link.segment_size(4096, True), link.segment_size(4096, True, untagged=True)) == (1024, 1414)
        assert link.segment_size(2048, False, untagged=True) == 1414  # alone
        rng = random.Random(3)
        a.mr.view[:16384] = rng.randbytes(16384)
        b.mr.view[:100] = rng.randbytes(100)
        a.post_recv(50, 300_000, 100)
        b.post_write(60, 0, 100, a, 0, opcode=WrOpcode.IBV_WR_SEND)
        b.dev.poll_once()  # B's Send leaves; A takes it in its next pass, before its own WRs
        sizes = [2828, 2048, 2048, 2048]
        at = [0, 2828, 2828 + 2048, 2828 + 2 * 2048]
        for i in range(4):
            b.post_recv(100 + i, 100_000 + 8192 * i, 4096)
        rec = _record(a)
        try:
            for i, n in enumerate(sizes):
                a.post_write(i, at[i], n, b, 0, opcode=WrOpcode.IBV_WR_SEND)
            done = complete(a, b, 5)
        finally:
            _restore((a, rec))
        assert sorted(done) == [(i, W.IBV_WC_SUCCESS) for i in range(4)] + [(50, W.IBV_WC_SUCCESS)]
        assert bytes(a.mr.view[300_000:300_100]) == bytes(b.mr.view[:100])
        for i, n in enumerate(sizes):
            assert bytes(b.mr.view[100_000 + 8192 * i:100_000 + 8192 * i + n]) == bytes(a.mr.view[at[i]:at[i] + n])
        assert _payloads(rec, segment.UNTAGGED_PREFIX_LEN) == [1414, 1414] + [1414, 634 + envelope.FLOW_ACK_LEN] + [1024] * 4
        assert a.dev.stats["flow_ack_carried"] == 1
        if native:
            half = 1024 + wire_link.OVERHEAD + segment.UNTAGGED_PREFIX_LEN
            # bursts of two messages' halves share a send (where a pass's
            # budget ends may split a message's run)
            assert any(type(e) is tuple and e[0] == half and len(e[1]) > 1 for e in rec.log), rec.log
