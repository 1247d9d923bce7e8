"""A session per verbs-library connection, and the verbs it serves.

Theory of operation
-------------------
``server.py`` accepts the connections and runs one ``Session`` per client
(``modify_qp`` is here too: the connection manager drives QPs with it).  A
session parses
each request with ``wire.ctl.decode_request_untrusted``, runs the handler
and sends exactly one reply; file descriptors (memfd segments, eventfds)
travel as SCM_RIGHTS.  A handler refuses with ``TableError(errno)`` (a typed
error reply to the caller); anything else it raises is a daemon bug: logged,
and the session — only that one — is torn down, the daemon keeps serving.

A session owns what it created.  On disconnect (the application exited or
crashed) everything is destroyed children first: QPs (to ERR, peers told),
CQs, channels, MRs (STags invalidated, so a late segment cannot land in a
dead mapping), PDs.  The connection manager may use a second connection of
the same process (same pid by SO_PEERCRED) to act on that process's QPs, so
a blocking listen does not stall the first connection's verbs.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

import trio

from ..wire import ctl, shm
from ..wire.ctl import Op
from ..wire.shm import AccessFlags, QPAttrMask as M, QPState as S, QPType, SrqAttrMask
from . import quota, status, tables
from .device import Device
from .cq import CompChannel, CompletionQueue, SharedReceiveQueue
from .qp import QueuePair
from .tables import TableError

log = logging.getLogger("udpverbs.daemon")

MAX_SGE = shm.MAX_SGE
MAX_INLINE = shm.MAX_INLINE
MAX_MR_SIZE = status.MAX_MR_SIZE


class Session:
    """One client connection and the resources it owns."""

    def __init__(self, device: Device, conn: trio.socket.SocketType, pid: int) -> None:
        self.device = device
        self.conn = conn
        self.pid = pid
        self.closed = False
        # Out of fds or memory here is the client's error, not the daemon's
        # exit: give back what was made, let the caller answer.
        self.ctx_fd, self.ctx_mm = shm.new_segment(shm.CtxLayout.size, "uv-ctx")
        made: list[int] = []
        try:
            for _ in range(2):
                made.append(os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
        except OSError:
            for fd in (*made, self.ctx_fd):
                os.close(fd)
            self.ctx_mm.close()
            raise
        self.doorbell, self.async_fd = made
        self._page_buf = shm.ffi.from_buffer(self.ctx_mm)
        self.page = shm.ffi.cast("struct uv_ctx_page *", self._page_buf)
        self.async_ring = shm.Ring(self.ctx_mm, shm.CtxLayout.async_offset, "struct uv_async_event",
                                   shm.ASYNC_RING_ENTRIES, init=True)
        self.hello = False
        self.fatal_sent = False
        self.pds: set[int] = set()
        self.mrs: set[int] = set()
        self.cqs: set[int] = set()
        self.channels: set[int] = set()
        self.qps: set[int] = set()
        self.srqs: set[int] = set()
        self.listeners: set[int] = set()
        self.mr_bytes = 0  # registered memory held, for the client's quota
        self.group_member: Any = None  # the rank this connection joined as (groups.py)

    # -- helpers the data path calls ---------------------------------------------
    def set_need_wakeup(self, v: int) -> None:
        self.page.need_wakeup = v

    def device_fatal(self) -> None:
        """Mark the context page: the daemon is shutting down (IBV_EVENT_DEVICE_FATAL)."""
        self.page.device_fatal = 1

    def async_event(self, event_type: int, element: int) -> None:
        """Queue an async event (QP fatal, CQ error, ...) and wake ctx.get_async_event."""
        r = self.async_ring
        try:
            if not r.free():
                return  # the app does not read its events; drop rather than block
        except shm.RingError:
            return
        e = r.next_slot()
        e.event_type = event_type
        e.element = element
        r.push()
        r.publish()
        try:
            os.eventfd_write(self.async_fd, 1)
        except OSError:
            pass

    # -- ownership ----------------------------------------------------------------
    def _charge(self, kind: str, nbytes: int = 0) -> None:
        """Refuse (ENOMEM) one more ``kind`` beyond this client's quota (``quota.py``)."""
        mine = [s for s in self.device.sessions if s.pid == self.pid]
        quota.check(self.device.config.quota, mine, kind, nbytes)

    def _qp(self, qpn: int) -> QueuePair:
        qp = self.device.qps.get(qpn)
        if qp is None or (qp.session is not self and qp.session.pid != self.pid):
            raise TableError(errno.ENOENT, f"no QP {qpn}")
        return qp

    # -- handlers -------------------------------------------------------------------
    def handle(self, op: Op, req: Any, fds: list[int]) -> tuple[bytes, list[int]]:
        """Run one request; return (reply, fds to pass).  Raises TableError."""
        if op != Op.HELLO and not self.hello:
            raise TableError(errno.EPROTO, "HELLO first")
        if fds and op != Op.REG_MR:
            raise TableError(errno.EINVAL, "unexpected file descriptors")
        fn = getattr(self, "op_" + op.name.lower(), None)
        if fn is None:
            raise TableError(errno.EOPNOTSUPP, f"{op.name} is not served here")
        return fn(req, fds)  # type: ignore[no-any-return]

    def op_hello(self, req: Any, fds: list[int]) -> tuple[bytes, list[int]]:
        if req.version != ctl.CTL_VERSION:
            raise TableError(errno.EPROTONOSUPPORT, f"control protocol {req.version}, daemon speaks {ctl.CTL_VERSION}")
        self.hello = True
        d = self.device
        c = d.config
        rep = ctl.encode_reply(
            Op.HELLO, ctx_handle=id(self) & 0xFFFFFFFF, udp_port=c.port, link_mtu=c.mtu, **status.device_limits(d),
            async_entries=shm.ASYNC_RING_ENTRIES, node_guid=d.node_guid, gid=d.gid, data=c.name.encode(),
        )
        return rep, [self.ctx_fd, self.doorbell, self.async_fd]

    def op_query_stats(self, req: Any, fds: list[int]) -> tuple[bytes, list[int]]:
        # with the daemon's CPU time so far, all its threads (what `udpverbs
        # perf --cpu_util` turns into a share of one CPU over a run)
        stats = status.counters(self.device, paths=True)
        text = "".join(f"{k} {v}\n" for k, v in sorted(stats.items()))
        return ctl.encode_reply(Op.QUERY_STATS, count=len(stats), data=text.encode()), []

    def op_query_status(self, req: Any, fds: list[int]) -> tuple[bytes, list[int]]:
        """What ``udpverbs devinfo`` and ``stat`` show: one page of a section (``status.py``)."""
        if req.section not in ctl.StatusSection._value2member_map_:
            raise TableError(errno.EINVAL, f"no status section {req.section}")
        nxt, data = status.page(self.device, req.section, req.start, self)
        return ctl.encode_reply(Op.QUERY_STATUS, next=nxt, data=data), []

    def op_alloc_pd(self, req: Any, fds: list[int]) -> tuple[bytes, list[int]]:
        pd = tables.ProtectionDomain(0, self)
        h = pd.handle = self.device.pds.add(pd)
        self.pds.add(h)
        return ctl.encode_reply(Op.ALLOC_PD, pd_handle=h), []

    def op_dealloc_pd(self, req: Any, fds: list[int]) -> tuple[bytes, list[int]]:
        pd = self.device.pds.get(req.pd_handle, self)
        if pd.mrs or pd.qps:
            raise TableError(errno.EBUSY, "PD still has MRs or QPs")
        self.device.pds.pop(pd.handle)
        self.pds.discard(pd.handle)
        return ctl.encode_reply(Op.DEALLOC_PD), []

    def op_reg_mr(self, req: Any, fds: list[int]) -> tuple[bytes, list[int]]:
        d = self.device
        if len(fds) != 1:
            raise TableError(errno.EINVAL, "REG_MR needs exactly one memfd")
        pd = d.pds.get(req.pd_handle, self)
        if req.length > MAX_MR_SIZE:
            raise TableError(errno.EINVAL, "region too large")
        if req.access & ~0x3F:
            raise TableError(errno.EINVAL, f"unsupported access flags {req.access:#x}")
        if req.access & (AccessFlags.IBV_ACCESS_REMOTE_WRITE | AccessFlags.IBV_ACCESS_REMOTE_ATOMIC) and \
                not req.access & AccessFlags.IBV_ACCESS_LOCAL_WRITE:
            # verbs: remote write/atomic require local write (ibv_reg_mr(3)).
            raise TableError(errno.EINVAL, "REMOTE_WRITE needs LOCAL_WRITE")
        self._charge("mr", req.length)
        try:
            mm = shm.map_segment_untrusted(fds[0], shm.page_round(req.length))
        except (OSError, ValueError) as e:
            code = e.errno if isinstance(e, OSError) and e.errno in quota.RESOURCE_ERRNOS else errno.EINVAL
            raise TableError(code, f"cannot map the region: {e}") from None
        mr = tables.MemoryRegion(0, pd, req.access, req.addr, req.length, mm)
        try:
            h = d.mrs.add(mr)
            d.stags.register(mr)
        except TableError:
            mr.close()
            raise
        mr.handle = h
        pd.mrs.add(h)
        self.mrs.add(h)
        self.mr_bytes += req.length
        return ctl.encode_reply(Op.REG_MR, mr_handle=h, lkey=mr.stag, rkey=mr.stag), []

    def op_dereg_mr(self, req: Any, fds: list[int]) -> tuple[bytes, list[int]]:
        mr = self.device.mrs.get(req.mr_handle)
        if mr.pd.session is not self:
            raise TableError(errno.ENOENT, "no such MR")
        self._dereg(mr)
        return ctl.encode_reply(Op.DEREG_MR), []

    def _dereg(self, mr: tables.MemoryRegion) -> None:
        d = self.device
        d.stags.invalidate(mr.stag)
        d.mrs.pop(mr.handle)
        mr.pd.mrs.discard(mr.handle)
        self.mrs.discard(mr.handle)
        self.mr_bytes -= mr.length
        # A WR still gathering from, scattering into, or answering a Read from
        # this region would touch a released mapping: end those QPs first.
        view = mr.view
        for qp in list(d.qps.values()):
            if qp.uses_view(view):
                qp.fatal(f"region {mr.stag:#x} deregistered while in use")
        mr.close()

    def op_create_comp_channel(self, req: Any, fds: list[int]) -> tuple[bytes, list[int]]:
        self._charge("channel")
        ch = CompChannel(0, self)
        ch.handle = self.device.channels.add(ch)
        self.channels.add(ch.handle)
        return ctl.encode_reply(Op.CREATE_COMP_CHANNEL, channel_handle=ch.handle), [ch.eventfd]

    def op_destroy_comp_channel(self, req: Any, fds: list[int]) -> tuple[bytes, list[int]]:
        ch = self.device.channels.get(req.channel_handle, self)
        if ch.cqs:
            raise TableError(errno.EBUSY, "channel still has CQs")
        self.device.channels.pop(ch.handle)
        self.channels.discard(ch.handle)
        ch.close()
        return ctl.encode_reply(Op.DESTROY_COMP_CHANNEL), []

    def op_create_cq(self, req: Any, fds: list[int]) -> tuple[bytes, list[int]]:
        d = self.device
        if not 1 <= req.cqe <= d.config.max_cqe:
            raise TableError(errno.EINVAL, f"cqe must be 1..{d.config.max_cqe}")
        ch = d.channels.get(req.channel_handle, self) if req.channel_handle else None
        self._charge("cq")
        cq = CompletionQueue(0, self, req.cqe, ch)
        try:
            cq.handle = d.cqs.add(cq)
        except TableError:
            cq.close()
            raise
        if ch is not None:
            ch.cqs.add(cq.handle)
        self.cqs.add(cq.handle)
        return (ctl.encode_reply(Op.CREATE_CQ, cq_handle=cq.handle, cqe=cq.entries, entries=cq.entries),
                [cq.fd, cq.eventfd])

    def op_destroy_cq(self, req: Any, fds: list[int]) -> tuple[bytes, list[int]]:
        cq = self.device.cqs.get(req.cq_handle, self)
        if cq.users:
            raise TableError(errno.EBUSY, "CQ still used by QPs")
        self._destroy_cq(cq)
        return ctl.encode_reply(Op.DESTROY_CQ), []

    def _destroy_cq(self, cq: CompletionQueue) -> None:
        self.device.cqs.pop(cq.handle)
        self.cqs.discard(cq.handle)
        if cq.channel is not None:
            cq.channel.cqs.discard(cq.handle)
        cq.close()

    def op_create_qp(self, req: Any, fds: list[int]) -> tuple[bytes, list[int]]:
        d = self.device
        if req.qp_type != QPType.IBV_QPT_RC:
            raise TableError(errno.EOPNOTSUPP, "only IBV_QPT_RC is implemented")
        pd = d.pds.get(req.pd_handle, self)
        scq = d.cqs.get(req.send_cq, self)
        rcq = d.cqs.get(req.recv_cq, self)
        c = d.config
        if not (1 <= req.max_send_wr <= c.max_qp_wr and req.max_recv_wr <= c.max_qp_wr
                and req.max_send_sge <= MAX_SGE and req.max_recv_sge <= MAX_SGE
                and req.max_inline_data <= MAX_INLINE):
            raise TableError(errno.EINVAL, "QP capabilities beyond the device limits")
        caps = {
            "max_send_wr": req.max_send_wr, "max_recv_wr": max(1, req.max_recv_wr),
            "max_send_sge": max(1, req.max_send_sge), "max_recv_sge": max(1, req.max_recv_sge),
            "max_inline_data": req.max_inline_data,
        }
        srq = d.srqs.get(req.srq_handle, self) if req.srq_handle else None
        if srq is not None and srq.pd is not pd:
            raise TableError(errno.EINVAL, "the SRQ belongs to another PD")
        self._charge("qp")
        qpn = d.alloc_qpn()
        qp = QueuePair(d, qpn, self, pd, scq, rcq, caps, bool(req.sq_sig_all), srq)
        if srq is not None:
            srq.users += 1
        d.qps[qpn] = qp
        pd.qps.add(qpn)
        scq.users += 1
        rcq.users += 1
        self.qps.add(qpn)
        lay = qp.layout
        rep = ctl.encode_reply(
            Op.CREATE_QP, qp_num=qpn, max_send_wr=lay.sq_entries, max_recv_wr=lay.rq_entries,
            max_send_sge=caps["max_send_sge"], max_recv_sge=caps["max_recv_sge"],
            max_inline_data=caps["max_inline_data"], sq_entries=lay.sq_entries, rq_entries=lay.rq_entries,
        )
        return rep, [qp.fd]

    def op_modify_qp(self, req: Any, fds: list[int]) -> tuple[bytes, list[int]]:
        qp = self._qp(req.qp_num)
        attrs = {f: getattr(req, f) for f in ctl.QP_ATTR_FIELDS}
        modify_qp(qp, req.attr_mask, attrs)
        return ctl.encode_reply(Op.MODIFY_QP), []

    def op_query_qp(self, req: Any, fds: list[int]) -> tuple[bytes, list[int]]:
        qp = self._qp(req.qp_num)
        a = dict(qp.attrs)
        a["qp_state"] = int(qp.state)
        a["cur_qp_state"] = int(qp.state)
        a["sq_draining"] = 0
        caps = qp.caps
        return ctl.encode_reply(
            Op.QUERY_QP, **a, max_send_wr=qp.layout.sq_entries, max_recv_wr=qp.layout.rq_entries,
            max_send_sge=caps["max_send_sge"], max_recv_sge=caps["max_recv_sge"],
            max_inline_data=caps["max_inline_data"], sq_sig_all=int(qp.sq_sig_all),
        ), []

    def op_destroy_qp(self, req: Any, fds: list[int]) -> tuple[bytes, list[int]]:
        qp = self._qp(req.qp_num)
        self.destroy_qp(qp)
        return ctl.encode_reply(Op.DESTROY_QP), []

    def destroy_qp(self, qp: QueuePair) -> None:
        d = self.device
        if d.cm is not None:
            d.cm.disconnect(qp)  # the peer QP moves to ERR instead of waiting on a dead QPN
            d.cm.qp_destroyed(qp)
        qp.state = S.IBV_QPS_RESET
        d.detach_link(qp)
        d.qps.pop(qp.qpn, None)
        qp.pd.qps.discard(qp.qpn)
        qp.send_cq.users -= 1
        qp.recv_cq.users -= 1
        if qp.srq is not None:
            qp.srq.users -= 1
        qp.session.qps.discard(qp.qpn)
        qp.close()

    def op_create_srq(self, req: Any, fds: list[int]) -> tuple[bytes, list[int]]:
        d = self.device
        pd = d.pds.get(req.pd_handle, self)
        if not (1 <= req.max_wr <= d.config.max_qp_wr and 1 <= req.max_sge <= MAX_SGE):
            raise TableError(errno.EINVAL, f"SRQ needs 1..{d.config.max_qp_wr} WRs and 1..{MAX_SGE} SGEs")
        self._charge("srq")
        srq = SharedReceiveQueue(0, self, pd, req.max_wr, req.max_sge, req.srq_limit)
        try:
            srq.handle = d.srqs.add(srq)
        except TableError:
            srq.close()
            raise
        self.srqs.add(srq.handle)
        return ctl.encode_reply(Op.CREATE_SRQ, srq_handle=srq.handle, max_wr=srq.entries, max_sge=srq.max_sge), \
            [srq.fd]

    def op_modify_srq(self, req: Any, fds: list[int]) -> tuple[bytes, list[int]]:
        srq = self.device.srqs.get(req.srq_handle, self)
        if req.attr_mask & ~int(SrqAttrMask.IBV_SRQ_LIMIT) or req.srq_limit > srq.entries:
            # Resizing is not supported (the app maps the ring at a fixed size).
            raise TableError(errno.EINVAL, "only IBV_SRQ_LIMIT can change, up to the SRQ's size")
        srq.limit = req.srq_limit
        self.device.loop.wake()
        return ctl.encode_reply(Op.MODIFY_SRQ), []

    def op_query_srq(self, req: Any, fds: list[int]) -> tuple[bytes, list[int]]:
        srq = self.device.srqs.get(req.srq_handle, self)
        return ctl.encode_reply(Op.QUERY_SRQ, max_wr=srq.entries, max_sge=srq.max_sge, srq_limit=srq.limit), []

    def op_destroy_srq(self, req: Any, fds: list[int]) -> tuple[bytes, list[int]]:
        srq = self.device.srqs.get(req.srq_handle, self)
        if srq.users:
            raise TableError(errno.EBUSY, "SRQ still used by QPs")
        self._destroy_srq(srq)
        return ctl.encode_reply(Op.DESTROY_SRQ), []

    def _destroy_srq(self, srq: SharedReceiveQueue) -> None:
        self.device.srqs.pop(srq.handle)
        self.srqs.discard(srq.handle)
        srq.close()

    # CM operations live in the connection manager (cm.py); they may block.
    async def handle_async(self, op: Op, req: Any) -> bytes | None:
        if self.device.cm is None:
            return None
        return await self.device.cm.handle(self, op, req)  # type: ignore[no-any-return]

    # -- lifetime -------------------------------------------------------------------
    def teardown(self) -> None:
        """Destroy everything this session owns, children first.  Safe twice."""
        if self.closed:
            return
        self.closed = True
        d = self.device
        d.sessions.discard(self)
        d.sessions_changed()
        d.loop.remove_doorbell(self.doorbell)
        if d.cm is not None:
            d.cm.session_closed(self)
        if d.groups is not None:
            d.groups.session_closed(self)
        for qpn in list(self.qps):
            qp = d.qps.get(qpn)
            if qp is not None:
                self.destroy_qp(qp)
        for h in list(self.srqs):
            srq = d.srqs.find(h)
            if srq is not None:
                self._destroy_srq(srq)
        for h in list(self.cqs):
            cq = d.cqs.find(h)
            if cq is not None:
                self._destroy_cq(cq)
        for h in list(self.channels):
            ch = d.channels.pop(h)
            if ch is not None:
                ch.close()
        for h in list(self.mrs):
            mr = d.mrs.find(h)
            if mr is not None:
                self._dereg(mr)
        for h in list(self.pds):
            d.pds.pop(h)
        self.async_ring.release()
        for fd in (self.ctx_fd, self.doorbell, self.async_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.page = shm.ffi.new("struct uv_ctx_page *")  # keep set_need_wakeup harmless
        shm.ffi.release(self._page_buf)
        try:
            self.ctx_mm.close()
        except BufferError:
            pass


def modify_qp(qp: QueuePair, attr_mask: int, attrs: dict[str, Any]) -> None:
    """Apply a modify_qp (state machine + attributes).  Raises TableError; changes nothing then."""
    d = qp.device
    new = tables.check_transition(qp.state, attr_mask, attrs.get("qp_state", qp.state))
    if attr_mask & M.IBV_QP_CUR_STATE and attrs["cur_qp_state"] != qp.state:
        raise TableError(errno.EINVAL, "cur_qp_state does not match")
    limit = d.config.max_qp_rd_atom
    if attr_mask & M.IBV_QP_MAX_QP_RD_ATOMIC and attrs["max_rd_atomic"] > limit:
        raise TableError(errno.EINVAL, f"max_rd_atomic above {limit}")
    if attr_mask & M.IBV_QP_MAX_DEST_RD_ATOMIC and attrs["max_dest_rd_atomic"] > limit:
        raise TableError(errno.EINVAL, f"max_dest_rd_atomic above {limit}")
    if attr_mask & M.IBV_QP_PORT and attrs["port_num"] != 1:
        raise TableError(errno.EINVAL, "the device has one port")
    addr = None
    if attr_mask & M.IBV_QP_AV:
        # The address vector names the peer daemon: dgid = its IP (IPv4-mapped),
        # dlid = its UDP port (iWARP has no LIDs; query_port().lid is our port).
        try:
            ip = ctl.ip_from_gid(attrs["dgid"])
        except ValueError:
            raise TableError(errno.EINVAL, "bad dgid") from None
        if not 0 < attrs["dlid"] <= 0xFFFF or ip.startswith("::"):
            raise TableError(errno.EINVAL, "ah_attr needs dgid (peer daemon IP) and dlid (its UDP port)")
        addr = (ip, int(attrs["dlid"]))
    if attr_mask & M.IBV_QP_DEST_QPN and not 0 < attrs["dest_qp_num"] < (1 << 24):
        raise TableError(errno.EINVAL, "dest_qp_num out of range")
    # Validated: apply.
    for bit, names in _MASK_FIELDS:
        if attr_mask & bit:
            for n in names:
                qp.attrs[n] = attrs[n]
    if attr_mask & M.IBV_QP_DEST_QPN:
        qp.dest_qpn = int(attrs["dest_qp_num"])
    if addr is not None and new != S.IBV_QPS_ERR and new != S.IBV_QPS_RESET:
        if qp.link is None or qp.link.addr != addr:
            d.detach_link(qp)
            d.attach_link(qp, addr)
    if new != qp.state:
        qp.set_state(new)
    d.qp_changed(qp)
    d.loop.wake()


_MASK_FIELDS = (
    (M.IBV_QP_ACCESS_FLAGS, ("qp_access_flags",)),
    (M.IBV_QP_PKEY_INDEX, ("pkey_index",)),
    (M.IBV_QP_PORT, ("port_num",)),
    (M.IBV_QP_AV, ("dgid", "dlid")),
    (M.IBV_QP_PATH_MTU, ("path_mtu",)),
    (M.IBV_QP_TIMEOUT, ("timeout",)),
    (M.IBV_QP_RETRY_CNT, ("retry_cnt",)),
    (M.IBV_QP_RNR_RETRY, ("rnr_retry",)),
    (M.IBV_QP_RQ_PSN, ("rq_psn",)),
    (M.IBV_QP_SQ_PSN, ("sq_psn",)),
    (M.IBV_QP_MAX_QP_RD_ATOMIC, ("max_rd_atomic",)),
    (M.IBV_QP_MAX_DEST_RD_ATOMIC, ("max_dest_rd_atomic",)),
    (M.IBV_QP_MIN_RNR_TIMER, ("min_rnr_timer",)),
    (M.IBV_QP_DEST_QPN, ("dest_qp_num",)),
)
