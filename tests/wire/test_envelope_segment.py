"""The envelope (wire/envelope.py) and the fused receive path (wire/segment.py)."""

from __future__ import annotations

import construct as c
import pytest
from hypothesis import given
from hypothesis import strategies as st

from udpverbs.wire import barrier, cm, envelope, flow, lock, rdmap, segment
from udpverbs.wire.envelope import Envelope, Kind
from udpverbs.wire.errors import WireError
from udpverbs.wire.rdmap import Opcode, TaggedHeader, UntaggedHeader

from .strategies import SETTINGS, assert_flips_detected, encode_segment, mutated, outcome, segments, u24

# kind DDP(1) | dst 0x000102 | flags 0 | src 0xABCDEF
ENVELOPE_HEX = "01000102" "00abcdef"


def test_envelope_known_answer() -> None:
    wire = envelope.encode(Kind.DDP, 0x000102, 0xABCDEF, b"z")
    assert wire == bytes.fromhex(ENVELOPE_HEX) + b"z"
    env, rest = envelope.decode_untrusted(wire)
    assert env == Envelope(Kind.DDP, 0x102, 0xABCDEF) and bytes(rest) == b"z"
    assert envelope.ENVELOPE.parse(wire[:8]) == dict(kind=1, dst_qpn=0x102, flags=0, src_qpn=0xABCDEF)


def test_imm_follows_flag_known_answer() -> None:
    wire = envelope.encode(Kind.DDP, 0x000102, 0xABCDEF, b"", envelope.Flags.IMM_FOLLOWS)
    assert wire == bytes.fromhex("01000102" "01abcdef")
    assert envelope.decode_untrusted(wire)[0] == Envelope(Kind.DDP, 0x102, 0xABCDEF, 1)
    with pytest.raises(ValueError):
        envelope.encode(Kind.CM, 0, 0, b"", envelope.Flags.IMM_FOLLOWS)


def test_flow_ack_trailer_known_answer() -> None:
    wire = envelope.encode(Kind.DDP, 0x000102, 0xABCDEF, b"seg", flow_ack=0x0A0B0C0D)
    assert wire == bytes.fromhex("01000102" "02abcdef") + b"seg" + bytes.fromhex("0a0b0c0d")
    env, rest = envelope.decode_untrusted(wire)
    assert env == Envelope(Kind.DDP, 0x102, 0xABCDEF, 2) and bytes(rest) == b"seg"
    assert envelope.flow_ack_msn(wire) == 0x0A0B0C0D == envelope.FLOW_ACK_TRAILER.parse(wire[-4:]).msn
    with pytest.raises(ValueError):
        envelope.encode(Kind.DDP, 1, 2, b"", envelope.Flags.FLOW_ACK)  # the flag without its MSN
    with pytest.raises(ValueError):
        envelope.encode(Kind.FLOW, 1, 2, b"", flow_ack=1)  # DDP messages only
    with pytest.raises(ValueError):
        envelope.encode(Kind.DDP, 1, 2, b"", flow_ack=1 << 32)


def test_flow_ack_trailer_is_not_part_of_the_segment() -> None:
    seg = rdmap.encode_untagged(Opcode.SEND, True, 5, 0, b"payload")
    wire = segment.encode(7, 8, seg, envelope.Flags.IMM_FOLLOWS, flow_ack=9)
    env, header, view = segment.decode_untrusted(wire)
    assert env.flags == envelope.Flags.IMM_FOLLOWS | envelope.Flags.FLOW_ACK
    assert header == rdmap.decode_untrusted(seg)[0] and bytes(view) == b"payload"
    assert envelope.flow_ack_msn(wire) == 9
    # a tagged segment with the trailer leaves the fused fast path
    tagged = segment.encode(7, 8, rdmap.encode_tagged(Opcode.RDMA_WRITE, True, 1, 2, b"AB"), flow_ack=3)
    assert bytes(segment.decode_untrusted(tagged)[2]) == b"AB"
    # an Atomic Request's fixed-size body is checked without the trailer
    atomic = rdmap.encode_untagged(Opcode.ATOMIC_REQUEST, True, 1, 0, bytes(rdmap.ATOMIC_REQUEST_LEN))
    assert segment.decode_untrusted(segment.encode(7, 8, atomic, flow_ack=1))[1] is not None


def test_cm_envelope_uses_qpn_zero() -> None:
    assert envelope.encode(Kind.CM, envelope.CM_QPN, 0) == bytes.fromhex("02000000" "00000000")


_kinds = st.sampled_from(sorted(Kind))
_FLOW_ACK = int(envelope.Flags.FLOW_ACK)
# Flags exist on DDP messages only (IMM_FOLLOWS, FLOW_ACK).
envelopes = st.one_of(
    st.builds(Envelope, _kinds, u24, u24, st.just(0)),
    st.builds(Envelope, st.just(Kind.DDP), u24, u24, st.sampled_from([1, 2, 3])),
)
#: the MSN of the FLOW_ACK trailer in the messages these tests build
TRAILER_MSN = 0x89ABCDEF


def _wire(e: Envelope, body: bytes = b"") -> bytes:
    return envelope.encode(e.kind, e.dst_qpn, e.src_qpn, body, e.flags & ~_FLOW_ACK,
                           TRAILER_MSN if e.flags & _FLOW_ACK else None)


def _ref_envelope(data: bytes) -> tuple[Envelope, bytes, int | None]:
    try:
        p = envelope.ENVELOPE.parse(data)
        msn = envelope.FLOW_ACK_TRAILER.parse(data[-4:]).msn if p.flags & _FLOW_ACK and len(data) >= 12 else None
    except c.ConstructError as e:
        raise WireError("reference", str(e)) from None
    if not 1 <= p.kind <= max(Kind) or p.flags & _FLOW_ACK and msn is None:
        raise WireError("reference")
    return Envelope(p.kind, p.dst_qpn, p.src_qpn, p.flags), data[8:len(data) - (4 if msn is not None else 0)], msn


def _fast_envelope(data: bytes) -> tuple[Envelope, bytes, int | None]:
    env, rest = envelope.decode_untrusted(data)
    return env, bytes(rest), envelope.flow_ack_msn(data) if env.flags & _FLOW_ACK else None


@SETTINGS
@given(envelopes, st.binary(max_size=16))
def test_envelope_round_trip(env: Envelope, body: bytes) -> None:
    wire = _wire(env, body)
    assert _fast_envelope(wire) == (env, body, TRAILER_MSN if env.flags & _FLOW_ACK else None)
    assert envelope.ENVELOPE.build(dict(kind=env.kind, dst_qpn=env.dst_qpn, src_qpn=env.src_qpn,
                                        flags=env.flags)) == wire[:8]


@SETTINGS
@given(st.one_of(st.binary(max_size=12), mutated(envelopes.map(_wire))))
def test_envelope_fast_agrees_with_construct(data: bytes) -> None:
    fast, ref = outcome(_fast_envelope, data), outcome(_ref_envelope, data)
    assert fast[0] == ref[0]
    if fast[0] == "ok":
        assert fast == ref


@pytest.mark.parametrize(("data", "reason"), [
    (bytes.fromhex("00000102" "00abcdef"), "bad_kind"),
    (bytes.fromhex("07000102" "00abcdef"), "bad_kind"),
    (bytes.fromhex("01000102" "04abcdef"), "bad_reserved"),  # no such flag
    (bytes.fromhex("01000102" "02abcdef" "000000"), "truncated"),  # FLOW_ACK without its trailer
    (bytes.fromhex("03000102" "02abcdef" "00000000"), "bad_reserved"),  # FLOW_ACK on a FLOW message
    (bytes.fromhex("01000102" "80abcdef"), "bad_reserved"),
    (bytes.fromhex("02000000" "01000000"), "bad_reserved"),  # IMM_FOLLOWS on a CM message
] + [(bytes.fromhex(ENVELOPE_HEX)[:n], "truncated") for n in range(8)])
def test_envelope_malformed(data: bytes, reason: str) -> None:
    with pytest.raises(WireError) as e:
        envelope.decode_untrusted(data)
    assert e.value.reason == reason


def test_envelope_refuses_caller_mistakes() -> None:
    with pytest.raises(ValueError):
        envelope.encode(Kind.DDP, 1 << 24, 0)
    with pytest.raises(ValueError):
        envelope.encode(0, 1, 1)


@SETTINGS
@given(envelopes)
def test_every_single_bit_flip_in_the_envelope_is_caught(env: Envelope) -> None:
    # FLOW_ACK says where the message ends: its bit and the trailer are one field
    assert_flips_detected(_wire(env), _fast_envelope, lambda v: (*v[0][:3], (v[0].flags, v[2])))


# --- the fused receive path --------------------------------------------------


def _body(env: Envelope, seg: tuple[TaggedHeader | UntaggedHeader, bytes]) -> bytes:
    return segment.encode(env.dst_qpn, env.src_qpn, encode_segment(*seg), env.flags & ~_FLOW_ACK,
                          TRAILER_MSN if env.flags & _FLOW_ACK else None)


def _fast(data: bytes) -> tuple[Envelope, object, bytes]:
    env, header, view = segment.decode_untrusted(data)
    return env, header, bytes(view)


def _composed(data: bytes) -> tuple[Envelope, object, bytes]:
    """The same decode, step by step through the two modules."""
    env, rest = envelope.decode_untrusted(data)
    if env.kind != Kind.DDP:
        return env, None, bytes(rest)
    header, view = rdmap.decode_untrusted(rest)
    return env, header, bytes(view)


def test_segment_known_answer() -> None:
    # envelope | C1 40 | STag | TO | payload
    wire = bytes.fromhex(ENVELOPE_HEX + "c140" "01020304" "0000000000001000") + b"AB"
    assert segment.encode(0x102, 0xABCDEF, rdmap.encode_tagged(Opcode.RDMA_WRITE, True, 0x01020304, 0x1000, b"AB")) == wire
    buf = bytearray(len(wire))
    assert segment.pack_tagged_into(buf, 0, 0x102, 0xABCDEF, Opcode.RDMA_WRITE, True, 0x01020304, 0x1000) == 22
    buf[22:] = b"AB"
    assert bytes(buf) == wire
    env, h, view = segment.decode_untrusted(wire)
    assert env == Envelope(Kind.DDP, 0x102, 0xABCDEF)
    assert h == TaggedHeader(Opcode.RDMA_WRITE, True, 0x01020304, 0x1000) and bytes(view) == b"AB"


def test_pack_untagged_into_matches_encode() -> None:
    buf = bytearray(segment.UNTAGGED_PREFIX_LEN)
    n = segment.pack_untagged_into(buf, 0, 7, 8, Opcode.SEND_INVALIDATE, True, 3, 0, inv_stag=0x55)
    assert n == 26
    assert bytes(buf) == segment.encode(7, 8, rdmap.encode_untagged(Opcode.SEND_INVALIDATE, True, 3, 0, b"", 0x55))


def test_non_ddp_kinds_pass_through() -> None:
    env, header, view = segment.decode_untrusted(envelope.encode(Kind.LOCK, 0, 0, b"lockmsg"))
    assert env.kind == Kind.LOCK and header is None and bytes(view) == b"lockmsg"


@SETTINGS
@given(envelopes.map(lambda e: e._replace(kind=Kind.DDP)), segments)
def test_segment_round_trip(env: Envelope, seg: tuple[TaggedHeader | UntaggedHeader, bytes]) -> None:
    assert _fast(_body(env, seg)) == (env, seg[0], seg[1])


@SETTINGS
@given(st.one_of(
    st.binary(max_size=40),
    mutated(st.builds(_body, envelopes.map(lambda e: e._replace(kind=Kind.DDP)), segments)),
))
def test_fused_path_agrees_with_the_two_steps(data: bytes) -> None:
    # Same outcome and the same reason: the fused path is only an optimization.
    assert outcome(_fast, data) == outcome(_composed, data)


@SETTINGS
@given(envelopes.map(lambda e: e._replace(kind=Kind.DDP)), segments)
def test_every_single_bit_flip_in_envelope_and_header_is_caught(
    env: Envelope, seg: tuple[TaggedHeader | UntaggedHeader, bytes]
) -> None:
    # A flip in ``kind`` sends the body to another kind's decoder, which must
    # then reject it; so decode all the way, as the daemon's dispatch does.
    wire = _body(env, seg)
    nbits = 8 * (8 + (14 if wire[8] & 0x80 else 18))
    assert_flips_detected(wire, _dispatch, lambda v: v, nbits)


_OTHER_KINDS = {
    Kind.CM: cm.decode_untrusted,
    Kind.FLOW: flow.decode_untrusted,
    Kind.LOCK: lock.decode_untrusted,
    Kind.BARRIER: barrier.decode_untrusted,
}


def _dispatch(data: bytes) -> tuple[object, ...]:
    env, header, view = segment.decode_untrusted(data)
    # FLOW_ACK says where the segment ends: the flags and the payload are one field
    if header is None:
        return (*env[:3], (env.flags, _OTHER_KINDS[env.kind](view)))
    return (*env[:3], (env.flags, bytes(view)), *header, type(header))


@SETTINGS
@given(st.binary(max_size=60))
def test_arbitrary_bytes_raise_only_wire_error(data: bytes) -> None:
    outcome(_fast, data)
    outcome(_fast, b"\x01" + data)  # force the DDP branch


@SETTINGS
@given(u24, u24, st.sampled_from([Opcode.RDMA_WRITE, Opcode.RDMA_READ_RESPONSE]), st.booleans(),
       st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1))
def test_tagged_packer_is_pack_tagged_into(dst: int, src: int, op: int, last: bool, stag: int, to: int) -> None:
    # The Write path's per-QP packer writes what pack_tagged_into writes.
    a, b = bytearray(segment.TAGGED_PREFIX_LEN), bytearray(segment.TAGGED_PREFIX_LEN)
    segment.pack_tagged_into(a, 0, dst, src, op, last, stag, to)
    segment.tagged_packer(dst, src, op)(b, last, stag, to)
    assert a == b


def test_tagged_packer_checks_once_at_creation() -> None:
    with pytest.raises(ValueError):
        segment.tagged_packer(envelope.MAX_QPN + 1, 1, Opcode.RDMA_WRITE)
    with pytest.raises(ValueError):
        segment.tagged_packer(1, 1, Opcode.SEND)
