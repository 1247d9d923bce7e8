"""A ping-pong's message leaves the moment its WQE is taken (``PeerLink.send_alone``).

Two real devices on loopback, loops turned by hand (``test_batching``'s
hosts).  A message that is the only thing its QP and its link have to send
goes to the socket from the pump, ahead of the rest of the pass and of the
link's bookkeeping for it (counter ``tx_alone``); messages posted together
still leave together, in one system call.  That the datagrams themselves
are what the usual path sends is ``tests/transport/test_link_alone.py``'s.
"""

from __future__ import annotations

import random

import pytest

from udpverbs.wire import native
from udpverbs.wire.shm import WcStatus as W, WrOpcode

from udpverbs.bench.inprocess import Host, complete, connected, establish, qp_pairs
from udpverbs.daemon.policy import LoopPolicy

from .twins import mangle, receive_all, turn
from .test_qp_scheduling import Tap


@pytest.mark.parametrize("native", [True, False])
async def test_each_message_of_a_ping_pong_leaves_alone(native: bool) -> None:
    a = Host("127.0.0.2", gso=True, native=native)
    async with connected(a) as (a, b):
        b.post_recv(50, 8192, 64)
        a.mr.view[0:8] = b"pingpong"
        # (opcode, messages a sends alone, messages b sends alone)
        ops = [(WrOpcode.IBV_WR_RDMA_WRITE, 1, 0), (WrOpcode.IBV_WR_SEND, 1, 0),
               (WrOpcode.IBV_WR_RDMA_READ, 1, 1), (WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD, 1, 1)]
        for i, (opcode, by_a, by_b) in enumerate(ops):
            alone = a.dev.stats["tx_alone"], b.dev.stats["tx_alone"]
            a.post_write(i, 0, 8, b, 128 if opcode == WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD else 64, opcode=opcode,
                         compare_add=1)
            assert complete(a, b, 1) == [(i, W.IBV_WC_SUCCESS)], opcode.name
            assert (a.dev.stats["tx_alone"] - alone[0], b.dev.stats["tx_alone"] - alone[1]) == (by_a, by_b), \
                opcode.name
        assert bytes(b.mr.view[64:72]) == b"pingpong"
        assert b.cqes()[0][:2] == (50, W.IBV_WC_SUCCESS)  # the Send's receive
        assert a.dev.dump_stats().get("link_retransmits", 0) == 0


async def test_messages_posted_together_leave_together() -> None:
    async with connected() as (a, b):
        if not a.dev.udp.gso:
            pytest.skip("this kernel has no UDP_SEGMENT")
        sends = a.dev.stats["tx_gso_sends"]
        for i in range(8):
            a.post_write(i, 8 * i, 8, b, 64 + 8 * i)
        a.dev.poll_once()
        assert a.dev.stats["tx_alone"] == 0
        assert a.dev.stats["tx_gso_sends"] == sends + 1  # all eight in one system call
        assert complete(a, b, 8) == [(i, W.IBV_WC_SUCCESS) for i in range(8)]
        assert bytes(b.mr.view[64:128]) == bytes(a.mr.view[0:64])


async def test_inline_writes_of_every_size_arrive_and_complete() -> None:
    # An inline Write's segment is built straight from the WQE (``Requester.start_next``):
    # each size up to the QP's max_inline_data, alone or among other WQEs,
    # lands byte-exact and completes in order; one byte more is a local
    # length error, as before.
    async with connected() as (a, b):
        a.qp.caps["max_inline_data"] = 64
        a.mr.view[:4096] = bytes(range(256)) * 16
        sizes = [0, 1, 2, 7, 33, 64]
        for i, n in enumerate(sizes):  # one at a time: each leaves alone
            a.post_write(i, 64 * i, n, b, 8192 + 64 * i, inline=True)
            a.mr.view[64 * i:64 * i + n] = bytes(n)  # the WQE holds the bytes: the source may change
            assert complete(a, b, 1) == [(i, W.IBV_WC_SUCCESS)]
        for i, n in enumerate(sizes):  # all at once, between SGE Writes: they leave together
            a.post_write(100 + 2 * i, 64 * i, n, b, 16384 + 64 * i, inline=True)
            a.post_write(101 + 2 * i, 64 * i, n, b, 24576 + 64 * i)
        assert complete(a, b, 2 * len(sizes)) == [(100 + i, W.IBV_WC_SUCCESS) for i in range(2 * len(sizes))]
        for i, n in enumerate(sizes):
            want = (bytes(range(256)) * 16)[64 * i:64 * i + n]
            assert bytes(b.mr.view[8192 + 64 * i:8192 + 64 * i + n]) == want
            assert bytes(b.mr.view[16384 + 64 * i:16384 + 64 * i + n]) == bytes(n)  # posted after the change
        a.post_write(200, 0, 65, b, 0, inline=True)
        assert complete(a, b, 1) == [(200, W.IBV_WC_LOC_LEN_ERR)]


@pytest.mark.parametrize("opcode", [WrOpcode.IBV_WR_RDMA_READ, WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD])
async def test_a_lone_request_is_answered_before_the_rest_of_the_pass(opcode: WrOpcode) -> None:
    # The responder answers a request it took alone through the compiled
    # lane at once, before the pass's link upkeep (timers, completions, the
    # pump); a batch of requests waits for the pump, as before.
    async with connected() as (a, b):
        tap = b.dev.udp.sock = Tap(b.dev.udp.sock)  # type: ignore[assignment]
        link = b.qp.link.link
        upkeep = link.next_deadline
        seen: list[int] = []  # the answers sent by each call of the link upkeep
        link.next_deadline = lambda: seen.append(len(tap.sent)) or upkeep()  # type: ignore[method-assign]
        for i in range(4):
            a.post_write(i, 0, 8, b, 128, opcode=opcode, compare_add=1)
            a.dev.poll_once()  # the request leaves
            before = len(tap.sent)
            for _ in range(200):  # until b has taken it through the lane and answered
                seen.clear()
                b.dev.poll_once()
                if len(tap.sent) > before:
                    break
            if i:  # the first one sets the lane's hint through the Python path
                assert seen[0] > before, "answered after the upkeep"
            assert complete(a, b, 1) == [(i, W.IBV_WC_SUCCESS)]
        assert b.dev.stats["rx_native_requests"] == 3
        b.dev.udp.sock = tap.sock


async def test_one_segment_writes_from_sges_arrive_and_complete() -> None:
    # A Write that fits one segment is built in start_next from its SGEs
    # too; one byte more takes the segmenting path.  Both land byte-exact.
    async with connected() as (a, b):
        a.mr.view[:8192] = bytes(range(256)) * 32
        max_data = a.qp.link.max_data
        writes = [(0, [(0, 0)]), (1, [(5, max_data)]), (2, [(0, 100), (300, 50), (1000, 7)]),
                  (3, [(11, max_data + 1)]), (4, [(0, max_data - 10), (4000, 10)])]
        for wr_id, sges in writes:
            a.post_write(wr_id, 0, 0, b, 65536 * (1 + wr_id), sges=sges)
            assert complete(a, b, 1) == [(wr_id, W.IBV_WC_SUCCESS)]
            want = b"".join(bytes(a.mr.view[off:off + n]) for off, n in sges)
            at = 65536 * (1 + wr_id)
            assert bytes(b.mr.view[at:at + len(want)]) == want


@pytest.mark.parametrize("opcode", [WrOpcode.IBV_WR_RDMA_WRITE, WrOpcode.IBV_WR_SEND])
async def test_a_long_turn_sends_what_it_has_every_32_work_requests(opcode: WrOpcode) -> None:
    # 64 small messages posted together: one pump turn takes them all, and
    # sends the first 32 before it takes the rest (qp._FLUSH_EVERY), so the
    # peer, and for Sends its Modified ACK, start on them sooner.  (Only A's
    # side is turned: what B would do with them is not the point.)
    async with connected() as (a, b):
        if not a.dev.udp.gso:
            pytest.skip("this kernel has no UDP_SEGMENT")
        sends = a.dev.stats["tx_gso_sends"]
        for i in range(64):
            a.post_write(i, 8 * (i % 8), 8, b, 64 + 8 * (i % 8), opcode=opcode)
        a.dev.poll_once()
        assert a.dev.stats["tx_gso_sends"] == sends + 2  # 32, then 32 at the end of the pass
        assert a.qp.link.link.stats.data_sent >= 64


async def _a_write_b_answers_mid_pass(a: Host, b: Host, wr_id: int, late: bool = False,
                                      opcode: WrOpcode = WrOpcode.IBV_WR_RDMA_WRITE,
                                      answer_opcode: WrOpcode = WrOpcode.IBV_WR_RDMA_WRITE) -> list[str]:
    """a Writes (or Sends, ``opcode``) to b; b's application posts its answer
    (a Write, or ``answer_opcode``) the moment b's pass has placed the data
    (while the pass goes on with the link's accounting of it), or
    (``late``) only once the pass is past its SQ watch, flushing its
    links.  Returns what that pass of b's did, in
    order: "answer" (the answer's datagram left) and "upkeep" (the links'
    timers were looked at)."""
    events: list[str] = []
    placed: list[bool] = []
    posted: list[bool] = []
    link = b.qp.link.link
    accounted, deadline, flush = link.data_run_received, link.next_deadline, b.dev.flush_links

    def answer() -> None:
        b.post_write(wr_id, 0, 8, a, 256, inline=True, opcode=answer_opcode)  # the application reacts
        posted.append(True)

    def data_run_received(*args: object) -> None:
        placed.append(True)
        if not late:
            answer()
        accounted(*args)

    def next_deadline() -> float | None:
        events.append("upkeep")
        return deadline()

    def flush_links() -> bool:
        if late and placed and not posted:
            answer()
        return flush()

    class Sock(Tap):
        def sendto(self, data: object, addr: object) -> int:
            events.append("answer")
            return super().sendto(data, addr)

    b.dev.udp.sock = Sock(b.dev.udp.sock)
    link.data_run_received, link.next_deadline = data_run_received, next_deadline  # type: ignore[method-assign]
    b.dev.flush_links = flush_links  # type: ignore[method-assign]
    try:
        a.post_write(wr_id, 0, 8, b, 64, inline=True, opcode=opcode)
        a.dev.poll_once()
        for _ in range(200):
            events.clear()
            b.dev.poll_once()
            if placed:
                break  # the pass that placed a's Write
    finally:
        b.dev.udp.sock = b.dev.udp.sock.sock
        del link.data_run_received, link.next_deadline, b.dev.flush_links
    assert posted
    return events


async def test_an_answer_posted_while_the_pass_goes_on_leaves_before_the_upkeep() -> None:
    # write_lat's server: the application sees the data and posts its answer
    # while the daemon's pass is still accounting for the Write it placed.
    # The pass looks for it between its steps (``QPScheduler.answer_early``), so
    # the answer leaves before the links' timers and completions are done;
    # and once more at its end, for an answer posted after its SQ watch.
    async with connected() as (a, b):
        for h in (a, b):
            h.qp.caps["max_inline_data"] = 64
        a.mr.view[0:8], b.mr.view[0:8] = b"pingpong", b"pongping"
        a.post_write(1, 0, 8, b, 64, inline=True)  # sets b's hint: the next Writes take the compiled lane
        assert complete(a, b, 1) == [(1, W.IBV_WC_SUCCESS)]
        for i in range(3):
            early = b.dev.stats["answered_early"]
            events = await _a_write_b_answers_mid_pass(a, b, 10 + i)
            assert events[:2] == ["answer", "upkeep"], i
            assert b.dev.stats["answered_early"] == early + 1
            assert complete(b, a, 1) == [(10 + i, W.IBV_WC_SUCCESS)]
        # posted after the pass's SQ watch: it still leaves in that pass
        early = b.dev.stats["answered_early"]
        events = await _a_write_b_answers_mid_pass(a, b, 13, late=True)
        assert "answer" in events and b.dev.stats["answered_early"] == early + 1
        assert complete(b, a, 1) == [(13, W.IBV_WC_SUCCESS)]
        assert bytes(b.mr.view[64:72]) == b"pingpong" and bytes(a.mr.view[256:264]) == b"pongping"
        assert b.dev.dump_stats().get("link_retransmits", 0) == 0


def _first_send(a: Host, b: Host, receives: int) -> None:
    """Inline posts on both sides; b posts ``receives`` receives (wr_id 50…) and a's first
    Send lands in the first of them, which sets b's hint for the compiled lane."""
    for h in (a, b):
        h.qp.caps["max_inline_data"] = 64
    a.mr.view[0:8] = b"pingpong"
    for i in range(receives):
        b.post_recv(50 + i, 8192 + 64 * i, 64)
    a.post_write(1, 0, 8, b, 0, inline=True, opcode=WrOpcode.IBV_WR_SEND)
    assert complete(a, b, 1) == [(1, W.IBV_WC_SUCCESS)]
    assert b.completions() == [(50, W.IBV_WC_SUCCESS)]


async def test_an_answer_to_a_send_is_taken_early_and_carries_the_modified_ack() -> None:
    # send_lat's server: a Send leaves its QP owing a Modified ACK, so the
    # pass will visit the QP anyway; with one WR outstanding at most (a
    # ping-pong's) its answering Send is still taken between the pass's
    # steps, and the flow ACK rides on it.
    async with connected() as (a, b):
        _first_send(a, b, 3)
        b.mr.view[0:8] = b"pongping"
        for i in range(2):
            a.post_recv(60 + i, 4096 + 64 * i, 64)
        for i in range(2):
            early, carried = b.dev.stats["answered_early"], b.dev.stats["flow_ack_carried"]
            events = await _a_write_b_answers_mid_pass(a, b, 10 + i, opcode=WrOpcode.IBV_WR_SEND,
                                                       answer_opcode=WrOpcode.IBV_WR_SEND)
            assert events[:2] == ["answer", "upkeep"], i
            assert b.dev.stats["answered_early"] == early + 1
            assert b.dev.stats["flow_ack_carried"] == carried + 1
            # b's CQ: the Send's receive, then its answer's completion
            assert complete(b, a, 2) == [(51 + i, W.IBV_WC_SUCCESS), (10 + i, W.IBV_WC_SUCCESS)]
            # a's: its Send, Modified-ACKed by the answer, and the answer's receive
            assert sorted(a.completions()) == [(10 + i, W.IBV_WC_SUCCESS), (60 + i, W.IBV_WC_SUCCESS)]
        assert bytes(a.mr.view[4096 + 64:4104 + 64]) == b"pongping"
        assert bytes(b.mr.view[8256:8264]) == b"pingpong"


async def test_a_streaming_qps_next_wqes_wait_for_the_pump() -> None:
    # With more WRs outstanding than a ping-pong's one, a QP that the pass
    # visits anyway keeps its new WQEs for the pump, after the pass's
    # completions; the answer still leaves in that pass.
    async with connected() as (a, b):
        _first_send(a, b, 2)
        b.mr.view[0:16] = b"pongpingpingpong"
        b.post_write(30, 0, 8, a, 512)
        b.post_write(31, 8, 8, a, 520)
        b.dev.poll_once()  # both leave; a has not acknowledged them yet
        assert len(b.qp.outstanding) == 2
        early = b.dev.stats["answered_early"]
        events = await _a_write_b_answers_mid_pass(a, b, 12, opcode=WrOpcode.IBV_WR_SEND)
        assert "answer" in events and b.dev.stats["answered_early"] == early
        assert sorted(complete(b, a, 4)) == [(12, W.IBV_WC_SUCCESS), (30, W.IBV_WC_SUCCESS),
                                             (31, W.IBV_WC_SUCCESS), (51, W.IBV_WC_SUCCESS)]
        assert bytes(a.mr.view[512:528]) == b"pongpingpingpong"


async def test_an_answer_does_not_pass_a_qp_waiting_itsturn() -> None:
    # Another QP of b waits in its link's line (a long Write under way): the
    # answer keeps its place behind it, taken when the pass reaches the line.
    a, b = Host("127.0.0.2", gso=True), Host("127.0.0.3", gso=True)
    try:
        pairs = qp_pairs(a, b, 2)
        await establish(a, b)
        for h in (a, b):
            h.qp.caps["max_inline_data"] = 64
        a.post_write(1, 0, 8, b, 64, inline=True)  # sets b's hint
        assert complete(a, b, 1) == [(1, W.IBV_WC_SUCCESS)]
        b.post_write(1, 0, 600_000, a, 100_000, qp=pairs[1][1])  # many passes' worth
        b.dev.poll_once()
        assert pairs[1][1] in b.qp.link.ready
        events = await _a_write_b_answers_mid_pass(a, b, 20)
        assert b.dev.stats["answered_early"] == 0 and events  # that pass did run
        done = complete(b, a, 2, passes=20000)
        assert sorted(done) == [(1, W.IBV_WC_SUCCESS), (20, W.IBV_WC_SUCCESS)]
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("native", [True, False])
async def test_a_send_of_several_segments_answers_with_the_modified_ack_on_its_last(native: bool) -> None:
    # A ping-pong of 3,000-byte Sends (three segments each): once each side
    # has learned that it answers (the first Modified ACK it owes goes alone:
    # transport/ackhold.py), every answer carries the Modified ACK of the
    # Send it answers on its last segment, built by the send lane's run as
    # by the Python path, and no flow message goes on its own.  The clock
    # stands still: no hold runs out.
    a, b = (Host(ip, gso=True, native=native) for ip in ("127.0.0.2", "127.0.0.3"))
    async with connected(a, b) as (a, b):
        clock = [a.dev.clock()]
        for h in (a, b):
            h.dev.clock = lambda: clock[0]
        a.mr.view[:3000] = bytes(range(250)) * 12
        b.mr.view[:3000] = bytes(range(249, -1, -1)) * 12
        carried = [h.dev.stats["flow_ack_carried"] for h in (a, b)]
        sent = [h.qp.link.link.stats.data_sent for h in (a, b)]
        cqes: dict[Host, list[tuple[int, int]]] = {a: [], b: []}
        rounds = 4
        for i in range(2 * rounds):
            sender, receiver = (a, b) if i % 2 == 0 else (b, a)
            receiver.post_recv(100 + i, 8192, 4096)
            sender.post_write(i, 0, 3000, receiver, 0, opcode=WrOpcode.IBV_WR_SEND)
            for _ in range(200):  # until the receive completes
                sender.dev.poll_once()
                receiver.dev.poll_once()
                for h in (a, b):
                    cqes[h] += h.completions()
                if (100 + i, W.IBV_WC_SUCCESS) in cqes[receiver]:
                    break
            assert (100 + i, W.IBV_WC_SUCCESS) in cqes[receiver]
            assert bytes(receiver.mr.view[8192:8192 + 3000]) == bytes(sender.mr.view[:3000])
        # a sends the even ones: its first (i = 0) answers nothing, its second
        # follows the Modified ACK it sent alone; b's first follows its own
        assert [h.dev.stats["flow_ack_carried"] - c for h, c in zip((a, b), carried)] == [rounds - 2, rounds - 1]
        # three segments a Send, and each side's one Modified ACK alone
        assert [h.qp.link.link.stats.data_sent - n for h, n in zip((a, b), sent)] == [3 * rounds + 1] * 2
        # and each answered Send completed on it (the last waits for an answer)
        assert sorted(x for x in cqes[a] + cqes[b] if x[0] < 100) == \
            [(i, W.IBV_WC_SUCCESS) for i in range(2 * rounds - 1)]


@pytest.mark.skipif(native.load() is None, reason="no C compiler here: runs of segments take the Python path")
@pytest.mark.parametrize("seed", range(8))
def test_ping_pongs_of_several_segments_get_through_a_bad_network(seed: int) -> None:
    # Writes and Sends of 3,000 bytes back and forth, each framed and sent as
    # soon as it is queued and recorded after (``Link.frame_run_alone``),
    # through a network that loses, duplicates, swaps and corrupts: every
    # message lands whole and completes once, as through the usual path.
    rng = random.Random(seed)
    # no hand-over: there are no scheduler turns to count on a hand-turned clock
    a, b = (Host(ip, gso=False, policy=LoopPolicy(hand_over_s=0.0)) for ip in ("127.0.0.2", "127.0.0.3"))
    try:
        clock = [1.0]
        for h in (a, b):
            h.dev.clock = lambda: clock[0]
        a.connect(b)
        b.connect(a)
        pa, pb = (x.dev.links[(y.dev.config.addr, y.dev.config.port)] for x, y in ((a, b), (b, a)))
        ends = {a: pa, b: pb}
        done: dict[Host, list[tuple[int, int]]] = {a: [], b: []}
        for i in range(16):
            sender, receiver = (a, b) if i % 2 == 0 else (b, a)
            send = i % 4 >= 2
            sender.mr.view[:3000] = rng.randbytes(3000)
            if send:
                receiver.post_recv(1000 + i, 8192, 4096)
            sender.post_write(i, 0, 3000, receiver, 8192, opcode=WrOpcode.IBV_WR_SEND if send else
                              WrOpcode.IBV_WR_RDMA_WRITE)
            for _ in range(4000):
                clock[0] += 0.001
                for x, y in ((sender, receiver), (receiver, sender)):
                    out = turn(x, ends[x], clock[0])
                    receive_all(y, ends[y], mangle(out, rng, 0.05, 0.5), clock[0])
                    done[x] += x.completions()
                if (i, W.IBV_WC_SUCCESS) in done[sender] and \
                        (not send or (1000 + i, W.IBV_WC_SUCCESS) in done[receiver]):
                    break
            assert (i, W.IBV_WC_SUCCESS) in done[sender], f"round {i}"
            assert bytes(receiver.mr.view[8192:8192 + 3000]) == bytes(sender.mr.view[:3000]), f"round {i}"
        assert sum(h.dev.stats["tx_run_alone"] for h in (a, b)) > 0
        for h in (a, b):
            assert sorted(done[h]) == sorted(set(done[h]))  # each once
            assert all(status == W.IBV_WC_SUCCESS for _, status in done[h])
    finally:
        a.close()
        b.close()
