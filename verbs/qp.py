"""Queue pairs, their attribute objects and work requests (pyverbs shapes).

Theory of operation
-------------------
``QP(pd, QPInitAttr(...))`` asks the daemon for an RC QP and maps the QP's
segment, which holds the send and receive rings.  ``post_send`` /
``post_recv`` write WQEs straight into those rings (``wire/shm.py``
layout), publish the producer index, and ring the doorbell only if the
daemon said it sleeps (``need_wakeup``): posting never blocks and costs no
syscall while the daemon is busy.  A full ring raises ENOMEM, like
``ibv_post_send``.  Threads posting to one queue take turns on its lock.

``modify`` / ``query`` go to the daemon, which owns the state machine (IB
§11.2.5.2: RESET -> INIT -> RTR -> RTS, SQD, ERR; an invalid transition or
attribute mask raises EINVAL and changes nothing).

The peer of a QP is named by its daemon: ``AHAttr.dlid`` is the peer
daemon's UDP port (its ``query_port().lid``) and ``AHAttr.gr.dgid`` its
GID (``query_gid()``, the daemon's IPv4 address mapped into IPv6).
"""

from __future__ import annotations

import enum
import errno
import mmap
import os
import struct
import threading
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NoReturn

from ..wire import ctl, shm
from ..wire.ctl import Op
from ..wire.shm import QPAttrMask as M, QPState as S, SendFlags
from .cq import CQ
from .device import GID, Resource, _close_all
from .errors import UserError, VerbsError
from .fastpath import load as _load_fastpath
from .pd import PD

_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF
# Plain ints for the per-WR tests: an IntFlag ``&`` runs Python-level enum code
# (~1 µs), and naming an enum member is a class attribute lookup each time.
_SEND_INLINE = int(SendFlags.IBV_SEND_INLINE)
_NOT_SENDABLE = frozenset({S.IBV_QPS_RESET, S.IBV_QPS_INIT, S.IBV_QPS_RTR})
#: the compiled writer of post lists, or None (the Python path alone)
_fast = _load_fastpath()


class QPCap:
    """``ibv_qp_cap``."""

    def __init__(self, max_send_wr: int = 1, max_recv_wr: int = 10, max_send_sge: int = 1,
                 max_recv_sge: int = 1, max_inline_data: int = 0) -> None:
        self.max_send_wr = max_send_wr
        self.max_recv_wr = max_recv_wr
        self.max_send_sge = max_send_sge
        self.max_recv_sge = max_recv_sge
        self.max_inline_data = max_inline_data

    def __repr__(self) -> str:
        return f"QPCap({self.__dict__})"


class QPInitAttr:
    """``ibv_qp_init_attr``; ``scq``/``rcq`` (pyverbs) and ``send_cq``/``recv_cq`` are aliases."""

    def __init__(self, qp_type: int = 2, qp_context: Any = None, scq: CQ | None = None, rcq: CQ | None = None,
                 srq: Any = None, cap: QPCap | None = None, sq_sig_all: int = 1, *,
                 send_cq: CQ | None = None, recv_cq: CQ | None = None) -> None:
        self.qp_type = qp_type
        self.qp_context = qp_context
        self.send_cq = send_cq or scq
        self.recv_cq = recv_cq or rcq or self.send_cq
        self.srq = srq
        self.cap = cap or QPCap()
        self.sq_sig_all = sq_sig_all

    scq = property(lambda self: self.send_cq)
    rcq = property(lambda self: self.recv_cq)


class GlobalRoute:
    """``ibv_global_route``: ``dgid`` names the peer daemon."""

    def __init__(self, dgid: GID | str | bytes | None = None, flow_label: int = 0, sgid_index: int = 0,
                 hop_limit: int = 1, traffic_class: int = 0) -> None:
        self.dgid = dgid if isinstance(dgid, GID) or dgid is None else GID(dgid)
        self.flow_label = flow_label
        self.sgid_index = sgid_index
        self.hop_limit = hop_limit
        self.traffic_class = traffic_class


class AHAttr:
    """``ibv_ah_attr``: ``dlid`` is the peer daemon's UDP port, ``gr.dgid`` its GID."""

    def __init__(self, dlid: int = 0, sl: int = 0, port_num: int = 1, is_global: int = 1,
                 gr: GlobalRoute | None = None, src_path_bits: int = 0, static_rate: int = 0) -> None:
        self.dlid = dlid
        self.sl = sl
        self.port_num = port_num
        self.is_global = is_global
        self.gr = gr or GlobalRoute()
        self.src_path_bits = src_path_bits
        self.static_rate = static_rate

    @property
    def dgid(self) -> GID | None:
        return self.gr.dgid

    def __repr__(self) -> str:
        return f"AHAttr(dlid={self.dlid}, dgid={self.gr.dgid!r})"


#: the QPAttr fields that are enums in libibverbs, shown by name
_ENUM_FIELDS: dict[str, type[enum.IntEnum] | type[enum.IntFlag]] = {
    "qp_state": S, "cur_qp_state": S, "qp_access_flags": shm.AccessFlags}


def _shown(field: str, v: Any) -> str:
    """``v`` by name if ``field`` is an enum and ``v`` one of its values (flags joined by ``|``), else its repr."""
    kind = _ENUM_FIELDS.get(field)
    if kind is not None and type(v) in (int, kind):
        try:
            return kind(v).name or "0"  # a flag set of none has no name
        except ValueError:
            pass
    return repr(v)


class QPAttr:
    """``ibv_qp_attr`` (the fields RC uses).

    From ``QP.query()``, ``qp_state`` and ``cur_qp_state`` are ``QPState``
    members and ``qp_access_flags`` an ``AccessFlags``: ints that compare
    equal to the ``IBV_*`` constants, shown by name in the repr.
    """

    def __init__(self, qp_state: int = S.IBV_QPS_RESET, cur_qp_state: int = S.IBV_QPS_RESET, **kw: Any) -> None:
        self.qp_state = qp_state
        self.cur_qp_state = cur_qp_state
        self.qp_access_flags = 0
        self.pkey_index = 0
        self.port_num = 1
        self.path_mtu = 5
        self.timeout = 14
        self.retry_cnt = 7
        self.rnr_retry = 7
        self.min_rnr_timer = 12
        self.rq_psn = 0
        self.sq_psn = 0
        self.max_rd_atomic = 1
        self.max_dest_rd_atomic = 1
        self.dest_qp_num = 0
        self.ah_attr = AHAttr()
        self.sq_draining = 0
        self.cap = QPCap()
        for k, v in kw.items():
            if not hasattr(self, k):
                raise UserError(f"QPAttr has no attribute {k!r}")
            setattr(self, k, v)

    def __repr__(self) -> str:
        # The states and access flags by name; int() of any of them is the C value.
        body = ", ".join(f"{k}={_shown(k, v)}" for k, v in self.__dict__.items() if k not in ("ah_attr", "cap"))
        return f"QPAttr({body}, ah_attr={self.ah_attr!r}, cap={self.cap!r})"

    def _wire(self) -> dict[str, Any]:
        gid = self.ah_attr.gr.dgid
        d = {f: int(getattr(self, f)) for f in ctl.QP_ATTR_FIELDS if f not in ("dgid", "dlid")}
        d["dgid"] = gid.raw if gid is not None else bytes(16)
        d["dlid"] = int(self.ah_attr.dlid)
        return d


class SGE:
    """``ibv_sge``: ``addr`` inside a registered MR (``mr.buf + offset``), ``length``, ``lkey``."""

    __slots__ = ("addr", "length", "lkey")

    def __init__(self, addr: int, length: int, lkey: int) -> None:
        self.addr = addr
        self.length = length
        self.lkey = lkey

    def __repr__(self) -> str:
        return f"SGE(addr={self.addr:#x}, length={self.length}, lkey={self.lkey:#x})"


class SendWR:
    """``ibv_send_wr``; ``set_wr_rdma`` / ``set_wr_atomic`` fill ``wr.rdma`` / ``wr.atomic`` as in pyverbs.

    ``imm_data`` (Send/Write with Immediate) and ``invalidate_rkey`` (Send
    with Invalidate) share one field, as in ``ibv_send_wr``.
    """

    def __init__(self, wr_id: int = 0, opcode: int = 2, num_sge: int | None = None, imm_data: int = 0,
                 sg: list[SGE] | None = None, send_flags: int = 0, next_wr: "SendWR | None" = None,
                 *, invalidate_rkey: int | None = None) -> None:
        self.wr_id = wr_id
        self.opcode = opcode
        self.sg = list(sg or [])
        self.num_sge = len(self.sg) if num_sge is None else num_sge
        self.imm_data = imm_data if invalidate_rkey is None else invalidate_rkey
        self.send_flags = send_flags
        self.next_wr = next_wr
        self.rkey = 0
        self.remote_addr = 0
        self.compare_add = 0
        self.swap = 0

    @property
    def invalidate_rkey(self) -> int:
        return self.imm_data

    @invalidate_rkey.setter
    def invalidate_rkey(self, rkey: int) -> None:
        self.imm_data = rkey

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        """Target of an RDMA Write/Read: the peer MR's ``rkey`` and an address in it."""
        self.rkey = rkey
        self.remote_addr = addr

    def set_wr_atomic(self, rkey: int, addr: int, compare_add: int, swap: int = 0) -> None:
        """Target and operands of an atomic (RFC 7306 §5): an 8-byte aligned ``addr`` in the peer MR.

        Fetch-and-Add adds ``compare_add``; Compare-and-Swap writes ``swap``
        where the word equals ``compare_add``.  The word's old value lands in
        the WR's single 8-byte SGE.
        """
        self.rkey = rkey
        self.remote_addr = addr
        self.compare_add = compare_add
        self.swap = swap


class RecvWR:
    """``ibv_recv_wr``."""

    def __init__(self, wr_id: int = 0, num_sge: int | None = None, sg: list[SGE] | None = None,
                 next_wr: "RecvWR | None" = None) -> None:
        self.wr_id = wr_id
        self.sg = list(sg or [])
        self.num_sge = len(self.sg) if num_sge is None else num_sge
        self.next_wr = next_wr


#: the C type of each WQE field the fast path packs unmasked (``wire/shm.py``)
_FIELD_BITS = {"addr": 64, "length": 32, "lkey": 32, "remote_addr": 64, "rkey": 32, "opcode": 32,
               "send_flags": 32, "num_sge": 32}


def _refuse(verb: str, fields: Iterable[tuple[str, Any]], err: Exception) -> NoReturn:
    """Raise ``UserError`` naming the first of ``fields`` that does not fit its
    C type.  The fast path packs with ``struct`` and comes here only for a
    value it refused (a negative length, count, address or key), so a post
    pays nothing for the check."""
    for name, value in fields:
        bits = _FIELD_BITS.get(name, 64)
        if type(value) is not int or not 0 <= value < 1 << bits:
            raise UserError(f"{verb}: {name}={value!r} is out of range (an unsigned {bits}-bit integer)") from None
    raise UserError(f"{verb}: a field is out of range ({err})") from None


def _pack_sges(verb: str, buf: memoryview, off: int, sg: list[Any], n: int) -> None:
    """Write the first ``n`` SGEs of ``sg`` at ``buf[off:]`` (the slot a ring is filling)."""
    pack = shm.SGE.pack_into
    for i in range(n):
        s = sg[i]
        try:
            pack(buf, off, s.addr, s.length, s.lkey)
        except struct.error as err:
            _refuse(f"{verb}, SGE {i}", (("addr", s.addr), ("length", s.length), ("lkey", s.lkey)), err)
        off += shm.SGE_SIZE


def _inline_data(sg: list[Any], n: int) -> bytes:
    """The bytes the first ``n`` SGEs of an inline send name, gathered."""
    if not 0 <= n <= len(sg):
        raise UserError(f"post_send: num_sge={n} with {len(sg)} SGEs given")
    for i in range(n):
        s = sg[i]
        if type(s.addr) is not int or type(s.length) is not int or s.addr < 0 or s.length < 0:
            _refuse(f"post_send, SGE {i}", (("addr", s.addr), ("length", s.length)), ValueError())
    return b"".join(bytes(shm.ffi.buffer(shm.ffi.cast("char *", s.addr), s.length)) for s in sg[:n])


def _write_send_wqe(buf: memoryview, off: int, wr: SendWR, n: int, cap: QPCap) -> None:
    """Write send WR ``wr`` (of ``n`` SGEs, checked against the list) into the slot at ``buf[off:]``."""
    inline = int(wr.send_flags) & _SEND_INLINE
    if inline:
        s = wr.sg[0] if n == 1 else None
        if s is not None and s.length >= 0 and s.addr >= 0:
            # perftest's case: copied once, from the buffer into the slot
            data = shm.ffi.buffer(shm.ffi.cast("char *", s.addr), s.length)
        else:
            data = _inline_data(wr.sg, n)
        num_sge, inline_len = 0, len(data)
    else:
        num_sge, inline_len = n, 0
    try:
        shm.SEND_WQE_HEAD.pack_into(buf, off, wr.wr_id & _U64, wr.remote_addr, wr.opcode, wr.send_flags, num_sge,
                                    wr.imm_data & _U32, wr.rkey, inline_len, wr.compare_add & _U64, wr.swap & _U64)
    except struct.error as err:
        # the masked fields always fit (an atomic's operands are two's complement): one of these did not
        _refuse("post_send", (("remote_addr", wr.remote_addr), ("rkey", wr.rkey), ("opcode", wr.opcode),
                              ("send_flags", wr.send_flags), ("num_sge", num_sge)), err)
    off += shm.SEND_WQE_SG_OFFSET
    if inline:
        if inline_len > cap.max_inline_data:
            raise VerbsError(f"{inline_len} inline bytes > max_inline_data {cap.max_inline_data}", errno.EINVAL)
        buf[off:off + inline_len] = data
    else:
        if n > cap.max_send_sge:
            raise VerbsError(f"num_sge {n} > max_send_sge {cap.max_send_sge}", errno.EINVAL)
        _pack_sges("post_send", buf, off, wr.sg, n)


def _wr_list(first: Any, rest: Any = None) -> Iterator[Any]:
    """The WRs of a post list: of a list or tuple ``first`` from index
    ``rest`` (0 if None), else of the chain (``next_wr``) from WR ``rest``
    (``first`` if None)."""
    if isinstance(first, (list, tuple)):
        return itertools.islice(first, rest or 0, None)
    return _chain(first if rest is None else rest)


def _chain(wr: Any) -> Iterator[Any]:
    while wr is not None:
        yield wr
        wr = wr.next_wr


def _report_bad(err: Exception, wr: Any, bad_wr: Any) -> None:
    """Name ``wr`` as the WR that failed: ``err.bad_wr`` is ``wr`` (as
    ``ibv_post_send``'s ``bad_wr`` points at it), and ``bad_wr``, if given,
    gets a copy of its fields (as pyverbs' ``post_send(wr, bad_wr)``)."""
    err.bad_wr = wr  # type: ignore[attr-defined]
    if bad_wr is not None and wr is not None:
        bad_wr.__dict__.update(vars(wr))


def post_recv_ring(ctx: Any, rq: shm.Ring, lock: threading.Lock, wr: RecvWR | None, max_sge: int) -> None:
    """Write a chain of receive WRs into ``rq`` (a QP's RQ or an SRQ), holding
    ``lock`` (the ring's), and ring the doorbell once."""
    if ctx._dead:
        ctx._check_alive("post_recv")
    posted = 0
    buf = rq.buf
    head, sg_offset = shm.RECV_WQE_HEAD, shm.RECV_WQE_SG_OFFSET
    lock.acquire()
    try:
        while wr is not None:
            n = wr.num_sge
            if n > len(wr.sg):
                raise UserError(f"num_sge={n} but {len(wr.sg)} SGEs given")
            if n > max_sge:
                raise VerbsError(f"num_sge {n} > max_recv_sge {max_sge}", errno.EINVAL)
            if rq.free() == 0:
                ctx._check_alive("post_recv")
                raise VerbsError("receive queue full", errno.ENOMEM)
            off = rq.next_slot_offset()
            wr_id = wr.wr_id & _U64
            try:
                head.pack_into(buf, off, wr_id, n)
            except struct.error as err:
                _refuse("post_recv", (("num_sge", n),), err)
            _pack_sges("post_recv", buf, off + sg_offset, wr.sg, n)
            rq.push()
            posted += 1
            wr = wr.next_wr
    finally:
        if posted:
            rq.publish()
            ctx.ring_doorbell()
        lock.release()


class QP(Resource):
    """An RC queue pair (``QP(pd, init_attr, qp_attr=None)``).

    With ``qp_attr`` the QP is moved to INIT at once, as pyverbs does.
    """

    #: what the compiled writer needs to know of the SQ, besides its producer index (made on the first post)
    _sq_args: tuple[int, ...] | None = None

    def __init__(self, pd: PD, init_attr: QPInitAttr, qp_attr: QPAttr | None = None) -> None:
        super().__init__()
        scq, rcq = init_attr.send_cq, init_attr.recv_cq
        if scq is None or rcq is None:
            raise UserError("QPInitAttr needs a send CQ (scq/send_cq)")
        cap = init_attr.cap
        ctx = pd.ctx
        srq = init_attr.srq
        # Handles are per daemon: another context's CQ (on another device) would
        # name some CQ of this one, so the library checks the parent.
        for what, obj in (("send CQ", scq), ("receive CQ", rcq), ("SRQ", srq)):
            if obj is not None and getattr(obj, "ctx", None) is not ctx:
                raise VerbsError(f"the {what} belongs to another context than the PD", errno.EINVAL)
        rep, fds = ctx.call(
            Op.CREATE_QP, pd_handle=pd.handle, send_cq=scq.handle, recv_cq=rcq.handle, qp_type=init_attr.qp_type,
            max_send_wr=cap.max_send_wr, max_recv_wr=cap.max_recv_wr, max_send_sge=cap.max_send_sge,
            max_recv_sge=cap.max_recv_sge, max_inline_data=cap.max_inline_data, sq_sig_all=int(init_attr.sq_sig_all),
            srq_handle=init_attr.srq.handle if init_attr.srq is not None else 0,
        )
        if len(fds) != 1:
            _close_all(fds)
            raise VerbsError("QP without its rings", errno.EPROTO)
        layout = shm.QPLayout(rep.sq_entries, rep.rq_entries)
        try:
            self._mm = mmap.mmap(fds[0], layout.size)
        finally:
            os.close(fds[0])
        self._sq = shm.Ring(self._mm, layout.sq_offset, "struct uv_send_wqe", rep.sq_entries)
        self._rq = shm.Ring(self._mm, layout.rq_offset, "struct uv_recv_wqe", rep.rq_entries)
        # A ring's producer index is private to this process and moved by
        # read-modify-write: two threads posting at once would fill one slot
        # twice, so each ring's posts take turns (as libibverbs' per-QP locks).
        self._sq_lock = threading.Lock()
        self._rq_lock = threading.Lock()
        self.ctx = ctx
        self.pd = pd
        self.qp_num = rep.qp_num
        self.qp_type = init_attr.qp_type
        self.qp_state = S.IBV_QPS_RESET
        self.scq, self.rcq = scq, rcq
        self.cap = QPCap(rep.max_send_wr, rep.max_recv_wr, rep.max_send_sge, rep.max_recv_sge,
                         rep.max_inline_data)
        self.sq_sig_all = init_attr.sq_sig_all
        self.srq = init_attr.srq
        pd._adopt(self)
        scq._qps.append(self)
        if rcq is not scq:
            rcq._qps.append(self)
        if qp_attr is not None:
            self.to_init(qp_attr)

    # -- control path ---------------------------------------------------------------
    def modify(self, qp_attr: QPAttr, attr_mask: int) -> None:
        """``ibv_modify_qp``.  Raises VerbsError(EINVAL) for an invalid transition or mask."""
        self._check_open()
        self.ctx.call(Op.MODIFY_QP, qp_num=self.qp_num, attr_mask=int(attr_mask), **qp_attr._wire())
        if attr_mask & M.IBV_QP_STATE:
            self.qp_state = S(qp_attr.qp_state)

    def query(self, attr_mask: int = 0) -> tuple[QPAttr, QPInitAttr]:
        """``ibv_query_qp``: the current attributes (all of them, whatever the mask)."""
        self._check_open()
        r, _ = self.ctx.call(Op.QUERY_QP, qp_num=self.qp_num)
        attr = QPAttr()
        for f in ctl.QP_ATTR_FIELDS:
            if f not in ("dgid", "dlid"):
                setattr(attr, f, getattr(r, f))
        attr.qp_state, attr.cur_qp_state = S(r.qp_state), S(r.cur_qp_state)
        attr.qp_access_flags = shm.AccessFlags(r.qp_access_flags)
        attr.ah_attr = AHAttr(dlid=r.dlid, gr=GlobalRoute(dgid=GID(r.dgid)))
        attr.cap = QPCap(r.max_send_wr, r.max_recv_wr, r.max_send_sge, r.max_recv_sge, r.max_inline_data)
        self.qp_state = attr.qp_state
        init = QPInitAttr(qp_type=self.qp_type, scq=self.scq, rcq=self.rcq, cap=attr.cap, sq_sig_all=r.sq_sig_all)
        return attr, init

    def to_init(self, attr: QPAttr) -> None:
        """RESET -> INIT with ``attr``'s pkey_index, port_num and qp_access_flags."""
        attr.qp_state = S.IBV_QPS_INIT
        self.modify(attr, M.IBV_QP_STATE | M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT | M.IBV_QP_ACCESS_FLAGS)

    def to_rtr(self, attr: QPAttr) -> None:
        """(RESET ->) INIT -> RTR; ``attr`` carries dest_qp_num and ah_attr."""
        if self.qp_state == S.IBV_QPS_RESET:
            self.to_init(attr)
        attr.qp_state = S.IBV_QPS_RTR
        self.modify(attr, M.IBV_QP_STATE | M.IBV_QP_AV | M.IBV_QP_PATH_MTU | M.IBV_QP_DEST_QPN | M.IBV_QP_RQ_PSN
                    | M.IBV_QP_MAX_DEST_RD_ATOMIC | M.IBV_QP_MIN_RNR_TIMER)

    def to_rts(self, attr: QPAttr) -> None:
        """(RESET -> INIT ->) RTR -> RTS, as pyverbs' ``to_rts``."""
        if self.qp_state in (S.IBV_QPS_RESET, S.IBV_QPS_INIT):
            self.to_rtr(attr)
        attr.qp_state = S.IBV_QPS_RTS
        self.modify(attr, M.IBV_QP_STATE | M.IBV_QP_SQ_PSN | M.IBV_QP_TIMEOUT | M.IBV_QP_RETRY_CNT
                    | M.IBV_QP_RNR_RETRY | M.IBV_QP_MAX_QP_RD_ATOMIC)

    # -- data path --------------------------------------------------------------------
    def post_send(self, wr: SendWR | Sequence[SendWR], bad_wr: SendWR | None = None) -> None:
        """Post a list of send WRs: a chain (``wr.next_wr``), or a list of them.  Never blocks.

        All of them go into the send queue in one call, which publishes them
        and rings the doorbell once.  The first WR that fails raises, with
        the WRs before it posted and the rest not (``ibv_post_send``): the
        exception's ``bad_wr`` is that WR, and a ``bad_wr`` argument gets a
        copy of its fields, as in pyverbs.

        Raises:
            VerbsError: EINVAL (QP not ready to send, too many SGEs, inline
                too long), ENOMEM (send queue full), ENODEV (the daemon is
                gone: IBV_EVENT_DEVICE_FATAL).
            UserError: ``num_sge`` larger than the SGE list, or a length,
                count, address or key that is negative or too large.
        """
        self._check_open()
        if self.qp_state in _NOT_SENDABLE:
            raise VerbsError(f"post_send on a QP in {S(self.qp_state).name}", errno.EINVAL)
        ctx = self.ctx
        if ctx._dead:
            ctx._check_alive("post_send")
        sq = self._sq
        lock = self._sq_lock
        lock.acquire()
        try:
            if _fast is None:
                return self._post_sends(_wr_list(wr), bad_wr)
            args = self._sq_args
            if args is None:
                cap = self.cap
                args = self._sq_args = (sq.hdr_addr, sq.slots_addr, sq.mask, sq.entries, cap.max_send_sge,
                                        cap.max_inline_data, _SEND_INLINE)
            # every WR the compiled writer is sure of, written, published and fenced
            posted, rest = _fast.post_send(wr, sq.prod, args)
            if posted:
                sq.push(posted)
                ctx.ring_doorbell(fenced=True)
            if rest is not None:
                self._post_sends(_wr_list(wr, rest), bad_wr)  # the first it was not sure of, and the rest
        finally:
            lock.release()

    def _post_sends(self, wrs: Iterable[SendWR], bad_wr: SendWR | None) -> None:
        """The Python path of ``post_send``, holding the SQ's lock."""
        sq = self._sq
        posted = 0
        wr = None
        try:
            for wr in wrs:
                n = wr.num_sge
                if n > len(wr.sg):
                    raise UserError(f"num_sge={n} but {len(wr.sg)} SGEs given")
                if sq.free() == 0:
                    self.ctx._check_alive("post_send")  # a daemon that is gone takes nothing from the ring
                    raise VerbsError("send queue full", errno.ENOMEM)
                _write_send_wqe(sq.buf, sq.next_slot_offset(), wr, n, self.cap)
                sq.push()
                posted += 1
        except (VerbsError, UserError) as e:
            _report_bad(e, wr, bad_wr)
            raise
        finally:
            if posted:
                sq.publish()
                self.ctx.ring_doorbell()

    def post_recv(self, wr: RecvWR, bad_wr: Any = None) -> None:
        """Post a chain of receive WRs.  Never blocks.

        Raises:
            VerbsError: EINVAL (QP in RESET, too many SGEs, the QP takes its
                receives from an SRQ), ENOMEM (queue full), ENODEV (the
                daemon is gone).
            UserError: ``num_sge`` larger than the SGE list, or a length,
                count, address or key that is negative or too large.
        """
        self._check_open()
        if self.qp_state == S.IBV_QPS_RESET:
            raise VerbsError("post_recv on a QP in RESET", errno.EINVAL)
        if self.srq is not None:
            raise VerbsError("this QP receives from its SRQ: post to the SRQ", errno.EINVAL)
        post_recv_ring(self.ctx, self._rq, self._rq_lock, wr, self.cap.max_recv_sge)

    def _release(self) -> None:
        for cq in (self.scq, self.rcq):
            if self in cq._qps:
                cq._qps.remove(self)
        try:
            if not self.ctx._closed:
                self.ctx.call(Op.DESTROY_QP, qp_num=self.qp_num)
        finally:
            self._sq.release()
            self._rq.release()
            try:
                self._mm.close()
            except BufferError:
                pass
