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
from collections.abc import Callable
from typing import Any

from . import envelope, rdmap
from .envelope import ENVELOPE_LEN, MAX_QPN, Envelope, Kind
from .errors import WireError

#: envelope + tagged DDP header
TAGGED_PREFIX_LEN = ENVELOPE_LEN + rdmap.ddp.TAGGED_HEADER_LEN  # 22
#: envelope + untagged DDP header
UNTAGGED_PREFIX_LEN = ENVELOPE_LEN + rdmap.ddp.UNTAGGED_HEADER_LEN  # 26

_ENV_TAGGED = struct.Struct("!IIBBIQ")  # envelope words, then RFC 5041 §6.2
_ENV_UNTAGGED = struct.Struct("!IIBBIIII")  # envelope words, then RFC 5041 §6.3
assert _ENV_TAGGED.size == TAGGED_PREFIX_LEN and _ENV_UNTAGGED.size == UNTAGGED_PREFIX_LEN
#: where the segment's offset sits in those headers, for builders that stamp
#: it into a packed header: the tagged offset (TO, 8 bytes), the message
#: offset (MO, 4 bytes)
TO_AT = struct.calcsize(_ENV_TAGGED.format[:-1])  # 14
MO_AT = struct.calcsize(_ENV_UNTAGGED.format[:-1])  # 22
_DDP = int(Kind.DDP)
#: the first envelope word of a DDP segment, without its destination QPN
DDP_WORD = _DDP << 24
_TN = tuple.__new__  # see rdmap._TN
_CLASSIFY = rdmap.CONTROL_CLASS
_FLAGS_KNOWN = envelope.FLAGS_KNOWN
_FLOW_ACK = envelope.FLOW_ACK_FLAG
_REASONS = rdmap.DECODE_REASONS


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
            ``rdmap.decode_untrusted``, for the same inputs; nothing else.
    """
    if len(body) >= TAGGED_PREFIX_LEN and body[0] == _DDP and body[ENVELOPE_LEN] & 0x80 and not body[4] & _FLOW_ACK:
        # Common case (RDMA Write / Read Response data): one unpack, one lookup.
        w0, w1, ctrl, rctl, stag, to = _ENV_TAGGED.unpack_from(body)
        flags = w1 >> 24
        if flags & ~_FLAGS_KNOWN:
            raise WireError("bad_reserved", "envelope flags")
        op = _CLASSIFY[(ctrl << 8) | rctl]
        if op < 0:
            raise WireError(_REASONS[-op])
        view = body if type(body) is memoryview else memoryview(body)
        return (
            _TN(Envelope, (_DDP, w0 & MAX_QPN, w1 & MAX_QPN, flags)),
            _TN(rdmap.TaggedHeader, (op, ctrl & 0x40 != 0, stag, to)),
            view[TAGGED_PREFIX_LEN:],
        )
    env, rest = envelope.decode_untrusted(body)
    if env.kind != _DDP:
        return env, None, rest
    header, payload = rdmap.decode_untrusted(rest)
    return env, header, payload


def _check_qpns(dst_qpn: int, src_qpn: int) -> None:
    if not (0 <= dst_qpn <= MAX_QPN and 0 <= src_qpn <= MAX_QPN):
        raise ValueError(f"QPN out of range: dst={dst_qpn} src={src_qpn}")


def pack_tagged_into(
    buf: bytearray | memoryview, offset: int, dst_qpn: int, src_qpn: int, opcode: int, last: bool, stag: int, to: int
) -> int:
    """Write envelope + tagged segment header at ``offset``; return 22.

    Raises:
        ValueError: a QPN, the opcode or a field is out of range.
    """
    _check_qpns(dst_qpn, src_qpn)
    ctrl, rctl = rdmap.tagged_control(opcode, last)
    try:
        _ENV_TAGGED.pack_into(buf, offset, DDP_WORD | dst_qpn, src_qpn, ctrl, rctl, stag, to)
    except struct.error as e:
        raise ValueError(str(e)) from None
    return TAGGED_PREFIX_LEN


def tagged_packer(dst_qpn: int, src_qpn: int, opcode: int) -> Callable[[Any, bool, int, int], None]:
    """Return ``pack(buf, last, stag, to)``: ``pack_tagged_into(buf, 0, dst_qpn, src_qpn, opcode, last, stag, to)``
    with the QPNs and the opcode checked once, here, instead of per segment.

    Raises:
        ValueError: a QPN or the opcode is out of range (now); ``pack`` raises
            struct.error for a ``stag``/``to`` out of range.
    """
    _check_qpns(dst_qpn, src_qpn)
    more = rdmap.tagged_control(opcode, False)
    last_ctl = rdmap.tagged_control(opcode, True)
    w0 = DDP_WORD | dst_qpn
    pack_into = _ENV_TAGGED.pack_into

    def pack(buf: Any, last: bool, stag: int, to: int) -> None:
        ctrl, rctl = last_ctl if last else more
        pack_into(buf, 0, w0, src_qpn, ctrl, rctl, stag, to)

    return pack


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
    flags: int = 0,
) -> int:
    """Write envelope + untagged segment header at ``offset``; return 26.

    ``flags``: envelope flags (``envelope.Flags``).

    Raises:
        ValueError: as ``rdmap.pack_untagged_into``, a QPN or flag out of range.
    """
    _check_qpns(dst_qpn, src_qpn)
    if flags & ~_FLAGS_KNOWN:
        raise ValueError(f"unknown envelope flags {flags:#x}")
    ctrl, rctl, qn = rdmap.untagged_control(opcode, last, inv_stag)
    try:
        _ENV_UNTAGGED.pack_into(buf, offset, DDP_WORD | dst_qpn, (flags << 24) | src_qpn, ctrl, rctl, inv_stag, qn,
                                msn, mo)
    except struct.error as e:
        raise ValueError(str(e)) from None
    return UNTAGGED_PREFIX_LEN


def encode(dst_qpn: int, src_qpn: int, segment: bytes | bytearray | memoryview, flags: int = 0,
           flow_ack: int | None = None) -> bytes:
    """Return a link body: a DDP envelope around a segment from
    ``rdmap.encode_*`` (and a FLOW_ACK trailer: ``envelope.encode``).

    Not for the hot path (it copies); the send loop uses ``pack_*_into``.

    Raises:
        ValueError: a QPN is out of range.
    """
    return envelope.encode(Kind.DDP, dst_qpn, src_qpn, segment, flags, flow_ack)
