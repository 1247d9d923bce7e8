"""Hypothesis strategies and shared checks for the wire tests.

Every property test runs derandomized (the same examples on every run) so the
suite is deterministic, and with a bounded number of examples so it is fast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import construct as c
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from udpverbs.wire import rdmap
from udpverbs.wire.errors import WireError

SETTINGS = settings(
    derandomize=True,
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u24 = st.integers(0, (1 << 24) - 1)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, (1 << 64) - 1)
payloads = st.binary(max_size=64)

tagged_opcodes = st.sampled_from(sorted(rdmap.TAGGED_OPCODES))
#: untagged opcodes whose messages may span segments (Send variants)
multi_segment_untagged = st.sampled_from(
    [op for op in rdmap.OPCODE_QN if op not in rdmap.SINGLE_SEGMENT]
)


@st.composite
def tagged_segments(draw: st.DrawFn) -> tuple[rdmap.TaggedHeader, bytes]:
    h = rdmap.TaggedHeader(draw(tagged_opcodes), draw(st.booleans()), draw(u32), draw(u64))
    return h, draw(payloads)


@st.composite
def untagged_segments(draw: st.DrawFn) -> tuple[rdmap.UntaggedHeader, bytes]:
    """Valid untagged segments of every opcode, single-segment ones well-formed."""
    op = draw(st.sampled_from(sorted(rdmap.OPCODE_QN)))
    inv = draw(u32) if op in rdmap.INVALIDATE_OPCODES else 0
    if op in rdmap.SINGLE_SEGMENT:
        size = rdmap.SINGLE_SEGMENT[op]
        if size is None:  # Terminate: any valid Terminate header
            payload = rdmap.encode_terminate(draw(terminates()))
        else:
            payload = draw(st.binary(min_size=size, max_size=size))
        h = rdmap.UntaggedHeader(op, True, inv, rdmap.OPCODE_QN[op], draw(u32), 0)
    else:
        h = rdmap.UntaggedHeader(op, draw(st.booleans()), inv, rdmap.OPCODE_QN[op], draw(u32), draw(u32))
        payload = draw(payloads)
    return h, payload


def encode_segment(h: rdmap.TaggedHeader | rdmap.UntaggedHeader, payload: bytes) -> bytes:
    if isinstance(h, rdmap.TaggedHeader):
        return rdmap.encode_tagged(h.opcode, h.last, h.stag, h.to, payload)
    return rdmap.encode_untagged(h.opcode, h.last, h.msn, h.mo, payload, h.inv_stag)


segments = st.one_of(tagged_segments(), untagged_segments())


@st.composite
def terminates(draw: st.DrawFn) -> rdmap.Terminate:
    layer = draw(st.sampled_from(sorted(rdmap.TERM_ETYPES)))
    etype = draw(st.sampled_from(sorted(rdmap.TERM_ETYPES[layer])))
    ddp_header = b""
    seglen = 0
    if draw(st.booleans()):
        h, p = draw(segments)
        full = encode_segment(h, p)
        ddp_header = full[: 14 if full[0] & 0x80 else 18]
        seglen = draw(u16)
    rdmap_header = draw(st.sampled_from([b"", None]))
    if rdmap_header is None:
        rdmap_header = draw(st.binary(min_size=28, max_size=28))
    return rdmap.Terminate(layer, etype, draw(u8), draw(st.booleans()), seglen, ddp_header, rdmap_header)


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[bytes]) -> bytes:
    """A valid encoding with a few bytes changed, cut short or extended."""
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(0, 3))):
        if data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(u8)
    action = draw(st.sampled_from(["keep", "cut", "extend"]))
    if action == "cut":
        data = data[: draw(st.integers(0, len(data)))]
    elif action == "extend":
        data += draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


def outcome(decode: Callable[[bytes], Any], data: bytes) -> tuple[str, Any]:
    """Run an ``*_untrusted`` decoder: ("ok", value) or ("err", reason).

    Anything other than WireError propagates and fails the test.
    """
    try:
        return "ok", decode(data)
    except WireError as e:
        return "err", e.reason


def flip(data: bytes, bit: int) -> bytes:
    b = bytearray(data)
    b[bit // 8] ^= 0x80 >> (bit % 8)
    return bytes(b)


def assert_flips_detected(data: bytes, decode: Callable[[bytes], Any], fields: Callable[[Any], tuple[Any, ...]], nbits: int | None = None) -> None:
    """Flip every bit of ``data`` (or of its first ``nbits``): the decoder must
    reject the result or decode a value that differs in exactly one field."""
    want = fields(decode(data))
    for bit in range(nbits if nbits is not None else 8 * len(data)):
        kind, value = outcome(decode, flip(data, bit))
        if kind == "err":
            continue
        got = fields(value)
        changed = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
        assert len(changed) == 1, f"bit {bit}: fields {changed} changed ({want} -> {got})"


def reference_parser(ref: c.Construct) -> Callable[[bytes], Any]:
    """A decoder over the construct declaration alone, failing with WireError."""

    def parse(data: bytes) -> Any:
        try:
            return ref.parse(data)
        except (c.ConstructError, KeyError) as e:
            raise WireError("reference", str(e)) from None

    return parse
