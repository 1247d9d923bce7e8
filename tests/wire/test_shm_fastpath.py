"""The struct fast-path layouts (wire/shm.py) against the cffi declarations they shadow.

The daemon reads WQEs and writes CQEs through cffi; the verbs library writes
WQEs and reads CQEs through ``struct``.  Both must see the same bytes, so
every property is checked in both directions: pack with the Struct and read
with cffi, write with cffi and unpack with the Struct.
"""

from __future__ import annotations

import mmap
import os
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from udpverbs.wire import shm

from .strategies import SETTINGS, u32, u64

ffi = shm.ffi

sges = st.tuples(u64, u32, u32)
sge_lists = st.lists(sges, max_size=shm.MAX_SGE)
send_heads = st.tuples(u64, u64, u32, u32, u32, u32, u32, u32, u64, u64)
recv_heads = st.tuples(u64, u32)
cqes = st.tuples(u64, u32, u32, u32, u32, u32, u32, u32, u32)
#: a slot somewhere inside a larger buffer, so offsets are exercised too
slot_offsets = st.integers(0, 7).map(lambda k: k * 64 + 8)


def _view(buf: bytearray, ctype: str, offset: int):
    return ffi.cast(ctype + " *", ffi.from_buffer(buf) + offset)


def test_exported_offsets_match_cffi() -> None:
    assert shm.SEND_WQE_HEAD.size == shm.SEND_WQE_SG_OFFSET == ffi.offsetof("struct uv_send_wqe", "sg")
    assert shm.SEND_WQE_INLINE_OFFSET == shm.SEND_WQE_SG_OFFSET
    assert shm.RECV_WQE_HEAD.size == shm.RECV_WQE_SG_OFFSET == ffi.offsetof("struct uv_recv_wqe", "sg")
    assert shm.SGE.size == shm.SGE_SIZE == ffi.sizeof("struct uv_sge")
    assert shm.CQE.size == shm.CQE_SIZE
    # each Struct names exactly the fields it packs, in order
    for st_, names in ((shm.SEND_WQE_HEAD, shm.SEND_WQE_HEAD_FIELDS), (shm.SGE, shm.SGE_FIELDS),
                       (shm.RECV_WQE_HEAD, shm.RECV_WQE_HEAD_FIELDS), (shm.CQE, shm.CQE_FIELDS)):
        assert len(st_.unpack(bytes(st_.size))) == len(names)


@pytest.mark.parametrize("fmt,ctype,names,end", [
    # a field dropped
    ("=QQIIIIIIQ", "struct uv_send_wqe", shm.SEND_WQE_HEAD_FIELDS[:-1], 56),
    # two fields swapped (same widths: only the names tell)
    ("=QQIIIIIIQQ", "struct uv_send_wqe",
     ("wr_id", "remote_addr", "send_flags", "opcode") + shm.SEND_WQE_HEAD_FIELDS[4:], 56),
    # a width wrong
    ("=QIIIIIIII", "struct uv_cqe", ("remote_addr",) + shm.CQE_FIELDS[1:], 40),
    ("=QHIIIIIII", "struct uv_cqe", shm.CQE_FIELDS, 40),
    # the padding left out, so num_sge's successor would be misplaced
    ("=QI", "struct uv_recv_wqe", shm.RECV_WQE_HEAD_FIELDS, 16),
    # a real field skipped as if it were padding
    ("=Q4xI", "struct uv_sge", ("addr", "lkey"), 16),
    # native alignment would pad silently: refused outright
    ("QII", "struct uv_sge", shm.SGE_FIELDS, 16),
])
def test_layout_check_refuses_a_mismatch(fmt: str, ctype: str, names: tuple[str, ...], end: int) -> None:
    with pytest.raises(RuntimeError):
        shm._check_fast_layout(struct.Struct(fmt), ctype, names, end)


@SETTINGS
@given(send_heads, sge_lists, slot_offsets)
def test_send_wqe_struct_to_cffi(head: tuple[int, ...], sgl: list[tuple[int, int, int]], off: int) -> None:
    buf = bytearray(off + shm.SEND_WQE_SIZE + 8)
    shm.SEND_WQE_HEAD.pack_into(buf, off, *head)
    for i, s in enumerate(sgl):
        shm.SGE.pack_into(buf, off + shm.SEND_WQE_SG_OFFSET + i * shm.SGE_SIZE, *s)
    e = _view(buf, "struct uv_send_wqe", off)
    assert tuple(getattr(e, f) for f in shm.SEND_WQE_HEAD_FIELDS) == head
    assert [(e.sg[i].addr, e.sg[i].length, e.sg[i].lkey) for i in range(len(sgl))] == sgl
    assert not any(buf[:off]) and not any(buf[off + shm.SEND_WQE_SIZE:])  # nothing outside the slot


@SETTINGS
@given(send_heads, sge_lists, slot_offsets)
def test_send_wqe_cffi_to_struct(head: tuple[int, ...], sgl: list[tuple[int, int, int]], off: int) -> None:
    buf = bytearray(off + shm.SEND_WQE_SIZE)
    e = _view(buf, "struct uv_send_wqe", off)
    for f, v in zip(shm.SEND_WQE_HEAD_FIELDS, head):
        setattr(e, f, v)
    for i, (addr, length, lkey) in enumerate(sgl):
        e.sg[i].addr, e.sg[i].length, e.sg[i].lkey = addr, length, lkey
    assert shm.SEND_WQE_HEAD.unpack_from(buf, off) == head
    got = [shm.SGE.unpack_from(buf, off + shm.SEND_WQE_SG_OFFSET + i * shm.SGE_SIZE) for i in range(len(sgl))]
    assert got == sgl


@SETTINGS
@given(st.binary(max_size=shm.MAX_INLINE), slot_offsets)
def test_inline_data_sits_where_the_sg_array_starts(data: bytes, off: int) -> None:
    buf = bytearray(off + shm.SEND_WQE_SIZE)
    start = off + shm.SEND_WQE_INLINE_OFFSET
    buf[start:start + len(data)] = data
    assert bytes(_view(buf, "struct uv_send_wqe", off).inline_data)[:len(data)] == data


@SETTINGS
@given(recv_heads, sge_lists, slot_offsets)
def test_recv_wqe_both_ways(head: tuple[int, int], sgl: list[tuple[int, int, int]], off: int) -> None:
    buf = bytearray(off + shm.RECV_WQE_SIZE)
    shm.RECV_WQE_HEAD.pack_into(buf, off, *head)
    for i, s in enumerate(sgl):
        shm.SGE.pack_into(buf, off + shm.RECV_WQE_SG_OFFSET + i * shm.SGE_SIZE, *s)
    e = _view(buf, "struct uv_recv_wqe", off)
    assert (e.wr_id, e.num_sge, e._pad) == head + (0,)
    assert [(e.sg[i].addr, e.sg[i].length, e.sg[i].lkey) for i in range(len(sgl))] == sgl

    back = bytearray(off + shm.RECV_WQE_SIZE)
    e = _view(back, "struct uv_recv_wqe", off)
    e.wr_id, e.num_sge = head
    for i, (addr, length, lkey) in enumerate(sgl):
        e.sg[i].addr, e.sg[i].length, e.sg[i].lkey = addr, length, lkey
    assert shm.RECV_WQE_HEAD.unpack_from(back, off) == head
    assert back == buf


@SETTINGS
@given(cqes, slot_offsets)
def test_cqe_both_ways(cqe: tuple[int, ...], off: int) -> None:
    buf = bytearray(off + shm.CQE_SIZE)
    shm.CQE.pack_into(buf, off, *cqe)
    e = _view(buf, "struct uv_cqe", off)
    assert tuple(getattr(e, f) for f in shm.CQE_FIELDS) == cqe

    back = bytearray(off + shm.CQE_SIZE)
    e = _view(back, "struct uv_cqe", off)
    for f, v in zip(shm.CQE_FIELDS, cqe):
        setattr(e, f, v)
    assert shm.CQE.unpack_from(back, off) == cqe
    assert back == buf


ring_types = st.sampled_from(["struct uv_send_wqe", "struct uv_recv_wqe", "struct uv_cqe"])


@SETTINGS
@given(ring_types, st.sampled_from([1, 2, 8, 16]), st.integers(0, 40), st.integers(0, 40), u64,
       st.integers(0, 3 * 64))
def test_ring_offsets_address_the_cffi_slots(ctype: str, entries: int, start: int, n: int, tag: int,
                                             offset: int) -> None:
    buf = bytearray(offset + shm.ring_bytes(entries, ffi.sizeof(ctype)))
    prod = shm.Ring(buf, offset, ctype, entries, init=True)
    cons = shm.Ring(buf, offset, ctype, entries)
    # start both sides at an arbitrary index, near the u32 wrap for large ones
    base = (0xFFFFFFFF - 20 + start) & 0xFFFFFFFF
    prod.prod = cons.cons = base
    prod.publish()
    cons.pop(0)
    n = min(n, entries)
    for i in range(n):
        slot = prod.next_slot()
        slot.wr_id = (tag + i) & 0xFFFFFFFFFFFFFFFF
        assert struct.unpack_from("=Q", prod.buf, prod.next_slot_offset())[0] == slot.wr_id
        prod.push()
    prod.publish()
    assert cons.available() == n
    for i in range(n):
        off = cons.slot_offset(i)
        assert offset + shm.RING_HDR_SIZE <= off <= len(buf) - cons.entry_size
        assert struct.unpack_from("=Q", cons.buf, off)[0] == cons.peek(i).wr_id == (tag + i) & 0xFFFFFFFFFFFFFFFF
        struct.pack_into("=Q", cons.buf, off, i)
        assert cons.peek(i).wr_id == i
    assert cons.slot_offset() == cons.slot_offset(0) == cons.slot_offset(entries)  # wraps like peek
    prod.release()
    cons.release()


def test_ring_buf_is_the_constructor_buffer_and_release_frees_the_mapping() -> None:
    fd, mm = shm.new_segment(shm.page_round(shm.ring_bytes(4, shm.CQE_SIZE)), "t")
    try:
        ring = shm.Ring(mm, 0, "struct uv_cqe", 4, init=True)
        assert ring.entry_size == shm.CQE_SIZE and len(ring.buf) == len(mm) and not ring.buf.readonly
        shm.CQE.pack_into(ring.buf, ring.next_slot_offset(), 7, 0, 1, 0, 8, 0, 3, 0, 0)
        off = ring.next_slot_offset()
        assert shm.CQE.unpack_from(mm, off)[0] == 7  # the mapping itself, not a copy
        with pytest.raises(BufferError):
            mm.close()  # still exported
        ring.release()
        with pytest.raises(ValueError):
            shm.CQE.unpack_from(ring.buf, 0)  # a released ring cannot touch the old mapping
        ring.release()  # harmless twice
        mm.close()
    finally:
        if not mm.closed:
            mm.close()
        os.close(fd)


def test_a_ring_too_big_for_its_buffer_keeps_no_export() -> None:
    mm = mmap.mmap(-1, mmap.PAGESIZE)
    with pytest.raises(ValueError):
        shm.Ring(mm, 0, "struct uv_send_wqe", 64)
    mm.close()
