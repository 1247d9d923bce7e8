"""RDMAP headers carried as a DDP payload (Read Request, Terminate, atomics, Immediate Data).

Theory of operation
-------------------
Five RDMAP messages are one DDP segment whose payload is a header of their
own (``rdmap.py`` takes apart the segment; this module its payload):

=====================  ==========  ===================================
message                length      layout
=====================  ==========  ===================================
RDMA Read Request      28          ``READ_REQUEST`` (RFC 5040 §4.4)
Terminate              4 to 52     ``TERMINATE`` (RFC 5040 §4.8)
Atomic Request         52          ``ATOMIC_REQUEST`` (RFC 7306 §5.2)
Atomic Response        12          ``ATOMIC_RESPONSE`` (RFC 7306 §5.3)
Immediate Data         8           ``IMMEDIATE_DATA`` (RFC 7306 §4)
=====================  ==========  ===================================

Each layout is declared once with ``construct`` (the reference, which the
tests parse with) and coded for the hot path with one ``struct`` each
(``encode_*``, ``pack_*_into``, ``decode_*_untrusted``); the tests prove
the two agree.  A Terminate names the layer that found the error and an
error type and code from that layer's table (RFC 5040 §4.8, RFC 5041 §7.2,
RFC 5044 §8): the enums below.  Decoders raise ``WireError``, never
anything else, on any input.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import construct as c

from . import ddp
from .errors import WireError


__all__ = [
    "AtomicOp", "TermLayer", "RdmapErrorType", "RdmapErrorCode", "DdpErrorType", "DdpTaggedErrorCode",
    "DdpUntaggedErrorCode", "LlpErrorCode", "READ_REQUEST_LEN", "ATOMIC_REQUEST_LEN", "ATOMIC_RESPONSE_LEN",
    "IMMEDIATE_DATA_LEN", "TERMINATE_MIN_LEN", "TERMINATE_MAX_LEN", "TERM_ETYPES", "READ_REQUEST", "TERMINATE",
    "ATOMIC_REQUEST", "ATOMIC_RESPONSE", "IMMEDIATE_DATA", "ReadRequest", "Terminate", "AtomicRequest",
    "AtomicResponse", "encode_read_request", "pack_read_request_into", "decode_read_request_untrusted",
    "encode_atomic_request", "pack_atomic_request_into", "decode_atomic_request_untrusted",
    "encode_atomic_response", "decode_atomic_response_untrusted", "encode_immediate_data",
    "decode_immediate_data_untrusted", "encode_terminate", "decode_terminate_untrusted",
]


class AtomicOp(enum.IntEnum):
    """Atomic Operation Code of an Atomic Request (RFC 7306 §5.2)."""

    FETCH_ADD = 0b0000
    SWAP = 0b0001
    CMP_SWAP = 0b0010


class TermLayer(enum.IntEnum):
    """Terminate Control: the layer that detected the error (RFC 5040 §4.8)."""

    RDMAP = 0
    DDP = 1
    LLP = 2


class RdmapErrorType(enum.IntEnum):
    """EType when the layer is RDMAP (RFC 5040 §4.8)."""

    LOCAL_CATASTROPHIC = 0
    REMOTE_PROTECTION = 1
    REMOTE_OPERATION = 2


class RdmapErrorCode(enum.IntEnum):
    """Error Code when the layer is RDMAP (RFC 5040 §4.8)."""

    INVALID_STAG = 0x00
    BASE_OR_BOUNDS_VIOLATION = 0x01
    ACCESS_RIGHTS_VIOLATION = 0x02
    STAG_NOT_ASSOCIATED_WITH_STREAM = 0x03
    TO_WRAP = 0x04
    INVALID_RDMAP_VERSION = 0x05
    UNEXPECTED_OPCODE = 0x06
    CATASTROPHIC_LOCALIZED = 0x07
    CATASTROPHIC_GLOBAL = 0x08
    STAG_CANNOT_BE_INVALIDATED = 0x09
    UNSPECIFIED = 0xFF


class DdpErrorType(enum.IntEnum):
    """EType when the layer is DDP (RFC 5041 §7.2)."""

    LOCAL_CATASTROPHIC = 0
    TAGGED_BUFFER = 1
    UNTAGGED_BUFFER = 2
    RESERVED_FOR_LLP = 3


class DdpTaggedErrorCode(enum.IntEnum):
    """Error Code for a DDP tagged buffer error (RFC 5041 §7.2)."""

    INVALID_STAG = 0x00
    BASE_OR_BOUNDS_VIOLATION = 0x01
    STAG_NOT_ASSOCIATED_WITH_STREAM = 0x02
    TO_WRAP = 0x03
    INVALID_DDP_VERSION = 0x04


class DdpUntaggedErrorCode(enum.IntEnum):
    """Error Code for a DDP untagged buffer error (RFC 5041 §7.2)."""

    INVALID_QN = 0x01
    INVALID_MSN_NO_BUFFER = 0x02
    INVALID_MSN_RANGE = 0x03
    INVALID_MO = 0x04
    MESSAGE_TOO_LONG = 0x05
    INVALID_DDP_VERSION = 0x06


class LlpErrorCode(enum.IntEnum):
    """Error Code when the layer is the LLP (our link, after RFC 5044 §8)."""

    STREAM_LOST = 0x01
    CRC_ERROR = 0x02
    FRAMING_ERROR = 0x03
    INVALID_REQUEST = 0x04


# --- layouts ----------------------------------------------------------------

READ_REQUEST_LEN = 28  # RFC 5040 §4.4
ATOMIC_REQUEST_LEN = 52  # RFC 7306 §5.2
ATOMIC_RESPONSE_LEN = 12  # RFC 7306 §5.3
IMMEDIATE_DATA_LEN = 8  # RFC 7306 §4
TERMINATE_MIN_LEN = 4  # RFC 5040 §4.8: the Terminate Control word alone
TERMINATE_MAX_LEN = 4 + 2 + ddp.UNTAGGED_HEADER_LEN + READ_REQUEST_LEN

READ_REQUEST = c.Struct(  # RFC 5040 §4.4
    "sink_stag" / c.Int32ub,
    "sink_to" / c.Int64ub,
    "size" / c.Int32ub,
    "src_stag" / c.Int32ub,
    "src_to" / c.Int64ub,
    c.Terminated,  # the header is the whole DDP payload
)

TERMINATE = c.Struct(  # RFC 5040 §4.8
    "control" / c.BitStruct(
        "layer" / c.BitsInteger(4),
        "etype" / c.BitsInteger(4),
        "ecode" / c.BitsInteger(8),
        "M" / c.Flag,
        "D" / c.Flag,
        "R" / c.Flag,
        "reserved" / c.Const(0, c.BitsInteger(13)),
    ),
    c.Check(lambda ctx: ctx.control.layer in TERM_ETYPES and ctx.control.etype in TERM_ETYPES[ctx.control.layer]),
    "ddp_segment_length" / c.If(c.this.control.D, c.Int16ub),
    # The copied DDP header's own T bit says whether it is 14 or 18 bytes.
    # Peek yields None at the end of the body: then the (untagged-sized)
    # Bytes below runs out of stream, the error the fast decoder reports too.
    "ddp_first_byte" / c.If(c.this.control.D, c.Peek(c.Int8ub)),
    "ddp_header" / c.If(
        c.this.control.D,
        c.Bytes(lambda ctx: ddp.TAGGED_HEADER_LEN if (ctx.ddp_first_byte or 0) & ddp.T_FLAG
                else ddp.UNTAGGED_HEADER_LEN),
    ),
    "rdmap_header" / c.If(c.this.control.R, c.Bytes(READ_REQUEST_LEN)),
    c.Terminated,
)

ATOMIC_REQUEST = c.Struct(  # RFC 7306 §5.2
    "word0" / c.BitStruct("reserved" / c.Const(0, c.BitsInteger(28)), "aop" / c.BitsInteger(4)),
    c.Check(lambda ctx: ctx.word0.aop in _ATOMIC_OPS),
    "req_id" / c.Int32ub,
    "stag" / c.Int32ub,
    "to" / c.Int64ub,
    "add_swap_data" / c.Int64ub,
    "add_swap_mask" / c.Int64ub,
    "compare_data" / c.Int64ub,
    "compare_mask" / c.Int64ub,
    c.Terminated,
)

ATOMIC_RESPONSE = c.Struct(  # RFC 7306 §5.3
    "req_id" / c.Int32ub,
    "orig_value" / c.Int64ub,
    c.Terminated,
)

IMMEDIATE_DATA = c.Struct("data" / c.Int64ub, c.Terminated)  # RFC 7306 §4

#: The error types each Terminate layer may name (RFC 5040 §4.8, RFC 5041 §7.2).
TERM_ETYPES: dict[int, frozenset[int]] = {
    TermLayer.RDMAP: frozenset(RdmapErrorType),
    TermLayer.DDP: frozenset(DdpErrorType),
    TermLayer.LLP: frozenset({0}),  # RFC 5044 §8: LLP EType 0 is the MPA/LLP error
}
_ATOMIC_OPS = frozenset(AtomicOp)

# --- decoded values ---------------------------------------------------------


class ReadRequest(NamedTuple):
    """RDMA Read Request header (RFC 5040 §4.4)."""

    sink_stag: int
    sink_to: int
    size: int
    src_stag: int
    src_to: int


class Terminate(NamedTuple):
    """Terminate header (RFC 5040 §4.8).

    ``ddp_header`` (D bit) is the DDP header of the offending segment, 14 or
    18 bytes, or empty; ``rdmap_header`` (R bit) is the 28-byte RDMAP header
    (a Read Request) of the offending message, or empty.  ``m`` says the
    DDP segment length is valid.
    """

    layer: int
    etype: int
    ecode: int
    m: bool = False
    ddp_segment_length: int = 0
    ddp_header: bytes = b""
    rdmap_header: bytes = b""


class AtomicRequest(NamedTuple):
    """Atomic Request header (RFC 7306 §5.2)."""

    aop: int
    req_id: int
    stag: int
    to: int
    add_swap_data: int
    add_swap_mask: int
    compare_data: int
    compare_mask: int


class AtomicResponse(NamedTuple):
    """Atomic Response header (RFC 7306 §5.3)."""

    req_id: int
    orig_value: int


# --- fast path ---------------------------------------------------------------

_READ_REQUEST = struct.Struct("!IQIIQ")
_ATOMIC_REQUEST = struct.Struct("!IIIQQQQQ")
_ATOMIC_RESPONSE = struct.Struct("!IQ")
_IMMEDIATE = struct.Struct("!Q")
_TERM_WORD = struct.Struct("!I")
_TERM_SEGLEN = struct.Struct("!H")
_TERM_M, _TERM_D, _TERM_R = 0x8000, 0x4000, 0x2000
assert _READ_REQUEST.size == READ_REQUEST_LEN
assert _ATOMIC_REQUEST.size == ATOMIC_REQUEST_LEN
assert _ATOMIC_RESPONSE.size == ATOMIC_RESPONSE_LEN


def _exact(body: bytes | bytearray | memoryview, want: int, what: str) -> None:
    if len(body) != want:
        raise WireError("bad_length", f"{what}: {len(body)} bytes, want {want}")


def _packed(s: struct.Struct, *values: int) -> bytes:
    try:
        return s.pack(*values)
    except struct.error as e:
        raise ValueError(str(e)) from None


def _packed_into(s: struct.Struct, buf: bytearray | memoryview, offset: int, *values: int) -> int:
    try:
        s.pack_into(buf, offset, *values)
    except struct.error as e:
        raise ValueError(str(e)) from None
    return s.size


def encode_read_request(r: ReadRequest) -> bytes:
    """Return the 28-byte Read Request header (RFC 5040 §4.4).

    Raises:
        ValueError: a field is out of range.
    """
    buf = bytearray(READ_REQUEST_LEN)
    pack_read_request_into(buf, 0, *r)
    return bytes(buf)


def pack_read_request_into(buf: bytearray | memoryview, offset: int, sink_stag: int, sink_to: int, size: int,
                           src_stag: int, src_to: int) -> int:
    """Write the Read Request header of ``encode_read_request`` at
    ``buf[offset:]``, with the fields as arguments; return its length.
    For the daemon's send path, which builds the whole segment in one
    buffer (no ``ReadRequest`` tuple, no intermediate bytes).

    Raises:
        ValueError: a field is out of range.
    """
    return _packed_into(_READ_REQUEST, buf, offset, sink_stag, sink_to, size, src_stag, src_to)


def decode_read_request_untrusted(body: bytes | bytearray | memoryview) -> ReadRequest:
    """Parse a Read Request header.  Raises WireError (``bad_length``) only."""
    _exact(body, READ_REQUEST_LEN, "read request")
    return ReadRequest(*_READ_REQUEST.unpack_from(body))


def encode_atomic_request(a: AtomicRequest) -> bytes:
    """Return the 52-byte Atomic Request header (RFC 7306 §5.2).

    Raises:
        ValueError: unknown atomic operation or a field out of range.
    """
    buf = bytearray(ATOMIC_REQUEST_LEN)
    pack_atomic_request_into(buf, 0, *a)
    return bytes(buf)


def pack_atomic_request_into(buf: bytearray | memoryview, offset: int, aop: int, req_id: int, stag: int, to: int,
                             add_swap_data: int, add_swap_mask: int, compare_data: int, compare_mask: int) -> int:
    """Write the Atomic Request header of ``encode_atomic_request`` at
    ``buf[offset:]``, with the fields as arguments; return its length (as
    ``pack_read_request_into``).

    Raises:
        ValueError: unknown atomic operation or a field out of range.
    """
    if aop not in _ATOMIC_OPS:
        raise ValueError(f"unknown atomic operation {aop}")
    return _packed_into(_ATOMIC_REQUEST, buf, offset, aop, req_id, stag, to, add_swap_data, add_swap_mask,
                        compare_data, compare_mask)


def decode_atomic_request_untrusted(body: bytes | bytearray | memoryview) -> AtomicRequest:
    """Parse an Atomic Request header.

    Raises:
        WireError: ``bad_length``, ``bad_reserved`` or ``bad_atomic_op`` only.
    """
    _exact(body, ATOMIC_REQUEST_LEN, "atomic request")
    a = AtomicRequest(*_ATOMIC_REQUEST.unpack_from(body))
    if a.aop >> 4:
        raise WireError("bad_reserved", "atomic request")
    if a.aop not in _ATOMIC_OPS:
        raise WireError("bad_atomic_op", str(a.aop))
    return a


def encode_atomic_response(a: AtomicResponse) -> bytes:
    """Return the 12-byte Atomic Response header (RFC 7306 §5.3).

    Raises:
        ValueError: a field is out of range.
    """
    return _packed(_ATOMIC_RESPONSE, *a)


def decode_atomic_response_untrusted(body: bytes | bytearray | memoryview) -> AtomicResponse:
    """Parse an Atomic Response header.  Raises WireError (``bad_length``) only."""
    _exact(body, ATOMIC_RESPONSE_LEN, "atomic response")
    return AtomicResponse(*_ATOMIC_RESPONSE.unpack_from(body))


def encode_immediate_data(data: int) -> bytes:
    """Return the 8 bytes of Immediate Data (RFC 7306 §4), big-endian.

    Raises:
        ValueError: ``data`` does not fit in 64 bits.
    """
    return _packed(_IMMEDIATE, data)


def decode_immediate_data_untrusted(body: bytes | bytearray | memoryview) -> int:
    """Parse Immediate Data.  Raises WireError (``bad_length``) only."""
    _exact(body, IMMEDIATE_DATA_LEN, "immediate data")
    return int(_IMMEDIATE.unpack_from(body)[0])


def encode_terminate(t: Terminate) -> bytes:
    """Return the Terminate header (RFC 5040 §4.8).

    Raises:
        ValueError: unknown layer/EType, a copied header of the wrong size,
            or a field out of range.
    """
    if t.layer not in TERM_ETYPES or t.etype not in TERM_ETYPES[t.layer]:
        raise ValueError(f"unknown Terminate layer/etype {t.layer}/{t.etype}")
    if not 0 <= t.ecode <= 0xFF:
        raise ValueError(f"error code {t.ecode} out of range")
    if t.ddp_header:
        want = ddp.TAGGED_HEADER_LEN if t.ddp_header[0] & ddp.T_FLAG else ddp.UNTAGGED_HEADER_LEN
        if len(t.ddp_header) != want:
            raise ValueError(f"copied DDP header of {len(t.ddp_header)} bytes, its T bit says {want}")
    elif t.ddp_segment_length:
        raise ValueError("a DDP segment length goes with a copied DDP header")
    if t.rdmap_header and len(t.rdmap_header) != READ_REQUEST_LEN:
        raise ValueError(f"copied RDMAP header of {len(t.rdmap_header)} bytes")
    word = (
        (t.layer << 28)
        | (t.etype << 24)
        | (t.ecode << 16)
        | (_TERM_M if t.m else 0)
        | (_TERM_D if t.ddp_header else 0)
        | (_TERM_R if t.rdmap_header else 0)
    )
    out = bytearray(_TERM_WORD.pack(word))
    if t.ddp_header:
        out += _packed(_TERM_SEGLEN, t.ddp_segment_length)
        out += t.ddp_header
    out += t.rdmap_header
    return bytes(out)


def decode_terminate_untrusted(body: bytes | bytearray | memoryview) -> Terminate:
    """Parse a Terminate header.

    Raises:
        WireError: ``bad_length``, ``bad_reserved`` or ``bad_layer``; nothing else.
    """
    n = len(body)
    if n < TERMINATE_MIN_LEN:
        raise WireError("bad_length", f"terminate of {n} bytes")
    (word,) = _TERM_WORD.unpack_from(body)
    if word & 0x1FFF:
        raise WireError("bad_reserved", "terminate")
    layer, etype, ecode = word >> 28, (word >> 24) & 0xF, (word >> 16) & 0xFF
    if layer not in TERM_ETYPES or etype not in TERM_ETYPES[layer]:
        raise WireError("bad_layer", f"layer {layer} etype {etype}")
    off = TERMINATE_MIN_LEN
    seglen, ddp_header, rdmap_header = 0, b"", b""
    if word & _TERM_D:
        if n < off + 3:
            raise WireError("bad_length", "terminate: copied DDP header cut short")
        (seglen,) = _TERM_SEGLEN.unpack_from(body, off)
        off += 2
        hlen = ddp.TAGGED_HEADER_LEN if body[off] & ddp.T_FLAG else ddp.UNTAGGED_HEADER_LEN
        ddp_header = bytes(body[off : off + hlen])
        off += hlen
    if word & _TERM_R:
        rdmap_header = bytes(body[off : off + READ_REQUEST_LEN])
        off += READ_REQUEST_LEN
    if off != n:
        raise WireError("bad_length", f"terminate of {n} bytes, its header says {off}")
    return Terminate(layer, etype, ecode, bool(word & _TERM_M), seglen, ddp_header, rdmap_header)
