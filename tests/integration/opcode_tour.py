"""Every RDMAP message once between two real daemons, and what the RFCs say its segments carry.

``run_tour(a, b)`` posts from A to B, on a fresh pair of QPs: an RDMA Write
of several segments, a Write with Immediate, a Read, a Send of several
segments, a Send with Immediate, with Invalidate and with Solicited Event,
a Fetch-and-Add, a Compare-and-Swap, a second Read, and last a Write to a
region without remote write access, which B answers with a Terminate.  It
returns what it posted (``Tour``).

``check_tour(tour, segments)`` holds the DDP segments a capture decoded
(``Segment``, from the project's codecs or from Wireshark) to RFC 5040,
RFC 5041 and RFC 7306, with the RFCs' numbers written out here rather than
taken from ``wire/``: the queue of every untagged opcode, one MSN sequence
per queue and direction from 1 (Read and Atomic Requests share queue 1),
message offsets from 0 with L on the last segment only, and the STags,
tagged offsets, lengths and operands of what was posted.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Iterable

from udpverbs import verbs
from udpverbs.verbs.enums import (
    IBV_ACCESS_LOCAL_WRITE,
    IBV_ACCESS_REMOTE_ATOMIC,
    IBV_ACCESS_REMOTE_READ,
    IBV_ACCESS_REMOTE_WRITE,
    IBV_SEND_SIGNALED,
    IBV_SEND_SOLICITED,
    IBV_WC_REM_ACCESS_ERR,
    IBV_WC_SUCCESS,
    IBV_WR_ATOMIC_CMP_AND_SWP,
    IBV_WR_ATOMIC_FETCH_AND_ADD,
    IBV_WR_RDMA_READ,
    IBV_WR_RDMA_WRITE,
    IBV_WR_RDMA_WRITE_WITH_IMM,
    IBV_WR_SEND,
    IBV_WR_SEND_WITH_IMM,
    IBV_WR_SEND_WITH_INV,
)

from .conftest import ACCESS_ALL, Side

ACCESS_ATOMIC = ACCESS_ALL | IBV_ACCESS_REMOTE_ATOMIC

# RDMA Message OpCodes (RFC 5040 §4.2; RFC 7306 adds 1000b-1011b)
WRITE, READ_REQUEST, READ_RESPONSE, SEND, SEND_INV, SEND_SE, SEND_SE_INV, TERMINATE = range(8)
IMMEDIATE, IMMEDIATE_SE, ATOMIC_REQUEST, ATOMIC_RESPONSE = 8, 9, 10, 11
#: the DDP queue of every untagged opcode: RFC 5040 §5 (Send 0, Read Request
#: 1, Terminate 2) and RFC 7306 (Immediate Data on 0, Atomic Request on 1
#: beside Read Requests, Atomic Response on 3)
RFC_QN = {READ_REQUEST: 1, SEND: 0, SEND_INV: 0, SEND_SE: 0, SEND_SE_INV: 0, TERMINATE: 2, IMMEDIATE: 0,
          IMMEDIATE_SE: 0, ATOMIC_REQUEST: 1, ATOMIC_RESPONSE: 3}
TAGGED = {WRITE, READ_RESPONSE}
FETCH_ADD, CMP_SWAP = 0b0000, 0b0010  # RFC 7306 Atomic Operation codes

WRITE_LEN = 10_000  # several segments at any --mtu the tests use
SEND_LEN = 5_000
READ_LEN = 3_000


@dataclasses.dataclass
class Segment:
    """One DDP segment as a capture decoded it.

    ``sender`` is "A" or "B"; ``seq`` the link sequence number of its
    packet (a retransmission repeats it).  Tagged segments have ``stag`` and
    ``to``; untagged ones ``qn``, ``msn``, ``mo`` and ``inv_stag``.
    ``length`` counts the DDP payload; ``body`` holds the fields of the
    RDMAP header a Read Request, Terminate, atomic or Immediate Data
    carries as its payload, by the names used below.
    """

    sender: str
    seq: int
    opcode: int
    last: bool
    length: int
    stag: int | None = None
    to: int | None = None
    qn: int | None = None
    msn: int | None = None
    mo: int | None = None
    inv_stag: int = 0
    body: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Tour:
    """What ``run_tour`` posted (addresses are B's unless named otherwise)."""

    rkey: int  #: B's region for Writes, Reads, Sends' data and atomics
    write_to: int
    write_imm_to: int
    imm: int
    read_from: int
    read2_from: int
    inv_rkey: int  #: the STag the Send with Invalidate names
    atomic_to: int
    add: int
    compare: int
    swap: int
    word_before: int  #: the atomic word before the Fetch-and-Add
    noperm_rkey: int  #: the region without remote write access
    noperm_to: int
    statuses: list[int] = dataclasses.field(default_factory=list)


def _post(side: Side, wr: verbs.SendWR) -> int:
    side.qp.post_send(wr)
    (wc,) = side.cq.poll_blocking(1, timeout=10)
    assert wc.wr_id == wr.wr_id
    return wc.status


def _wr(side: Side, wr_id: int, opcode: int, n: int, offset: int = 0, flags: int = IBV_SEND_SIGNALED,
        **kw: Any) -> verbs.SendWR:
    return verbs.SendWR(wr_id=wr_id, opcode=opcode, sg=[verbs.SGE(side.mr.buf + offset, n, side.mr.lkey)],
                        send_flags=flags, **kw)


def run_tour(a: Side, b: Side) -> Tour:
    """Post every opcode from A's QP to B's (connected, in RTS, nothing sent yet); see the module docstring."""
    inv_target = verbs.MR(b.pd, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)
    noperm = verbs.MR(b.pd, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ)
    base = b.mr.buf
    t = Tour(rkey=b.mr.rkey, write_to=base + 64, write_imm_to=base + 65536, imm=0x5EED1234, read_from=base + 131072,
             read2_from=base + 131072 + 4096, inv_rkey=inv_target.rkey, atomic_to=base + 196608,
             add=0x10, compare=0x1234_5688, swap=0xABCD, word_before=0x1234_5678, noperm_rkey=noperm.rkey,
             noperm_to=noperm.buf + 128)
    a.mr.write(bytes(range(256)) * 64, 16384, 0)
    b.mr.write(bytes(range(7, 247)) * 20, 4800, t.read_from - base)
    b.mr.write(t.word_before.to_bytes(8, sys.byteorder), 8, t.atomic_to - base)
    for i in range(5):  # Write with Immediate, Send, Send with Immediate, with Invalidate, with SE
        b.qp.post_recv(verbs.RecvWR(wr_id=100 + i, sg=[verbs.SGE(base + 524288 + 8192 * i, 8192, b.mr.lkey)]))
    wrs: list[verbs.SendWR] = []
    w = _wr(a, 1, IBV_WR_RDMA_WRITE, WRITE_LEN)
    w.set_wr_rdma(t.rkey, t.write_to)
    wrs.append(w)
    w = _wr(a, 2, IBV_WR_RDMA_WRITE_WITH_IMM, 100, imm_data=t.imm)
    w.set_wr_rdma(t.rkey, t.write_imm_to)
    wrs.append(w)
    w = _wr(a, 3, IBV_WR_RDMA_READ, READ_LEN, offset=32768)
    w.set_wr_rdma(t.rkey, t.read_from)
    wrs.append(w)
    wrs.append(_wr(a, 4, IBV_WR_SEND, SEND_LEN))
    wrs.append(_wr(a, 5, IBV_WR_SEND_WITH_IMM, 16, imm_data=t.imm + 1))
    wrs.append(_wr(a, 6, IBV_WR_SEND_WITH_INV, 8, invalidate_rkey=t.inv_rkey))
    wrs.append(_wr(a, 7, IBV_WR_SEND, 8, flags=IBV_SEND_SIGNALED | IBV_SEND_SOLICITED))
    w = _wr(a, 8, IBV_WR_ATOMIC_FETCH_AND_ADD, 8, offset=40960)
    w.set_wr_atomic(t.rkey, t.atomic_to, t.add)
    wrs.append(w)
    w = _wr(a, 9, IBV_WR_ATOMIC_CMP_AND_SWP, 8, offset=40968)
    w.set_wr_atomic(t.rkey, t.atomic_to, t.compare, t.swap)
    wrs.append(w)
    w = _wr(a, 10, IBV_WR_RDMA_READ, 64, offset=45056)
    w.set_wr_rdma(t.rkey, t.read2_from)
    wrs.append(w)
    w = _wr(a, 11, IBV_WR_RDMA_WRITE, 32)
    w.set_wr_rdma(t.noperm_rkey, t.noperm_to)
    wrs.append(w)
    t.statuses = [_post(a, wr) for wr in wrs]
    for _ in range(5):
        (wc,) = b.cq.poll_blocking(1, timeout=10)
        assert wc.status == IBV_WC_SUCCESS, wc
    assert t.statuses == [IBV_WC_SUCCESS] * 10 + [IBV_WC_REM_ACCESS_ERR]
    assert int.from_bytes(b.mr.read(8, t.atomic_to - base), sys.byteorder) == t.swap  # the CAS compared equal
    return t


# -- checking ------------------------------------------------------------------

def first_copies(segments: Iterable[Segment]) -> list[Segment]:
    """The segments with retransmitted copies left out (one per sender and link sequence number)."""
    seen: set[tuple[str, int]] = set()
    out = []
    for s in segments:
        if (s.sender, s.seq) not in seen:
            seen.add((s.sender, s.seq))
            out.append(s)
    return out


def untagged_messages(segments: list[Segment]) -> dict[tuple[str, int], list[list[Segment]]]:
    """Untagged segments by (sender, QN), grouped into messages by MSN in
    the order each message's first segment was sent; checks RFC 5041 §5:
    MSNs 1, 2, 3, … on each queue, each message's MOs contiguous from 0,
    L set on its last segment only."""
    queues: dict[tuple[str, int], list[list[Segment]]] = {}
    for s in segments:
        if s.opcode in TAGGED:
            continue
        assert s.qn == RFC_QN[s.opcode], f"opcode {s.opcode} on QN {s.qn}, the RFCs say {RFC_QN[s.opcode]}: {s}"
        msgs = queues.setdefault((s.sender, s.qn), [])
        if msgs and msgs[-1][0].msn == s.msn:
            msgs[-1].append(s)
        else:
            msgs.append([s])
    for key, msgs in queues.items():
        assert [m[0].msn for m in msgs] == list(range(1, len(msgs) + 1)), f"MSNs on {key}: {[m[0].msn for m in msgs]}"
        for m in msgs:
            offsets = [0]
            for s in m[:-1]:
                offsets.append(offsets[-1] + s.length)
            assert [s.mo for s in m] == offsets, f"MOs of {key} MSN {m[0].msn}: {[s.mo for s in m]}"
            assert [s.last for s in m] == [False] * (len(m) - 1) + [True], f"L flags of {key} MSN {m[0].msn}"
            assert len({s.opcode for s in m}) == 1
    return queues


def tagged_messages(segments: list[Segment], sender: str, opcode: int) -> list[list[Segment]]:
    """The tagged messages ``sender`` sent with ``opcode``, each checked
    contiguous: one STag, each TO where the segment before it ended, L on
    the last segment only."""
    msgs: list[list[Segment]] = []
    for s in segments:
        if s.sender != sender or s.opcode != opcode:
            continue
        if msgs and not msgs[-1][-1].last:
            prev = msgs[-1][-1]
            assert (s.stag, s.to) == (prev.stag, prev.to + prev.length), f"{s} does not follow {prev}"
            msgs[-1].append(s)
        else:
            msgs.append([s])
    assert all(m[-1].last for m in msgs)
    return msgs


def check_tour(tour: Tour, segments: list[Segment]) -> None:
    """Hold the captured segments of a tour to the RFCs and to what was posted (module docstring)."""
    segs = first_copies(segments)
    queues = untagged_messages(segs)
    ops = {key: [m[0].opcode for m in msgs] for key, msgs in queues.items()}
    # Queue 0: Write with Immediate's Immediate Data, Send, Send with
    # Immediate (a Send and Immediate Data), Send with Invalidate, Send with SE.
    assert ops[("A", 0)] == [IMMEDIATE, SEND, SEND, IMMEDIATE, SEND_INV, SEND_SE]
    # Queue 1: Reads and atomics in one MSN sequence (RFC 7306).
    assert ops[("A", 1)] == [READ_REQUEST, ATOMIC_REQUEST, ATOMIC_REQUEST, READ_REQUEST]
    assert ops[("B", 3)] == [ATOMIC_RESPONSE, ATOMIC_RESPONSE]
    assert ops[("B", 2)] == [TERMINATE]
    assert not {k for k in ops if k[0] == "A"} - {("A", 0), ("A", 1)}
    assert not {k for k in ops if k[0] == "B"} - {("B", 2), ("B", 3)}
    _check_sends(tour, queues[("A", 0)])
    _check_reads_and_atomics(tour, queues[("A", 1)], queues[("B", 3)], segs)
    writes = tagged_messages(segs, "A", WRITE)
    assert [(m[0].stag, m[0].to, sum(s.length for s in m)) for m in writes] == [
        (tour.rkey, tour.write_to, WRITE_LEN), (tour.rkey, tour.write_imm_to, 100),
        (tour.noperm_rkey, tour.noperm_to, 32)]
    assert len(writes[0]) > 1
    (term,) = queues[("B", 2)][0]
    # RFC 5040 §4.8: RDMAP layer, Remote Protection Error, Access Rights
    # Violation, with the offending segment's DDP header copied
    assert (term.body["layer"], term.body["etype"], term.body["ecode"]) == (0, 1, 2)
    assert (term.body["ddp_stag"], term.body["ddp_to"]) == (tour.noperm_rkey, tour.noperm_to)


def _check_sends(tour: Tour, q0: list[list[Segment]]) -> None:
    imm1, send, send_imm, imm2, send_inv, send_se = q0
    assert imm1[0].body["imm_data"] == tour.imm and imm2[0].body["imm_data"] == tour.imm + 1
    assert [sum(s.length for s in m) for m in (send, send_imm, send_inv, send_se)] == [SEND_LEN, 16, 8, 8]
    assert len(send) > 1
    assert send_inv[0].inv_stag == tour.inv_rkey
    assert all(s.inv_stag == 0 for m in (send, send_imm, send_se, imm1, imm2) for s in m)


def _check_reads_and_atomics(tour: Tour, q1: list[list[Segment]], q3: list[list[Segment]],
                             segs: list[Segment]) -> None:
    (read1,), (fadd,), (cas,), (read2,) = q1
    for req, src, size in ((read1, tour.read_from, READ_LEN), (read2, tour.read2_from, 64)):
        assert (req.body["src_stag"], req.body["src_to"], req.body["size"]) == (tour.rkey, src, size)
    responses = tagged_messages(segs, "B", READ_RESPONSE)
    assert [(m[0].stag, m[0].to, sum(s.length for s in m)) for m in responses] == [
        (req.body["sink_stag"], req.body["sink_to"], req.body["size"]) for req in (read1, read2)]
    assert (fadd.body["aop"], fadd.body["stag"], fadd.body["to"], fadd.body["add_swap_data"]) == \
        (FETCH_ADD, tour.rkey, tour.atomic_to, tour.add)
    assert (cas.body["aop"], cas.body["stag"], cas.body["to"], cas.body["add_swap_data"],
            cas.body["compare_data"]) == (CMP_SWAP, tour.rkey, tour.atomic_to, tour.swap, tour.compare)
    (r1,), (r2,) = q3
    assert (r1.body["req_id"], r1.body["orig_value"]) == (fadd.body["req_id"], tour.word_before)
    assert (r2.body["req_id"], r2.body["orig_value"]) == (cas.body["req_id"], tour.word_before + tour.add)
