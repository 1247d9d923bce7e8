"""DDP segment headers, bit-exact to RFC 5041 §6 (without the MPA header).

Theory of operation
-------------------
Every DDP segment starts with the 8-bit DDP Control Field (RFC 5041 §6.1)::

     0 1 2 3 4 5 6 7
    +-+-+-+-+-+-+-+-+
    |T|L| Rsvd  | DV|     T: tagged, L: last segment of the message,
    +-+-+-+-+-+-+-+-+     Rsvd: 0, DV: DDP version = 01b

followed by the first octet reserved for the ULP (RsvdULP[0:7]), which RDMAP
uses as its own control field (RFC 5040 §4.1; see ``rdmap.py``).  Then:

* tagged buffer model (RFC 5041 §6.2), 14 bytes in all:
  STag (32 bits), TO (64 bits);
* untagged buffer model (RFC 5041 §6.3), 18 bytes in all:
  RsvdULP[8:39] (32 bits: RDMAP puts the Invalidate STag there),
  QN (32), MSN (32), MO (32).

The MPA header and CRC of RFC 5044 are not used: the link layer frames each
message in one datagram and carries the CRC32c (``link.py``).

Receivers here also reject a nonzero Rsvd field (``bad_reserved``), which
RFC 5041 lets a receiver ignore: every peer is this implementation, so a set
reserved bit means corruption or version skew, and rejecting it means a
flipped bit anywhere in the header is noticed.

This module holds the layout; ``rdmap.py`` holds the one combined decoder
(DDP + RDMAP control) that the receive path calls per segment.
"""

from __future__ import annotations

import struct

import construct as c

DDP_VERSION = 1  #: RFC 5041 §6.1: DV = 01b

# DDP Control Field bits (RFC 5041 §6.1); bit 0 of the figure is the MSB.
T_FLAG = 0x80
L_FLAG = 0x40
RSVD_MASK = 0x3C
DV_MASK = 0x03

#: First octet of a tagged / untagged segment for each (last) value.
CTRL_TAGGED = T_FLAG | DDP_VERSION
CTRL_UNTAGGED = DDP_VERSION

TAGGED_HEADER_LEN = 14  # RFC 5041 §6.2
UNTAGGED_HEADER_LEN = 18  # RFC 5041 §6.3

# --- reference declarations --------------------------------------------------

DDP_CONTROL = c.BitStruct(
    "T" / c.Flag,
    "L" / c.Flag,
    "rsvd" / c.Const(0, c.BitsInteger(4)),
    "dv" / c.Const(DDP_VERSION, c.BitsInteger(2)),
)

#: RFC 5041 §6.2 (T must be 1).
DDP_TAGGED_HEADER = c.Struct(
    "control" / DDP_CONTROL,
    c.Check(c.this.control.T),
    "rsvdulp" / c.Int8ub,
    "stag" / c.Int32ub,
    "to" / c.Int64ub,
)

#: RFC 5041 §6.3 (T must be 0).
DDP_UNTAGGED_HEADER = c.Struct(
    "control" / DDP_CONTROL,
    c.Check(lambda ctx: not ctx.control.T),
    "rsvdulp" / c.Int8ub,
    "rsvdulp_word" / c.Int32ub,
    "qn" / c.Int32ub,
    "msn" / c.Int32ub,
    "mo" / c.Int32ub,
)

# --- fast path ---------------------------------------------------------------

#: control, RsvdULP[0:7], STag, TO
TAGGED = struct.Struct("!BBIQ")
#: control, RsvdULP[0:7], RsvdULP[8:39], QN, MSN, MO
UNTAGGED = struct.Struct("!BBIIII")
assert TAGGED.size == TAGGED_HEADER_LEN and UNTAGGED.size == UNTAGGED_HEADER_LEN


def control_byte(tagged: bool, last: bool) -> int:
    """Return the DDP Control Field for a segment (RFC 5041 §6.1)."""
    return (T_FLAG if tagged else 0) | (L_FLAG if last else 0) | DDP_VERSION
