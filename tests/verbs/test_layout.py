"""The shared-memory layout (wire/shm.py) and control messages (wire/ctl.py)."""

from __future__ import annotations

import errno
import mmap
import os
import re
import struct
import threading
from typing import Any

import pytest
from hypothesis import given, strategies as st

from udpverbs import verbs
from udpverbs.verbs.cq import CQ
from udpverbs.verbs.device import Resource
from udpverbs.verbs.qp import QP, post_recv_ring
from udpverbs.wire import ctl, shm
from udpverbs.wire.errors import WireError

from ..wire.strategies import SETTINGS, u32, u64


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


# --- the client's WQE / CQE fast paths against the daemon's (cffi) view ------------------


class _Ctx:
    """Stands in for a Context: counts doorbells instead of asking a daemon."""

    _closed = False
    _dead = False  # the daemon is there

    def __init__(self) -> None:
        self.doorbells = 0

    def _check_alive(self, what: str) -> None:
        pass

    def ring_doorbell(self, fenced: bool = False) -> None:
        self.doorbells += 1


class _Rings:
    """A QP's and a CQ's rings in plain memory, with the daemon-side Ring of each."""

    def __init__(self, entries: int = 8, max_send_sge: int = 4, max_recv_sge: int = 4, max_inline: int = 64) -> None:
        lay = shm.QPLayout(entries, entries)
        qbuf = bytearray(lay.size)
        self.ctx = _Ctx()
        self.qp = QP.__new__(QP)
        Resource.__init__(self.qp)
        self.qp.ctx = self.ctx
        self.qp.qp_state = shm.QPState.IBV_QPS_RTS
        self.qp.cap = verbs.QPCap(entries, entries, max_send_sge, max_recv_sge, max_inline)
        self.qp.srq = None
        self.qp._sq = shm.Ring(qbuf, lay.sq_offset, "struct uv_send_wqe", entries, init=True)
        self.qp._rq = shm.Ring(qbuf, lay.rq_offset, "struct uv_recv_wqe", entries, init=True)
        self.qp._sq_lock, self.qp._rq_lock = threading.Lock(), threading.Lock()
        self.sq = shm.Ring(qbuf, lay.sq_offset, "struct uv_send_wqe", entries)
        self.rq = shm.Ring(qbuf, lay.rq_offset, "struct uv_recv_wqe", entries)
        cbuf = bytearray(shm.ring_bytes(entries, shm.CQE_SIZE))
        self.cq = CQ.__new__(CQ)
        Resource.__init__(self.cq)
        self.cq._ring = shm.Ring(cbuf, 0, "struct uv_cqe", entries)
        self.cq._lock = threading.Lock()
        self.cqr = shm.Ring(cbuf, 0, "struct uv_cqe", entries, init=True)

    def complete(self, cqes: list[tuple[int, ...]], skip: int) -> None:
        """Write ``cqes`` (values in ``shm.CQE_FIELDS`` order) as the daemon does, from slot ``skip`` on."""
        self.cqr.prod = self.cq._ring.cons = skip  # somewhere other than slot 0
        self.cqr.publish()
        for c in cqes:
            e = self.cqr.next_slot()
            for f, v in zip(shm.CQE_FIELDS, c):
                setattr(e, f, v)
            self.cqr.push()
        self.cqr.publish()


def _sgl(e: Any) -> list[tuple[int, int, int]]:
    return [(e.sg[i].addr, e.sg[i].length, e.sg[i].lkey) for i in range(e.num_sge)]


send_wrs = st.builds(
    lambda wr_id, op, flags, imm, rkey, raddr, cmp, swp, sgl: _send_wr(wr_id, op, flags, imm, rkey, raddr, cmp,
                                                                       swp, sgl),
    st.integers(-(1 << 63), (1 << 64) - 1), st.sampled_from(list(shm.WrOpcode)),
    st.sampled_from([0, shm.SendFlags.IBV_SEND_SIGNALED, shm.SendFlags.IBV_SEND_FENCE | 6]),
    u32, u32, u64, u64, u64, st.lists(st.tuples(u64, u32, u32), max_size=4))


def _send_wr(wr_id: int, op: int, flags: int, imm: int, rkey: int, raddr: int, cmp: int, swp: int,
             sgl: list[tuple[int, int, int]]) -> verbs.SendWR:
    wr = verbs.SendWR(wr_id=wr_id, opcode=op, imm_data=imm, send_flags=flags, sg=[verbs.SGE(*s) for s in sgl])
    wr.set_wr_atomic(rkey, raddr, cmp, swp)
    return wr


@SETTINGS
@given(st.lists(send_wrs, min_size=1, max_size=8))
def test_post_send_writes_what_the_daemon_reads(wrs: list[verbs.SendWR]) -> None:
    r = _Rings()
    for a, b in zip(wrs, wrs[1:]):
        a.next_wr = b
    r.qp.post_send(wrs[0])
    assert r.ctx.doorbells == 1 and r.sq.available() == len(wrs)
    for i, wr in enumerate(wrs):
        e = r.sq.peek(i)
        assert (e.wr_id, e.remote_addr, e.opcode, e.send_flags, e.imm_data, e.rkey, e.compare_add, e.swap) == (
            wr.wr_id & (2**64 - 1), wr.remote_addr, wr.opcode, wr.send_flags, wr.imm_data, wr.rkey,
            wr.compare_add, wr.swap)
        assert e.inline_len == 0 and _sgl(e) == [(s.addr, s.length, s.lkey) for s in wr.sg]


def test_post_send_inline_copies_the_bytes() -> None:
    r = _Rings()
    parts = [shm.ffi.new("char[]", b"hello "), shm.ffi.new("char[]", b"world")]
    sg = [verbs.SGE(int(shm.ffi.cast("uintptr_t", p)), len(p) - 1, 0) for p in parts]
    r.qp.post_send(verbs.SendWR(wr_id=3, opcode=shm.WrOpcode.IBV_WR_SEND, sg=sg,
                                send_flags=shm.SendFlags.IBV_SEND_INLINE | shm.SendFlags.IBV_SEND_SIGNALED))
    e = r.sq.peek()
    assert (e.wr_id, e.num_sge, e.inline_len) == (3, 0, 11)
    assert bytes(e.inline_data)[:11] == b"hello world"
    too_long = [verbs.SGE(sg[0].addr, 6, 0)] * 11
    with pytest.raises(verbs.VerbsError, match="66 inline bytes > max_inline_data 64"):
        r.qp.post_send(verbs.SendWR(opcode=shm.WrOpcode.IBV_WR_SEND, sg=too_long,
                                    send_flags=shm.SendFlags.IBV_SEND_INLINE))
    assert r.sq.available() == 1


def test_post_send_errors_are_unchanged() -> None:
    r = _Rings(entries=2, max_send_sge=1)
    sge = verbs.SGE(0x1000, 8, 1)
    ok = verbs.SendWR(wr_id=1, opcode=0, sg=[sge])
    # values that do not fit their field: UserError naming it
    for bad, (field, value) in (
            (verbs.SendWR(opcode=-1, sg=[sge]), ("opcode", -1)),
            (verbs.SendWR(opcode=None, sg=[sge]), ("opcode", None)),
            (verbs.SendWR(opcode=0, send_flags=1 << 32, sg=[sge]), ("send_flags", 1 << 32)),
            (verbs.SendWR(opcode=0, sg=[verbs.SGE(0x1000, 1 << 32, 1)]), ("length", 1 << 32)),
            (verbs.SendWR(opcode=0, sg=[verbs.SGE(-1, 8, 1)]), ("addr", -1)),
            (verbs.SendWR(opcode=0, sg=[verbs.SGE(0x1000, 8, 2.0)]), ("lkey", 2.0))):
        with pytest.raises(verbs.UserError, match=re.escape(f"{field}={value!r} is out of range")):
            r.qp.post_send(bad)
    with pytest.raises(verbs.VerbsError, match="num_sge 2 > max_send_sge 1") as e:
        r.qp.post_send(verbs.SendWR(opcode=0, sg=[sge, sge]))
    assert e.value.error_code == errno.EINVAL
    with pytest.raises(verbs.UserError, match="num_sge=2 but 1 SGEs given"):
        r.qp.post_send(verbs.SendWR(opcode=0, num_sge=2, sg=[sge]))
    assert r.ctx.doorbells == 0 and r.sq.available() == 0  # nothing half-posted
    # a chain failing at its third WR keeps the two before it, published once
    ok.next_wr = verbs.SendWR(wr_id=2, opcode=0, sg=[sge], next_wr=verbs.SendWR(opcode=0, sg=[sge]))
    with pytest.raises(verbs.VerbsError) as e:
        r.qp.post_send(ok)
    assert e.value.error_code == errno.ENOMEM
    assert r.ctx.doorbells == 1 and [r.sq.peek(i).wr_id for i in range(r.sq.available())] == [1, 2]
    r.qp.qp_state = shm.QPState.IBV_QPS_RTR
    with pytest.raises(verbs.VerbsError, match="post_send on a QP in IBV_QPS_RTR"):
        r.qp.post_send(verbs.SendWR(opcode=0, sg=[sge]))


@SETTINGS
@given(st.lists(st.tuples(st.integers(-(1 << 63), (1 << 64) - 1), st.lists(st.tuples(u64, u32, u32), max_size=4)),
                min_size=1, max_size=8), st.booleans())
def test_post_recv_writes_what_the_daemon_reads(wrs: list[tuple[int, list[tuple[int, int, int]]]],
                                                srq: bool) -> None:
    r = _Rings()
    chain = None
    for wr_id, sgl in reversed(wrs):
        chain = verbs.RecvWR(wr_id=wr_id, sg=[verbs.SGE(*s) for s in sgl], next_wr=chain)
    if srq:  # the SRQ posts through the same routine, into its own ring
        post_recv_ring(r.ctx, r.qp._rq, threading.Lock(), chain, 4)
    else:
        r.qp.post_recv(chain)
    assert r.ctx.doorbells == 1 and r.rq.available() == len(wrs)
    assert [(r.rq.peek(i).wr_id, _sgl(r.rq.peek(i))) for i in range(len(wrs))] == [
        (wr_id & (2**64 - 1), sgl) for wr_id, sgl in wrs]


def test_post_recv_errors_are_unchanged() -> None:
    r = _Rings(entries=1, max_recv_sge=1)
    sge = verbs.SGE(0x1000, 8, 1)
    with pytest.raises(verbs.UserError, match="length=-8 is out of range"):
        r.qp.post_recv(verbs.RecvWR(sg=[verbs.SGE(0x1000, -8, 1)]))
    with pytest.raises(verbs.UserError, match="num_sge=-1 is out of range"):
        r.qp.post_recv(verbs.RecvWR(num_sge=-1))
    with pytest.raises(verbs.VerbsError, match="num_sge 2 > max_recv_sge 1"):
        r.qp.post_recv(verbs.RecvWR(sg=[sge, sge]))
    with pytest.raises(verbs.UserError, match="num_sge=3 but 1 SGEs given"):
        r.qp.post_recv(verbs.RecvWR(num_sge=3, sg=[sge]))
    r.qp.post_recv(verbs.RecvWR(wr_id=5, sg=[sge]))
    with pytest.raises(verbs.VerbsError, match="receive queue full"):
        r.qp.post_recv(verbs.RecvWR(sg=[sge]))
    assert r.ctx.doorbells == 1 and r.rq.available() == 1 and r.rq.peek().wr_id == 5


@SETTINGS
@given(st.lists(st.tuples(*[u64] + [u32] * 8), min_size=1, max_size=8), st.integers(0, 8), st.integers(1, 9))
def test_poll_returns_what_the_daemon_wrote(cqes: list[tuple[int, ...]], skip: int, batch: int) -> None:
    r = _Rings()
    r.complete(cqes, skip)
    got: list[tuple[int, ...]] = []
    while len(got) < len(cqes):
        n, wcs = r.cq.poll(batch)
        assert n == len(wcs) == min(batch, len(cqes) - len(got))
        got += [tuple(getattr(w, f) for f in shm.CQE_FIELDS) for w in wcs]
    assert got == cqes
    assert r.cq.poll(batch) == (0, [])
    assert r.cqr.free() == 8  # consumed and published
