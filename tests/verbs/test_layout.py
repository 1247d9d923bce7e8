"""The shared-memory layout (wire/shm.py) and control messages (wire/ctl.py)."""

from __future__ import annotations

import mmap
import os
import struct

import pytest
from hypothesis import given, strategies as st

from udpverbs.wire import ctl, shm
from udpverbs.wire.errors import WireError


def test_struct_sizes_and_offsets_are_fixed() -> None:
    # Both processes map these; the sizes are part of the contract.
    assert shm.RING_HDR_SIZE == 192
    assert shm.ffi.offsetof("struct uv_ring_hdr", "consumer") == 64  # own cache line
    assert shm.ffi.offsetof("struct uv_ring_hdr", "entries") == 128
    assert shm.CQE_SIZE == 40
    assert shm.SEND_WQE_SIZE == 56 + 16 * shm.MAX_SGE
    assert shm.RECV_WQE_SIZE == 16 + 16 * shm.MAX_SGE
    assert shm.ffi.offsetof("struct uv_send_wqe", "inline_data") == shm.ffi.offsetof("struct uv_send_wqe", "sg")
    assert shm.CtxLayout.size == mmap.PAGESIZE


def test_round_entries_and_layout() -> None:
    assert [shm.round_entries(n) for n in (0, 1, 2, 3, 64, 65)] == [1, 1, 2, 4, 64, 128]
    lay = shm.QPLayout(64, 128)
    assert lay.rq_offset == shm.ring_bytes(64, shm.SEND_WQE_SIZE)
    assert lay.size % mmap.PAGESIZE == 0 and lay.size >= lay.rq_offset + shm.ring_bytes(128, shm.RECV_WQE_SIZE)


def test_ring_between_two_mappings_of_one_memfd() -> None:
    fd, mm_daemon = shm.new_segment(shm.page_round(shm.ring_bytes(8, shm.CQE_SIZE)), "t")
    mm_app = shm.map_segment_untrusted(fd, len(mm_daemon))
    os.close(fd)
    prod = shm.Ring(mm_daemon, 0, "struct uv_cqe", 8, init=True)
    cons = shm.Ring(mm_app, 0, "struct uv_cqe", 8)
    for round_ in range(5):  # wraps the ring several times
        assert prod.free() == 8
        for i in range(8):
            e = prod.next_slot()
            e.wr_id = round_ * 100 + i
            prod.push()
        assert cons.available() == 0  # nothing visible before publish
        prod.publish()
        assert prod.free() == 0 and cons.available() == 8
        assert [cons.peek(i).wr_id for i in range(8)] == [round_ * 100 + i for i in range(8)]
        cons.pop(8)
    for r in (prod, cons):
        r.release()
    mm_app.close()
    mm_daemon.close()


def test_lying_indices_raise_ring_error() -> None:
    buf = bytearray(shm.ring_bytes(4, shm.CQE_SIZE))
    r = shm.Ring(buf, 0, "struct uv_cqe", 4, init=True)
    r.hdr.producer = 5  # claims 5 items in a 4-slot ring
    with pytest.raises(shm.RingError):
        r.available()
    r.hdr.consumer = 0xFFFFFFF0
    with pytest.raises(shm.RingError):
        r.free()
    r.release()


def test_segments_are_sealed_against_shrinking() -> None:
    fd, mm = shm.new_segment(8192, "t")
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)
    finally:
        mm.close()
        os.close(fd)
    # an fd that cannot be sealed is refused
    r, w = os.pipe()
    try:
        with pytest.raises(OSError):
            shm.map_segment_untrusted(r, 4096)
    finally:
        os.close(r)
        os.close(w)
    # and one smaller than claimed
    fd = os.memfd_create("small", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 4096)
        with pytest.raises(OSError):
            shm.map_segment_untrusted(fd, 8192)
    finally:
        os.close(fd)


@pytest.mark.parametrize("op", list(ctl.Op))
def test_every_request_and_reply_round_trips(op: ctl.Op) -> None:
    for table, enc, dec in ((ctl.REQUESTS, ctl.encode_request, None), (ctl.REPLIES, ctl.encode_reply, None)):
        lay = table[op]
        fields = {f: (b"\x01" * 16 if f in ("gid", "dgid") else i + 1) for i, f in enumerate(lay.fields)}
        if lay.tail:
            fields["data"] = b"private"
        msg = enc(op, **fields)
        if table is ctl.REQUESTS:
            got_op, got = ctl.decode_request_untrusted(msg)
            assert got_op == op
        else:
            status, got = ctl.decode_reply(msg, op)
            assert status == 0
        assert got._asdict() == fields


def test_error_reply_carries_text_and_private_data() -> None:
    msg = ctl.encode_error(ctl.Op.CM_CONNECT, 111, "refused", b"why not")
    assert ctl.decode_reply(msg, ctl.Op.CM_CONNECT) == (111, ("refused", b"why not"))
    with pytest.raises(WireError):
        ctl.decode_reply(msg, ctl.Op.CM_ACCEPT)  # answers another op


@given(st.binary(max_size=200))
def test_request_decoder_raises_only_wire_error(data: bytes) -> None:
    try:
        ctl.decode_request_untrusted(data)
    except WireError:
        pass


def test_truncated_and_overlong_bodies_are_rejected() -> None:
    msg = ctl.encode_request(ctl.Op.REG_MR, pd_handle=1, access=1, length=10, addr=4096)
    with pytest.raises(WireError):
        ctl.decode_request_untrusted(msg[:-1])
    with pytest.raises(WireError):
        ctl.decode_request_untrusted(msg + b"x")
    with pytest.raises(WireError):
        ctl.decode_request_untrusted(struct.pack("!HHi", 999, 0, 0))


def test_gid_mapping() -> None:
    gid = ctl.gid_from_ip("127.0.0.3")
    assert gid == bytes(10) + b"\xff\xff" + bytes([127, 0, 0, 3])
    assert ctl.ip_from_gid(gid) == "127.0.0.3"
    assert ctl.ip_from_gid(ctl.gid_from_ip("fe80::1")) == "fe80::1"


def test_runtime_dir_rule(monkeypatch) -> None:
    monkeypatch.setenv("UDPVERBS_RUNTIME_DIR", "/x/y")
    assert ctl.socket_path("uv7") == "/x/y/uv7.sock"
    monkeypatch.delenv("UDPVERBS_RUNTIME_DIR")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/5")
    assert ctl.runtime_dir() == "/run/user/5/udpverbs"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert ctl.runtime_dir() == f"/tmp/udpverbs-{os.getuid()}"
