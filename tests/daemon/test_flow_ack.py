"""A Modified ACK rides on the answering Send (envelope FLOW_ACK) when the QP answers quickly.

Two real ``Device`` objects in one process on loopback (``test_batching.Host``),
both loops turned by hand, on trio's autojump clock: the devices' time moves
only when the test sleeps, so "the answer came within the delayed-ACK time"
and "it did not" are decided by the test, not by the machine's speed.
"""

from __future__ import annotations

import trio

from udpverbs.wire.shm import WcStatus as W, WrOpcode

from udpverbs.bench.inprocess import Host, connected

SEND = WrOpcode.IBV_WR_SEND


def _turn(*hosts: Host, until, limit: int = 200) -> None:
    for _ in range(limit):
        for h in hosts:
            h.dev.poll_once()
        if until():
            return
    raise AssertionError("no progress")


def _data_sent(h: Host) -> int:
    return h.qp.link.link.stats.data_sent


def _exchange(a: Host, b: Host, i: int, *, answer: bool) -> tuple[list, list]:
    """a Sends 8 bytes to b; b (if ``answer``) Sends 8 bytes back at once.
    Returns the completions each side saw (receives reposted)."""
    seen_a: list[tuple[int, int]] = []
    seen_b: list[tuple[int, int]] = []
    a.post_write(100 + i, 0, 8, b, 0, opcode=SEND)
    _turn(a, b, until=lambda: seen_b.extend(b.completions()) or seen_b)
    b.post_recv(i, 4096, 64)
    if answer:
        b.post_write(200 + i, 0, 8, a, 0, opcode=SEND)
        _turn(b, a, until=lambda: seen_a.extend(a.completions()) or len(seen_a) == 2)
        a.post_recv(i, 4096, 64)
    return seen_a, seen_b


async def test_a_send_ping_pong_sends_one_message_per_hop(autojump_clock) -> None:
    async with connected() as (a, b):
        for h in (a, b):
            h.post_recv(0, 4096, 64)
        _exchange(a, b, 0, answer=True)  # b's answer follows its ACK closely: from now on it carries it
        assert b.qp.flow_hold.answers
        _exchange(a, b, 1, answer=True)  # ... and a's next Send follows a's ACK of b's answer
        assert a.qp.flow_hold.answers
        acks = [h.qp.link.link.stats.acks_sent for h in (a, b)]
        b_done: list[tuple[int, int]] = b.completions()
        for i in range(2, 7):
            sent_a, sent_b = _data_sent(a), _data_sent(b)
            seen_a, seen_b = _exchange(a, b, i, answer=True)
            # a's Send completed on the ACK that b's answer carried, with the answer's receive
            assert sorted(seen_a) == [(i - 1, W.IBV_WC_SUCCESS), (100 + i, W.IBV_WC_SUCCESS)]
            b_done += seen_b
            assert _data_sent(b) - sent_b == 1  # the answer alone: no Modified ACK message
            assert _data_sent(a) - sent_a == 1
        b_done += b.completions()
        # b's answers completed on the ACKs that a's next Sends carried (the last one's is still held)
        assert sorted(wr for wr, st in b_done if st == W.IBV_WC_SUCCESS and wr >= 200) == [201, 202, 203, 204, 205]
        assert all(st == W.IBV_WC_SUCCESS for _, st in b_done)
        assert b.dev.stats["flow_ack_carried"] >= 5
        assert [h.qp.link.link.stats.acks_sent for h in (a, b)] == acks  # no link ACK of their own either
        # a's last Send was answered, so a owes b an ACK, held for a's next Send
        assert a.qp.flow_ack_due and a.qp.flow_hold.until is not None
        assert a.dev.next_deadline() <= a.qp.flow_hold.until


async def test_a_send_nobody_answers_is_acked_at_once(autojump_clock) -> None:
    async with connected() as (a, b):
        b.post_recv(0, 4096, 64)
        b.post_recv(1, 4096, 64)
        for i in range(2):
            sent_b = _data_sent(b)
            done: list[tuple[int, int]] = []
            _exchange(a, b, i, answer=False)
            # no sleep: b's ACK left in the pass that placed the Send
            _turn(a, b, until=lambda: done.extend(a.completions()) or done)
            assert done == [(100 + i, W.IBV_WC_SUCCESS)]
            assert _data_sent(b) - sent_b == 1 and not b.qp.flow_hold.answers
        assert b.dev.stats["flow_ack_carried"] == 0


async def test_a_late_answer_lets_the_held_ack_go_alone(autojump_clock) -> None:
    async with connected() as (a, b):
        for h in (a, b):
            h.post_recv(0, 4096, 64)
        _exchange(a, b, 0, answer=True)
        assert b.qp.flow_hold.answers
        # a Sends; b places it and holds its ACK for an answer that does not come
        _exchange(a, b, 1, answer=False)
        assert b.qp.flow_ack_due and b.qp.flow_hold.until is not None
        for _ in range(5):
            a.dev.poll_once()
            b.dev.poll_once()
        assert a.completions() == []  # still held
        delay = b.qp.link.link.config.max_ack_delay_s
        assert b.dev.next_deadline() == b.qp.flow_hold.until
        await trio.sleep(delay)
        done: list[tuple[int, int]] = []
        _turn(b, a, until=lambda: done.extend(a.completions()) or done)
        assert done == [(101, W.IBV_WC_SUCCESS)]
        assert b.dev.stats["flow_ack_hold_expired"] == 1
        assert not b.qp.flow_hold.answers and not b.qp.flow_ack_due  # ACKs go at once again
        # The next Send is ACKed in the pass that places it, with no wait.
        _exchange(a, b, 2, answer=False)
        assert not b.qp.flow_ack_due
