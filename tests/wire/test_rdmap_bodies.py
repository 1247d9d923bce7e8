"""RDMAP headers carried as DDP payload: Read Request (RFC 5040 §4.4),
Terminate (§4.8), Atomic Request/Response (RFC 7306 §5), Immediate Data (§4).

Known answers are hand-written from the RFC figures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import construct as c
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from udpverbs.wire import rdmap
from udpverbs.wire.errors import WireError
from udpverbs.wire.rdmap import (
    AtomicOp,
    AtomicRequest,
    AtomicResponse,
    DdpErrorType,
    DdpUntaggedErrorCode,
    ReadRequest,
    Terminate,
    TermLayer,
)

from .strategies import SETTINGS, reference_parser, assert_flips_detected, mutated, outcome, terminates, u32, u64

READ_REQUEST = ReadRequest(0xAABBCCDD, 0x1122334455667788, 0x00010000, 0x01020304, 0x40)
# sink STag | sink TO | RDMA Read Message Size | source STag | source TO
READ_REQUEST_HEX = "aabbccdd" "1122334455667788" "00010000" "01020304" "0000000000000040"

ATOMIC_REQUEST = AtomicRequest(AtomicOp.CMP_SWAP, 7, 0x0A0B0C0D, 0x100, 5, 2**64 - 1, 3, 2**64 - 1)
# Rsvd(28) AOpCode(4) | Request Identifier | Remote STag | Remote TO |
# Add/Swap Data | Add/Swap Mask | Compare Data | Compare Mask
ATOMIC_REQUEST_HEX = (
    "00000002" "00000007" "0a0b0c0d" "0000000000000100"
    "0000000000000005" "ffffffffffffffff" "0000000000000003" "ffffffffffffffff"
)
ATOMIC_RESPONSE = AtomicResponse(7, 3)
ATOMIC_RESPONSE_HEX = "00000007" "0000000000000003"  # Original Request Id | Original Remote Data

# Terminate: Layer=DDP(1) EType=untagged buffer(2) Code=no buffer(2), M=1 D=1 R=0
#   -> 0001 0010 | 0000 0010 | 1100 0000 0000 0000 = 12 02 c0 00
# then DDP Segment Length 0x0020 and the copied 18-byte untagged Send header.
SEND_HEADER_HEX = "4143" "00000000" "00000000" "00000001" "00000000"
TERMINATE = Terminate(
    TermLayer.DDP, DdpErrorType.UNTAGGED_BUFFER, DdpUntaggedErrorCode.INVALID_MSN_NO_BUFFER,
    True, 0x20, bytes.fromhex(SEND_HEADER_HEX), b"",
)
TERMINATE_HEX = "1202c000" "0020" + SEND_HEADER_HEX
# Layer=RDMAP(0) EType=remote protection(1) Code=invalid STag(0), D=1 R=1 (M=0):
#   0000 0001 | 0000 0000 | 0110 0000 ... = 01 00 60 00, seg len, copied Read
#   Request segment header (tagged? no: untagged 18 bytes), then its 28-byte header.
READ_REQ_SEGMENT_HEX = "4141" "00000000" "00000001" "00000005" "00000000"
TERMINATE_RDMAP = Terminate(
    TermLayer.RDMAP, rdmap.RdmapErrorType.REMOTE_PROTECTION, rdmap.RdmapErrorCode.INVALID_STAG,
    False, 46, bytes.fromhex(READ_REQ_SEGMENT_HEX), bytes.fromhex(READ_REQUEST_HEX),
)
TERMINATE_RDMAP_HEX = "01006000" "002e" + READ_REQ_SEGMENT_HEX + READ_REQUEST_HEX
# A tagged copied header (14 bytes): Layer=DDP EType=tagged(1) Code=base/bounds(1), D=1
TERMINATE_TAGGED = Terminate(TermLayer.DDP, DdpErrorType.TAGGED_BUFFER, 1, False, 1486,
                             bytes.fromhex("c140" "01020304" "0000000000001000"))
TERMINATE_TAGGED_HEX = "11014000" "05ce" "c140" "01020304" "0000000000001000"

# (encode, decode, reference construct, value, hex)
CODECS: list[tuple[Callable[[Any], bytes], Callable[[bytes], Any], c.Construct, Any, str]] = [
    (rdmap.encode_read_request, rdmap.decode_read_request_untrusted, rdmap.READ_REQUEST, READ_REQUEST, READ_REQUEST_HEX),
    (rdmap.encode_atomic_request, rdmap.decode_atomic_request_untrusted, rdmap.ATOMIC_REQUEST, ATOMIC_REQUEST,
     ATOMIC_REQUEST_HEX),
    (rdmap.encode_atomic_response, rdmap.decode_atomic_response_untrusted, rdmap.ATOMIC_RESPONSE, ATOMIC_RESPONSE,
     ATOMIC_RESPONSE_HEX),
    (rdmap.encode_immediate_data, rdmap.decode_immediate_data_untrusted, rdmap.IMMEDIATE_DATA, 0x0102030405060708,
     "0102030405060708"),
    (rdmap.encode_terminate, rdmap.decode_terminate_untrusted, rdmap.TERMINATE, TERMINATE, TERMINATE_HEX),
    (rdmap.encode_terminate, rdmap.decode_terminate_untrusted, rdmap.TERMINATE, TERMINATE_RDMAP, TERMINATE_RDMAP_HEX),
    (rdmap.encode_terminate, rdmap.decode_terminate_untrusted, rdmap.TERMINATE, TERMINATE_TAGGED, TERMINATE_TAGGED_HEX),
]
IDS = ["read_request", "atomic_request", "atomic_response", "immediate", "terminate_ddp", "terminate_rdmap",
       "terminate_tagged"]


@pytest.mark.parametrize(("enc", "dec", "ref", "value", "hexstr"), CODECS, ids=IDS)
def test_known_answer(enc: Any, dec: Any, ref: c.Construct, value: Any, hexstr: str) -> None:
    wire = bytes.fromhex(hexstr)
    assert enc(value) == wire
    assert dec(wire) == value
    ref.parse(wire)  # the reference declaration accepts it too


@pytest.mark.parametrize(("enc", "dec", "ref", "value", "hexstr"), CODECS, ids=IDS)
def test_truncated_or_extended_is_bad_length(enc: Any, dec: Any, ref: c.Construct, value: Any, hexstr: str) -> None:
    wire = bytes.fromhex(hexstr)
    for n in range(len(wire)):
        with pytest.raises(WireError) as e:
            dec(wire[:n])
        assert e.value.reason == "bad_length", n
    with pytest.raises(WireError):
        dec(wire + b"\x00")


@pytest.mark.parametrize(("enc", "dec", "ref", "value", "hexstr"), CODECS, ids=IDS)
def test_every_single_bit_flip_is_caught(enc: Any, dec: Any, ref: c.Construct, value: Any, hexstr: str) -> None:
    as_tuple = (lambda v: (v,)) if isinstance(value, int) else tuple
    assert_flips_detected(bytes.fromhex(hexstr), dec, as_tuple)


read_requests = st.builds(ReadRequest, u32, u64, u32, u32, u64)
atomic_requests = st.builds(AtomicRequest, st.sampled_from(sorted(AtomicOp)), u32, u32, u64, u64, u64, u64, u64)
atomic_responses = st.builds(AtomicResponse, u32, u64)


def _ref_read_request(v: ReadRequest) -> bytes:
    return rdmap.READ_REQUEST.build(v._asdict())


def _ref_atomic_request(v: AtomicRequest) -> bytes:
    d = v._asdict()
    d["word0"] = dict(aop=d.pop("aop"))
    return rdmap.ATOMIC_REQUEST.build(d)


def _ref_terminate(t: Terminate) -> bytes:
    return rdmap.TERMINATE.build(
        dict(
            control=dict(layer=t.layer, etype=t.etype, ecode=t.ecode, M=t.m, D=bool(t.ddp_header), R=bool(t.rdmap_header)),
            ddp_segment_length=t.ddp_segment_length if t.ddp_header else None,
            ddp_first_byte=t.ddp_header[0] if t.ddp_header else None,
            ddp_header=t.ddp_header or None,
            rdmap_header=t.rdmap_header or None,
        )
    )


ROUND_TRIPS = [
    (read_requests, rdmap.encode_read_request, rdmap.decode_read_request_untrusted, _ref_read_request),
    (atomic_requests, rdmap.encode_atomic_request, rdmap.decode_atomic_request_untrusted, _ref_atomic_request),
    (atomic_responses, rdmap.encode_atomic_response, rdmap.decode_atomic_response_untrusted,
     lambda v: rdmap.ATOMIC_RESPONSE.build(v._asdict())),
    (u64, rdmap.encode_immediate_data, rdmap.decode_immediate_data_untrusted,
     lambda v: rdmap.IMMEDIATE_DATA.build(dict(data=v))),
    (terminates(), rdmap.encode_terminate, rdmap.decode_terminate_untrusted, _ref_terminate),
]
RT_IDS = ["read_request", "atomic_request", "atomic_response", "immediate", "terminate"]


@pytest.mark.parametrize(("values", "enc", "pack_into"), [
    (read_requests, rdmap.encode_read_request, rdmap.pack_read_request_into),
    (atomic_requests, rdmap.encode_atomic_request, rdmap.pack_atomic_request_into),
], ids=["read_request", "atomic_request"])
def test_pack_into_writes_what_encode_returns(values: Any, enc: Any, pack_into: Any) -> None:
    @SETTINGS
    @given(values, st.integers(0, 40))
    def check(value: Any, offset: int) -> None:
        wire = enc(value)
        buf = bytearray(b"\xa5" * (offset + len(wire) + 3))
        assert pack_into(buf, offset, *value) == len(wire)
        assert buf == b"\xa5" * offset + wire + b"\xa5" * 3  # its bytes, and nothing else touched

    check()


def test_pack_into_refuses_what_encode_refuses() -> None:
    buf = bytearray(64)
    with pytest.raises(ValueError):
        rdmap.pack_read_request_into(buf, 0, 1 << 32, 0, 1, 1, 0)
    with pytest.raises(ValueError):
        rdmap.pack_atomic_request_into(buf, 0, 0x7, 0, 0, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError):
        rdmap.pack_atomic_request_into(buf, 0, AtomicOp.FETCH_ADD, 0, 0, -1, 0, 0, 0, 0)


@pytest.mark.parametrize(("values", "enc", "dec", "ref_build"), ROUND_TRIPS, ids=RT_IDS)
def test_round_trips_and_reference_agreement(values: Any, enc: Any, dec: Any, ref_build: Any) -> None:
    @SETTINGS
    @given(values)
    def check(value: Any) -> None:
        wire = enc(value)
        assert dec(wire) == value  # decode . encode
        assert enc(dec(wire)) == wire  # encode . decode
        assert ref_build(value) == wire  # fast encoder == construct

    check()


REFS = [
    (rdmap.decode_read_request_untrusted, rdmap.READ_REQUEST, read_requests.map(rdmap.encode_read_request)),
    (rdmap.decode_atomic_request_untrusted, rdmap.ATOMIC_REQUEST, atomic_requests.map(rdmap.encode_atomic_request)),
    (rdmap.decode_atomic_response_untrusted, rdmap.ATOMIC_RESPONSE, atomic_responses.map(rdmap.encode_atomic_response)),
    (rdmap.decode_terminate_untrusted, rdmap.TERMINATE, terminates().map(rdmap.encode_terminate)),
]


@pytest.mark.parametrize(("dec", "ref", "valid"), REFS, ids=["read_request", "atomic_request", "atomic_response",
                                                             "terminate"])
def test_fast_decoder_rejects_what_construct_rejects(dec: Any, ref: c.Construct, valid: Any) -> None:
    ref_parse = reference_parser(ref)

    @SETTINGS
    @given(st.one_of(st.binary(max_size=70), mutated(valid)))
    # D set and the copied segment length present, but no DDP header after it:
    # the construct declaration once crashed with a TypeError here.
    @example(b"\x00\x00\x40\x00\x00\x00")
    def check(data: bytes) -> None:
        assert outcome(dec, data)[0] == outcome(ref_parse, data)[0]

    check()


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (bytes.fromhex("00000003") + bytes(48), "bad_atomic_op"),  # AOpCode 0011b unassigned
        (bytes.fromhex("00000010") + bytes(48), "bad_reserved"),
        (bytes.fromhex("30000000"), "bad_layer"),  # layer 3
        (bytes.fromhex("04000000"), "bad_layer"),  # RDMAP EType 4
        (bytes.fromhex("00000001"), "bad_reserved"),
        (bytes.fromhex("00004000"), "bad_length"),  # D set, nothing follows
    ],
)
def test_malformed_body_reason(data: bytes, reason: str) -> None:
    dec = rdmap.decode_atomic_request_untrusted if len(data) == 52 else rdmap.decode_terminate_untrusted
    with pytest.raises(WireError) as e:
        dec(data)
    assert e.value.reason == reason


def test_encoders_refuse_caller_mistakes() -> None:
    with pytest.raises(ValueError):
        rdmap.encode_atomic_request(ATOMIC_REQUEST._replace(aop=3))
    with pytest.raises(ValueError):
        rdmap.encode_terminate(TERMINATE._replace(ddp_header=bytes(14)))  # T=0 says 18
    with pytest.raises(ValueError):
        rdmap.encode_terminate(TERMINATE._replace(rdmap_header=bytes(27)))
    with pytest.raises(ValueError):
        rdmap.encode_terminate(TERMINATE._replace(layer=5))
    with pytest.raises(ValueError):
        rdmap.encode_immediate_data(1 << 64)


@SETTINGS
@given(st.binary(max_size=80))
def test_arbitrary_bytes_raise_only_wire_error(data: bytes) -> None:
    for dec in (
        rdmap.decode_read_request_untrusted,
        rdmap.decode_atomic_request_untrusted,
        rdmap.decode_atomic_response_untrusted,
        rdmap.decode_immediate_data_untrusted,
        rdmap.decode_terminate_untrusted,
    ):
        outcome(dec, data)


def test_rdmap_names_every_body_layout_of_rdmap_bodies() -> None:
    # one definition of each layout (rdmap_bodies), reachable as rdmap.X for every caller
    from udpverbs.wire import rdmap_bodies

    for name in rdmap_bodies.__all__:
        assert getattr(rdmap, name) is getattr(rdmap_bodies, name), name
