"""The link header: the reliable, congestion-controlled layer between daemons.

Theory of operation
-------------------
Every UDP datagram between two udpverbs daemons is one *link packet*::

    +---------+-------+-------+---------+
    | header  | SACK  | body  | CRC32c  |
    | 28 B    | 8 B*n | ...   | 4 B     |
    +---------+-------+-------+---------+

The header plays the role TCP plays under MPA in iWARP: sequence numbers,
cumulative and selective ACKs, timestamps for RTT measurement (the delay
signal of the EFE-style congestion control), a receive window, and a 32-bit
connection tag chosen at random at link setup.  A packet is accepted only if
its tag is the receiver's own tag for that link (as SCTP's verification tag),
so a blind spoofer must guess 32 bits, and packets of a previous incarnation
of a peer are dropped.  The CRC32c trailer covers header, SACK blocks and
body (MPA's CRC, RFC 5044 §6), because UDP's checksum is weak.

Byte order is network order.  ``seq``/``ack`` are 32-bit and wrap; ``ts_us``
and ``ts_echo_us`` are microseconds modulo 2**32.

``LINK_HEADER`` (construct) is the reference declaration; ``encode`` and
``decode_untrusted`` are the per-datagram fast path over ``struct``, and
``tests/wire/test_link.py`` proves the two agree on every input.
"""

from __future__ import annotations

import enum
import ipaddress
import struct
from typing import Any, Callable, NamedTuple

import construct as c

from .crc import _CRC, CRC_LEN, _crc32c
from .errors import WireError

LINK_VERSION = 2  # 2: INIT and INIT_ACK carry the sender's addresses
MAX_SACK_BLOCKS = 4


class PacketType(enum.IntEnum):
    DATA = 1  #: carries one upper-layer message; may piggyback the cumulative ACK
    ACK = 2  #: pure ACK, may carry SACK blocks
    INIT = 3  #: link setup request; body is a LinkInit, conn_tag is 0
    INIT_ACK = 4  #: link setup answer; body is a LinkInit
    KEEPALIVE = 5  #: liveness probe; the peer answers with an ACK
    ABORT = 6  #: the sender tears the link down (restart, shutdown, retry budget)
    #: the answer to an INIT from a peer we keep no link for: conn_tag is the
    #: INIT's tag, the body a cookie the initiator sends again in its INIT
    #: (SCTP's State Cookie, RFC 9260 §5.1.3; QUIC's Retry, RFC 9000 §8.1);
    #: the answering daemon keeps nothing until it does
    COOKIE = 7
    #: a path MTU probe (RFC 8899 §4.1): a LinkProbe body padded to the
    #: size being tried, no message, answered at once with PROBE_ACK; not
    #: in the sequence space, so its loss costs no retransmission
    PROBE = 8
    #: the answer to a PROBE: the probe's id and the body length that arrived
    PROBE_ACK = 9


class LinkFlags(enum.IntFlag):
    NONE = 0
    ACK_NOW = 0x01  #: ask the receiver to ACK at once (probe, last packet of a burst)
    RETRANSMISSION = 0x02  #: diagnostic only: this DATA packet was sent before


# --- reference declaration ---------------------------------------------------

SACK_BLOCK = c.Struct("start" / c.Int32ub, "end" / c.Int32ub)

LINK_HEADER = c.Struct(
    "version" / c.Const(LINK_VERSION, c.Int8ub),
    "ptype" / c.Int8ub,
    "flags" / c.Int8ub,
    "path_id" / c.Int8ub,
    "conn_tag" / c.Int32ub,
    "seq" / c.Int32ub,
    "ack" / c.Int32ub,
    "ts_us" / c.Int32ub,
    "ts_echo_us" / c.Int32ub,
    "rwnd" / c.Int16ub,
    "sack_count" / c.Int8ub,
    "reserved" / c.Const(0, c.Int8ub),
    "sack" / c.Array(c.this.sack_count, SACK_BLOCK),
)

#: One of the sender's addresses (its other paths, ``transport/paths.py``):
#: family 4 or 6, the address, the UDP port.
LINK_ADDRESS = c.Struct(
    "family" / c.Int8ub,
    "address" / c.Switch(c.this.family, {4: c.Bytes(4), 6: c.Bytes(16)}, default=c.Error),
    "port" / c.Int16ub,
)

#: Body of INIT and INIT_ACK: what each side tells the other at link setup.
LINK_INIT = c.Struct(
    "tag" / c.Int32ub,  # the sender's own tag: the peer puts it in conn_tag
    "isn" / c.Int32ub,  # the sender's initial sequence number
    "max_payload" / c.Int16ub,  # largest link body the sender accepts
    "rwnd" / c.Int16ub,  # initial receive window, packets
    "incarnation" / c.Int64ub,  # changes when a daemon restarts
    # the sender's addresses, at most MAX_ADDRESSES (a count byte, then each)
    "addresses" / c.PrefixedArray(c.Int8ub, LINK_ADDRESS),
    # empty, or (INIT only) the COOKIE_LEN bytes of the COOKIE that answered the last INIT
    "cookie" / c.GreedyBytes,
)
#: the most addresses an INIT / INIT_ACK carries
MAX_ADDRESSES = 8

#: Body of PROBE: an id the PROBE_ACK returns, then zeros up to the size probed.
LINK_PROBE = c.Struct("probe_id" / c.Int32ub, "padding" / c.GreedyBytes)
#: Body of PROBE_ACK: the PROBE's id and the length of the body that arrived.
LINK_PROBE_ACK = c.Struct("probe_id" / c.Int32ub, "size" / c.Int32ub)

#: Body of COOKIE: the passive daemon's clock (seconds) and a keyed MAC
#: (``transport/cookie.py``); opaque to the initiator, which echoes it.
COOKIE_LEN = 16
LINK_COOKIE = c.Struct("stamp_s" / c.Int32ub, "mac" / c.Bytes(COOKIE_LEN - 4))

# --- fast path ---------------------------------------------------------------

_HDR = struct.Struct("!BBBBIIIIIHBB")
HEADER_LEN = _HDR.size  # 28
OVERHEAD = HEADER_LEN + CRC_LEN  # bytes a link packet adds around its body (no SACK)
_SACK = struct.Struct("!II")
_INIT = struct.Struct("!IIHHQ")
_PORT = struct.Struct("!H")
_PROBE_ID = struct.Struct("!I")
_PROBE_ACK = struct.Struct("!II")
#: the shortest PROBE body: its id
PROBE_MIN_BODY = _PROBE_ID.size
_PTYPE_MAX = max(PacketType)
_U32 = 0xFFFFFFFF
_TN = tuple.__new__


class LinkHeader(NamedTuple):
    """A decoded link header.

    A NamedTuple rather than a frozen dataclass: this is built once per
    datagram, and tuple construction is about ten times cheaper than a frozen
    dataclass ``__init__``.
    """

    ptype: int
    flags: int
    path_id: int
    conn_tag: int
    seq: int
    ack: int
    ts_us: int
    ts_echo_us: int
    rwnd: int
    sack: tuple[tuple[int, int], ...] = ()


class LinkInit(NamedTuple):
    tag: int
    isn: int
    max_payload: int
    rwnd: int
    incarnation: int
    cookie: bytes = b""  #: empty, or COOKIE_LEN bytes echoed from a COOKIE
    #: the sender's addresses (IPv4 or IPv6 text, UDP port), its paths' ends
    addresses: tuple[tuple[str, int], ...] = ()


def encode(h: LinkHeader, body: bytes | bytearray | memoryview = b"") -> bytes:
    """Build a complete link packet: header, SACK blocks, body and CRC32c.

    Raises:
        ValueError: more than ``MAX_SACK_BLOCKS`` SACK blocks, or a field out
            of range (a caller bug).
    """
    return encode_fields(h.ptype, h.flags, h.path_id, h.conn_tag, h.seq, h.ack, h.ts_us, h.ts_echo_us, h.rwnd, body,
                         h.sack)


def encode_fields(ptype: int, flags: int, path_id: int, conn_tag: int, seq: int, ack: int, ts_us: int,
                  ts_echo_us: int, rwnd: int, body: bytes | bytearray | memoryview = b"",
                  sack: tuple[tuple[int, int], ...] = ()) -> bytes:
    """``encode`` from plain fields: the sender's per-packet path builds no ``LinkHeader``.

    The body is copied once (by the final join); the CRC runs over header and
    body in two steps instead of over a concatenated copy.

    Raises:
        ValueError: as ``encode``.
    """
    head = _head(ptype, flags, path_id, conn_tag, seq, ack, ts_us, ts_echo_us, rwnd, sack)
    return b"".join((head, body, _CRC.pack(_crc32c(body, _crc32c(head)))))


def _head(ptype: int, flags: int, path_id: int, conn_tag: int, seq: int, ack: int, ts_us: int, ts_echo_us: int,
          rwnd: int, sack: tuple[tuple[int, int], ...]) -> bytes:
    """A packet's header and SACK blocks (what comes before its body)."""
    n = len(sack)
    if n > MAX_SACK_BLOCKS:
        raise ValueError(f"at most {MAX_SACK_BLOCKS} SACK blocks, got {n}")
    try:
        head = _HDR.pack(LINK_VERSION, ptype, flags, path_id, conn_tag, seq, ack, ts_us, ts_echo_us, rwnd, n, 0)
        if n:
            head += b"".join([_SACK.pack(start, end) for start, end in sack])
    except struct.error as e:
        raise ValueError(str(e)) from None
    return head


def encode_fields_parts(ptype: int, flags: int, path_id: int, conn_tag: int, seq: int, ack: int, ts_us: int,
                        ts_echo_us: int, rwnd: int, lead: bytes, payload: memoryview, tail: bytes,
                        sack: tuple[tuple[int, int], ...] = (),
                        crc: Callable[[Any, int], int] = _crc32c) -> tuple[bytes, memoryview, bytes]:
    """``encode_fields`` for a body given in three parts, ``lead + payload +
    tail``, without joining them: ``(header, SACK blocks and lead; payload;
    tail and CRC32c)``, whose concatenation is ``encode_fields``' packet.
    The payload is not copied: the CRC runs over it where it lies (``crc``:
    ``crc(data, value)`` continuing a CRC32c, the ``crc32c`` package's
    signature), so the caller can hand the three parts to ``sendmsg``.

    Raises:
        ValueError: as ``encode``.
    """
    head = _head(ptype, flags, path_id, conn_tag, seq, ack, ts_us, ts_echo_us, rwnd, sack) + lead
    return head, payload, tail + _CRC.pack(_crc32c(tail, crc(payload, _crc32c(head))))


def decode_untrusted(datagram: bytes | bytearray | memoryview) -> tuple[LinkHeader, memoryview]:
    """Check and parse a link packet from the network.

    Returns the header and a view of the body.

    Raises:
        WireError: ``truncated``, ``bad_crc``, ``bad_version``, ``bad_ptype``,
            ``bad_sack`` or ``bad_reserved``; never anything else.
    """
    n = len(datagram)
    if n < OVERHEAD:
        raise WireError("truncated", f"{n} bytes")
    view = datagram if type(datagram) is memoryview else memoryview(datagram)
    end = n - CRC_LEN
    if _crc32c(view[:end]) != _CRC.unpack_from(view, end)[0]:
        raise WireError("bad_crc")
    (version, ptype, flags, path_id, tag, seq, ack, ts, echo, rwnd, nsack,
     reserved) = _HDR.unpack_from(view)
    if version != LINK_VERSION:
        raise WireError("bad_version", str(version))
    if not 1 <= ptype <= _PTYPE_MAX:
        raise WireError("bad_ptype", str(ptype))
    if reserved:
        raise WireError("bad_reserved")
    off = HEADER_LEN
    sack: tuple[tuple[int, int], ...] = ()
    if nsack:
        if nsack > MAX_SACK_BLOCKS or off + 8 * nsack > end:
            raise WireError("bad_sack", f"{nsack} blocks")
        sack = tuple(_SACK.unpack_from(view, off + 8 * i) for i in range(nsack))
        off += 8 * nsack
    # tuple.__new__ skips the NamedTuple's Python-level __new__ (per datagram).
    return _TN(LinkHeader, (ptype, flags, path_id, tag, seq, ack, ts, echo, rwnd, sack)), view[off:end]


def encode_init(init: LinkInit) -> bytes:
    """The body of INIT / INIT_ACK.

    Raises:
        ValueError: a cookie of the wrong length, more than ``MAX_ADDRESSES``
            addresses, or one that is not an IP address and a port.
    """
    if len(init.cookie) not in (0, COOKIE_LEN):
        raise ValueError(f"a cookie is {COOKIE_LEN} bytes, not {len(init.cookie)}")
    addrs = init.addresses
    if len(addrs) > MAX_ADDRESSES:
        raise ValueError(f"at most {MAX_ADDRESSES} addresses, not {len(addrs)}")
    parts = [_INIT.pack(*init[:5]), bytes((len(addrs),))]
    for host, port in addrs:
        ip = ipaddress.ip_address(host)
        try:
            parts += (bytes((ip.version,)), ip.packed, _PORT.pack(port))
        except struct.error as e:
            raise ValueError(f"port {port!r}: {e}") from None
    parts.append(init.cookie)
    return b"".join(parts)


def decode_init_untrusted(body: bytes | bytearray | memoryview) -> LinkInit:
    """Parse the body of INIT / INIT_ACK.  Raises WireError only."""
    n = len(body)
    off = _INIT.size + 1
    if n < off:
        raise WireError("bad_length", f"link init body of {n} bytes")
    count = body[_INIT.size]
    if count > MAX_ADDRESSES:
        raise WireError("bad_count", f"{count} addresses")
    addrs = []
    for _ in range(count):
        if off >= n:
            raise WireError("truncated", "link init addresses")
        family = body[off]
        size = 4 if family == 4 else 16 if family == 6 else 0
        if not size:
            raise WireError("bad_family", str(family))
        end = off + 1 + size
        if end + 2 > n:
            raise WireError("truncated", "link init addresses")
        raw = bytes(body[off + 1:end])
        ip = ipaddress.IPv4Address(raw) if size == 4 else ipaddress.IPv6Address(raw)
        addrs.append((str(ip), _PORT.unpack_from(body, end)[0]))
        off = end + 2
    if n - off not in (0, COOKIE_LEN):
        raise WireError("bad_length", f"link init body of {n} bytes")
    return LinkInit(*_INIT.unpack_from(body), bytes(body[off:]), tuple(addrs))


def decode_cookie_untrusted(body: bytes | bytearray | memoryview) -> bytes:
    """The cookie a COOKIE packet carries.  Raises WireError only."""
    if len(body) != COOKIE_LEN:
        raise WireError("bad_length", f"cookie of {len(body)} bytes")
    return bytes(body)


def encode_probe(probe_id: int, body_len: int) -> bytes:
    """The body of a PROBE: ``probe_id``, then zeros up to ``body_len`` bytes.

    Raises:
        ValueError: ``body_len`` below ``PROBE_MIN_BODY``, or an id out of range.
    """
    if body_len < PROBE_MIN_BODY:
        raise ValueError(f"a probe body is at least {PROBE_MIN_BODY} bytes, not {body_len}")
    try:
        return _PROBE_ID.pack(probe_id) + bytes(body_len - PROBE_MIN_BODY)
    except struct.error as e:
        raise ValueError(str(e)) from None


def decode_probe_untrusted(body: bytes | bytearray | memoryview) -> int:
    """The id of a PROBE body (its padding is not read).  Raises WireError only."""
    if len(body) < PROBE_MIN_BODY:
        raise WireError("truncated", f"probe body of {len(body)} bytes")
    return int(_PROBE_ID.unpack_from(body)[0])


def encode_probe_ack(probe_id: int, size: int) -> bytes:
    """The body of a PROBE_ACK.  Raises ValueError: a field out of range."""
    try:
        return _PROBE_ACK.pack(probe_id, size)
    except struct.error as e:
        raise ValueError(str(e)) from None


def decode_probe_ack_untrusted(body: bytes | bytearray | memoryview) -> tuple[int, int]:
    """``(probe_id, size)`` of a PROBE_ACK body.  Raises WireError only."""
    if len(body) != _PROBE_ACK.size:
        raise WireError("bad_length", f"probe ack body of {len(body)} bytes")
    probe_id, size = _PROBE_ACK.unpack_from(body)
    return probe_id, size
