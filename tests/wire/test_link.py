"""Link header (wire/link.py) and CRC32c (wire/crc.py)."""

from __future__ import annotations

import ipaddress

import construct as c
import pytest
from hypothesis import given
from hypothesis import strategies as st

from udpverbs.wire import crc, link
from udpverbs.wire.errors import WireError
from udpverbs.wire.link import LinkFlags, LinkHeader, LinkInit, PacketType

from .strategies import SETTINGS, mutated, outcome, u8, u16, u32, u64


def test_crc32c_check_value() -> None:
    # The standard CRC-32C check value (RFC 3720 appendix B.4 polynomial).
    assert crc.crc32c(b"123456789") == 0xE3069283
    assert crc.crc32c(b"") == 0


HEADER = LinkHeader(PacketType.DATA, LinkFlags.ACK_NOW, 0, 0xDEADBEEF, 5, 3, 1000, 0, 64)
# version 2 | DATA 1 | ACK_NOW 1 | path 0 | tag | seq 5 | ack 3 | ts 1000 |
# echo 0 | rwnd 64 | sack count 0 | reserved 0
HEADER_HEX = "02010100" "deadbeef" "00000005" "00000003" "000003e8" "00000000" "0040" "00" "00"


def test_known_answer() -> None:
    wire = link.encode(HEADER, b"hi")
    head = bytes.fromhex(HEADER_HEX) + b"hi"
    assert wire == head + crc.crc32c(head).to_bytes(4, "big")
    assert len(bytes.fromhex(HEADER_HEX)) == link.HEADER_LEN == 28
    h, body = link.decode_untrusted(wire)
    assert h == HEADER and bytes(body) == b"hi"


def test_known_answer_with_sack() -> None:
    h = HEADER._replace(ptype=PacketType.ACK, sack=((7, 9), (12, 13)))
    wire = link.encode(h)
    head = bytes.fromhex(HEADER_HEX.replace("02010100", "02020100", 1)[:-4] + "0200")
    head += bytes.fromhex("00000007" "00000009" "0000000c" "0000000d")
    assert wire[:-4] == head
    assert link.decode_untrusted(wire)[0] == h


def _init_dict(init: LinkInit) -> dict:
    """``init`` as the construct declaration builds and parses it."""
    d = init._asdict()
    d["addresses"] = [dict(family=ipaddress.ip_address(h).version, address=ipaddress.ip_address(h).packed, port=p)
                      for h, p in init.addresses]
    return d


def _reference_init(data: bytes) -> LinkInit:
    """INIT body decode on construct alone (the lengths the fast decoder checks, too)."""
    try:
        p = link.LINK_INIT.parse(data)
    except (c.ConstructError, KeyError) as e:
        raise WireError("reference", str(e)) from None
    if len(p.cookie) not in (0, link.COOKIE_LEN) or len(p.addresses) > link.MAX_ADDRESSES:
        raise WireError("reference", "length")
    addrs = tuple((str(ipaddress.ip_address(a.address)), a.port) for a in p.addresses)
    return LinkInit(p.tag, p.isn, p.max_payload, p.rwnd, p.incarnation, p.cookie, addrs)


def test_init_known_answer() -> None:
    init = LinkInit(0x01020304, 0x0A0B0C0D, 1472, 256, 0x1122334455667788)
    wire = link.encode_init(init)
    assert wire == bytes.fromhex("01020304" "0a0b0c0d" "05c0" "0100" "1122334455667788" "00")
    assert link.decode_init_untrusted(wire) == init
    assert link.LINK_INIT.parse(wire) == _init_dict(init)


def test_init_known_answer_with_addresses_and_cookie() -> None:
    init = LinkInit(1, 2, 1472, 256, 3, bytes(range(16)), (("10.0.0.1", 18515), ("fd00::2", 0x1234)))
    wire = link.encode_init(init)
    assert wire == bytes.fromhex("00000001" "00000002" "05c0" "0100" "0000000000000003" "02"
                                 "04" "0a000001" "4853"
                                 "06" "fd000000000000000000000000000002" "1234") + bytes(range(16))
    assert link.decode_init_untrusted(wire) == init
    assert link.LINK_INIT.build(_init_dict(init)) == wire
    # every shorter body is refused, never misread
    for n in range(len(wire)):
        if n != len(wire) - link.COOKIE_LEN:
            with pytest.raises(WireError):
                link.decode_init_untrusted(wire[:n])
    assert link.decode_init_untrusted(wire[:-link.COOKIE_LEN]) == init._replace(cookie=b"")


@pytest.mark.parametrize(("patch", "reason"), [((20, 9), "bad_count"), ((21, 5), "bad_family"),
                                               ((20, 3), "truncated")])
def test_init_garbage_reason(patch: tuple[int, int], reason: str) -> None:
    wire = bytearray(link.encode_init(LinkInit(1, 2, 3, 4, 5, b"", (("10.0.0.1", 1), ("10.0.0.2", 2)))))
    wire[patch[0]] = patch[1]
    with pytest.raises(WireError) as e:
        link.decode_init_untrusted(bytes(wire))
    assert e.value.reason == reason


def test_init_encode_refuses_what_it_cannot_carry() -> None:
    with pytest.raises(ValueError):
        link.encode_init(LinkInit(1, 2, 3, 4, 5, b"", (("10.0.0.1", 1),) * (link.MAX_ADDRESSES + 1)))
    with pytest.raises(ValueError):
        link.encode_init(LinkInit(1, 2, 3, 4, 5, b"", (("not an address", 1),)))
    with pytest.raises(ValueError):
        link.encode_init(LinkInit(1, 2, 3, 4, 5, b"", (("10.0.0.1", 70000),)))


sacks = st.lists(st.tuples(u32, u32), max_size=link.MAX_SACK_BLOCKS).map(tuple)
headers = st.builds(
    LinkHeader, st.sampled_from(sorted(PacketType)), u8, u8, u32, u32, u32, u32, u32, u16, sacks
)


@SETTINGS
@given(headers, st.binary(max_size=64))
def test_round_trips_and_reference_agreement(h: LinkHeader, body: bytes) -> None:
    wire = link.encode(h, body)
    got, view = link.decode_untrusted(wire)
    assert got == h and bytes(view) == body
    assert link.encode(got, view) == wire
    ref = _reference_header(h)
    assert wire[: len(ref)] == ref


@SETTINGS
@given(headers, st.binary(max_size=40), st.binary(max_size=3000), st.binary(max_size=8))
def test_a_body_in_parts_makes_the_same_packet(h: LinkHeader, lead: bytes, payload: bytes, tail: bytes) -> None:
    # the parts a zero-copy send hands to sendmsg, joined, are encode's packet;
    # the payload is not copied (the middle part is the view given)
    view = memoryview(payload)
    parts = link.encode_fields_parts(h.ptype, h.flags, h.path_id, h.conn_tag, h.seq, h.ack, h.ts_us, h.ts_echo_us,
                                     h.rwnd, lead, view, tail, h.sack)
    assert b"".join(parts) == link.encode(h, lead + payload + tail)
    assert parts[1] is view


def _reference_header(h: LinkHeader) -> bytes:
    """The link header as the construct declaration builds it."""
    return link.LINK_HEADER.build(
        dict(
            ptype=h.ptype, flags=h.flags, path_id=h.path_id, conn_tag=h.conn_tag, seq=h.seq, ack=h.ack,
            ts_us=h.ts_us, ts_echo_us=h.ts_echo_us, rwnd=h.rwnd, sack_count=len(h.sack),
            sack=[dict(start=s, end=e) for s, e in h.sack],
        )
    )


def _reference_decode(data: bytes) -> tuple[LinkHeader, bytes]:
    """Link decode on construct alone (CRC checked with the same crc32c)."""
    try:
        if len(data) < 4 or crc.crc32c(data[:-4]) != int.from_bytes(data[-4:], "big"):
            raise WireError("bad_crc")
        p = link.LINK_HEADER.parse(data[:-4])
        if not 1 <= p.ptype <= max(PacketType) or p.sack_count > link.MAX_SACK_BLOCKS:
            raise WireError("reference")
    except c.ConstructError as e:
        raise WireError("reference", str(e)) from None
    size = link.HEADER_LEN + 8 * p.sack_count
    sack = tuple((s.start, s.end) for s in p.sack)
    h = LinkHeader(p.ptype, p.flags, p.path_id, p.conn_tag, p.seq, p.ack, p.ts_us, p.ts_echo_us, p.rwnd, sack)
    return h, data[size:-4]


def _fix_crc(data: bytes) -> bytes:
    """Give mutated bytes a valid CRC, so the checks behind the CRC are exercised."""
    return data[:-4] + crc.crc32c(data[:-4]).to_bytes(4, "big") if len(data) >= 4 else data


def _fast(data: bytes) -> tuple[LinkHeader, bytes]:
    h, view = link.decode_untrusted(data)
    return h, bytes(view)


@SETTINGS
@given(st.one_of(st.binary(max_size=80), mutated(st.builds(link.encode, headers, st.binary(max_size=16))).map(_fix_crc)))
def test_fast_decoder_agrees_with_construct(data: bytes) -> None:
    fast, ref = outcome(_fast, data), outcome(_reference_decode, data)
    assert fast[0] == ref[0], (fast, ref)
    if fast[0] == "ok":
        assert fast == ref


@pytest.mark.parametrize(
    ("index", "value", "reason"),
    [(0, 1, "bad_version"), (1, 0, "bad_ptype"), (1, max(PacketType) + 1, "bad_ptype"), (27, 1, "bad_reserved"), (26, 5, "bad_sack"),
     (26, 1, "bad_sack")],
)
def test_malformed_reason(index: int, value: int, reason: str) -> None:
    wire = bytearray(link.encode(HEADER))
    wire[index] = value
    with pytest.raises(WireError) as e:
        link.decode_untrusted(_fix_crc(bytes(wire)))
    assert e.value.reason == reason


def test_truncated_at_every_length() -> None:
    wire = link.encode(HEADER)
    for n in range(len(wire)):
        with pytest.raises(WireError) as e:
            link.decode_untrusted(wire[:n])
        assert e.value.reason in ("truncated", "bad_crc")


def test_every_single_bit_flip_fails_the_crc() -> None:
    wire = link.encode(HEADER._replace(sack=((1, 2),)), b"payload")
    for bit in range(8 * len(wire)):
        flipped = bytearray(wire)
        flipped[bit // 8] ^= 0x80 >> (bit % 8)
        with pytest.raises(WireError) as e:
            link.decode_untrusted(bytes(flipped))
        assert e.value.reason == "bad_crc"


@SETTINGS
@given(st.binary(max_size=100))
def test_arbitrary_bytes_raise_only_wire_error(data: bytes) -> None:
    outcome(link.decode_untrusted, data)
    outcome(link.decode_init_untrusted, data)
    outcome(link.decode_cookie_untrusted, data)
    outcome(link.decode_probe_untrusted, data)
    outcome(link.decode_probe_ack_untrusted, data)
    outcome(link.decode_untrusted, _fix_crc(data))


@SETTINGS
@given(st.binary(min_size=link.COOKIE_LEN, max_size=link.COOKIE_LEN))
def test_cookie_round_trip(cookie: bytes) -> None:
    assert link.decode_cookie_untrusted(cookie) == cookie
    parsed = link.LINK_COOKIE.parse(cookie)
    assert link.LINK_COOKIE.build(dict(stamp_s=parsed.stamp_s, mac=parsed.mac)) == cookie


addresses = st.lists(st.tuples(st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6)).map(str), u16),
                     max_size=link.MAX_ADDRESSES).map(tuple)
inits = st.builds(LinkInit, u32, u32, u16, u16, u64,
                  st.just(b"") | st.binary(min_size=link.COOKIE_LEN, max_size=link.COOKIE_LEN), addresses)


@SETTINGS
@given(inits)
def test_init_round_trip(init: LinkInit) -> None:
    wire = link.encode_init(init)
    assert link.decode_init_untrusted(wire) == init
    assert link.LINK_INIT.build(_init_dict(init)) == wire


@SETTINGS
@given(st.one_of(st.binary(max_size=80), mutated(inits.map(link.encode_init))))
def test_init_decoder_agrees_with_construct(data: bytes) -> None:
    fast, ref = outcome(link.decode_init_untrusted, data), outcome(_reference_init, data)
    assert fast[0] == ref[0], (fast, ref)
    if fast[0] == "ok":
        assert fast == ref


@SETTINGS
@given(headers.map(lambda h: h._replace(sack=())), st.binary(max_size=64))
def test_encode_fields_is_encode_without_sack(h: LinkHeader, body: bytes) -> None:
    # The sender's per-packet path (encode delegates to it, so compare with
    # the construct declaration too): header, body, CRC32c of both.
    wire = link.encode_fields(*h[:9], body)
    assert wire == link.encode(h, body)
    ref = _reference_header(h) + body
    assert wire == ref + crc.crc32c(ref).to_bytes(4, "big")


def test_probe_known_answer() -> None:
    body = link.encode_probe(0x01020304, 10)
    assert body == bytes.fromhex("01020304" "000000000000")
    assert link.decode_probe_untrusted(body) == 0x01020304
    ack = link.encode_probe_ack(7, 8940)
    assert ack == bytes.fromhex("00000007" "000022ec")
    assert link.decode_probe_ack_untrusted(ack) == (7, 8940)
    with pytest.raises(ValueError):
        link.encode_probe(1, link.PROBE_MIN_BODY - 1)


@SETTINGS
@given(u32, st.integers(link.PROBE_MIN_BODY, 9000))
def test_probe_agrees_with_construct(probe_id: int, body_len: int) -> None:
    body = link.encode_probe(probe_id, body_len)
    assert len(body) == body_len
    assert link.LINK_PROBE.build(dict(probe_id=probe_id, padding=bytes(body_len - 4))) == body
    assert link.LINK_PROBE.parse(body).probe_id == link.decode_probe_untrusted(body) == probe_id


@SETTINGS
@given(u32, u32)
def test_probe_ack_agrees_with_construct(probe_id: int, size: int) -> None:
    body = link.encode_probe_ack(probe_id, size)
    assert link.LINK_PROBE_ACK.build(dict(probe_id=probe_id, size=size)) == body
    parsed = link.LINK_PROBE_ACK.parse(body)
    assert (parsed.probe_id, parsed.size) == link.decode_probe_ack_untrusted(body) == (probe_id, size)


def _reference_probe(data: bytes) -> int:
    try:
        return int(link.LINK_PROBE.parse(data).probe_id)
    except c.ConstructError as e:
        raise WireError("reference", str(e)) from None


def _reference_probe_ack(data: bytes) -> tuple[int, int]:
    try:
        p = link.LINK_PROBE_ACK.parse(data)
    except c.ConstructError as e:
        raise WireError("reference", str(e)) from None
    if len(data) != link.LINK_PROBE_ACK.sizeof():
        raise WireError("reference", "trailing bytes")
    return p.probe_id, p.size


@SETTINGS
@given(st.binary(max_size=16))
def test_probe_decoders_agree_with_construct_on_any_bytes(data: bytes) -> None:
    for fast, ref in ((link.decode_probe_untrusted, _reference_probe),
                      (link.decode_probe_ack_untrusted, _reference_probe_ack)):
        got, want = outcome(fast, data), outcome(ref, data)
        assert got[0] == want[0]
        if got[0] == "ok":
            assert got == want
