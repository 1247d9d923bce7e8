"""QP-level Modified ACK/NACK messages (``Kind.FLOW``), after RHiNET/PM.

Theory of operation
-------------------
The link already makes delivery reliable between daemons, so what is left is
the receiver having no posted receive buffer for an untagged Send (DDP queue
0).  PM's Modified ACK/NACK answers it: the receiver NACKs the Send whose MSN
found no buffer and drops every later Send of that QP until the NACKed one
comes again; the sender re-sends from that MSN and sends nothing newer until
it is accepted.  Two ideas the RHiNET paper leaves open are in the message
set: a back-off hint, and an active "resume" when the receiver posts buffers.

One 12-byte layout, addressed by the envelope's QPNs::

    type u8 | reserved u8 (0) | reserved u16 (0) | msn u32 | backoff_us u32

* ``RNR_NACK``: the Send with this MSN found no receive buffer; it and all
  later Sends were dropped.  ``backoff_us`` > 0: retry after that long;
  0: wait for RESUME (the sender still retries on its own RNR timer).
* ``RESUME``: buffers are posted again; re-send from ``msn``.
* ``ACK``: every Send with MSN < ``msn`` was placed; the sender may drop its
  copies.  ``backoff_us`` is 0 except on RNR_NACK.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import construct as c

from .errors import WireError
from .fixed import pack_checked, unpack_typed_untrusted


class FlowType(enum.IntEnum):
    ACK = 1
    RNR_NACK = 2
    RESUME = 3


class FlowMessage(NamedTuple):
    ftype: int
    msn: int
    backoff_us: int = 0


_TYPES = frozenset(FlowType)

FLOW_MESSAGE = c.Struct(
    "type" / c.Int8ub,
    c.Check(lambda ctx: ctx.type in _TYPES),
    "reserved" / c.Const(0, c.Int8ub),
    "reserved2" / c.Const(0, c.Int16ub),
    "msn" / c.Int32ub,
    "backoff_us" / c.Int32ub,
    c.Check(lambda ctx: ctx.backoff_us == 0 or ctx.type == FlowType.RNR_NACK),
    c.Terminated,
)

_LAYOUT = struct.Struct("!BBHII")
FLOW_LEN = _LAYOUT.size  # 12


def encode(m: FlowMessage) -> bytes:
    """Return the 12-byte wire form of ``m``.

    Raises:
        ValueError: unknown type, a back-off on a non-NACK, or a field out of range.
    """
    if m.ftype not in _TYPES or (m.backoff_us and m.ftype != FlowType.RNR_NACK):
        raise ValueError(f"bad flow message {m!r}")
    return pack_checked(_LAYOUT, m.ftype, 0, 0, m.msn, m.backoff_us)


def decode_untrusted(body: bytes | bytearray | memoryview) -> FlowMessage:
    """Parse a flow-control message from the network.

    Raises:
        WireError: ``bad_length``, ``bad_type`` or ``bad_reserved``; nothing else.
    """
    ftype, r8, r16, msn, backoff = unpack_typed_untrusted(body, _LAYOUT, _TYPES, "flow message")
    if r8 or r16 or (backoff and ftype != FlowType.RNR_NACK):
        raise WireError("bad_reserved", "flow message")
    return FlowMessage(ftype, msn, backoff)
