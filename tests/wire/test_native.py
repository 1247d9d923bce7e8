"""The compiled receive lane's contract, datagram by datagram.

``udpv_rx_write_run`` places a run of in-order RDMA Write segments (or, in
sequential mode, Read Response segments, or untagged, a Send's segments up
to its last, with the Modified ACK its last may carry) and stops at the
first datagram that is not one (which the Python path then handles).
Datagrams here are built with the shipped encoders (``link.encode_fields``,
``segment.pack_tagged_into``); each case spoils one field of the third and
expects the run to end before it, with nothing of it written.  That the lane
and the Python path agree on whole streams is
``tests/daemon/test_native_lane.py``.

The send lane's two builders (``udpv_tx_bodies``, ``udpv_tx_frame_slots``)
must produce exactly the bytes of the Python encoders, for any field values;
``tests/daemon/test_native_send_lane.py`` checks whole streams.
"""

from __future__ import annotations

import errno
import random
import select
import socket
import struct
import time
from collections.abc import Callable

import pytest
from hypothesis import given, settings, strategies as st

from udpverbs.daemon import rxlane, udp
from udpverbs.transport.link import run_slots
from udpverbs.wire import envelope, link, native, rdmap, segment
from udpverbs.wire.link import PacketType
from udpverbs.wire.rdmap import Opcode

mod = native.load()
pytestmark = pytest.mark.skipif(mod is None, reason="no C compiler here: the daemon uses the Python path")

TAG, ISN, ACK, QPN, PEER_QPN, STAG, BASE, LENGTH = 0x5EED5EED, 1000, 77, 5, 9, 0x1234501, 0x7F0000, 64 * 1024
PAYLOAD = 1000


def _datagram(i: int, *, ptype: int = PacketType.DATA, tag: int = TAG, seq_off: int = 0, ack: int = ACK,
              sack: tuple[tuple[int, int], ...] = (), opcode: int = Opcode.RDMA_WRITE, dst_qpn: int = QPN,
              src_qpn: int = PEER_QPN, flags: int = 0, stag: int = STAG, to: int | None = None,
              payload: bytes | None = None) -> bytes:
    body = bytearray(segment.TAGGED_PREFIX_LEN)
    segment.pack_tagged_into(body, 0, dst_qpn, src_qpn, opcode, i == 4, stag,
                             BASE + i * PAYLOAD if to is None else to)
    body[4] |= flags  # envelope flags share the second word with the source QPN
    body += bytes([i]) * PAYLOAD if payload is None else payload
    return link.encode_fields(ptype, link.LinkFlags.ACK_NOW if i == 4 else 0, 0, tag, ISN + i + seq_off, ack,
                              1000 + i, 500 + i, 200 - i, body, sack)


def _run(datagrams: list[bytes], seg: int | None = None, max_count: int = 256,
         next_to: int | None = None, send: bool = False, length: int = LENGTH,
         send_op: int = Opcode.SEND, read: bool = False, request: int = 0) -> tuple[int, object, bytearray]:
    """Run the lane over ``datagrams``; with ``next_to``, in sequential mode
    from that offset; with ``send``, untagged: a Send (``send_op``) of MSN
    ``MSN`` into a receive of ``length`` bytes; with ``read``, Read Responses
    into a sink of ``length`` bytes at ``BASE``; with ``request``, requests
    of that opcode, MSN ``MSN`` (all as daemon/rxlane.py sets them up)."""
    assert mod is not None
    ffi, lib = mod.ffi, mod.lib
    r = ffi.new("udpv_rx_run *")
    r.conn_tag, r.seq, r.max_count = TAG, ISN, max_count
    r.w0, r.w1 = (1 << 24) | QPN, PEER_QPN
    if request:
        r.ctrl_more, r.rctl, r.ctrl_last, r.qn, length = rxlane.REQUEST_LANE[request]
        r.untagged, r.msn, r.stag, r.base = 1, MSN, 0, 0
        r.last_ends = r.whole = r.last_fills = r.many = 1
        next_to = 0
    elif send:
        r.ctrl_more, r.rctl, r.ctrl_last = rxlane.SEND_CTRL[send_op]
        r.untagged, r.msn, r.stag, r.base = 1, MSN, 0, 0
        r.last_ends = 1
        next_to = next_to or 0
    elif read:
        r.ctrl_more, r.rctl, r.ctrl_last = rxlane.READ_RESPONSE_CTRL
        r.stag, r.base, r.last_ends, r.last_fills = STAG, BASE, 1, 1
        next_to = next_to or BASE
    else:
        r.ctrl_more, r.rctl = rdmap.tagged_control(Opcode.RDMA_WRITE, False)
        r.ctrl_last = rdmap.tagged_control(Opcode.RDMA_WRITE, True)[0]
        r.stag, r.base = STAG, BASE
    r.length = length
    if next_to is not None:
        r.sequential, r.next_to = 1, next_to
    mem = bytearray(LENGTH)
    buf = b"".join(datagrams)
    k = lib.udpv_rx_write_run(r, buf, len(buf), seg or len(datagrams[0]), ffi.from_buffer("uint8_t[]", mem))
    return k, r, mem


def test_a_clean_run_is_placed_whole_with_its_link_fields() -> None:
    k, r, mem = _run([_datagram(i) for i in range(5)])
    assert k == 5
    assert bytes(mem[:5 * PAYLOAD]) == b"".join(bytes([i]) * PAYLOAD for i in range(5))
    assert not any(mem[5 * PAYLOAD:])
    assert (r.first_ack, r.first_ts, r.first_echo, r.first_rwnd, r.first_flags) == (ACK, 1000, 500, 200, 0)
    assert (r.last_ts, r.last_rwnd, r.flags_or, r.bytes) == (1004, 196, link.LinkFlags.ACK_NOW, 5 * PAYLOAD)


def test_the_window_bounds_the_run() -> None:
    assert _run([_datagram(i) for i in range(5)], max_count=3)[0] == 3


def test_a_shorter_last_datagram_ends_a_gro_buffer() -> None:
    ds = [_datagram(i) for i in range(4)] + [_datagram(4, payload=b"\xff" * 10)]
    k, r, mem = _run(ds, seg=len(ds[0]))
    assert k == 5 and bytes(mem[4 * PAYLOAD:4 * PAYLOAD + 11]) == b"\xff" * 10 + b"\0"


def _flip_crc(d: bytes) -> bytes:
    return d[:-1] + bytes([d[-1] ^ 1])


def _version(d: bytes) -> bytes:
    body = bytearray(d[:-4])
    body[0] = link.LINK_VERSION - 1
    return bytes(body) + link._CRC.pack(link._crc32c(body))


def _reserved(d: bytes) -> bytes:
    body = bytearray(d[:-4])
    body[27] = 1
    return bytes(body) + link._CRC.pack(link._crc32c(body))


SPOILERS: dict[str, Callable[[], bytes]] = {
    "crc": lambda: _flip_crc(_datagram(2)),
    "version": lambda: _version(_datagram(2)),
    "reserved": lambda: _reserved(_datagram(2)),
    "ack packet": lambda: _datagram(2, ptype=PacketType.ACK),
    "sack blocks": lambda: _datagram(2, sack=((ISN + 9, ISN + 10),)),
    "tag": lambda: _datagram(2, tag=TAG + 1),
    "sequence": lambda: _datagram(2, seq_off=1),
    "ack field moved": lambda: _datagram(2, ack=ACK + 1),
    "other qp": lambda: _datagram(2, dst_qpn=QPN + 1),
    "other peer qp": lambda: _datagram(2, src_qpn=PEER_QPN + 1),
    "envelope flags": lambda: _datagram(2, flags=1),
    "read response": lambda: _datagram(2, opcode=Opcode.RDMA_READ_RESPONSE),
    "other stag": lambda: _datagram(2, stag=STAG + 0x100),
    "below the region": lambda: _datagram(2, to=BASE - 1),
    "past the region": lambda: _datagram(2, to=BASE + LENGTH - PAYLOAD + 1),
    "offset wraps": lambda: _datagram(2, to=(1 << 64) - 1),
    "too short": lambda: _datagram(2)[:link.HEADER_LEN + segment.TAGGED_PREFIX_LEN + 3],
    "shorter than a CRC": lambda: _datagram(2)[:3],
}


@pytest.mark.parametrize("spoil", sorted(SPOILERS))
def test_the_run_stops_before_a_datagram_it_does_not_recognise(spoil: str) -> None:
    bad = SPOILERS[spoil]()
    ds = [_datagram(0), _datagram(1), bad, _datagram(3)]
    if len(bad) == len(ds[0]):  # GRO coalesces equal sizes only
        k, _, mem = _run(ds)
        assert k == 2 and not any(mem[2 * PAYLOAD:])
    if spoil != "ack field moved":  # a run may start at any ACK field
        k, _, mem = _run([bad])
        assert k == 0 and not any(mem)


def test_the_region_end_is_inclusive() -> None:
    k, _, mem = _run([_datagram(0, to=BASE + LENGTH - PAYLOAD, payload=b"\x01" * PAYLOAD)])
    assert k == 1 and mem[-PAYLOAD:] == b"\x01" * PAYLOAD and not any(mem[:-PAYLOAD])


def test_in_sequential_mode_the_run_stops_at_a_gap_or_a_step_back() -> None:
    # Read Responses: each segment must start where the last one ended
    k, r, _ = _run([_datagram(i) for i in range(5)], next_to=BASE)
    assert k == 5 and r.next_to == BASE + 5 * PAYLOAD
    assert _run([_datagram(i) for i in range(5)], next_to=BASE + 1)[0] == 0
    for to in (BASE + 2 * PAYLOAD + 1, BASE + PAYLOAD):
        datagrams = [_datagram(i) for i in range(5)]
        datagrams[2] = _datagram(2, to=to)
        k, _, mem = _run(datagrams, next_to=BASE)
        assert k == 2 and not any(mem[2 * PAYLOAD:])


# -- the middle of a Send: untagged, queue 0, one MSN, the MO in order ---------

MSN = 3


def _send_datagram(i: int, *, opcode: int = Opcode.SEND, msn: int = MSN, mo: int | None = None, last: bool = False,
                   flags: int = 0, inv_stag: int = 0, payload: int = PAYLOAD, trailer: bytes = b"",
                   fill: int | None = None) -> bytes:
    body = bytearray(segment.UNTAGGED_PREFIX_LEN)
    segment.pack_untagged_into(body, 0, QPN, PEER_QPN, opcode, last, msn, i * PAYLOAD if mo is None else mo, inv_stag,
                               flags)
    body += bytes([i if fill is None else fill]) * payload + trailer
    return link.encode_fields(PacketType.DATA, 0, 0, TAG, ISN + i, ACK, 1000 + i, 500 + i, 200 - i, body)


def _respoil(d: bytes, change: Callable[[bytearray], None]) -> bytes:
    """``d`` with ``change`` applied to its link body, the CRC still valid."""
    h, body = link.decode_untrusted(d)
    b = bytearray(body)
    change(b)
    return link.encode_fields(h.ptype, h.flags, h.path_id, h.conn_tag, h.seq, h.ack, h.ts_us, h.ts_echo_us,
                              h.rwnd, b, h.sack)


SEND_SPOILERS: dict[str, Callable[[], bytes]] = {
    "other msn": lambda: _send_datagram(2, msn=MSN + 1),
    "queue 1": lambda: _respoil(_send_datagram(2), lambda b: b.__setitem__(slice(14, 18), b"\0\0\0\1")),
    "an invalidate stag": lambda: _respoil(_send_datagram(2), lambda b: b.__setitem__(slice(10, 14), b"\0\0\1\0")),
    "mo gap": lambda: _send_datagram(2, mo=2 * PAYLOAD + 1),
    "mo step back": lambda: _send_datagram(2, mo=PAYLOAD),
    "solicited": lambda: _send_datagram(2, opcode=Opcode.SEND_SE),
    "immediate data follows": lambda: _send_datagram(2, flags=1),
    "a modified ack on a middle segment": lambda: _send_datagram(2, flags=_FLOW_ACK, trailer=b"\0\0\0\1"),
    "ddp control zero": lambda: _respoil(_send_datagram(2), lambda b: b.__setitem__(8, 0)),
    "tagged": lambda: _datagram(2),
    "too short": lambda: _send_datagram(2)[:link.HEADER_LEN + segment.UNTAGGED_PREFIX_LEN + 3],
}


def test_a_send_s_middle_segments_are_placed_in_order() -> None:
    k, r, mem = _run([_send_datagram(i) for i in range(5)], send=True)
    assert k == 5 and r.next_to == r.bytes == 5 * PAYLOAD
    assert bytes(mem[:5 * PAYLOAD]) == b"".join(bytes([i]) * PAYLOAD for i in range(5)) and not any(mem[5 * PAYLOAD:])
    assert _run([_send_datagram(i) for i in range(5)], send=True, next_to=1)[0] == 0


@pytest.mark.parametrize("spoil", sorted(SEND_SPOILERS))
def test_a_send_run_stops_before_a_segment_it_does_not_recognise(spoil: str) -> None:
    bad = SEND_SPOILERS[spoil]()
    ds = [_send_datagram(0), _send_datagram(1), bad, _send_datagram(3)]
    if len(bad) == len(ds[0]):
        k, _, mem = _run(ds, send=True)
        assert k == 2 and not any(mem[2 * PAYLOAD:])
    k, _, mem = _run([bad], send=True, next_to=2 * PAYLOAD)
    assert k == 0 and not any(mem)


_FLOW_ACK = int(envelope.Flags.FLOW_ACK)  # the C lane's FLOW_ACK_FLAG must agree


def test_a_send_s_last_segment_is_placed_and_ends_the_run() -> None:
    # what follows it (the next Send) waits for the Python path to complete the receive
    ds = [_send_datagram(0), _send_datagram(1), _send_datagram(2, last=True), _send_datagram(0, msn=MSN + 1)]
    k, r, mem = _run(ds, send=True)
    assert k == 3 and r.ended == 1 and r.flow_ack == 0 and r.bytes == 3 * PAYLOAD
    assert bytes(mem[:3 * PAYLOAD]) == b"".join(bytes([i]) * PAYLOAD for i in range(3)) and not any(mem[3 * PAYLOAD:])
    k, r, _ = _run(ds[:2], send=True)
    assert k == 2 and r.ended == 0


def test_a_modified_ack_on_a_send_s_last_segment_is_reported_not_placed() -> None:
    d = _send_datagram(0, opcode=Opcode.SEND_SE, last=True, flags=_FLOW_ACK, payload=7, fill=9,
                       trailer=(0xFEEDF00D).to_bytes(4, "big"))
    k, r, mem = _run([d], send=True, send_op=Opcode.SEND_SE)
    assert k == 1 and r.ended == 1 and r.flow_ack == 1 and r.flow_ack_msn == 0xFEEDF00D
    assert r.bytes == 7 and bytes(mem[:7]) == b"\x09" * 7 and not any(mem[7:])
    # a single-segment Send of 0 bytes carries the ACK alone
    k, r, _ = _run([_send_datagram(0, last=True, flags=_FLOW_ACK, payload=0, trailer=b"\0\0\0\5")], send=True)
    assert k == 1 and r.bytes == 0 and r.flow_ack_msn == 5


@pytest.mark.parametrize("bad", ["no room for the trailer", "immediate data follows too", "invalidate"])
def test_a_send_s_last_segment_the_lane_does_not_complete_stays_out(bad: str) -> None:
    if bad == "no room for the trailer":
        d, op = _send_datagram(2, last=True, flags=_FLOW_ACK, payload=3), Opcode.SEND
    elif bad == "immediate data follows too":
        d, op = _send_datagram(2, last=True, flags=_FLOW_ACK | 1, trailer=bytes(4)), Opcode.SEND
    else:  # the STag is invalidated in Python before the receive completes
        d, op = _send_datagram(2, last=True, opcode=Opcode.SEND_INVALIDATE), Opcode.SEND_INVALIDATE
    k, r, mem = _run([d], send=True, send_op=op, next_to=2 * PAYLOAD)
    assert k == 0 and r.ended == 0 and not any(mem)


def _response(i: int, last: bool = False, payload: bytes | None = None) -> bytes:
    """Read Response segment ``i``, the ``last`` of its Read or not."""
    d = _datagram(i, opcode=Opcode.RDMA_READ_RESPONSE, payload=payload)
    if last != (i == 4):  # _datagram makes the fifth one the last
        ctrl = rdmap.tagged_control(Opcode.RDMA_READ_RESPONSE, last)[0]
        d = _respoil(d, lambda b: b.__setitem__(8, ctrl))
    return d


def test_a_read_s_last_response_ends_the_run_when_it_fills_the_sink() -> None:
    # what follows (the next Read's responses) waits for the Python path to complete this Read
    ds = [_response(i, last=i == 4) for i in range(5)] + [_response(0)]
    k, r, mem = _run(ds, seg=len(ds[0]), read=True, length=5 * PAYLOAD)
    assert k == 5 and r.ended == 1 and r.flow_ack == 0 and r.bytes == 5 * PAYLOAD
    assert bytes(mem[:5 * PAYLOAD]) == b"".join(bytes([i]) * PAYLOAD for i in range(5)) and not any(mem[5 * PAYLOAD:])
    # a last segment that leaves the sink short is the Python path's (a tagged buffer error)
    k, r, mem = _run(ds, seg=len(ds[0]), read=True, length=5 * PAYLOAD + 1)
    assert k == 4 and r.ended == 0 and not any(mem[4 * PAYLOAD:])
    k, r, _ = _run([_response(0, last=True)], read=True, length=PAYLOAD)  # one segment, as a small Read's
    assert k == 1 and r.ended == 1


def test_a_send_longer_than_its_receive_ends_the_run() -> None:
    k, _, mem = _run([_send_datagram(i) for i in range(4)], send=True, length=3 * PAYLOAD - 1)
    assert k == 2 and not any(mem[2 * PAYLOAD:])


def _request(i: int, *, opcode: int = Opcode.RDMA_READ_REQUEST, msn: int = MSN, last: bool = True, flags: int = 0,
             size: int | None = None, trailer: bytes = b"", fill: int | None = None) -> bytes:
    """Request ``i`` of a stream (link sequence ``ISN + i``), its body bytes
    ``fill`` (default ``i``), the request's own size unless ``size``."""
    return _send_datagram(i, opcode=opcode, msn=msn, mo=0, last=last, flags=flags, fill=fill,
                          payload=rdmap.SINGLE_SEGMENT[opcode] if size is None else size, trailer=trailer)


REQUEST_SPOILERS: dict[str, Callable[[], bytes]] = {
    "other msn": lambda: _request(0, fill=1, msn=MSN + 1),
    "queue 0": lambda: _respoil(_request(0, fill=1), lambda b: b.__setitem__(slice(14, 18), b"\0\0\0\0")),
    "the atomic queue": lambda: _respoil(_request(0, fill=1), lambda b: b.__setitem__(slice(14, 18), b"\0\0\0\3")),
    "not the last": lambda: _request(0, fill=1, last=False),
    "a byte short": lambda: _request(0, fill=1, size=rdmap.READ_REQUEST_LEN - 1),
    "a byte long": lambda: _request(0, fill=1, size=rdmap.READ_REQUEST_LEN + 1),
    "a modified ack": lambda: _request(0, fill=1, flags=_FLOW_ACK, trailer=b"\0\0\0\1"),
    "an invalidate stag": lambda: _respoil(_request(0, fill=1), lambda b: b.__setitem__(slice(10, 14), b"\0\0\1\0")),
    "an atomic request": lambda: _request(0, fill=1, opcode=Opcode.ATOMIC_REQUEST),
    "an atomic response": lambda: _request(0, fill=1, opcode=Opcode.ATOMIC_RESPONSE),
    "a send": lambda: _send_datagram(0, last=True, mo=0, payload=rdmap.READ_REQUEST_LEN, fill=1),
}


@pytest.mark.parametrize("op", [Opcode.RDMA_READ_REQUEST, Opcode.ATOMIC_REQUEST, Opcode.ATOMIC_RESPONSE])
def test_requests_are_taken_whole_one_msn_after_another(op: int) -> None:
    # each body after the one before it, for the QP to answer (an Atomic
    # Response: to complete) in order; the run ends where the MSNs skip
    size = rdmap.SINGLE_SEGMENT[op]
    stream = [_request(0, opcode=op, fill=7), _request(1, opcode=op, msn=MSN + 1, fill=8),
              _request(2, opcode=op, msn=MSN + 3, fill=9)]
    k, r, mem = _run(stream, request=op)
    assert k == 2 and r.ended == 1 and r.flow_ack == 0 and r.bytes == 2 * size and r.msn == MSN + 2
    assert bytes(mem[:2 * size]) == b"\x07" * size + b"\x08" * size and not any(mem[2 * size:])


def test_requests_stop_at_the_run_s_room() -> None:
    op = Opcode.ATOMIC_REQUEST
    k, r, mem = _run([_request(i, opcode=op, msn=MSN + i) for i in range(4)], request=op, max_count=3)
    assert k == 3 and r.msn == MSN + 3


@pytest.mark.parametrize("spoil", sorted(REQUEST_SPOILERS))
def test_a_request_the_lane_does_not_take_stays_out(spoil: str) -> None:
    # the body's bytes are 1, so anything copied would show
    assert _run([_request(0, fill=1)], request=Opcode.RDMA_READ_REQUEST)[0] == 1
    k, r, mem = _run([REQUEST_SPOILERS[spoil]()], request=Opcode.RDMA_READ_REQUEST)
    assert k == 0 and r.ended == 0 and not any(mem)


_RESPONSE = Opcode.ATOMIC_RESPONSE
RESPONSE_SPOILERS: dict[str, Callable[[], bytes]] = {
    "other msn": lambda: _request(0, opcode=_RESPONSE, fill=1, msn=MSN + 1),
    "the request queue": lambda: _respoil(_request(0, opcode=_RESPONSE, fill=1),
                                          lambda b: b.__setitem__(slice(14, 18), b"\0\0\0\1")),
    "not the last": lambda: _request(0, opcode=_RESPONSE, fill=1, last=False),
    "a byte short": lambda: _request(0, opcode=_RESPONSE, fill=1, size=rdmap.ATOMIC_RESPONSE_LEN - 1),
    "a byte long": lambda: _request(0, opcode=_RESPONSE, fill=1, size=rdmap.ATOMIC_RESPONSE_LEN + 1),
    "an atomic request": lambda: _request(0, fill=1, opcode=Opcode.ATOMIC_REQUEST),
}


@pytest.mark.parametrize("spoil", sorted(RESPONSE_SPOILERS))
def test_an_atomic_response_the_lane_does_not_take_stays_out(spoil: str) -> None:
    assert _run([_request(0, opcode=_RESPONSE, fill=1)], request=_RESPONSE)[0] == 1
    k, r, mem = _run([RESPONSE_SPOILERS[spoil]()], request=_RESPONSE)
    assert k == 0 and r.ended == 0 and not any(mem)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_crc32c_matches_the_crc32c_package(level: int) -> None:
    """Each implementation the CPU has (tables, the crc32 instruction in
    three streams, 64-byte folding) against the package, at the lengths
    where their loops hand over."""
    from crc32c import crc32c

    assert mod is not None
    best = mod.lib.udpv_crc32c_level(-1)
    if level > best:
        pytest.skip(f"this CPU has CRC32c implementations up to {best}")
    rng = random.Random(5)
    # around the three-stream thresholds (3 × 480, 3 × 2048), a 1472-byte
    # datagram's body, the folding's start (256) and its 256- and 64-byte loops
    lengths = [0, 1, 7, 8, 9, 63, 255, 256, 257, 263, 319, 320, 321, 383, 511, 512, 513, 575, 767, 1439, 1440, 1441,
               1468, 2887, 6143, 6144, 6145, 7584, 7585, 12_289, 65_503, 200_000]
    try:
        assert mod.lib.udpv_crc32c_level(level) == level
        for n in lengths:
            data = rng.randbytes(n + 3)
            p = mod.ffi.from_buffer("uint8_t[]", data)
            for at in (0, 3):  # unaligned too: the loops load without alignment
                for start in (0, 0xDEADBEEF):
                    assert mod.lib.udpv_crc32c(start, p + at, n) == crc32c(data[at:at + n], start), (n, at)
    finally:
        mod.lib.udpv_crc32c_level(best)


# -- the send lane: the same bytes as the Python encoders ---------------------

_SEND_OPCODES = [Opcode.SEND, Opcode.SEND_SE, Opcode.SEND_INVALIDATE, Opcode.SEND_SE_INVALIDATE]


@settings(max_examples=80, deadline=None)
@given(opcode=st.sampled_from([Opcode.RDMA_WRITE, Opcode.RDMA_READ_RESPONSE, *_SEND_OPCODES]), k=st.integers(1, 6),
       max_data=st.integers(1, 3000), last_len=st.integers(0, 3000), ends=st.booleans(),
       dst=st.integers(0, segment.MAX_QPN), src=st.integers(0, segment.MAX_QPN), stag=st.integers(0, 2**32 - 1),
       to=st.integers(0, 2**64 - 1), seq=st.integers(0, 2**32 - 1), flag_at=st.integers(0, 8),
       fields=st.tuples(*[st.integers(0, 2**32 - 1)] * 4, st.integers(0, 0xFFFF), st.integers(0, 255)),
       env_flags=st.integers(0, 1), seed=st.integers(0, 2**32), level=st.sampled_from([1, 2]),
       flow_ack=st.one_of(st.none(), st.integers(0, 2**32 - 1)))
def test_the_send_lane_builds_what_the_python_encoders_build(
        opcode: int, k: int, max_data: int, last_len: int, ends: bool, dst: int, src: int, stag: int, to: int,
        seq: int, flag_at: int, fields: tuple[int, ...], env_flags: int, seed: int, level: int,
        flow_ack: int | None) -> None:
    """At CRC level 2 (where the CPU has it) a payload of 256 bytes or more
    is copied and run through the CRC in one pass, and the framer moves the
    headers' CRC register past it; at level 1 the framer reads the packet."""
    assert mod is not None
    lib = mod.lib
    best = lib.udpv_crc32c_level(-1)
    lib.udpv_crc32c_level(level)
    try:
        _check_send_lane(opcode, k, max_data, last_len, ends, dst, src, stag, to, seq, flag_at, fields, env_flags,
                         seed, flow_ack)
    finally:
        lib.udpv_crc32c_level(best)


@pytest.mark.parametrize("last_len", [100, 252, 253, 256, 300])
@pytest.mark.parametrize("level", [1, 2])
def test_a_modified_ack_rides_on_a_sends_last_segment(last_len: int, level: int) -> None:
    """The FLOW_ACK trailer after the last payload, below, across and above
    the length from which the lane folds the CRC as it copies (256: a
    payload of 252 with its 4-byte trailer is the first that is folded
    from its register)."""
    assert mod is not None
    best = mod.lib.udpv_crc32c_level(-1)
    mod.lib.udpv_crc32c_level(level)
    try:
        _check_send_lane(Opcode.SEND, 3, 1000, last_len, True, 5, 6, 0, 0, 77, 2, (1, 2, 3, 4, 5, 0), 0, 9,
                         0xA1B2C3D4)
    finally:
        mod.lib.udpv_crc32c_level(best)


def _check_send_lane(opcode: int, k: int, max_data: int, last_len: int, ends: bool, dst: int, src: int, stag: int,
                     to: int, seq: int, flag_at: int, fields: tuple[int, ...], env_flags: int, seed: int,
                     flow_ack: int | None) -> None:
    assert mod is not None
    ffi, lib = mod.ffi, mod.lib
    last_len = min(last_len, max_data)
    source = random.Random(seed).randbytes((k - 1) * max_data + last_len)
    tagged = opcode in (Opcode.RDMA_WRITE, Opcode.RDMA_READ_RESPONSE)
    prefix = segment.TAGGED_PREFIX_LEN if tagged else segment.UNTAGGED_PREFIX_LEN
    # A Send's: the STag it invalidates (0 for a plain Send), its MSN, its
    # offset (a 32-bit MO), envelope flags on the last segment only.
    inv = stag if opcode in rdmap.INVALIDATE_OPCODES else 0
    msn, mo = seq, to & 0xFFFFFFF  # below 2**28: a run's offsets stay within MO's 32 bits
    flags = env_flags  # IMM_FOLLOWS, the one flag a Send's last segment carries
    # and a Modified ACK we owe, as a FLOW_ACK trailer after the last segment's payload, when it fits
    if tagged or not ends or last_len + envelope.FLOW_ACK_LEN > max_data:
        flow_ack = None
    tail = b"" if flow_ack is None else flow_ack.to_bytes(envelope.FLOW_ACK_LEN, "big")
    if flow_ack is not None:
        flags |= envelope.Flags.FLOW_ACK

    def header(buf: bytearray, last: bool, off: int) -> None:
        if tagged:
            segment.pack_tagged_into(buf, 0, dst, src, opcode, last, stag, off & (2**64 - 1))
        else:
            segment.pack_untagged_into(buf, 0, dst, src, opcode, last, msn, off, inv, flags if last else 0)

    # the Python path: one segment at a time (daemon/requester.py), then link.encode_fields per packet
    expected = []
    for i in range(k):
        n = max_data if i < k - 1 else last_len
        last = ends and i == k - 1
        body = bytearray(prefix + n)
        header(body, last, (to if tagged else mo) + i * max_data)
        body[prefix:] = source[i * max_data:i * max_data + n]
        if last:
            body += tail
        expected.append((bytes(body), len(body) - prefix))
    ack, ts, echo, tag, rwnd, path_id = fields
    packets = [link.encode_fields(PacketType.DATA, link.LinkFlags.ACK_NOW if i == flag_at else 0, path_id, tag,
                                  (seq + i) & 0xFFFFFFFF, ack, ts, echo, rwnd, body) for i, (body, _) in enumerate(expected)]
    # the lane: headers packed once by the same encoders, all bodies in one
    # call, then all packets in one call
    t = ffi.new("udpv_tx_segments *")
    header(ffi.buffer(t.more), False, 0)  # type: ignore[arg-type]
    header(ffi.buffer(t.last), True, 0)  # type: ignore[arg-type]
    t.prefix = prefix
    t.off_at, t.off_len, t.off = (segment.TO_AT, 8, to) if tagged else (segment.MO_AT, 4, mo)
    ffi.buffer(t.tail)[:len(tail)] = tail
    t.tail_len = len(tail)
    stride = prefix + max_data
    bodies = bytearray((k - 1) * stride + prefix + last_len + len(tail))
    lib.udpv_tx_bodies(t, ffi.from_buffer("uint8_t[]", bodies), source, k, stride, last_len, ends, stride)
    assert [bytes(bodies[i * stride:i * stride + prefix + n]) for i, (_, n) in
            enumerate(expected)] == [b for b, _ in expected]
    f = ffi.new("udpv_tx_frame *")
    f.path_id, f.conn_tag, f.seq, f.ack, f.ts, f.echo, f.rwnd = path_id, tag, seq, ack, ts, echo, rwnd
    f.flag_at, f.flag = flag_at, link.LinkFlags.ACK_NOW
    # as the daemon sends them: each body built where its packet will be
    # (Link.send_run's layout), then the headers and CRCs written around
    # them; the spoiled bytes in between must all be overwritten
    f.prefix = prefix  # built by udpv_tx_bodies: long payloads' CRC registers wait in the CRC fields
    head, slot = run_slots(stride)
    assert slot == stride + link.OVERHEAD
    out = bytearray(b"\xee" * sum(map(len, packets)))
    lib.udpv_tx_bodies(t, ffi.from_buffer("uint8_t[]", out) + head, source, k, stride, last_len, ends, slot)
    assert lib.udpv_tx_frame_slots(f, ffi.from_buffer("uint8_t[]", out), k, stride,
                                   prefix + last_len + len(tail)) == len(out)
    assert bytes(out) == b"".join(packets)
    # and the receiving side's parser reads them back
    for p in packets:
        h, body = link.decode_untrusted(p)
        assert h.seq == (seq + packets.index(p)) & 0xFFFFFFFF
        segment.decode_untrusted(body)


# -- the armed read: the socket read and the lane in one call ---------------------------------------------


def _armed_pair(peer: "socket.socket") -> tuple[object, object, bytearray, "socket.socket"]:
    """A receiving socket (kernel arrival stamps on, as the daemon's), an
    ``udpv_rx_recv`` armed for ``peer``'s address and a Write run expecting
    ``_datagram``'s stream; with the memory the run writes."""
    assert mod is not None
    ffi = mod.ffi
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.setsockopt(socket.SOL_SOCKET, udp.SO_TIMESTAMPNS, 1)
    a = ffi.new("udpv_rx_recv *")
    a.fd = rx.fileno()
    host, port = peer.getsockname()
    a.peer_addr = struct.unpack("=I", socket.inet_aton(host))[0]
    a.peer_port = socket.htons(port)
    r = ffi.new("udpv_rx_run *")
    r.conn_tag, r.seq, r.max_count = TAG, ISN, 64
    r.w0, r.w1 = (1 << 24) | QPN, PEER_QPN
    r.ctrl_more, r.rctl = rdmap.tagged_control(Opcode.RDMA_WRITE, False)
    r.ctrl_last = rdmap.tagged_control(Opcode.RDMA_WRITE, True)[0]
    r.stag, r.base, r.length = STAG, BASE, LENGTH
    return a, r, bytearray(LENGTH), rx


def _read_armed(a: object, r: object, mem: bytearray, cap: int = 1 << 16) -> tuple[int, bytes]:
    assert mod is not None
    ffi, lib = mod.ffi, mod.lib
    buf = ffi.new("uint8_t[]", cap)
    k = lib.udpv_rx_recv_run(a, r, buf, cap, ffi.from_buffer("uint8_t[]", mem))
    return k, ffi.buffer(buf, max(0, a.n))[:] if k >= 0 else b""


def _wait_readable(s: "socket.socket") -> None:
    assert select.select([s], [], [], 2.0)[0], "the datagram did not arrive"


def test_the_armed_read_places_what_the_armed_peer_sent() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        tx.bind(("127.0.0.1", 0))
        a, r, mem, rx = _armed_pair(tx)
        with rx:
            d = _datagram(0, payload=b"\x5a" * PAYLOAD)
            tx.sendto(d, rx.getsockname())
            _wait_readable(rx)
            k, got = _read_armed(a, r, mem)
            assert (k, a.from_peer, a.truncated, a.n, a.seg) == (1, 1, 0, len(d), len(d))
            assert got == d and bytes(mem[:PAYLOAD]) == b"\x5a" * PAYLOAD and not any(mem[PAYLOAD:])
            assert abs(a.ts_sec + a.ts_nsec * 1e-9 - time.time()) < 5.0  # the kernel's stamp
            assert (r.first_ack, r.bytes) == (ACK, PAYLOAD)


def test_the_armed_read_leaves_another_sender_s_datagram_to_the_caller() -> None:
    # Same bytes, the run would take them: from any other address the lane
    # is not run, and the caller gets the datagram and its source.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as armed, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
        armed.bind(("127.0.0.1", 0))
        other.bind(("127.0.0.1", 0))
        a, r, mem, rx = _armed_pair(armed)
        with rx:
            d = _datagram(1, payload=b"\xee" * PAYLOAD, to=BASE)
            other.sendto(d, rx.getsockname())
            _wait_readable(rx)
            k, got = _read_armed(a, r, mem)
            assert (k, a.from_peer, a.n) == (0, 0, len(d))
            assert got == d and not any(mem)
            assert (socket.inet_ntoa(struct.pack("=I", a.src_addr)), socket.ntohs(a.src_port)) == \
                other.getsockname()


def test_the_armed_read_reports_an_empty_socket_and_a_truncated_datagram() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        tx.bind(("127.0.0.1", 0))
        a, r, mem, rx = _armed_pair(tx)
        with rx:
            rx.setblocking(False)
            assert _read_armed(a, r, mem)[0] == -1 and a.err == errno.EAGAIN
            d = _datagram(0)
            tx.sendto(d, rx.getsockname())
            _wait_readable(rx)
            k, _ = _read_armed(a, r, mem, cap=len(d) - 1)
            assert (k, a.truncated, a.from_peer) == (0, 1, 1) and not any(mem)
            assert _read_armed(a, r, mem)[0] == -1  # it was read (and dropped): nothing left
