"""DDP segment headers carrying RDMAP: RFC 5041 §6, RFC 5040 §4, RFC 7306.

The known-answer vectors were written by hand from the RFC bit figures:
DDP Control = T L Rsvd(4) DV(2) with DV=01b; RDMAP Control = RV(2)=01b
Rsv(2)=00b OpCode(4).  So a last tagged segment starts 0xC1, a middle one
0x81, a last untagged one 0x41, a middle one 0x01; the RDMAP control byte is
0x40 | opcode.
"""

from __future__ import annotations

import construct as c
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from udpverbs.wire import ddp, rdmap
from udpverbs.wire.errors import WireError
from udpverbs.wire.rdmap import Opcode, TaggedHeader, UntaggedHeader

from .strategies import (
    SETTINGS,
    assert_flips_detected,
    encode_segment,
    mutated,
    outcome,
    segments,
    tagged_segments,
    untagged_segments,
)

STAG = "01020304"
TO = "0000000000001000"

# (header, payload, hand-written hex of the whole segment)
KNOWN = [
    # RDMA Write, last segment: C1 40 | STag | TO | payload
    (TaggedHeader(Opcode.RDMA_WRITE, True, 0x01020304, 0x1000), b"AB", "c140" + STAG + TO + "4142"),
    # RDMA Write, middle segment: T=1 L=0 -> 0x81
    (TaggedHeader(Opcode.RDMA_WRITE, False, 0x01020304, 0x1000), b"", "8140" + STAG + TO),
    # RDMA Read Response (0010b): C1 42
    (TaggedHeader(Opcode.RDMA_READ_RESPONSE, True, 0xFFFFFFFF, 2**64 - 1), b"", "c142" + "ff" * 12),
    # Send (0011b), last: 41 43 | RsvdULP 0 | QN 0 | MSN 1 | MO 0
    (UntaggedHeader(Opcode.SEND, True, 0, 0, 1, 0), b"x", "4143" + "00000000" "00000000" "00000001" "00000000" "78"),
    # Send, first of several: T=0 L=0 -> 0x01; MO 0, MSN 7
    (UntaggedHeader(Opcode.SEND, False, 0, 0, 7, 0), b"", "0143" + "00000000" "00000000" "00000007" "00000000"),
    # Send with Invalidate (0100b): Invalidate STag in RsvdULP[8:39]
    (UntaggedHeader(Opcode.SEND_INVALIDATE, True, 0xCAFEBABE, 0, 2, 1472), b"",
     "4144" + "cafebabe" "00000000" "00000002" "000005c0"),
    # Send with SE (0101b)
    (UntaggedHeader(Opcode.SEND_SE, True, 0, 0, 3, 0), b"", "4145" + "00" * 4 + "00" * 4 + "00000003" + "00" * 4),
    # Send with SE and Invalidate (0110b)
    (UntaggedHeader(Opcode.SEND_SE_INVALIDATE, True, 0x11, 0, 4, 0), b"",
     "4146" + "00000011" "00000000" "00000004" "00000000"),
    # RDMA Read Request (0001b): QN 1, single segment, 28-byte body
    (UntaggedHeader(Opcode.RDMA_READ_REQUEST, True, 0, 1, 1, 0), bytes(28),
     "4141" + "00000000" "00000001" "00000001" "00000000" + "00" * 28),
    # Terminate (0111b): QN 2; body = control word only (RDMAP, local catastrophic)
    (UntaggedHeader(Opcode.TERMINATE, True, 0, 2, 1, 0), bytes(4),
     "4147" + "00000000" "00000002" "00000001" "00000000" + "00000000"),
    # Immediate Data (1000b) and with SE (1001b): QN 0, 8 bytes
    (UntaggedHeader(Opcode.IMMEDIATE_DATA, True, 0, 0, 9, 0), bytes(range(8)),
     "4148" + "00000000" "00000000" "00000009" "00000000" "0001020304050607"),
    (UntaggedHeader(Opcode.IMMEDIATE_DATA_SE, True, 0, 0, 9, 0), bytes(8),
     "4149" + "00000000" "00000000" "00000009" "00000000" + "00" * 8),
    # Atomic Request (1010b): QN 1 beside Read Requests, 52 bytes; Atomic Response (1011b): QN 3, 12 bytes
    (UntaggedHeader(Opcode.ATOMIC_REQUEST, True, 0, 1, 1, 0), bytes(52),
     "414a" + "00000000" "00000001" "00000001" "00000000" + "00" * 52),
    (UntaggedHeader(Opcode.ATOMIC_RESPONSE, True, 0, 3, 1, 0), bytes(12),
     "414b" + "00000000" "00000003" "00000001" "00000000" + "00" * 12),
]


@pytest.mark.parametrize(("header", "payload", "hexstr"), KNOWN, ids=[f"{h.opcode.name}-{h.last}" for h, _, _ in KNOWN])
def test_known_answer(header: TaggedHeader | UntaggedHeader, payload: bytes, hexstr: str) -> None:
    wire = bytes.fromhex(hexstr)
    assert encode_segment(header, payload) == wire
    got, view = rdmap.decode_untrusted(wire)
    assert got == header and bytes(view) == payload
    assert rdmap.decode_reference(wire) == (header, payload)


def test_every_opcode_has_a_known_answer() -> None:
    assert {h.opcode for h, _, _ in KNOWN} == set(Opcode)


def test_header_lengths_match_rfc_5041() -> None:
    assert ddp.TAGGED_HEADER_LEN == 14 and ddp.UNTAGGED_HEADER_LEN == 18
    assert ddp.control_byte(tagged=True, last=True) == 0xC1
    assert ddp.control_byte(tagged=False, last=False) == 0x01


def test_decode_at_offset() -> None:
    wire = bytes.fromhex(KNOWN[0][2])
    h, view = rdmap.decode_untrusted(b"\xff" * 5 + wire, 5)
    assert h == KNOWN[0][0] and bytes(view) == b"AB"


@SETTINGS
@given(segments)
def test_round_trip_encode_then_decode(seg: tuple[TaggedHeader | UntaggedHeader, bytes]) -> None:
    header, payload = seg
    got, view = rdmap.decode_untrusted(encode_segment(header, payload))
    assert got == header and bytes(view) == payload


@SETTINGS
@given(segments)
def test_decode_then_encode_gives_the_same_bytes(seg: tuple[TaggedHeader | UntaggedHeader, bytes]) -> None:
    wire = encode_segment(*seg)
    header, view = rdmap.decode_untrusted(wire)
    assert encode_segment(header, bytes(view)) == wire


def _reference_build(header: TaggedHeader | UntaggedHeader, payload: bytes) -> bytes:
    tagged = isinstance(header, TaggedHeader)
    return rdmap.RDMAP_SEGMENT.build(
        dict(
            ddp=dict(T=tagged, L=header.last),
            rdmap=dict(opcode=header.opcode),
            buffer=dict(stag=header.stag, to=header.to) if tagged else dict(
                inv_stag=header.inv_stag, msn=header.msn, mo=header.mo
            ),
            payload=payload,
        )
    )


@SETTINGS
@given(segments)
def test_fast_encoder_agrees_with_construct(seg: tuple[TaggedHeader | UntaggedHeader, bytes]) -> None:
    assert encode_segment(*seg) == _reference_build(*seg)


def _fast(data: bytes) -> tuple[TaggedHeader | UntaggedHeader, bytes]:
    h, view = rdmap.decode_untrusted(data)
    return h, bytes(view)


COMPILED = rdmap.RDMAP_SEGMENT.compile()


@SETTINGS
@given(st.one_of(st.binary(max_size=80), mutated(segments.map(lambda s: encode_segment(*s)))))
# A 4-byte Immediate Data: construct's compiled Bytes(8) read it short and accepted it.
@example(bytes.fromhex("4148") + bytes(20))
def test_fast_decoder_agrees_with_construct(data: bytes) -> None:
    fast = outcome(_fast, data)
    ref = outcome(rdmap.decode_reference, data)
    assert fast[0] == ref[0], (fast, ref)
    if fast[0] == "ok":
        assert fast == ref
    # The compiled declaration (what bench/wirecost times) says the same.
    assert outcome(lambda d: rdmap.decode_reference(d, COMPILED), data) == ref


def test_fast_decoder_agrees_with_construct_on_every_control_pair() -> None:
    # All 65,536 (DDP control, RDMAP control) pairs, each on a well-formed rest.
    for ctrl in range(256):
        rest = bytes(12) if ctrl & 0x80 else bytes(16) + bytes(28)
        for rctl in range(256):
            data = bytes((ctrl, rctl)) + rest
            fast = outcome(_fast, data)
            ref = outcome(rdmap.decode_reference, data)
            assert fast[0] == ref[0], (hex(ctrl), hex(rctl), fast, ref)


@SETTINGS
@given(st.binary(max_size=120))
def test_arbitrary_bytes_raise_only_wire_error(data: bytes) -> None:
    outcome(_fast, data)


# --- every malformed class, with the reason receivers count ------------------

SEND = bytes.fromhex(KNOWN[3][2])
WRITE = bytes.fromhex(KNOWN[0][2])
READ_REQ = bytes.fromhex(KNOWN[8][2])


def _patched(data: bytes, index: int, value: int) -> bytes:
    b = bytearray(data)
    b[index] = value
    return bytes(b)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (_patched(WRITE, 0, 0xC0), "bad_dv"),  # DV = 00
        (_patched(WRITE, 0, 0xC2), "bad_dv"),  # DV = 10
        (_patched(WRITE, 0, 0xC5), "bad_reserved"),  # DDP Rsvd bit
        (_patched(WRITE, 1, 0x80), "bad_rv"),  # RV = 10
        (_patched(WRITE, 1, 0x00), "bad_rv"),  # RV = 00
        (_patched(WRITE, 1, 0x50), "bad_reserved"),  # RDMAP Rsv bit
        (_patched(SEND, 1, 0x4C), "bad_opcode"),  # 1100b: unassigned
        (_patched(SEND, 1, 0x4F), "bad_opcode"),
        (_patched(WRITE, 1, 0x43), "bad_tagged"),  # Send opcode with T=1
        (_patched(SEND, 1, 0x40), "bad_tagged"),  # Write opcode with T=0
        (_patched(SEND, 9, 0x01), "bad_qn"),  # Send on QN 1
        (_patched(READ_REQ, 9, 0x00), "bad_qn"),  # Read Request on QN 0
        (_patched(SEND, 5, 0x01), "bad_reserved"),  # Invalidate STag on a plain Send
        (_patched(READ_REQ, 0, 0x01), "bad_segment"),  # Read Request with L=0
        (_patched(READ_REQ, 17, 0x01), "bad_segment"),  # Read Request with MO != 0
        (READ_REQ[:-1], "bad_length"),
        (READ_REQ + b"\x00", "bad_length"),
    ],
)
def test_malformed_reason(data: bytes, reason: str) -> None:
    with pytest.raises(WireError) as e:
        rdmap.decode_untrusted(data)
    assert e.value.reason == reason
    with pytest.raises(WireError):
        rdmap.decode_reference(data)


@pytest.mark.parametrize("wire", [WRITE[:14], SEND[:18]], ids=["tagged", "untagged"])
def test_truncated_at_every_length(wire: bytes) -> None:
    for n in range(len(wire)):
        with pytest.raises(WireError) as e:
            rdmap.decode_untrusted(wire[:n])
        assert e.value.reason == "truncated"
    rdmap.decode_untrusted(wire)  # the whole header alone is a valid empty segment


@SETTINGS
@given(segments)
def test_every_single_bit_flip_is_caught(seg: tuple[TaggedHeader | UntaggedHeader, bytes]) -> None:
    # The segment header has no CRC of its own (the link's covers it), so a
    # flip must either be rejected or change exactly the field it lands in.
    wire = encode_segment(*seg)
    nbits = 8 * (14 if wire[0] & 0x80 else 18)
    assert_flips_detected(wire, _fast, lambda v: (*v[0], type(v[0]), v[1]), nbits)


def test_encoders_refuse_caller_mistakes() -> None:
    with pytest.raises(ValueError):
        rdmap.encode_tagged(Opcode.SEND, True, 1, 2)
    with pytest.raises(ValueError):
        rdmap.encode_untagged(Opcode.RDMA_WRITE, True, 1, 0)
    with pytest.raises(ValueError):
        rdmap.encode_untagged(Opcode.SEND, True, 1, 0, inv_stag=5)
    with pytest.raises(ValueError):
        rdmap.encode_tagged(Opcode.RDMA_WRITE, True, 1 << 32, 0)


@SETTINGS
@given(untagged_segments())
def test_untagged_queue_number_follows_opcode(seg: tuple[UntaggedHeader, bytes]) -> None:
    h, _ = seg
    assert h.qn == {
        Opcode.RDMA_READ_REQUEST: 1,
        Opcode.TERMINATE: 2,
        Opcode.ATOMIC_REQUEST: 1,  # RFC 7306: beside Read Requests
        Opcode.ATOMIC_RESPONSE: 3,
    }.get(h.opcode, 0)


@SETTINGS
@given(tagged_segments())
def test_tagged_segments_are_write_or_read_response(seg: tuple[TaggedHeader, bytes]) -> None:
    assert seg[0].opcode in (Opcode.RDMA_WRITE, Opcode.RDMA_READ_RESPONSE)


@SETTINGS
@given(segments)
def test_ddp_declarations_read_the_same_fields(seg: tuple[TaggedHeader | UntaggedHeader, bytes]) -> None:
    # wire/ddp.py's declarations see the RFC 5041 fields; RsvdULP[0:7] is the
    # RDMAP control byte and RsvdULP[8:39] the Invalidate STag.
    header, payload = seg
    wire = encode_segment(header, payload)
    if isinstance(header, TaggedHeader):
        p = ddp.DDP_TAGGED_HEADER.parse(wire[:14])
        assert (p.stag, p.to) == (header.stag, header.to)
        with pytest.raises(c.ConstructError):
            ddp.DDP_UNTAGGED_HEADER.parse(wire[:18].ljust(18, b"\0"))
    else:
        p = ddp.DDP_UNTAGGED_HEADER.parse(wire[:18])
        assert (p.rsvdulp_word, p.qn, p.msn, p.mo) == (header.inv_stag, header.qn, header.msn, header.mo)
        with pytest.raises(c.ConstructError):
            ddp.DDP_TAGGED_HEADER.parse(wire[:14])
    assert p.control.L == header.last and p.rsvdulp == 0x40 | header.opcode
