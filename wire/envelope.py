"""The 8-byte envelope in front of every upper-layer message on a link.

Theory of operation
-------------------
iWARP binds one QP to one TCP/MPA stream, so DDP never names a QP.  We
multiplex every QP between two daemons over one reliable link (so they share
one congestion controller, as the EFE does per path), which means each link
message must say which QP it is for.  The envelope does that::

     0                   1                   2                   3
     0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
    +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
    |     kind      |              destination QPN                  |
    +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
    |     flags     |                source QPN                     |
    +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+

``kind`` says which decoder reads the rest (DDP/RDMAP segment, connection
management, QP flow control, lock, barrier, group membership).  The source
QPN lets the receiver drop a message that does not come from the QP's
connected peer (stale after QPN reuse, or misrouted).  QPN 0 is the connection manager.

``flags`` carries what the RFC bytes behind it cannot say about a message
on a multiplexed link.  Two bits are defined, on DDP messages only:

* ``IMM_FOLLOWS`` on a Send (the last segment of it) says that the Immediate
  Data message after it belongs to the same receive: our Send with Immediate
  (verbs' IBV_WR_SEND_WITH_IMM) is a Send followed by RFC 7306 Immediate
  Data, and RFC 7306 alone would have the Immediate Data consume a receive
  of its own.
* ``FLOW_ACK``: the message ends with a 4-byte trailer, not part of the DDP
  segment: an MSN with the meaning of a Modified ACK (``wire/flow.py``
  ``ACK``) from the source QP, "every queue-0 message of yours below this
  MSN was placed".  A QP that answers Sends with Sends carries its ACK on
  its answer instead of in a message of its own (``daemon/requester.py``)::

      | envelope (8) | DDP segment ... | msn u32 |

Every other bit, and any bit on another kind, is refused as ``bad_reserved``.

``ENVELOPE`` and ``FLOW_ACK_TRAILER`` (construct) are the reference
declarations; ``encode``, ``pack_into``, ``pack_flow_ack_into``,
``decode_untrusted`` and ``flow_ack_msn`` are the per-message fast path.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import construct as c

from .errors import WireError

ENVELOPE_LEN = 8
MAX_QPN = (1 << 24) - 1
#: QPN of the connection manager (RFC 5044's MPA exchange has no QP yet).
CM_QPN = 0


class Kind(enum.IntEnum):
    DDP = 1  #: a DDP segment carrying RDMAP (RFC 5041 + RFC 5040 / RFC 7306)
    CM = 2  #: connection management (wire/cm.py)
    FLOW = 3  #: QP-level Modified ACK/NACK (wire/flow.py)
    LOCK = 4  #: RHiNET queue lock (wire/lock.py)
    BARRIER = 5  #: tree barrier (wire/barrier.py)
    GROUP = 6  #: process-group membership (wire/group.py)


_KIND_MAX = max(Kind)


class Flags(enum.IntFlag):
    IMM_FOLLOWS = 0x01  #: the next Immediate Data completes this Send's receive
    FLOW_ACK = 0x02  #: a Modified ACK's MSN ends the message (FLOW_ACK_TRAILER)


#: every envelope flag this version knows (others are refused)
FLAGS_KNOWN = int(Flags.IMM_FOLLOWS | Flags.FLOW_ACK)
#: Flags.FLOW_ACK as a plain int (IntFlag operators are slow on the per-segment path)
FLOW_ACK_FLAG = int(Flags.FLOW_ACK)
#: bytes of the trailer a FLOW_ACK message ends with
FLOW_ACK_LEN = 4

# --- reference declaration ---------------------------------------------------

ENVELOPE = c.Struct(
    "kind" / c.Int8ub,
    "dst_qpn" / c.Int24ub,
    "flags" / c.Int8ub,
    # this-expressions, not a lambda, so the declaration still compiles (wirecost).
    c.Check(((c.this.flags & (0xFF ^ FLAGS_KNOWN)) == 0) & ((c.this.flags == 0) | (c.this.kind == int(Kind.DDP)))),
    "src_qpn" / c.Int24ub,
)

#: the last FLOW_ACK_LEN bytes of a message whose envelope has FLOW_ACK
FLOW_ACK_TRAILER = c.Struct("msn" / c.Int32ub)

# --- fast path ---------------------------------------------------------------

_ENV = struct.Struct("!II")
_TRAILER = struct.Struct("!I")


class Envelope(NamedTuple):
    """A decoded envelope (a NamedTuple: built once per datagram)."""

    kind: int
    dst_qpn: int
    src_qpn: int
    flags: int = 0


def pack_into(buf: bytearray | memoryview, offset: int, kind: int, dst_qpn: int, src_qpn: int,
              flags: int = 0) -> int:
    """Write an envelope into ``buf`` at ``offset``; return ``ENVELOPE_LEN``.

    Raises:
        ValueError: an unknown kind or flag, or a QPN out of range (a caller bug).
    """
    if not 1 <= kind <= _KIND_MAX or not 0 <= dst_qpn <= MAX_QPN or not 0 <= src_qpn <= MAX_QPN \
            or flags & ~FLAGS_KNOWN or (flags and kind != Kind.DDP):
        raise ValueError(f"envelope out of range: kind={kind} dst={dst_qpn} src={src_qpn} flags={flags}")
    _ENV.pack_into(buf, offset, (kind << 24) | dst_qpn, (flags << 24) | src_qpn)
    return ENVELOPE_LEN


def encode(kind: int, dst_qpn: int, src_qpn: int, body: bytes | bytearray | memoryview = b"",
           flags: int = 0, flow_ack: int | None = None) -> bytes:
    """Return envelope + ``body`` (+ the FLOW_ACK trailer with MSN
    ``flow_ack``, which sets that flag) as one bytes object.

    Raises:
        ValueError: a field is out of range, or FLOW_ACK in ``flags`` without an MSN.
    """
    if flow_ack is not None:
        flags |= FLOW_ACK_FLAG
    elif flags & FLOW_ACK_FLAG:
        raise ValueError("FLOW_ACK needs the MSN of its trailer")
    n = ENVELOPE_LEN + len(body)
    buf = bytearray(n + (FLOW_ACK_LEN if flow_ack is not None else 0))
    pack_into(buf, 0, kind, dst_qpn, src_qpn, flags)
    buf[ENVELOPE_LEN:n] = body
    if flow_ack is not None:
        pack_flow_ack_into(buf, n, flow_ack)
    return bytes(buf)


def pack_flow_ack_into(buf: bytearray | memoryview, offset: int, msn: int) -> int:
    """Write the FLOW_ACK trailer (the message's last bytes) at ``offset``;
    return ``FLOW_ACK_LEN``.

    Raises:
        ValueError: ``msn`` out of range.
    """
    try:
        _TRAILER.pack_into(buf, offset, msn)
    except struct.error as e:
        raise ValueError(str(e)) from None
    return FLOW_ACK_LEN


def flow_ack_msn(data: bytes | bytearray | memoryview) -> int:
    """The MSN in the trailer of a message ``decode_untrusted`` accepted with FLOW_ACK."""
    return _TRAILER.unpack_from(data, len(data) - FLOW_ACK_LEN)[0]


def decode_untrusted(data: bytes | bytearray | memoryview) -> tuple[Envelope, memoryview]:
    """Parse the envelope of a link message from the network.

    Returns the envelope and a view of the message after it, up to the
    FLOW_ACK trailer if the envelope has that flag (``flow_ack_msn`` reads it).

    Raises:
        WireError: ``truncated`` (also: no room for the FLOW_ACK trailer),
            ``bad_kind`` or ``bad_reserved`` (an unknown flag, or a flag on a
            kind other than DDP); nothing else.
    """
    if len(data) < ENVELOPE_LEN:
        raise WireError("truncated", f"{len(data)} bytes, envelope needs {ENVELOPE_LEN}")
    w0, w1 = _ENV.unpack_from(data)
    kind = w0 >> 24
    if not 1 <= kind <= _KIND_MAX:
        raise WireError("bad_kind", str(kind))
    flags = w1 >> 24
    end = len(data)
    if flags:
        if flags & ~FLAGS_KNOWN or kind != Kind.DDP:
            raise WireError("bad_reserved", "envelope flags")
        if flags & FLOW_ACK_FLAG:
            end -= FLOW_ACK_LEN
            if end < ENVELOPE_LEN:
                raise WireError("truncated", f"{len(data)} bytes, FLOW_ACK needs {ENVELOPE_LEN + FLOW_ACK_LEN}")
    # tuple.__new__ skips the NamedTuple's Python-level __new__ (per datagram).
    return tuple.__new__(Envelope, (kind, w0 & MAX_QPN, w1 & MAX_QPN, flags)), memoryview(data)[ENVELOPE_LEN:end]
