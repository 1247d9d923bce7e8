"""RDMAP over DDP: RFC 5040 (+ RFC 7306 atomics and immediate data), bit-exact.

Theory of operation
-------------------
RDMAP has no header of its own on most messages: it takes the first octet
DDP reserves for the ULP (RsvdULP[0:7]) as the *RDMAP Control Field*
(RFC 5040 §4.1)::

     0 1 2 3 4 5 6 7
    +-+-+-+-+-+-+-+-+
    |RV |Rsv| OpCode|    RV: RDMAP version = 01b, Rsv: 0
    +-+-+-+-+-+-+-+-+

and, on untagged messages, RsvdULP[8:39] for the Invalidate STag of Send with
Invalidate (RFC 5040 §4.1).  The opcode fixes the buffer model and, for
untagged messages, the DDP queue number (RFC 5040 §4.2 table; RFC 7306 §8.1):

=====  ==========================  ======  ==
code   message                     tagged  QN
=====  ==========================  ======  ==
0000b  RDMA Write                  yes     --
0001b  RDMA Read Request           no      1
0010b  RDMA Read Response          yes     --
0011b  Send                        no      0
0100b  Send with Invalidate        no      0
0101b  Send with SE                no      0
0110b  Send with SE and Invalidate no      0
0111b  Terminate                   no      2
1000b  Immediate Data              no      0
1001b  Immediate Data with SE      no      0
1010b  Atomic Request              no      1
1011b  Atomic Response             no      3
=====  ==========================  ======  ==

An Atomic Request travels on the Read Request queue: Read and Atomic
Requests share one MSN sequence (and the ORD/IRD budget), so the responder
answers them in the order they were sent.  Atomic Responses have queue 3 to
themselves and, as on every DDP queue (RFC 5041 §5.3), their own MSN
sequence from 1.

Checked against secondary sources that follow the RFCs (Linux siw's
``iwarp.h``, Wireshark's iWARP dissector, urdma): both control fields,
opcodes 0000b-1011b, the Atomic Request on queue 1 and the Atomic Response
on queue 3 (urdma), QNs 0-2, the Read Request, Terminate and Atomic
layouts, FetchAdd = 0000b and CmpSwap = 0010b.  Taken from RFC 7306 alone,
with no second source to check them against: Immediate Data on QN 0,
Swap = 0001b.

Read Request, Terminate, Atomic Request/Response and Immediate Data carry an
RDMAP header as the DDP payload of a single-segment message; their layouts
and codecs are ``rdmap_bodies.py``'s (re-exported here, so ``rdmap.X`` names
every RDMAP layout).

The receive path calls ``decode_untrusted(buf, offset)`` once per segment.
It checks every bit of both control fields, the opcode/buffer-model/queue
consistency and, for single-segment messages, L, MO and the length, with one
``struct`` unpack and one table lookup, and returns a NamedTuple header and a
view of the payload.  The ``construct`` declarations below are the reference;
``decode_reference`` parses with them alone, and the tests prove both agree.
"""

from __future__ import annotations

import enum
import functools
import operator
import struct
from typing import NamedTuple

import construct as c

from . import ddp
from .errors import WireError
from .rdmap_bodies import (  # noqa: F401 - re-exported: callers name every RDMAP layout rdmap.X
    AtomicOp, TermLayer, RdmapErrorType, RdmapErrorCode, DdpErrorType, DdpTaggedErrorCode, DdpUntaggedErrorCode,
    LlpErrorCode, READ_REQUEST_LEN, ATOMIC_REQUEST_LEN, ATOMIC_RESPONSE_LEN, IMMEDIATE_DATA_LEN, TERMINATE_MIN_LEN,
    TERMINATE_MAX_LEN, TERM_ETYPES, READ_REQUEST, TERMINATE, ATOMIC_REQUEST, ATOMIC_RESPONSE, IMMEDIATE_DATA,
    ReadRequest, Terminate, AtomicRequest, AtomicResponse, encode_read_request, pack_read_request_into,
    decode_read_request_untrusted, encode_atomic_request, pack_atomic_request_into, decode_atomic_request_untrusted,
    encode_atomic_response, decode_atomic_response_untrusted, encode_immediate_data,
    decode_immediate_data_untrusted, encode_terminate, decode_terminate_untrusted,
)

RDMAP_VERSION = 1  #: RFC 5040 §4.1: RV = 01b


class Opcode(enum.IntEnum):
    """RDMA Message OpCode (RFC 5040 §4.2, RFC 7306 §8.1)."""

    RDMA_WRITE = 0b0000
    RDMA_READ_REQUEST = 0b0001
    RDMA_READ_RESPONSE = 0b0010
    SEND = 0b0011
    SEND_INVALIDATE = 0b0100
    SEND_SE = 0b0101
    SEND_SE_INVALIDATE = 0b0110
    TERMINATE = 0b0111
    IMMEDIATE_DATA = 0b1000
    IMMEDIATE_DATA_SE = 0b1001
    ATOMIC_REQUEST = 0b1010
    ATOMIC_RESPONSE = 0b1011


class QueueNumber(enum.IntEnum):
    """DDP untagged queue used by each RDMAP message (RFC 5040 §5.1, RFC 7306)."""

    SEND = 0  #: Send variants and Immediate Data: consume a posted receive
    READ_REQUEST = 1  #: Read Requests and Atomic Requests, one MSN sequence
    TERMINATE = 2
    ATOMIC_RESPONSE = 3


TAGGED_OPCODES = frozenset({Opcode.RDMA_WRITE, Opcode.RDMA_READ_RESPONSE})
INVALIDATE_OPCODES = frozenset({Opcode.SEND_INVALIDATE, Opcode.SEND_SE_INVALIDATE})
#: Queue number of every untagged opcode (RFC 5040 §5.1; RFC 7306 §8.1).
OPCODE_QN: dict[int, int] = {
    Opcode.RDMA_READ_REQUEST: QueueNumber.READ_REQUEST,
    Opcode.SEND: QueueNumber.SEND,
    Opcode.SEND_INVALIDATE: QueueNumber.SEND,
    Opcode.SEND_SE: QueueNumber.SEND,
    Opcode.SEND_SE_INVALIDATE: QueueNumber.SEND,
    Opcode.TERMINATE: QueueNumber.TERMINATE,
    Opcode.IMMEDIATE_DATA: QueueNumber.SEND,
    Opcode.IMMEDIATE_DATA_SE: QueueNumber.SEND,
    Opcode.ATOMIC_REQUEST: QueueNumber.READ_REQUEST,
    Opcode.ATOMIC_RESPONSE: QueueNumber.ATOMIC_RESPONSE,
}

# --- single-segment messages (their bodies: rdmap_bodies.py) -----------------

#: Messages that always fit in one segment, with their exact payload length
#: (``None``: Terminate, whose length its own header determines).
SINGLE_SEGMENT: dict[int, int | None] = {
    Opcode.RDMA_READ_REQUEST: READ_REQUEST_LEN,
    Opcode.TERMINATE: None,
    Opcode.IMMEDIATE_DATA: IMMEDIATE_DATA_LEN,
    Opcode.IMMEDIATE_DATA_SE: IMMEDIATE_DATA_LEN,
    Opcode.ATOMIC_REQUEST: ATOMIC_REQUEST_LEN,
    Opcode.ATOMIC_RESPONSE: ATOMIC_RESPONSE_LEN,
}

# --- reference declarations --------------------------------------------------

RDMAP_CONTROL = c.BitStruct(
    "rv" / c.Const(RDMAP_VERSION, c.BitsInteger(2)),
    "rsv" / c.Const(0, c.BitsInteger(2)),
    "opcode" / c.BitsInteger(4),
)


_op = c.this.rdmap.opcode
_uop = c.this._.rdmap.opcode  # the opcode, seen from inside the buffer-model part
_U32 = c.Int32ub

#: A whole DDP segment carrying RDMAP: RFC 5041 §6 with the RFC 5040 §4.1-4.2
#: and RFC 7306 §8.1 rules.  Written with ``this`` expressions only (no
#: lambdas) so that ``.compile()`` works on it.
RDMAP_SEGMENT = c.Struct(
    "ddp" / ddp.DDP_CONTROL,
    "rdmap" / RDMAP_CONTROL,
    c.Check(_op <= max(Opcode).value),  # opcodes are 0000b..1011b, no gaps
    c.Check(c.this.ddp.T == ((_op == Opcode.RDMA_WRITE.value) | (_op == Opcode.RDMA_READ_RESPONSE.value))),
    "buffer" / c.IfThenElse(
        c.this.ddp.T,
        c.Struct("stag" / _U32, "to" / c.Int64ub),  # RFC 5041 §6.2
        c.Struct(  # RFC 5041 §6.3
            "inv_stag" / _U32,  # RsvdULP[8:39]: only Send with Invalidate uses it
            c.Check(
                (c.this.inv_stag == 0)
                | (_uop == Opcode.SEND_INVALIDATE.value)
                | (_uop == Opcode.SEND_SE_INVALIDATE.value)
            ),
            "qn" / c.Switch(_uop, {int(op): c.Const(int(qn), _U32) for op, qn in OPCODE_QN.items()}),
            "msn" / _U32,
            "mo" / _U32,
            # Read Request and the Terminate / RFC 7306 messages are one segment.
            c.Check(
                ((_uop != Opcode.RDMA_READ_REQUEST.value) & (_uop < Opcode.TERMINATE.value))
                | (c.this._.ddp.L & (c.this.mo == 0))
            ),
        ),
    ),
    "payload" / c.Switch(
        _op, {int(op): c.Bytes(size) for op, size in SINGLE_SEGMENT.items() if size}, default=c.GreedyBytes
    ),
    # Said again as a check: construct 2.10's compiled Bytes(n) returns a
    # short read instead of failing (a 4-byte Immediate Data would pass).
    c.Check(functools.reduce(operator.and_, [
        (_op != int(op)) | (c.len_(c.this.payload) == size) for op, size in SINGLE_SEGMENT.items() if size])),
    c.Check(
        (_op != Opcode.TERMINATE.value)
        | ((c.len_(c.this.payload) >= TERMINATE_MIN_LEN) & (c.len_(c.this.payload) <= TERMINATE_MAX_LEN))
    ),
    c.Terminated,
)

# --- decoded values ----------------------------------------------------------


class TaggedHeader(NamedTuple):
    """DDP tagged segment header with its RDMAP opcode (Write, Read Response)."""

    opcode: int
    last: bool
    stag: int
    to: int


class UntaggedHeader(NamedTuple):
    """DDP untagged segment header with its RDMAP opcode.

    ``inv_stag`` is RsvdULP[8:39]: the STag to invalidate for Send with
    Invalidate (RFC 5040 §4.1), 0 for every other opcode.
    """

    opcode: int
    last: bool
    inv_stag: int
    qn: int
    msn: int
    mo: int


SegmentHeader = TaggedHeader | UntaggedHeader


# --- fast path: per-segment headers ------------------------------------------

_TAGGED = ddp.TAGGED
_UNTAGGED = ddp.UNTAGGED
_TAGGED_LEN = ddp.TAGGED_HEADER_LEN
_UNTAGGED_LEN = ddp.UNTAGGED_HEADER_LEN
#: the WireError reasons of a bad control pair, by the negative index CONTROL_CLASS gives
DECODE_REASONS = ("", "bad_dv", "bad_reserved", "bad_rv", "bad_opcode", "bad_tagged")


def _classify(ctrl: int, rctl: int) -> int:
    """Opcode for a valid (DDP control, RDMAP control) pair, else -reason index."""
    if ctrl & ddp.DV_MASK != ddp.DDP_VERSION:
        return -1
    if ctrl & ddp.RSVD_MASK:
        return -2
    if rctl >> 6 != RDMAP_VERSION:
        return -3
    if rctl & 0x30:
        return -2
    op = rctl & 0x0F
    if op not in OPCODE_QN and op not in TAGGED_OPCODES:
        return -4
    if bool(ctrl & ddp.T_FLAG) != (op in TAGGED_OPCODES):
        return -5
    return op


#: (DDP control << 8 | RDMAP control) -> opcode, or -index into DECODE_REASONS.
#: One lookup checks DV, both reserved fields, RV, the opcode and T.
CONTROL_CLASS = tuple(_classify(i >> 8, i & 0xFF) for i in range(1 << 16))
#: queue number by opcode (-1 for tagged opcodes)
_QN = tuple(OPCODE_QN.get(op, -1) for op in range(16))
#: exact payload length of single-segment messages by opcode; -1 none, 0 Terminate
_FIXED = tuple(-1 if op not in SINGLE_SEGMENT else (SINGLE_SEGMENT[op] or 0) for op in range(16))
_INVALIDATES = tuple(op in INVALIDATE_OPCODES for op in range(16))
_RCTL = tuple((RDMAP_VERSION << 6) | op for op in range(16))
#: ``tuple.__new__(Header, fields)`` skips the NamedTuple's Python-level
#: ``__new__``: half the cost of building a header, once per segment.
_TN = tuple.__new__


def decode_untrusted(
    buf: bytes | bytearray | memoryview, offset: int = 0
) -> tuple[TaggedHeader | UntaggedHeader, memoryview]:
    """Check and parse one DDP segment carrying RDMAP, starting at ``offset``.

    Returns the header and a view of the segment's payload (for Read Request,
    Terminate, Atomic and Immediate Data: their RDMAP header, which the
    ``decode_*_untrusted`` functions below parse).

    Raises:
        WireError: ``truncated``, ``bad_dv``, ``bad_reserved``, ``bad_rv``,
            ``bad_opcode``, ``bad_tagged`` (T flag wrong for the opcode),
            ``bad_qn``, ``bad_segment`` (a single-segment message with L=0
            or MO!=0) or ``bad_length``; never anything else.
    """
    n = len(buf) - offset
    if n < _TAGGED_LEN:
        raise WireError("truncated", f"{n} bytes of DDP segment")
    if buf[offset] & 0x80:
        ctrl, rctl, stag, to = _TAGGED.unpack_from(buf, offset)
        op = CONTROL_CLASS[(ctrl << 8) | rctl]
        if op < 0:
            raise WireError(DECODE_REASONS[-op])
        return _TN(TaggedHeader, (op, ctrl & 0x40 != 0, stag, to)), memoryview(buf)[offset + _TAGGED_LEN :]
    if n < _UNTAGGED_LEN:
        raise WireError("truncated", f"{n} bytes of untagged DDP segment")
    ctrl, rctl, word, qn, msn, mo = _UNTAGGED.unpack_from(buf, offset)
    op = CONTROL_CLASS[(ctrl << 8) | rctl]
    if op < 0:
        raise WireError(DECODE_REASONS[-op])
    if qn != _QN[op]:
        raise WireError("bad_qn", f"QN {qn} for opcode {op}")
    if word and not _INVALIDATES[op]:
        raise WireError("bad_reserved", "RsvdULP[8:39]")
    last = ctrl & 0x40 != 0
    fixed = _FIXED[op]
    if fixed >= 0:
        if not last or mo:
            raise WireError("bad_segment", f"opcode {op} must be one segment")
        size = n - _UNTAGGED_LEN
        if size != fixed if fixed else not TERMINATE_MIN_LEN <= size <= TERMINATE_MAX_LEN:
            raise WireError("bad_length", f"{size} bytes for opcode {op}")
    return _TN(UntaggedHeader, (op, last, word, qn, msn, mo)), memoryview(buf)[offset + _UNTAGGED_LEN :]


#: (opcode, last) -> (DDP control, RDMAP control): every valid tagged start.
TAGGED_CONTROL: dict[tuple[int, bool], tuple[int, int]] = {
    (op, last): (ddp.control_byte(True, last), _RCTL[op]) for op in TAGGED_OPCODES for last in (False, True)
}
#: (opcode, last) -> (DDP control, RDMAP control, QN): every valid untagged start.
UNTAGGED_CONTROL: dict[tuple[int, bool], tuple[int, int, int]] = {
    (op, last): (ddp.control_byte(False, last), _RCTL[op], qn) for op, qn in OPCODE_QN.items() for last in (False, True)
}


def tagged_control(opcode: int, last: bool) -> tuple[int, int]:
    """Return the (DDP control, RDMAP control) bytes of a tagged segment.

    Raises:
        ValueError: ``opcode`` is not a tagged RDMAP message.
    """
    try:
        return TAGGED_CONTROL[opcode, last]
    except KeyError:
        raise ValueError(f"opcode {opcode} is not a tagged RDMAP message") from None


def untagged_control(opcode: int, last: bool, inv_stag: int) -> tuple[int, int, int]:
    """Return the (DDP control, RDMAP control, QN) of an untagged segment.

    Raises:
        ValueError: ``opcode`` is tagged or unknown, or ``inv_stag`` is given
            for an opcode that does not invalidate.
    """
    try:
        ctl = UNTAGGED_CONTROL[opcode, last]
    except KeyError:
        raise ValueError(f"opcode {opcode} is not an untagged RDMAP message") from None
    if inv_stag and not _INVALIDATES[opcode]:
        raise ValueError(f"opcode {opcode} carries no Invalidate STag")
    return ctl


def pack_tagged_into(
    buf: bytearray | memoryview, offset: int, opcode: int, last: bool, stag: int, to: int
) -> int:
    """Write a tagged segment header (Write / Read Response); return its length.

    Raises:
        ValueError: ``opcode`` is not tagged, or a field is out of range.
    """
    ctrl, rctl = tagged_control(opcode, last)
    try:
        _TAGGED.pack_into(buf, offset, ctrl, rctl, stag, to)
    except struct.error as e:
        raise ValueError(str(e)) from None
    return _TAGGED_LEN


def pack_untagged_into(
    buf: bytearray | memoryview,
    offset: int,
    opcode: int,
    last: bool,
    msn: int,
    mo: int,
    inv_stag: int = 0,
) -> int:
    """Write an untagged segment header; the queue number follows the opcode.

    Returns the header length.

    Raises:
        ValueError: as ``untagged_control``, or a field is out of range.
    """
    ctrl, rctl, qn = untagged_control(opcode, last, inv_stag)
    try:
        _UNTAGGED.pack_into(buf, offset, ctrl, rctl, inv_stag, qn, msn, mo)
    except struct.error as e:
        raise ValueError(str(e)) from None
    return _UNTAGGED_LEN


def encode_tagged(
    opcode: int, last: bool, stag: int, to: int, payload: bytes | bytearray | memoryview = b""
) -> bytes:
    """Return a whole tagged segment: header + ``payload``.

    Raises:
        ValueError: as ``pack_tagged_into``.
    """
    buf = bytearray(_TAGGED_LEN + len(payload))
    pack_tagged_into(buf, 0, opcode, last, stag, to)
    buf[_TAGGED_LEN:] = payload
    return bytes(buf)


def encode_untagged(
    opcode: int,
    last: bool,
    msn: int,
    mo: int,
    payload: bytes | bytearray | memoryview = b"",
    inv_stag: int = 0,
) -> bytes:
    """Return a whole untagged segment: header + ``payload``.

    Raises:
        ValueError: as ``pack_untagged_into``.
    """
    buf = bytearray(_UNTAGGED_LEN + len(payload))
    pack_untagged_into(buf, 0, opcode, last, msn, mo, inv_stag)
    buf[_UNTAGGED_LEN:] = payload
    return bytes(buf)


def decode_reference(
    buf: bytes, declaration: c.Construct = RDMAP_SEGMENT
) -> tuple[TaggedHeader | UntaggedHeader, bytes]:
    """Parse one segment with the ``construct`` declaration alone (slow).

    The tests hold ``decode_untrusted`` to this; ``declaration`` may be the
    compiled ``RDMAP_SEGMENT``.

    Raises:
        WireError: ``reference`` for anything the declaration rejects.
    """
    try:
        p = declaration.parse(buf)
    except (c.ConstructError, KeyError, struct.error) as e:  # compiled parsers raise struct.error
        raise WireError("reference", str(e)) from None
    b = p.buffer
    if p.ddp.T:
        return TaggedHeader(p.rdmap.opcode, p.ddp.L, b.stag, b.to), p.payload
    return UntaggedHeader(p.rdmap.opcode, p.ddp.L, b.inv_stag, b.qn, b.msn, b.mo), p.payload
