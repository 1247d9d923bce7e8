"""The per-datagram hot path: envelope + DDP/RDMAP header in one step.

Theory of operation
-------------------
A link body (what ``link.decode_untrusted`` returns after the link header)
is an 8-byte envelope (``envelope.py``) and, when its kind is DDP, one DDP
segment carrying RDMAP (``rdmap.py``).  The daemon's receive loop calls
``decode_untrusted(body)`` once per datagram and dispatches on the result;
the send path writes envelope and segment header straight into one
preallocated buffer with ``pack_tagged_into`` / ``pack_untagged_into`` and
copies the payload behind them once.

Every check lives in ``envelope`` and ``rdmap``; this module only fuses their
``struct`` formats so the common case costs one unpack.
"""

from __future__ import annotations

import struct

from . import envelope, rdmap
from .envelope import ENVELOPE_LEN, MAX_QPN, Envelope, Kind
from .errors import WireError

#: envelope + tagged DDP header
TAGGED_PREFIX_LEN = ENVELOPE_LEN + rdmap.ddp.TAGGED_HEADER_LEN  # 22
#: envelope + untagged DDP header
UNTAGGED_PREFIX_LEN = ENVELOPE_LEN + rdmap.ddp.UNTAGGED_HEADER_LEN  # 26

_ENV = struct.Struct("!II")
_ENV_TAGGED = struct.Struct("!IIBBIQ")
_KIND_DDP_WORD = Kind.DDP << 24
_KIND_MAX = max(Kind)


def decode_untrusted(
    body: bytes | bytearray | memoryview,
) -> tuple[Envelope, rdmap.TaggedHeader | rdmap.UntaggedHeader | None, memoryview]:
    """Check and parse a link body: envelope, then the DDP/RDMAP header if any.

    Returns ``(envelope, header, payload)``: for ``Kind.DDP`` the segment
    header and a view of the segment payload; for every other kind ``None``
    and a view of the message after the envelope (for ``cm``, ``flow``,
    ``lock`` or ``barrier`` to decode).

    Raises:
        WireError: any reason of ``envelope.decode_untrusted`` or
            ``rdmap.decode_untrusted``; nothing else.
    """
    n = len(body)
    if n >= TAGGED_PREFIX_LEN and body[0] == Kind.DDP and body[ENVELOPE_LEN] & 0x80:
        # Common case (RDMA Write / Read Response data): one unpack.
        w0, w1, ctrl, rctl, stag, to = _ENV_TAGGED.unpack_from(body)
        if w1 >> 24:
            raise WireError("bad_reserved", "envelope")
        op = rdmap._CLASSIFY[(ctrl << 8) | rctl]
        if op < 0:
            raise WireError(rdmap._REASONS[-op])
        return (
            Envelope(Kind.DDP, w0 & MAX_QPN, w1 & MAX_QPN),
            rdmap.TaggedHeader(op, ctrl & 0x40 != 0, stag, to),
            memoryview(body)[TAGGED_PREFIX_LEN:],
        )
    env, rest = envelope.decode_untrusted(body)
    if env.kind != Kind.DDP:
        return env, None, rest
    header, payload = rdmap.decode_untrusted(rest)
    return env, header, payload


def _pack(buf: bytearray | memoryview, offset: int, dst_qpn: int, src_qpn: int, pack_header, *fields) -> int:  # type: ignore[no-untyped-def]
    envelope.pack_into(buf, offset, Kind.DDP, dst_qpn, src_qpn)
    return ENVELOPE_LEN + pack_header(buf, offset + ENVELOPE_LEN, *fields)  # type: ignore[no-any-return]


def pack_tagged_into(
    buf: bytearray | memoryview, offset: int, dst_qpn: int, src_qpn: int, opcode: int, last: bool, stag: int, to: int
) -> int:
    """Write envelope + tagged segment header at ``offset``; return 22.

    Raises:
        ValueError: a QPN, the opcode or a field is out of range.
    """
    return _pack(buf, offset, dst_qpn, src_qpn, rdmap.pack_tagged_into, opcode, last, stag, to)


def pack_untagged_into(
    buf: bytearray | memoryview,
    offset: int,
    dst_qpn: int,
    src_qpn: int,
    opcode: int,
    last: bool,
    msn: int,
    mo: int,
    inv_stag: int = 0,
) -> int:
    """Write envelope + untagged segment header at ``offset``; return 26.

    Raises:
        ValueError: as ``rdmap.pack_untagged_into``, or a QPN out of range.
    """
    return _pack(buf, offset, dst_qpn, src_qpn, rdmap.pack_untagged_into, opcode, last, msn, mo, inv_stag)


def encode(dst_qpn: int, src_qpn: int, segment: bytes | bytearray | memoryview) -> bytes:
    """Return a link body: a DDP envelope around a segment from ``rdmap.encode_*``.

    Not for the hot path (it copies); the send loop uses ``pack_*_into``.

    Raises:
        ValueError: a QPN is out of range.
    """
    return envelope.encode(Kind.DDP, dst_qpn, src_qpn, segment)
