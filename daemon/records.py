"""Work-request records: what the engine keeps of a WR between its WQE and its CQE.

The requester turns a send WQE into an ``OutWR`` (kept in the QP's
``outstanding`` queue, in posting order, until its completion) and, while
its message is under way, into one of: an ``OutgoingWrite`` (an RDMA Write
being cut into tagged segments), a ``Q0Message`` (a Send or Immediate Data
on untagged queue 0, kept until the receiver's Modified ACK), a
``PendingRead`` or ``PendingAtomic`` (an ORRQ entry waiting for its
response).  The responder keeps ``ReadResponse`` and ``AtomicReply``
entries on its IRRQ.  A ``Gather`` is a resolved SGE list: (view, offset,
length) pieces of registered memory and a cursor over them.
"""

from __future__ import annotations

from .opcodes import WC_SUCCESS


class OutWR:
    """A send WR between being taken from the SQ and its completion."""

    __slots__ = ("wr_id", "wc_opcode", "signaled", "byte_len", "last_n", "done", "status",
                 "rkey", "raddr", "sink_stag", "q0_last", "atomic_msn")

    def __init__(self, wr_id: int, wc_opcode: int, signaled: bool, byte_len: int) -> None:
        self.wr_id = wr_id
        self.wc_opcode = wc_opcode
        self.signaled = signaled
        self.byte_len = byte_len
        self.last_n = -1  # link message number of the last message; -1 until all are queued
        self.done = False  # complete regardless of link acks (Read placed, or failed)
        self.status = WC_SUCCESS
        self.rkey = 0
        self.raddr = 0
        self.sink_stag = -1
        # MSN of the WR's last queue-0 message (Send, Immediate Data): such a WR
        # completes when the receiver accepts that message (Modified ACK), not
        # when the link acknowledges it, because the receiver may NACK it.
        self.q0_last = -1
        self.atomic_msn = -1  # queue-1 MSN of an Atomic Request


def lane_run(remaining: int, contiguous: int, max_data: int, room: int, space: int) -> tuple[int, int, bool]:
    """How many of a message's next segments the send lane builds in one go:
    ``(count, the last one's payload length, whether it is the message's
    last)``; count 0 (fewer than two): the per-segment path.

    ``remaining``: the message's bytes not yet sent, ``contiguous`` of them
    in one buffer; ``room``, ``space``: segments the pump and the link take.
    """
    if remaining <= contiguous:
        segments = -(-remaining // max_data)
    else:
        segments = contiguous // max_data  # whole segments: the one spanning two SGEs goes by copy_out
    k = min(segments, room, space)
    if k < 2:
        return 0, 0, False
    if k == segments and remaining <= contiguous:
        return k, remaining - (k - 1) * max_data, True
    return k, max_data, False


class Gather:
    """A resolved SGE list: (view, offset, length) pieces and a cursor."""

    __slots__ = ("pieces", "total", "idx", "off")

    def __init__(self, pieces: list[tuple[memoryview, int, int]]) -> None:
        self.pieces = pieces
        total = 0
        for p in pieces:  # not sum() over a generator: this is on every WQE's and receive's path
            total += p[2]
        self.total = total
        self.idx = 0
        self.off = 0

    def rewind(self) -> None:
        """Start gathering from the first byte again (a NACKed Send is re-sent whole)."""
        self.idx = 0
        self.off = 0

    def skip(self, n: int) -> None:
        """Move the cursor ``n`` bytes on, within the current piece (the send
        lane copied them)."""
        self.off += n
        if self.off == self.pieces[self.idx][2]:
            self.idx += 1
            self.off = 0

    def copy_out(self, buf: bytearray, pos: int, n: int) -> None:
        """Copy the next ``n`` bytes of the gather list into ``buf[pos:]``."""
        pieces = self.pieces
        while n:
            view, base, length = pieces[self.idx]
            k = min(n, length - self.off)
            buf[pos:pos + k] = view[base + self.off:base + self.off + k]
            pos += k
            n -= k
            self.off += k
            if self.off == length:
                self.idx += 1
                self.off = 0

    def scatter(self, offset: int, data: memoryview) -> None:
        """Place ``data`` at message offset ``offset`` (bounds checked by the caller)."""
        n = len(data)
        pos = 0
        for view, base, length in self.pieces:
            if offset >= length:
                offset -= length
                continue
            k = min(n - pos, length - offset)
            view[base + offset:base + offset + k] = data[pos:pos + k]
            pos += k
            offset = 0
            if pos == n:
                return


class OutgoingWrite:
    """The RDMA Write the requester is segmenting now."""

    __slots__ = ("wr", "gather", "sent", "with_imm", "imm", "solicited", "seg")

    def __init__(self, wr: OutWR, gather: Gather, with_imm: bool, imm: int, solicited: bool, seg: int) -> None:
        self.wr = wr
        self.gather = gather
        self.sent = 0
        self.with_imm = with_imm
        self.imm = imm
        self.solicited = solicited
        self.seg = seg  # each segment's payload (PeerLink.segment_size)


class Q0Message:
    """A queue-0 message (Send, or Immediate Data when ``gather`` is None) kept
    until the receiver accepts it, so a receiver-not-ready NACK can have it re-sent."""

    __slots__ = ("msn", "wr", "gather", "opcode", "inv_stag", "flags", "imm", "sent", "seg")

    def __init__(self, msn: int, wr: OutWR, gather: Gather | None, opcode: int, inv_stag: int = 0,
                 flags: int = 0, imm: int = 0, seg: int = 0) -> None:
        self.msn = msn  # unwrapped; the wire carries msn & 0xFFFFFFFF
        self.wr = wr
        self.gather = gather
        self.opcode = opcode
        self.inv_stag = inv_stag
        self.flags = flags
        self.imm = imm
        self.sent = 0
        self.seg = seg  # each segment's payload (PeerLink.segment_size); 0: as many as fit


class PendingAtomic:
    """An ORRQ entry for an Atomic Request: where the original value goes."""

    __slots__ = ("wr", "gather", "req_id")

    def __init__(self, wr: OutWR, gather: Gather, req_id: int) -> None:
        self.wr = wr
        self.gather = gather
        self.req_id = req_id


class AtomicReply:
    """An IRRQ entry: an Atomic Response body waiting its turn behind earlier Read Responses."""

    __slots__ = ("body",)
    view = None  # touches no region after the operation: nothing to release

    def __init__(self, body: bytes) -> None:
        self.body = body


class PendingRead:
    """An ORRQ entry: a Read Request sent, its responses being placed."""

    __slots__ = ("wr", "gather", "size", "placed")

    def __init__(self, wr: OutWR, gather: Gather) -> None:
        self.wr = wr
        self.gather = gather
        self.size = gather.total
        self.placed = 0


class ReadResponse:
    """An IRRQ entry: a Read Request accepted, its response being sent."""

    __slots__ = ("view", "off", "size", "sink_stag", "sink_to", "sent", "seg")

    def __init__(self, view: memoryview, off: int, size: int, sink_stag: int, sink_to: int, seg: int) -> None:
        self.view = view
        self.off = off
        self.size = size
        self.sink_stag = sink_stag
        self.sink_to = sink_to
        self.sent = 0
        self.seg = seg  # each segment's payload (PeerLink.segment_size)
