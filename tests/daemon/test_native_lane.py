"""The compiled receive lane for RDMA Writes does what the Python path does.

Two receiving devices built from the same seed, one with the lane and one
without, get the same datagrams from one sender: in order, lost, duplicated,
swapped, corrupted, coalesced into GRO buffers or not, for Writes that place
and Writes that must end in a Terminate (unknown STag, past the region's
end), Read Responses, and Sends (plain, with Immediate Data, with
Invalidate, longer than their receive, or waiting out an RNR NACK; of one
segment or many; some carrying a Modified ACK for the receivers' own
Sends).  After every step they must answer the sender with the same bytes
and write the same CQEs, and at the end hold the same memory, counters and
QP state.  The clock is a
number advanced by hand and the datagrams are carried by the test, so
nothing depends on scheduling.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from udpverbs.wire import link as wire_link, native, rdmap, segment, shm
from udpverbs.wire.rdmap import Opcode
from udpverbs.wire.shm import QPState as S, WcStatus as W, WrOpcode

from udpverbs.bench.inprocess import MR_LEN, Host, complete, connected, establish, qp_pairs
from udpverbs.daemon.policy import IN_PASS_ORDER

from .twins import link_state, mangle, receive_all, turn, twins

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler here: the daemon uses the Python path")

_STEP_S = 0.001


_MORE_CTRL, _OP_READ_RESPONSE = rdmap.tagged_control(Opcode.RDMA_READ_RESPONSE, False)
_LAST_CTRL = rdmap.tagged_control(Opcode.RDMA_READ_RESPONSE, True)[0]
_seen_responses = [0]


def _forge_read_response_to(out: list[bytes], delta: int | str) -> tuple[list[bytes], int | str]:
    """Move the tagged offset of the tenth Read Response segment in ``out`` by
    ``delta`` (a peer that places out of order or past the sink), or with
    ``delta == "overrun"`` make the first Read's last segment longer and not
    the last, or with ``"ctrl zero"`` give the tenth a DDP control byte of 0
    (a DDP version the decoder refuses); the CRC stays valid.  Returns the
    datagrams and what is left to forge (0: done)."""
    forged = []
    for d in map(bytes, out):
        h, body = wire_link.decode_untrusted(d)
        if (delta and h.ptype == wire_link.PacketType.DATA and len(body) > segment.TAGGED_PREFIX_LEN
                and body[9] == _OP_READ_RESPONSE):
            _seen_responses[0] += 1
            b = bytearray(body)
            if delta == "overrun":
                if b[8] == _LAST_CTRL:
                    b[8] = _MORE_CTRL
                    b += bytes(100)  # in order, but past the end of the sink
                    delta = 0
            elif _seen_responses[0] == 10 and delta == "ctrl zero":
                b[8] = 0
                delta = 0
            elif _seen_responses[0] == 10:
                b[14:22] = ((int.from_bytes(b[14:22], "big") + delta) % 2**64).to_bytes(8, "big")
                delta = 0
            if not delta:
                d = wire_link.encode_fields(h.ptype, h.flags, h.path_id, h.conn_tag, h.seq, h.ack, h.ts_us,
                                            h.ts_echo_us, h.rwnd, b, h.sack)
        forged.append(d)
    return forged, delta


@contextlib.contextmanager
def _run(seed: int, writes: list[tuple[int, int, str]], loss: float, replies: int = 0,
         gro: float = 0.7, reply_len: int = 30_000, reads: int = 0,
         forge_to: int | str = 0, sends: list[tuple[int, str]] | None = None,
         answers: int = 0, requests: list[str] | None = None) -> Iterator[tuple[Host, Host]]:
    """A writes ``writes`` to both receivers, which write ``replies`` Writes back (so
    the ACK field of A's datagrams moves while A's own Writes stream) and post
    ``reads`` RDMA Reads of A's memory (whose Read Responses the lane places
    too; ``forge_to`` moves the tagged offset of the tenth one by that much)
    and Send A ``answers`` short messages (whose Modified ACKs A's later
    Sends carry); then A Sends ``sends`` (see ``_post_sends``) and asks the
    receivers ``requests`` (see ``_post_requests``); yields A and the
    receiver with the lane."""
    hosts = [Host("127.0.0.2", gso=False, policy=IN_PASS_ORDER),
             Host("127.0.0.3", gso=False, native=True, policy=IN_PASS_ORDER),
             Host("127.0.0.3", gso=False, native=False, policy=IN_PASS_ORDER)]  # the same seed: same tags, ISNs, STags
    try:
        yield _exchange(random.Random(seed), *hosts, writes, loss, replies, gro, reply_len, reads, forge_to,
                        sends or [], answers, requests or [])
    finally:
        for h in hosts:
            h.close()


#: where the receivers' receives start, one every _RECV_STRIDE bytes
_RECV_AT, _RECV_STRIDE = MR_LEN // 2, MR_LEN // 8
_SEND_KIND = {"ok": WrOpcode.IBV_WR_SEND, "imm": WrOpcode.IBV_WR_SEND_WITH_IMM, "inv": WrOpcode.IBV_WR_SEND_WITH_INV,
              "too_long": WrOpcode.IBV_WR_SEND, "late": WrOpcode.IBV_WR_SEND}


def _send_source(i: int) -> int:
    return 4096 * i + 7


def _post_sends(a: Host, receivers: tuple[Host, Host], first_wr_id: int,
                sends: list[tuple[int, str]], first: int, late: list[tuple[int, int]]) -> None:
    """A posts a Send per ``(length, kind)`` in ``sends[first:]``, the i-th from
    ``_send_source(i)``: kind "ok", "imm" (with Immediate Data), "inv"
    (invalidating a spare region of the receiver's), "too_long" (the
    receive holds half of it) or "late" (its receive, and all later ones,
    come after the sender's first try, which is NACKed).  The receivers post the receives that are not late;
    those that are go to ``late``, as ``(offset, length)``, for the caller to post."""
    for i, (length, kind) in enumerate(sends[first:], first):
        assert length < _RECV_STRIDE and i < Host.QP_CAPS["max_recv_wr"]
        at, room = _RECV_AT + i * _RECV_STRIDE, length // 2 if kind == "too_long" else length
        imm = 0x5EED
        if kind == "inv":
            stags = {h.spare_stag() for h in receivers}
            assert len(stags) == 1  # twins
            imm = stags.pop()
        if kind == "late" or late:
            late.append((at, room))
        else:
            for h in receivers:
                h.post_recv(300 + i, at, room)
        a.post_write(first_wr_id + i, _send_source(i), length, receivers[0], 0, opcode=_SEND_KIND[kind], imm=imm)


_REQUEST_KIND = {"read": WrOpcode.IBV_WR_RDMA_READ, "bad_stag": WrOpcode.IBV_WR_RDMA_READ,
                 "fetch_add": WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD, "cmp_swap": WrOpcode.IBV_WR_ATOMIC_CMP_AND_SWP}


def _post_requests(rng: random.Random, a: Host, receiver: Host, first_wr_id: int, requests: list[str]) -> None:
    """A posts an RDMA Read of the receivers' memory (up to 3,000 bytes; or
    of an STag they do not have: "bad_stag") or an atomic on an 8-byte word
    of it per kind in ``requests``, the answers into the second half of
    A's memory, which nothing else uses."""
    for i, kind in enumerate(requests):
        dst = MR_LEN // 2 + 4096 * i
        if kind in ("read", "bad_stag"):
            length, src = rng.randrange(1, 3000), rng.randrange(MR_LEN - 3000)
        else:
            length, src = 8, 8 * rng.randrange(MR_LEN // 8)
        rkey = receiver.mr.stag + (1 << 8) if kind == "bad_stag" else None
        # a Compare-and-Swap that compares with the word's own value swaps
        compare = int.from_bytes(receiver.mr.view[src:src + 8], sys.byteorder) if rng.random() < 0.5 else 0
        a.post_write(first_wr_id + i, dst, length, receiver, src, rkey, opcode=_REQUEST_KIND[kind],
                     compare_add=compare if kind == "cmp_swap" else rng.randrange(1 << 64), swap=rng.randrange(1 << 64))


def _exchange(rng: random.Random, a: Host, fast: Host, slow: Host, writes: list[tuple[int, int, str]],
              loss: float, replies: int, gro: float, reply_len: int, reads: int = 0,
              forge_to: int | str = 0, sends: list[tuple[int, str]] | None = None,
              answers: int = 0, requests: list[str] | None = None) -> tuple[Host, Host]:
    assert fast.dev.native is not None and slow.dev.native is None
    clock, pa, pf, ps = twins(a, fast, slow)
    a.mr.view[:] = rng.randbytes(MR_LEN)
    fast.mr.view[:] = slow.mr.view[:] = rng.randbytes(MR_LEN)
    for i in range(replies):
        length, dst = rng.randrange(reply_len), rng.randrange(MR_LEN - reply_len)
        for h in (fast, slow):
            h.post_write(100 + i, dst, length, a, dst)
    for i in range(reads):  # into the receivers' memory, from anywhere in A's
        length, src, dst = rng.randrange(reply_len), rng.randrange(MR_LEN - reply_len), rng.randrange(MR_LEN - reply_len)
        for h in (fast, slow):
            h.post_write(200 + i, dst, length, a, src, opcode=WrOpcode.IBV_WR_RDMA_READ)
    replies += reads
    for i in range(answers):  # into the top of A's memory (only the receivers' is compared)
        at = MR_LEN - (i + 1) * 4096
        a.post_recv(500 + i, at, 4096)
        length = rng.randrange(1, 1000)
        for h in (fast, slow):
            h.post_write(600 + i, 4096 * i, length, a, 0, opcode=WrOpcode.IBV_WR_SEND)
    replies += answers
    for i, (length, dst, kind) in enumerate(writes):
        rkey = fast.mr.stag + (1 << 8) if kind == "bad_stag" else None
        if kind == "past_end":
            dst = MR_LEN - length // 2 - 1
        a.post_write(i, 0, length, fast, dst, rkey=rkey)
    requests = requests or []
    _post_requests(rng, a, fast, 700, requests)
    sends = sends or []
    late: list[tuple[int, int]] = []
    replies += len(sends)  # each receive completes, well or not
    done: list[tuple[int, int]] = []
    held: list[bytes] = []
    # With answers, the second half of the Sends goes after they have
    # reached A, which then owes a Modified ACK, and the first of them
    # carries it (into the lane, if the Send before it set the hint).
    half = len(sends) // 2 if answers else len(sends)
    _post_sends(a, (fast, slow), len(writes), sends[:half], 0, late)
    first_msn, posted = a.qp.rx_msn, half == len(sends)
    for step in range(4000):
        if not posted and (a.qp.rx_msn - first_msn >= answers or step >= 100):
            _post_sends(a, (fast, slow), len(writes), sends, half, late)
            posted = True
        if step == 100:
            for at, room in late:
                for h in (fast, slow):
                    h.post_recv(400 + at, at, room)
        clock[0] += _STEP_S
        now = clock[0]
        held += turn(a, pa, now)
        if forge_to:
            held, forge_to = _forge_read_response_to(held, forge_to)
        if rng.random() < 0.3:
            continue  # arrives with the next step's: a GRO buffer may span two of A's passes
        receives = mangle(held, rng, loss, gro)
        held = []
        receive_all(fast, pf, receives, now)
        receive_all(slow, ps, receives, now)
        out_f, out_s = turn(fast, pf, now), turn(slow, ps, now)
        assert out_f == out_s  # the same ACKs, windows, echoes, Terminates
        assert link_state(pf) == link_state(ps)
        receive_all(a, pa, [(d, len(d)) for d in out_f if rng.random() >= loss], now)
        done += a.completions()
        replied = fast.cqes()
        assert replied == slow.cqes()  # every field: opcode, byte_len, wc_flags, QPNs...
        replies -= len(replied)
        if (len(done) == len(writes) + len(sends) + answers + len(requests) and replies <= 0
                or a.qp.state == S.IBV_QPS_ERR):
            break
    # both receivers ran the same datagrams to the same end
    assert bytes(fast.mr.view) == bytes(slow.mr.view)
    assert pf.link.stats.as_dict() == ps.link.stats.as_dict()
    assert pf.link.rcv_nxt == ps.link.rcv_nxt
    assert fast.qp.state == slow.qp.state and fast.qp.rx_write_bytes == slow.qp.rx_write_bytes
    assert (fast.qp.rx_msn, fast.qp.rx_placed) == (slow.qp.rx_msn, slow.qp.rx_placed)
    lane = {k: fast.dev.stats.pop(k, 0)
            for k in ("rx_native_datagrams", "rx_native_sends", "rx_native_reads", "rx_native_requests",
                      "rx_native_atomic_responses", "rx_batched_sends")}
    assert +fast.dev.stats == +slow.dev.stats
    fast.dev.stats.update(lane)
    return a, fast


_WRITE = st.tuples(st.integers(0, 40_000), st.integers(0, MR_LEN - 40_000),
                   st.sampled_from(["ok"] * 8 + ["bad_stag", "past_end"]))


#: one segment (which may carry a Modified ACK) or many
_SEND = st.tuples(st.one_of(st.integers(0, 1400), st.integers(1, 60_000)),
                  st.sampled_from(["ok", "ok", "imm", "inv", "too_long", "late"]))


#: what A asks the receivers: Reads and atomics, and now and then a Read they must refuse
_REQUEST = st.sampled_from(["read"] * 3 + ["fetch_add"] * 2 + ["cmp_swap"] * 2 + ["bad_stag"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), writes=st.lists(_WRITE, min_size=1, max_size=5),
       loss=st.sampled_from([0.0, 0.02, 0.1]), replies=st.integers(0, 3), reads=st.integers(0, 2),
       sends=st.lists(_SEND, max_size=4), answers=st.integers(0, 2), requests=st.lists(_REQUEST, max_size=4))
def test_the_lane_and_the_python_path_agree(seed: int, writes: list[tuple[int, int, str]], loss: float,
                                            replies: int, reads: int, sends: list[tuple[int, str]],
                                            answers: int, requests: list[str]) -> None:
    with _run(seed, writes, loss, replies, reads=reads, sends=sends, answers=answers, requests=requests):
        pass


@pytest.mark.parametrize("loss", [0.0, 0.05])
def test_requests_go_through_the_lane(loss: float) -> None:
    requests = ["read"] * 3 + ["fetch_add", "cmp_swap"] * 2
    with _run(29, [(1, 0, "ok")], loss, requests=requests) as (a, fast):
        assert fast.qp.state == S.IBV_QPS_RTS and a.qp.state == S.IBV_QPS_RTS
        if not loss:
            # all but the first Read and the first atomic, which set the hint
            assert fast.dev.stats["rx_native_requests"] == len(requests) - 2


@pytest.mark.parametrize("delta", [1, -1448, 1 << 20, "overrun", "ctrl zero"])
def test_a_read_response_out_of_place_ends_alike(delta: int | str) -> None:
    # in the middle of a run the lane holds: a gap, a step back, past the sink,
    # in order but longer than the sink, a segment the decoder refuses
    _seen_responses[0] = 0
    with _run(17, [(1, 0, "ok")], 0.0, reads=1, reply_len=200_000, forge_to=delta) as (_, fast):
        assert fast.dev.stats["terminate_sent"] == 1 and fast.qp.state == S.IBV_QPS_ERR


@pytest.mark.parametrize("loss", [0.0, 0.05])
def test_read_responses_go_through_the_lane(loss: float) -> None:
    with _run(13, [(1, 0, "ok")], loss, reads=3, reply_len=300_000) as (a, fast):
        assert fast.qp.state == S.IBV_QPS_RTS
        # all but the first Read's first segment, and what loss sends the Python way
        assert fast.dev.stats["rx_native_datagrams"] > (0.5 if loss else 0.9) * fast.dev.dump_stats()[
            "link_data_received"]
        if not loss:
            assert fast.dev.stats["rx_native_reads"] == 3  # the lane completed them all


@pytest.mark.parametrize("loss", [0.0, 0.05])
@pytest.mark.parametrize("bad", ["bad_stag", "past_end"])
def test_a_bad_write_behind_a_good_one_ends_alike(bad: str, loss: float) -> None:
    # the lane holds the good Write's STag when the bad one's first segment comes
    with _run(3, [(30_000, 0, "ok"), (30_000, 100_000, bad)], loss) as (_, fast):
        assert fast.dev.stats["terminate_sent"] == 1 and fast.qp.state == S.IBV_QPS_ERR


@pytest.mark.parametrize("gro", [0.0, 0.7])
def test_writes_in_both_directions_at_once(gro: float) -> None:
    # the ACK field of A's datagrams moves while its Writes stream
    with _run(11, [(300_000, 0, "ok"), (300_000, 300_000, "ok")], 0.0, replies=3, gro=gro, reply_len=300_000):
        pass


def test_a_clean_stream_goes_through_the_lane_and_arrives_byte_exact() -> None:
    writes = [(300_000, 4096, "ok"), (1, 0, "ok"), (70_000, 500_000, "ok")]
    with _run(7, writes, 0.0) as (a, fast):
        assert a.qp.state == S.IBV_QPS_RTS
        assert fast.dev.stats["rx_native_datagrams"] > 200  # all but each Write's first segment
        view = fast.mr.view
        assert bytes(view[4096:4096 + 300_000]) == bytes(a.mr.view[:300_000])
        assert bytes(view[500_000:570_000]) == bytes(a.mr.view[:70_000])
        assert view[0] == a.mr.view[0]



async def test_writes_interleaved_over_many_qps_stay_in_the_lane() -> None:
    # Each QP's next message makes the lane stop at a segment of another QP:
    # it points itself there instead of leaving that segment to the Python
    # path (one datagram per message before, most of a 64-QP stream's cost).
    a, b = Host("127.0.0.2", gso=True), Host("127.0.0.3", gso=True)
    try:
        pairs = qp_pairs(a, b, 4)
        await establish(a, b)
        rng = random.Random(5)
        a.mr.view[:] = rng.randbytes(MR_LEN)
        length, rounds = 30_000, 3
        for i in range(rounds):
            for k, (qa, _) in enumerate(pairs):
                at = (i * len(pairs) + k) * length
                a.post_write(k, at, length, b, at, qp=qa)
        done: list[tuple[int, int]] = []
        for _ in range(20000):
            a.dev.poll_once()
            b.dev.poll_once()
            done += a.completions()
            if len(done) == rounds * len(pairs):
                break
        assert sorted(done) == sorted((k, 0) for k in range(len(pairs)) for _ in range(rounds))
        total = rounds * len(pairs) * length
        assert bytes(b.mr.view[:total]) == bytes(a.mr.view[:total])
        assert not any(b.mr.view[total:])  # nothing placed past the Writes
        received = b.dev.dump_stats()["link_data_received"]
        assert received > 12 * 20  # 21 segments a Write
        # the first segment sets the first hint; after it, only loss would leave the lane
        assert b.dev.stats["rx_native_datagrams"] >= received - 1 - b.dev.dump_stats().get("link_retransmits", 0)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kinds", ["WS", "S1S2", "WR"])
async def test_runs_of_every_kind_in_turn_keep_the_lane(kinds: str) -> None:
    # The lane's settings for a Write's run are kept while the hint and the
    # region stay the same, and a Send's (but the receive's) while the hint
    # does.  A run of another kind or QP in between must make the next one
    # set them again, or the lane turns it away, or worse.  Each round brings
    # b, in this order: a Write and a Send (WS), Sends on two QPs (S1S2), or
    # a Write and the Response to b's Read (WR).
    a, b = Host("127.0.0.2", gso=True), Host("127.0.0.3", gso=True)
    try:
        (qa1, qb1), (qa2, qb2) = qp_pairs(a, b, 2)
        await establish(a, b)
        rng = random.Random(11)
        a.mr.view[:] = rng.randbytes(MR_LEN)
        # three segments each (a prime: no stream's message is cut evenly,
        # see equal_segment_size)
        length, rounds = 4_001, 4
        received = 0
        for i in range(rounds):
            at = i * length
            if kinds == "WS":
                b.post_recv(100 + i, 500_000 + at, length)
                a.post_write(2 * i, at, length, b, at)
                a.post_write(2 * i + 1, 100_000 + at, length, b, 0, opcode=WrOpcode.IBV_WR_SEND)
                theirs, ours = 2, [(100 + i, 0)]
                moved = [(at, at), (100_000 + at, 500_000 + at)]
            elif kinds == "S1S2":
                b.post_recv(100 + i, 500_000 + at, length, qp=qb1)
                b.post_recv(200 + i, 600_000 + at, length, qp=qb2)
                a.post_write(2 * i, 100_000 + at, length, b, 0, opcode=WrOpcode.IBV_WR_SEND, qp=qa1)
                a.post_write(2 * i + 1, 200_000 + at, length, b, 0, opcode=WrOpcode.IBV_WR_SEND, qp=qa2)
                theirs, ours = 2, [(100 + i, 0), (200 + i, 0)]
                moved = [(100_000 + at, 500_000 + at), (200_000 + at, 600_000 + at)]
            else:
                a.post_write(i, at, length, b, at)
                b.post_write(1000 + i, 300_000 + at, length, a, 200_000 + at, opcode=WrOpcode.IBV_WR_RDMA_READ)
                theirs, ours = 1, [(1000 + i, 0)]
                moved = [(at, at), (200_000 + at, 300_000 + at)]
            done: list[tuple[int, int]] = []
            got: list[tuple[int, int]] = []
            for _ in range(2000):
                a.dev.poll_once()
                b.dev.poll_once()
                done += a.completions()
                got += b.completions()
                if len(done) == theirs and len(got) == len(ours):
                    break
            assert sorted(done) == [(theirs * i + j, 0) for j in range(theirs)]
            assert sorted(got) == ours
            for src, dst in moved:
                assert bytes(b.mr.view[dst:dst + length]) == bytes(a.mr.view[src:src + length]), (i, src, dst)
            received += 2 * 3
        assert b.dev.dump_stats()["link_data_received"] == received
        # each message's first segment sets the hint; the lane takes the rest
        assert b.dev.stats["rx_native_datagrams"] >= received * 2 // 3
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("loss", [0.0, 0.05])
def test_sends_go_through_the_lane_and_arrive_byte_exact(loss: float) -> None:
    sends = [(100_000, "ok"), (50_000, "imm"), (70_001, "inv"), (1, "ok")]
    with _run(19, [(1, 0, "ok")], loss, sends=sends) as (a, fast):
        assert a.qp.state == S.IBV_QPS_RTS and fast.dev.stats["stag_remote_invalidated"] == 1
        # all but each Send's first and last segments, and what loss sends the
        # Python way: behind a hole, until it is filled (the window stays open
        # under random loss, so that is a good part of so short a transfer)
        assert fast.dev.stats["rx_native_datagrams"] > (0.3 if loss else 0.9) * fast.dev.dump_stats()[
            "link_data_received"]
        for i, (length, _) in enumerate(sends):
            at, src = _RECV_AT + i * _RECV_STRIDE, _send_source(i)
            assert bytes(fast.mr.view[at:at + length]) == bytes(a.mr.view[src:src + length])


@pytest.mark.parametrize("kinds", [("late", "ok"), ("ok", "too_long")])
def test_a_send_nacked_or_too_long_ends_alike(kinds: tuple[str, str]) -> None:
    # the lane holds the first Send's receive when the second one's first
    # segment is NACKed for want of a receive, or overruns its receive
    with _run(23, [(1, 0, "ok")], 0.0, sends=[(40_000, k) for k in kinds]) as (a, fast):
        if kinds[0] == "late":
            assert fast.dev.stats["rnr_nack_sent"] >= 1 and a.qp.state == S.IBV_QPS_RTS
        else:
            assert fast.dev.stats["terminate_sent"] == 1 and fast.qp.state == S.IBV_QPS_ERR
        assert fast.dev.stats["rx_native_datagrams"] > 20


def test_the_daemon_flag_turns_the_lane_off() -> None:
    from udpverbs.daemon import config
    from udpverbs.daemon.device import Device, DeviceConfig

    assert config.load([])["native"] is True
    assert config.load(["--no-native"])["native"] is False
    dev = Device(DeviceConfig(native=False))
    try:
        assert dev.native is None
    finally:
        dev.close()


@pytest.mark.parametrize("native", [True, False])
def test_a_read_whose_sink_is_deregistered_midway_costs_the_daemon_nothing(native: bool) -> None:
    # The sink's view is released under an outstanding Read (the application
    # deregistered its region): the responses that follow are bad input,
    # counted, never an exception out of the receive path.
    a, req = Host("127.0.0.2", gso=False), Host("127.0.0.3", gso=False, native=native)
    try:
        clock = [1.0]
        for h in (a, req):
            h.dev.clock = lambda: clock[0]
        a.connect(req)
        req.connect(a)
        pa = a.dev.links[(req.dev.config.addr, req.dev.config.port)]
        pr = req.dev.links[(a.dev.config.addr, a.dev.config.port)]
        req.post_write(1, 0, 300_000, a, 0, opcode=WrOpcode.IBV_WR_RDMA_READ)
        closed = False
        for _ in range(400):
            clock[0] += _STEP_S
            receive_all(a, pa, [(d, len(d)) for d in turn(req, pr, clock[0])], clock[0])
            out = turn(a, pa, clock[0])
            if not closed and req.qp.orrq and req.qp.orrq[0].placed > 10_000:
                req.dev.stags.invalidate(req.mr.stag)
                req.mr.close()
                closed = True
            receive_all(req, pr, [(b"".join(out), len(out[0]))] if out else [], clock[0])
            if req.completions():
                break
        assert closed and req.dev.stats["rx_exception"] >= 1
    finally:
        a.close()
        req.close()


def test_single_segment_sends_and_the_acks_they_carry_go_through_the_lane() -> None:
    # The first Send goes the Python way (the hint is the Writes') and points
    # the lane at Sends; the rest leave after the receivers' answer has
    # reached A, and the first of them carries A's Modified ACK for it.
    sends = [(100, "ok"), (0, "ok"), (1000, "ok"), (1400, "ok")]
    with _run(29, [(40_000, 0, "ok")], 0.0, sends=sends, answers=1) as (a, fast):
        assert a.dev.stats["flow_ack_carried"] == 1
        assert fast.dev.stats["rx_native_sends"] == 2  # not the first, nor the one with no room
        assert not fast.qp.outstanding  # the carried ACK completed the answer
        for i, (length, _) in enumerate(sends):
            at, src = _RECV_AT + i * _RECV_STRIDE, _send_source(i)
            assert bytes(fast.mr.view[at:at + length]) == bytes(a.mr.view[src:src + length])


async def test_small_reads_complete_through_the_lane_in_the_pass_that_places_them() -> None:
    # A one-segment Read Response is first and last at once; each Read has a
    # sink STag of its own, so the lane follows the ORRQ head, not the hint.
    # The responder takes the Read Requests through the lane too, and
    # answers each in the pass that takes it.
    async with connected(Host("127.0.0.2", gso=True), Host("127.0.0.3", gso=True)) as (a, b):
        b.mr.view[256:266] = bytes(range(1, 11))
        for i in range(5):
            a.post_write(i, 128 + 2 * i, 2, b, 256 + 2 * i, opcode=WrOpcode.IBV_WR_RDMA_READ)
            assert complete(a, b, 1, 50) == [(i, 0)]
        assert bytes(a.mr.view[128:138]) == bytes(range(1, 11))
        assert a.dev.stats["rx_native_reads"] == 4  # all but the first, which sets the hint
        assert b.dev.stats["rx_native_requests"] == 4  # likewise


@pytest.mark.parametrize("native", [True, False])
async def test_atomic_responses_complete_through_the_lane(native: bool) -> None:
    # The requester takes an Atomic Response as the responder takes its
    # request: the lane checks the packet and header (queue 3, the MSN after
    # the last one, one whole 12-byte segment) and the QP matches it with
    # the ORRQ head as the Python path does.  The original values land
    # alike with the lane or without it.
    async with connected(Host("127.0.0.2", gso=True, native=native), Host("127.0.0.3", gso=True)) as (a, b):
        word = 0x0102030405060708
        b.mr.view[64:72] = word.to_bytes(8, sys.byteorder)
        ops = [(WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD, 5, 0), (WrOpcode.IBV_WR_ATOMIC_CMP_AND_SWP, 0, 9),
               (WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD, 1 << 63, 0)]
        expected = []
        for i in range(6):
            opcode, add, swap = ops[i % 3]
            if opcode == WrOpcode.IBV_WR_ATOMIC_CMP_AND_SWP:
                add = word if i % 2 else word + 1  # swaps when it compares equal
            expected.append(word)
            if opcode == WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD:
                word = (word + add) & (1 << 64) - 1
            elif add == word:
                word = swap
            a.post_write(i, 1024 + 8 * i, 8, b, 64, opcode=opcode, compare_add=add, swap=swap)
            assert complete(a, b, 1, 50) == [(i, 0)]
        got = [int.from_bytes(a.mr.view[1024 + 8 * i:1032 + 8 * i], sys.byteorder) for i in range(6)]
        assert got == expected
        assert int.from_bytes(b.mr.view[64:72], sys.byteorder) == word
        # all but the first, which sets the hint
        assert a.dev.stats["rx_native_atomic_responses"] == (5 if native else 0)


@pytest.mark.parametrize("gone", [False, True])
@pytest.mark.parametrize("ahead", [False, True])
async def test_a_receive_resolved_ahead_still_follows_the_stag_table(ahead: bool, gone: bool) -> None:
    # B's receive, into a spare region of B's, is resolved ahead of A's
    # Send when B's own Send leaves (``ahead``), as a Send ping-pong posts
    # it (with the compiled lane, the arming resolves it instead, in a pass
    # of its own: here by hand); if the region is deregistered before A's
    # Send comes (``gone``), the Send finds it gone either way.
    async with connected(Host("127.0.0.2", gso=True), Host("127.0.0.3", gso=True)) as (a, b):
        stag = b.spare_stag()
        spare = b.dev.stags.lookup(stag)
        rq = b.qp.recv_ring
        rq.prod = rq.hdr.producer
        at = rq.next_slot_offset()
        shm.RECV_WQE_HEAD.pack_into(rq.buf, at, 77, 1)
        shm.SGE.pack_into(rq.buf, at + shm.RECV_WQE_SG_OFFSET, spare.addr + 100, 64, stag)
        rq.push()
        rq.publish()
        a.post_recv(5, 4096, 64)  # B's Send lands away from what A sends
        if ahead:
            b.post_write(1, 0, 2, a, 0, opcode=WrOpcode.IBV_WR_SEND)
            b.dev.poll_once()  # B's Send leaves, then its receive is resolved
            if b.dev.native is not None:
                b.qp.prefetch_receive()
            kept = b.qp.peek_receive()  # resolved ahead: the same answer each time
            assert kept is not None and kept[0] == 77 and b.qp.peek_receive() is kept
        if gone:
            b.dev.stags.invalidate(stag)
        a.mr.view[:2] = b"hi"
        a.post_write(2, 0, 2, b, 0, opcode=WrOpcode.IBV_WR_SEND)
        got: list[tuple[int, int]] = []
        for _ in range(50):
            a.dev.poll_once()
            b.dev.poll_once()
            got += b.completions()
            if any(wr_id == 77 for wr_id, _ in got):
                break
        status = W.IBV_WC_LOC_PROT_ERR if gone else W.IBV_WC_SUCCESS
        assert (77, status) in got
        assert bytes(spare.view[100:102]) == (b"\0\0" if gone else b"hi")


@pytest.mark.parametrize("side", ["receive", "send"])
async def test_the_same_sge_posted_once_its_region_is_gone_fails(side: str) -> None:
    # Applications post the same buffer over and over, and the daemon keeps
    # the last one-SGE list of a WQE it resolved (``Requester.resolve``):
    # only while the STag table stands still.  Once the region is
    # invalidated (as deregistration starts), the same SGE posted again
    # fails, on either side, and nothing lands in, or leaves from, the old
    # region.
    async with connected(Host("127.0.0.2", gso=True), Host("127.0.0.3", gso=True)) as (a, b):
        stag = b.spare_stag()
        spare = b.dev.stags.lookup(stag)
        assert spare is not None
        spare.view[:2] = b"ok"
        got: list[tuple[int, int]] = []
        for round_ in range(2):
            if round_:
                b.dev.stags.invalidate(stag)
            if side == "receive":
                b.post_recv(70 + round_, 100, 64, local=spare)
                a.mr.view[:2] = b"hi" if round_ == 0 else b"no"
                a.post_write(round_, 0, 2, b, 0, opcode=WrOpcode.IBV_WR_SEND)
            else:
                a.post_recv(70 + round_, 64 * round_, 64)
                b.post_write(round_, 0, 2, a, 0, opcode=WrOpcode.IBV_WR_SEND, local=spare)
            for _ in range(50):
                a.dev.poll_once()
                b.dev.poll_once()
                got += b.completions()  # the receive's, or the Send's
                if any(wr_id == (70 if side == "receive" else 0) + round_ for wr_id, _ in got):
                    break
        if side == "receive":
            assert got == [(70, W.IBV_WC_SUCCESS), (71, W.IBV_WC_LOC_PROT_ERR)]
            assert bytes(spare.view[100:102]) == b"hi"
        else:
            assert got == [(0, W.IBV_WC_SUCCESS), (1, W.IBV_WC_LOC_PROT_ERR)]
            assert bytes(a.mr.view[0:2]) == b"ok" and not any(a.mr.view[64:128])


async def test_a_batch_longer_than_a_lane_call_takes_is_taken_in_parts() -> None:
    # 70 Atomic Responses back to back, more than the 64 a lane call takes,
    # and a limit that would allow them all: one call takes 64 and leaves
    # the rest.  (A GRO buffer holds at most 64 datagrams; the daemon must
    # not depend on that.)
    async with connected(Host("127.0.0.2", gso=True), Host("127.0.0.3", gso=True)) as (a, b):
        a.post_write(0, 1024, 8, b, 64, opcode=WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD, compare_add=1)
        assert complete(a, b, 1, 50) == [(0, 0)]  # an RTT sample, so the link takes runs
        pl = a.qp.link
        link = pl.link
        expect = link.run_receivable()
        assert expect is not None and expect[2] > 70
        tag, seq, _ = expect
        msn = a.qp.rx_atomic_resp_msn
        datagrams = []
        for i in range(70):
            body = bytearray(segment.UNTAGGED_PREFIX_LEN)
            segment.pack_untagged_into(body, 0, 1, 1, Opcode.ATOMIC_RESPONSE, True, msn + i, 0)
            body += rdmap.encode_atomic_response(rdmap.AtomicResponse(i, i))
            datagrams.append(wire_link.encode_fields(wire_link.PacketType.DATA, 0, link.path_id, tag,
                                                     (seq + i) & 0xFFFFFFFF, (link.isn + link.recovery.una) & 0xFFFFFFFF,
                                                     1000, 0, 100, bytes(body)))
        size = len(datagrams[0])
        pl.rx_hint = (a.qp, 0, int(Opcode.ATOMIC_RESPONSE))
        now = a.dev.now
        used = a.dev.lane.place_run(pl, b"".join(datagrams), 0, size, now, now, 10_000)
        assert used == 64 * size
        assert a.dev.stats["rx_native_atomic_responses"] == 64


def _cqes_at_each_lane_run(host: Host) -> list[int]:
    """From now on, how many CQEs wait in ``host``'s CQ each time its link
    accounts for a run the compiled lane took (``Link.data_run_received``)."""
    seen: list[int] = []
    link = host.qp.link.link
    run_received = link.data_run_received

    def accounted(*args: Any) -> None:
        seen.append(host.cq.ring.available())
        run_received(*args)

    link.data_run_received = accounted  # type: ignore[method-assign]
    return seen


async def test_a_send_completes_before_the_link_accounts_for_its_run() -> None:
    # The application waits on a Send's CQE; the link's accounting of the
    # run (and of the ACK it carries) waits on nothing: the lane's pass
    # writes the CQE first.
    async with connected() as (a, b):
        for i in range(3):
            b.post_recv(i, 256 * i, 64)
        seen = _cqes_at_each_lane_run(b)
        for i in range(3):
            a.post_write(10 + i, 0, 8, b, 0, opcode=WrOpcode.IBV_WR_SEND)
            assert complete(a, b, 1, 50) == [(10 + i, 0)]
        assert [c[0] for c in b.cqes()] == [0, 1, 2]
        assert b.dev.stats["rx_native_sends"] == 2  # all but the first, which set the hint
        assert seen[-2:] == [2, 3]  # each lane Send's CQE was there already


@pytest.mark.parametrize("native", [True, False])
async def test_a_receive_is_off_its_ring_before_its_cqe_is_seen(native: bool) -> None:
    # verbs: once the application has polled a receive's CQE, its slot is
    # free.  An application that keeps its RQ full re-posts at once, so the
    # ring's consumer index must move before the CQE is written, by the
    # lane's path as by the Python path.
    async with connected(Host("127.0.0.2", gso=True), Host("127.0.0.3", gso=True, native=native)) as (a, b):
        rq = b.qp.recv_ring
        for i in range(Host.QP_CAPS["max_recv_wr"]):
            b.post_recv(i, 256 * i, 64)
        freed_at_cqe = []
        push = b.cq.push

        def pushed(*args: Any, **kw: Any) -> bool:
            freed_at_cqe.append(rq.hdr.consumer)
            return push(*args, **kw)

        b.cq.push = pushed  # type: ignore[method-assign]
        lane = b.dev.lane
        if lane is not None:  # the armed read writes the CQE itself: look right after it
            read_send = lane.read_send

            def read_and_look(*args: Any) -> int:
                k = read_send(*args)
                if lane.cqe_written:
                    freed_at_cqe.append(rq.hdr.consumer)
                return k

            lane.read_send = read_and_look  # type: ignore[method-assign]
        for i in range(4):
            a.post_write(10 + i, 0, 8, b, 0, opcode=WrOpcode.IBV_WR_SEND)
            assert complete(a, b, 1, 50) == [(10 + i, 0)]
        assert freed_at_cqe == [1, 2, 3, 4]
        assert b.dev.stats["rx_native_sends"] == (3 if native else 0)


@pytest.mark.parametrize("opcode", [WrOpcode.IBV_WR_RDMA_READ, WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD])
async def test_a_read_or_atomic_completes_before_the_link_accounts_for_its_run(opcode: WrOpcode) -> None:
    # As for a Send's receive: the requester's application waits on the
    # CQE, which the lane's pass writes before the link's accounting.
    async with connected() as (a, b):
        seen = _cqes_at_each_lane_run(a)
        for i in range(3):
            a.post_write(i, 1024 + 8 * i, 8, b, 64, opcode=opcode, compare_add=1)
            for _ in range(50):
                a.dev.poll_once()
                b.dev.poll_once()
                if a.cq.ring.available() > i:
                    break
        assert [(c[0], c[1]) for c in a.cqes()] == [(0, 0), (1, 0), (2, 0)]
        assert seen[-2:] == [2, 3]  # the lane's two: each one's CQE was there already
