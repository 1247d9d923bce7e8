"""The connection manager: rdma_cm-like connect / listen / accept between daemons.

Theory of operation
-------------------
iWARP connects a QP with MPA Request/Reply on a fresh TCP stream (RFC 5044
§7); our daemons exchange the same facts (QPNs, IRD/ORD, private data) as
``wire/cm.py`` messages on the link between them (``Kind.CM``, QPN 0):

    active app        active daemon           passive daemon        passive app
    CM_CONNECT  ──►   CONNECT_REQUEST  ──────►  listener queue  ◄── CM_GET_REQUEST
                                                                ◄── CM_ACCEPT(qp)
                      QP -> RTR -> RTS  ◄────── ACCEPT, QP -> RTR -> RTS
    reply (RTS) ◄──

A request for a service port nobody listens on, or one the application
rejects, comes back as REJECT; the active side's CM_CONNECT fails with
ECONNREFUSED for the first (as TCP's connect to a closed port) and
ECONNABORTED for the second, carrying the peer's private data.  Neither
touches the QP, which may connect again.  IRD/ORD are negotiated as
MPA v2 does (RFC 6581 §5): each side's ORD is capped by the other's IRD.
Disconnect moves both QPs to ERR, which flushes them.

The blocking requests (CM_CONNECT, CM_GET_REQUEST) await trio events set by
the data path when the peer answers, under the caller's timeout.
"""

from __future__ import annotations

import errno
import logging
from typing import TYPE_CHECKING, Any

import trio

from ..wire import cm as wcm
from ..wire import ctl, envelope, shm
from ..wire.ctl import Op
from ..wire.envelope import Kind
from ..wire.errors import WireError
from ..wire.shm import AccessFlags as A, QPAttrMask as M, QPState as S
from .tables import TableError

if TYPE_CHECKING:
    from .device import Device
    from .peer import PeerLink
    from .qp import QueuePair

log = logging.getLogger("udpverbs.daemon")

MAX_LISTENERS = 1024
_DEFAULT_ACCESS = A.IBV_ACCESS_LOCAL_WRITE | A.IBV_ACCESS_REMOTE_WRITE | A.IBV_ACCESS_REMOTE_READ


class CmError(TableError):
    """A CM refusal that may carry the peer's private data back."""

    def __init__(self, errno_: int, text: str, private_data: bytes = b"") -> None:
        super().__init__(errno_, text)
        self.private_data = private_data


class Listener:
    def __init__(self, handle: int, session: Any, port: int, backlog: int) -> None:
        self.handle = handle
        self.session = session
        self.port = port
        self.send, self.recv = trio.open_memory_channel[int](max(1, backlog))


class Incoming:
    """A CONNECT_REQUEST waiting for the listening application's decision."""

    def __init__(self, conn_id: int, pl: "PeerLink", req: wcm.ConnectRequest, listener: Listener) -> None:
        self.conn_id = conn_id
        self.pl = pl
        self.req = req
        self.listener = listener


class Outgoing:
    """A CONNECT_REQUEST we sent, waiting for ACCEPT or REJECT."""

    def __init__(self, qp: "QueuePair", pl: "PeerLink") -> None:
        self.qp = qp
        self.pl = pl
        self.done = trio.Event()
        self.answer: wcm.Accept | wcm.Reject | None = None
        self.failure = ""
        self.ord = 1
        self.ird = 1


class ConnectionManager:
    def __init__(self, device: "Device") -> None:
        self.device = device
        device.cm = self
        self.listeners: dict[int, Listener] = {}  # service port -> listener
        self.by_handle: dict[int, Listener] = {}
        self.incoming: dict[int, Incoming] = {}
        self.outgoing: dict[tuple[tuple[str, int], int], Outgoing] = {}
        self._next = 1

    def _id(self) -> int:
        self._next = (self._next % 0xFFFFFFFF) + 1
        return self._next

    def _send(self, pl: "PeerLink", msg: wcm.CmMessage) -> None:
        if pl.up:
            pl.send(envelope.encode(Kind.CM, envelope.CM_QPN, envelope.CM_QPN, wcm.encode(msg)))
            self.device.loop.wake()

    # -- from the network (called by the data path) ---------------------------------
    def on_message(self, pl: "PeerLink", body: memoryview) -> None:
        try:
            msg = wcm.decode_untrusted(body)
        except WireError as e:
            self.device.stats["cm_" + e.reason] += 1
            return
        if isinstance(msg, wcm.ConnectRequest):
            lst = self.listeners.get(msg.service_port)
            if lst is None:
                self._send(pl, wcm.Reject(msg.request_id, wcm.RejectReason.NO_LISTENER))
                return
            conn_id = self._id()
            inc = Incoming(conn_id, pl, msg, lst)
            try:
                lst.send.send_nowait(conn_id)
            except trio.WouldBlock:
                self._send(pl, wcm.Reject(msg.request_id, wcm.RejectReason.NO_RESOURCES))
                return
            self.incoming[conn_id] = inc
        elif isinstance(msg, (wcm.Accept, wcm.Reject)):
            out = self.outgoing.pop((pl.addr, msg.request_id), None)
            if out is None or out.pl is not pl:
                self.device.stats["cm_unmatched"] += 1
                return
            if isinstance(msg, wcm.Accept):
                # Move the QP to RTS here, in the data path, before the peer's
                # first segments (right behind the ACCEPT on the link) arrive.
                out.ord = min(out.ord, max(1, msg.ird))
                try:
                    self._to_rts(out.qp, pl, msg.qpn, out.ord, out.ird)
                except TableError as e:
                    out.failure = str(e)
                    out.done.set()
                    return
            out.answer = msg
            out.done.set()
        elif isinstance(msg, wcm.Disconnect):
            for qp in list(pl.qps):
                if qp.dest_qpn == msg.qpn and qp.state != S.IBV_QPS_ERR:
                    qp.fatal("peer disconnected")

    def on_link_failed(self, pl: "PeerLink") -> None:
        for key, out in list(self.outgoing.items()):
            if out.pl is pl:
                del self.outgoing[key]
                out.failure = pl.failed_reason or "link failed"
                out.done.set()

    # -- bookkeeping ------------------------------------------------------------------
    def qp_destroyed(self, qp: "QueuePair") -> None:
        for key, out in list(self.outgoing.items()):
            if out.qp is qp:
                del self.outgoing[key]
                out.failure = "QP destroyed"
                out.done.set()

    def disconnect(self, qp: "QueuePair") -> None:
        """Tell the peer QP (if connected) that this one is going away."""
        if qp.link is not None and qp.dest_qpn and qp.state in (S.IBV_QPS_RTR, S.IBV_QPS_RTS, S.IBV_QPS_SQD):
            self._send(qp.link, wcm.Disconnect(0, qp.qpn))

    def session_closed(self, sess: Any) -> None:
        for h in list(sess.listeners):
            self._drop_listener(h)

    def _drop_listener(self, handle: int) -> None:
        lst = self.by_handle.pop(handle, None)
        if lst is None:
            return
        lst.session.listeners.discard(handle)
        if self.listeners.get(lst.port) is lst:
            del self.listeners[lst.port]
        lst.send.close()
        for cid, inc in list(self.incoming.items()):
            if inc.listener is lst:
                del self.incoming[cid]
                self._send(inc.pl, wcm.Reject(inc.req.request_id, wcm.RejectReason.NO_LISTENER))

    # -- from applications ----------------------------------------------------------------
    async def handle(self, sess: Any, op: Op, req: Any) -> bytes:
        """Serve one CM control request; raises TableError/CmError to refuse."""
        if op == Op.CM_LISTEN:
            if req.port in self.listeners:
                raise TableError(errno.EADDRINUSE, f"service port {req.port} already has a listener")
            if len(self.by_handle) >= MAX_LISTENERS:
                raise TableError(errno.ENOMEM, "too many listeners")
            lst = Listener(self._id(), sess, req.port, min(max(1, req.backlog), 1024))
            self.listeners[req.port] = lst
            self.by_handle[lst.handle] = lst
            sess.listeners.add(lst.handle)
            return ctl.encode_reply(Op.CM_LISTEN, listener_handle=lst.handle)
        if op == Op.CM_DESTROY_LISTENER:
            self._owned_listener(sess, req.listener_handle)
            self._drop_listener(req.listener_handle)
            return ctl.encode_reply(Op.CM_DESTROY_LISTENER)
        if op == Op.CM_GET_REQUEST:
            return await self._get_request(sess, req)
        if op == Op.CM_ACCEPT:
            return self._accept(sess, req)
        if op == Op.CM_REJECT:
            inc = self._owned_incoming(sess, req.conn_id)
            del self.incoming[inc.conn_id]
            self._check_pd(req.data)
            self._send(inc.pl, wcm.Reject(inc.req.request_id, wcm.RejectReason.REFUSED_BY_APP, req.data))
            return ctl.encode_reply(Op.CM_REJECT)
        if op == Op.CM_CONNECT:
            return await self._connect(sess, req)
        if op == Op.CM_DISCONNECT:
            qp = sess._qp(req.qp_num)
            self.disconnect(qp)
            if qp.state != S.IBV_QPS_ERR:
                qp.set_state(S.IBV_QPS_ERR)
            self.device.loop.wake()
            return ctl.encode_reply(Op.CM_DISCONNECT)
        raise TableError(errno.EOPNOTSUPP, op.name)

    def _owned_listener(self, sess: Any, handle: int) -> Listener:
        lst = self.by_handle.get(handle)
        if lst is None or lst.session.pid != sess.pid:
            raise TableError(errno.ENOENT, "no such listener")
        return lst

    def _owned_incoming(self, sess: Any, conn_id: int) -> Incoming:
        inc = self.incoming.get(conn_id)
        if inc is None or inc.listener.session.pid != sess.pid:
            raise TableError(errno.ENOENT, "no such connection request")
        return inc

    @staticmethod
    def _check_pd(data: bytes) -> None:
        if len(data) > wcm.MAX_PRIVATE_DATA:
            raise TableError(errno.EINVAL, f"private data is at most {wcm.MAX_PRIVATE_DATA} bytes")

    async def _get_request(self, sess: Any, req: Any) -> bytes:
        lst = self._owned_listener(sess, req.listener_handle)
        self.device.stats["cm_get_request_waits"] += 1
        while True:
            with trio.move_on_after(req.timeout_ms / 1000):
                try:
                    conn_id = await lst.recv.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    raise TableError(errno.EBADF, "listener destroyed") from None
                inc = self.incoming.get(conn_id)
                if inc is None:
                    continue
                r = inc.req
                ip, port = inc.pl.addr
                return ctl.encode_reply(Op.CM_GET_REQUEST, conn_id=conn_id, remote_qpn=r.qpn, ord=r.ord,
                                        ird=r.ird, gid=ctl.gid_from_ip(ip), udp_port=port, data=r.private_data)
            raise TableError(errno.ETIMEDOUT, "no connection request before the timeout")

    def _to_rts(self, qp: "QueuePair", pl: "PeerLink", dest_qpn: int, ord_: int, ird: int) -> None:
        """Drive ``qp`` (RESET or INIT) to RTS towards ``dest_qpn`` behind ``pl``."""
        from .control import modify_qp  # control imports this module's users; avoid a cycle

        ip, port = pl.addr
        attrs = dict(qp.attrs)
        if qp.state == S.IBV_QPS_RESET:
            attrs.update(qp_state=S.IBV_QPS_INIT, qp_access_flags=_DEFAULT_ACCESS, pkey_index=0, port_num=1)
            modify_qp(qp, M.IBV_QP_STATE | M.IBV_QP_ACCESS_FLAGS | M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT, attrs)
        if qp.state != S.IBV_QPS_INIT:
            raise TableError(errno.EINVAL, f"QP {qp.qpn} must be in RESET or INIT to connect")
        attrs.update(qp_state=S.IBV_QPS_RTR, dgid=ctl.gid_from_ip(ip), dlid=port, dest_qp_num=dest_qpn,
                     max_dest_rd_atomic=ird, path_mtu=5, rq_psn=0, min_rnr_timer=12)
        modify_qp(qp, M.IBV_QP_STATE | M.IBV_QP_AV | M.IBV_QP_PATH_MTU | M.IBV_QP_DEST_QPN | M.IBV_QP_RQ_PSN
                  | M.IBV_QP_MAX_DEST_RD_ATOMIC | M.IBV_QP_MIN_RNR_TIMER, attrs)
        attrs.update(qp_state=S.IBV_QPS_RTS, sq_psn=0, timeout=14, retry_cnt=7, rnr_retry=7, max_rd_atomic=ord_)
        modify_qp(qp, M.IBV_QP_STATE | M.IBV_QP_SQ_PSN | M.IBV_QP_TIMEOUT | M.IBV_QP_RETRY_CNT
                  | M.IBV_QP_RNR_RETRY | M.IBV_QP_MAX_QP_RD_ATOMIC, attrs)

    def _limits(self, ord_: int, ird: int) -> tuple[int, int]:
        cap = self.device.config.max_qp_rd_atom
        return max(1, min(ord_ or cap, cap)), max(1, min(ird or cap, cap))

    def _accept(self, sess: Any, req: Any) -> bytes:
        inc = self._owned_incoming(sess, req.conn_id)
        self._check_pd(req.data)
        qp = sess._qp(req.qp_num)
        my_ord, my_ird = self._limits(req.ord, req.ird)
        # RFC 6581 §5: our ORD may not exceed the peer's IRD (and the reverse).
        ord_ = min(my_ord, max(1, inc.req.ird))
        ird = my_ird
        if not inc.pl.up:
            del self.incoming[inc.conn_id]
            raise TableError(errno.ECONNRESET, "the link to the requester failed")
        self._to_rts(qp, inc.pl, inc.req.qpn, ord_, ird)
        del self.incoming[inc.conn_id]
        self._send(inc.pl, wcm.Accept(inc.req.request_id, qp.qpn, ird, ord_, shm.MAX_MSG_SZ, req.data))
        return ctl.encode_reply(Op.CM_ACCEPT)

    async def _connect(self, sess: Any, req: Any) -> bytes:
        self._check_pd(req.data)
        qp = sess._qp(req.qp_num)
        if qp.state not in (S.IBV_QPS_RESET, S.IBV_QPS_INIT):
            raise TableError(errno.EINVAL, f"QP {qp.qpn} must be in RESET or INIT to connect")
        try:
            ip = ctl.ip_from_gid(req.gid)
        except ValueError:
            raise TableError(errno.EINVAL, "bad GID") from None
        ord_, ird = self._limits(req.ord, req.ird)
        pl = self.device.get_link((ip, req.udp_port))
        out = Outgoing(qp, pl)
        out.ord, out.ird = ord_, ird
        request_id = self._id()
        self.outgoing[(pl.addr, request_id)] = out
        self._send(pl, wcm.ConnectRequest(request_id, req.port, qp.qpn, ird, ord_, shm.MAX_MSG_SZ, req.data))
        with trio.move_on_after(max(1, req.timeout_ms) / 1000):
            await out.done.wait()
        self.outgoing.pop((pl.addr, request_id), None)
        ans = out.answer
        if out.failure:
            raise TableError(errno.ECONNRESET, f"connect failed: {out.failure}")
        if ans is None:
            raise TableError(errno.ETIMEDOUT, f"no answer from {ip}:{req.udp_port} before the timeout")
        if isinstance(ans, wcm.Reject):
            if ans.reason == wcm.RejectReason.REFUSED_BY_APP:
                # Its own errno: the application said no, where ECONNREFUSED means nobody listens (yet).
                raise CmError(errno.ECONNABORTED, "connection rejected by the peer application", ans.private_data)
            why = {wcm.RejectReason.NO_LISTENER: f"nobody listens on service port {req.port}",
                   wcm.RejectReason.NO_RESOURCES: "the peer has no resources",
                   }.get(ans.reason, "rejected")
            raise CmError(errno.ECONNREFUSED, f"connection refused: {why}", ans.private_data)
        return ctl.encode_reply(Op.CM_CONNECT, remote_qpn=ans.qpn, ord=out.ord, ird=ird, data=ans.private_data)
