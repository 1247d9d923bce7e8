"""An rdma_cm-like connection helper: listen / connect / accept / reject / disconnect.

Theory of operation
-------------------
The passive side listens on a *service port* of its own daemon
(``CMListener(ctx, port)``); the active side calls ``connect(qp, host,
port, udp_port=...)`` naming the peer daemon (IP and UDP port) and the
service port.  The daemons exchange QPNs, IRD/ORD and up to 512 bytes of
private data (``wire/cm.py``, after MPA, RFC 5044 §7) and each drives its
QP to RTS, so both calls return with a connected QP.  A request nobody
listens for, or one the application rejects, raises ``VerbsError`` with
ECONNREFUSED on the active side (``.private_data`` holds the reject's).
``disconnect(qp)`` moves both QPs to ERR, which flushes them.

CM requests may block (waiting for the peer), so each listener and each
connect uses its own control connection; the verbs of the ``Context`` stay
usable meanwhile.  trio users call the ``*_async`` flavours, which run the
blocking call in a worker thread (control path only; the data path never
blocks).
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

from ..wire import ctl
from ..wire.ctl import Op
from .device import Context, Resource, _close_all, _Control
from .errors import UserError
from .qp import QP

DEFAULT_UDP_PORT = 18515
MAX_PRIVATE_DATA = ctl.MAX_PRIVATE_DATA


def _side_control(ctx: Context, timeout_s: float) -> _Control:
    c = _Control(ctx.socket_path, timeout_s)
    _, fds = c.call(Op.HELLO, version=ctl.CTL_VERSION)
    _close_all(fds)  # the side connection needs none of the context's shared memory
    return c


def _gid_of(host: str) -> bytes:
    try:
        ipaddress.ip_address(host)
        ip = host
    except ValueError:
        ip = socket.gethostbyname(host)
    return ctl.gid_from_ip(ip)


def _pd(data: bytes) -> bytes:
    data = bytes(data)
    if len(data) > MAX_PRIVATE_DATA:
        raise UserError(f"private data is at most {MAX_PRIVATE_DATA} bytes, got {len(data)}")
    return data


class ConnParam:
    """What a connection agreed: ``remote_qpn``, ``ord``, ``ird``, ``private_data``."""

    def __init__(self, remote_qpn: int, ord: int, ird: int, private_data: bytes) -> None:
        self.remote_qpn = remote_qpn
        self.ord = ord
        self.ird = ird
        self.private_data = private_data


class ConnRequest:
    """An incoming connection request (rdma_cm CONNECT_REQUEST event)."""

    def __init__(self, conn_id: int, remote_qpn: int, ord: int, ird: int, host: str, udp_port: int,
                 private_data: bytes) -> None:
        self.conn_id = conn_id
        self.remote_qpn = remote_qpn
        self.ord = ord
        self.ird = ird
        self.host = host
        self.udp_port = udp_port
        self.private_data = private_data

    def __repr__(self) -> str:
        return f"ConnRequest(conn_id={self.conn_id}, from {self.host}:{self.udp_port} qpn {self.remote_qpn})"


def connect(qp: QP, host: str, port: int, *, udp_port: int = DEFAULT_UDP_PORT, private_data: bytes = b"",
            ord: int = 0, ird: int = 0, timeout: float = 10.0) -> ConnParam:
    """Connect ``qp`` (RESET or INIT) to the listener on service ``port`` of the daemon at ``host:udp_port``.

    ``ord``/``ird`` 0 mean the device maximum; the result is negotiated.
    Returns the agreed ``ConnParam``; the QP is in RTS.

    Raises:
        VerbsError: ECONNREFUSED (no listener, or rejected; ``.private_data``),
            ETIMEDOUT (no answer), ECONNRESET (the link to the peer failed).
    """
    qp._check_open()
    c = _side_control(qp.ctx, timeout + 5)
    try:
        rep, _ = c.call(Op.CM_CONNECT, timeout_s=timeout + 5, qp_num=qp.qp_num, gid=_gid_of(host),
                        udp_port=udp_port, port=port, ord=ord, ird=ird, timeout_ms=int(timeout * 1000),
                        data=_pd(private_data))
    finally:
        c.close()
    qp.qp_state = 3  # IBV_QPS_RTS
    return ConnParam(rep.remote_qpn, rep.ord, rep.ird, rep.data)


async def connect_async(qp: QP, host: str, port: int, **kw: Any) -> ConnParam:
    """trio flavour of ``connect``."""
    import trio

    return await trio.to_thread.run_sync(lambda: connect(qp, host, port, **kw))


def disconnect(qp: QP) -> None:
    """Move ``qp`` and its peer to ERR (both flush their queues)."""
    qp._check_open()
    qp.ctx.call(Op.CM_DISCONNECT, qp_num=qp.qp_num)
    qp.qp_state = 6  # IBV_QPS_ERR


class CMListener(Resource):
    """Listen for connection requests on a service ``port`` of the local daemon."""

    def __init__(self, ctx: Context, port: int, backlog: int = 16) -> None:
        super().__init__()
        self.ctx = ctx
        self.port = port
        self._c = _side_control(ctx, ctx.timeout_s)
        try:
            rep, _ = self._c.call(Op.CM_LISTEN, port=port, backlog=backlog)
        except BaseException:
            self._c.close()
            raise
        self.handle = rep.listener_handle
        ctx._adopt(self)

    def get_request(self, timeout: float = 10.0) -> ConnRequest:
        """Wait for the next connection request.

        Raises:
            VerbsError: ETIMEDOUT when none arrives within ``timeout`` seconds.
        """
        self._check_open()
        r, _ = self._c.call(Op.CM_GET_REQUEST, timeout_s=timeout + 5, listener_handle=self.handle,
                            timeout_ms=int(timeout * 1000))
        return ConnRequest(r.conn_id, r.remote_qpn, r.ord, r.ird, ctl.ip_from_gid(r.gid), r.udp_port, r.data)

    async def get_request_async(self, timeout: float = 10.0) -> ConnRequest:
        """trio flavour of ``get_request``."""
        import trio

        return await trio.to_thread.run_sync(lambda: self.get_request(timeout))

    def accept(self, req: ConnRequest, qp: QP, private_data: bytes = b"", ord: int = 0, ird: int = 0) -> None:
        """Accept ``req`` on ``qp`` (RESET or INIT); the QP is in RTS when this returns."""
        self._check_open()
        self._c.call(Op.CM_ACCEPT, conn_id=req.conn_id, qp_num=qp.qp_num, ord=ord, ird=ird,
                     data=_pd(private_data))
        qp.qp_state = 3

    def reject(self, req: ConnRequest, private_data: bytes = b"") -> None:
        """Refuse ``req``; the active side's ``connect`` raises ECONNREFUSED."""
        self._check_open()
        self._c.call(Op.CM_REJECT, conn_id=req.conn_id, data=_pd(private_data))

    def _release(self) -> None:
        try:
            self._c.call(Op.CM_DESTROY_LISTENER, listener_handle=self.handle)
        except Exception:  # the daemon drops the listener with the connection anyway
            pass
        self._c.close()
