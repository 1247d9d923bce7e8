"""Connection management messages (``Kind.CM``), after MPA's exchange (RFC 5044 §7).

Theory of operation
-------------------
iWARP sets a connection up with the MPA Request/Reply frames on a fresh TCP
stream: they carry IRD/ORD (MPA v2, RFC 6581) and up to 512 bytes of private
data (RFC 5044 §7.1), and a Reply can reject.  We have no stream per QP, so
the daemons' connection managers exchange the same information as link
messages addressed to QPN 0 (``envelope.CM_QPN``; both envelope QPNs are 0
and the QPNs travel in the body)::

    type u8 | reserved u8 (0) | private data length u16 | request id u32
    type-specific fixed part | private data

* CONNECT_REQUEST: service port u16 (the listener's "port"), IRD u16,
  ORD u16, reserved u16, requester QPN u32, max message size u32.
* ACCEPT: responder QPN u32, IRD u16, ORD u16, max message size u32.
* REJECT: reason u16 (``RejectReason``), reserved u16.
* DISCONNECT: the sender's QPN u32; no private data.

The requester picks ``request_id``; ACCEPT and REJECT echo it, so a reply
matches its request and a duplicated request (the requester retried) is
recognised by the pair (peer, request id).

``CM_MESSAGE`` (construct) is the reference; ``encode`` and
``decode_untrusted`` are the codecs (not per-segment hot path).
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import construct as c

from .errors import WireError

#: RFC 5044 §7.1: private data is at most 512 bytes.
MAX_PRIVATE_DATA = 512


class CmType(enum.IntEnum):
    CONNECT_REQUEST = 1
    ACCEPT = 2
    REJECT = 3
    DISCONNECT = 4


class RejectReason(enum.IntEnum):
    NO_LISTENER = 1  #: nobody listens on the service port
    REFUSED_BY_APP = 2  #: the listening application rejected the request
    NO_RESOURCES = 3  #: the responder could not create the QP
    BAD_REQUEST = 4  #: unacceptable parameters (IRD/ORD, sizes)


class ConnectRequest(NamedTuple):
    request_id: int
    service_port: int
    qpn: int  #: the requester's QPN
    ird: int
    ord: int
    max_message_size: int
    private_data: bytes = b""


class Accept(NamedTuple):
    request_id: int
    qpn: int  #: the responder's QPN
    ird: int
    ord: int
    max_message_size: int
    private_data: bytes = b""


class Reject(NamedTuple):
    request_id: int
    reason: int
    private_data: bytes = b""


class Disconnect(NamedTuple):
    request_id: int
    qpn: int  #: the QPN of the sender that is disconnecting


CmMessage = ConnectRequest | Accept | Reject | Disconnect

# --- reference declaration ---------------------------------------------------

CM_MESSAGE = c.Struct(
    "type" / c.Int8ub,
    "reserved" / c.Const(0, c.Int8ub),
    "pd_len" / c.Int16ub,
    c.Check(c.this.pd_len <= MAX_PRIVATE_DATA),
    "request_id" / c.Int32ub,
    "fixed" / c.Switch(
        c.this.type,
        {
            CmType.CONNECT_REQUEST: c.Struct(
                "service_port" / c.Int16ub,
                "ird" / c.Int16ub,
                "ord" / c.Int16ub,
                "reserved" / c.Const(0, c.Int16ub),
                "qpn" / c.Int32ub,
                "max_message_size" / c.Int32ub,
            ),
            CmType.ACCEPT: c.Struct(
                "qpn" / c.Int32ub,
                "ird" / c.Int16ub,
                "ord" / c.Int16ub,
                "max_message_size" / c.Int32ub,
            ),
            CmType.REJECT: c.Struct(
                "reason" / c.Int16ub,
                c.Check(lambda ctx: ctx.reason in _REASONS),
                "reserved" / c.Const(0, c.Int16ub),
            ),
            CmType.DISCONNECT: c.Struct("qpn" / c.Int32ub, c.Check(lambda ctx: ctx._.pd_len == 0)),
        },
        default=c.Error,
    ),
    "private_data" / c.Bytes(c.this.pd_len),
    c.Terminated,
)

# --- codecs ------------------------------------------------------------------

_HEAD = struct.Struct("!BBHI")
_FIXED = {
    CmType.CONNECT_REQUEST: struct.Struct("!HHHHII"),
    CmType.ACCEPT: struct.Struct("!IHHI"),
    CmType.REJECT: struct.Struct("!HH"),
    CmType.DISCONNECT: struct.Struct("!I"),
}
_REASONS = frozenset(RejectReason)


def _fields(m: CmMessage) -> tuple[int, tuple[int, ...], bytes]:
    if isinstance(m, ConnectRequest):
        return CmType.CONNECT_REQUEST, (m.service_port, m.ird, m.ord, 0, m.qpn, m.max_message_size), m.private_data
    if isinstance(m, Accept):
        return CmType.ACCEPT, (m.qpn, m.ird, m.ord, m.max_message_size), m.private_data
    if isinstance(m, Reject):
        if m.reason not in _REASONS:
            raise ValueError(f"unknown reject reason {m.reason}")
        return CmType.REJECT, (m.reason, 0), m.private_data
    if isinstance(m, Disconnect):
        return CmType.DISCONNECT, (m.qpn,), b""
    raise TypeError(f"not a CM message: {m!r}")


def encode(m: CmMessage) -> bytes:
    """Return the wire form of a CM message (the body after the envelope).

    Raises:
        ValueError: private data over 512 bytes, unknown reject reason, or a
            field out of range.
        TypeError: ``m`` is not a CM message.
    """
    ctype, fixed, pd = _fields(m)
    if len(pd) > MAX_PRIVATE_DATA:
        raise ValueError(f"{len(pd)} bytes of private data, at most {MAX_PRIVATE_DATA}")
    try:
        return _HEAD.pack(ctype, 0, len(pd), m.request_id) + _FIXED[ctype].pack(*fixed) + bytes(pd)
    except struct.error as e:
        raise ValueError(str(e)) from None


def decode_untrusted(body: bytes | bytearray | memoryview) -> CmMessage:
    """Parse a CM message from the network.

    Raises:
        WireError: ``truncated``, ``bad_type``, ``bad_reserved``,
            ``bad_reason`` or ``bad_length``; nothing else.
    """
    n = len(body)
    if n < _HEAD.size:
        raise WireError("truncated", f"CM message of {n} bytes")
    ctype, reserved, pd_len, request_id = _HEAD.unpack_from(body)
    fixed_struct = _FIXED.get(ctype)
    if fixed_struct is None:
        raise WireError("bad_type", f"CM type {ctype}")
    if reserved:
        raise WireError("bad_reserved", "CM header")
    off = _HEAD.size + fixed_struct.size
    if pd_len > MAX_PRIVATE_DATA or (ctype == CmType.DISCONNECT and pd_len) or n != off + pd_len:
        raise WireError("bad_length", f"CM type {ctype}: {n} bytes, private data {pd_len}")
    f = fixed_struct.unpack_from(body, _HEAD.size)
    pd = bytes(body[off:])
    if ctype == CmType.CONNECT_REQUEST:
        if f[3]:
            raise WireError("bad_reserved", "connect request")
        return ConnectRequest(request_id, f[0], f[4], f[1], f[2], f[5], pd)
    if ctype == CmType.ACCEPT:
        return Accept(request_id, f[0], f[1], f[2], f[3], pd)
    if ctype == CmType.REJECT:
        if f[0] not in _REASONS:
            raise WireError("bad_reason", str(f[0]))
        if f[1]:
            raise WireError("bad_reserved", "reject")
        return Reject(request_id, f[0], pd)
    return Disconnect(request_id, f[0])
