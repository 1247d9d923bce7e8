"""An rdma_cm-like connection helper: listen / connect / accept / reject / disconnect.

Theory of operation
-------------------
The passive side listens on a *service port* of its own daemon
(``CMListener(ctx, port)``); the active side calls ``connect(qp,
"host:udp_port", port)`` naming the peer daemon (its address and UDP port,
or its GID as ``udpverbs devinfo`` prints it) and the service port.  The
daemons exchange QPNs, IRD/ORD and up to 512 bytes of private data
(``wire/cm.py``, after MPA, RFC 5044 §7) and each drives its QP to RTS, so
both calls return with a connected QP.  A request nobody listens for
raises ``VerbsError`` with ECONNREFUSED on the active side; one the
application rejects raises ``ConnectionRejected`` (ECONNABORTED,
``.private_data`` holds the reject's).  A failed connect leaves the QP as
it was, so it may connect again.  ``disconnect(qp)`` moves both QPs to ERR,
which flushes them.

CM requests may block (waiting for the peer), so each listener and each
connect uses its own control connection; the verbs of the ``Context`` stay
usable meanwhile.  trio users call the ``*_async`` flavours, which run the
blocking call in a worker thread (control path only; the data path never
blocks).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from typing import Any

from ..wire import ctl
from ..wire.ctl import Op
from ..wire.shm import QPState
from .device import GID, Context, Resource, _close_all, _Control
from .errors import ConnectionRejected, UserError, VerbsError
from .qp import QP

DEFAULT_UDP_PORT = 18515
MAX_PRIVATE_DATA = ctl.MAX_PRIVATE_DATA


def _side_control(ctx: Context, timeout_s: float) -> _Control:
    c = _Control(ctx.socket_path, timeout_s)
    _, fds = c.call(Op.HELLO, version=ctl.CTL_VERSION)
    _close_all(fds)  # the side connection needs none of the context's shared memory
    return c


def _peer(host: str | GID, udp_port: int | None) -> tuple[bytes, int]:
    """The GID and UDP port of the daemon ``host`` names.

    ``host`` is an address or host name, a GID (text as ``devinfo`` prints
    it, or a ``GID``), either followed by ``:PORT`` (``127.0.0.3:18515``,
    ``[0000:...:7f00:0003]:18515``), which gives the UDP port ``udp_port``
    gives otherwise.

    Raises:
        UserError: a malformed ``host`` or port, or two different UDP ports.
    """
    if isinstance(host, GID):
        name, port_text = host.gid, None
    elif host.startswith("["):
        name, sep, rest = host[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise UserError(f"connect: {host!r} is not [ADDRESS]:PORT")
        port_text = rest[1:] if rest else None
    elif host.count(":") == 1:  # host:port; an IPv6 address or a GID has several colons
        name, port_text = host.split(":")
    else:
        name, port_text = host, None
    if port_text is not None:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise UserError(f"connect: {port_text!r} in {host!r} is not a UDP port")
        if udp_port is not None and udp_port != int(port_text):
            raise UserError(f"connect: {host!r} names UDP port {port_text}, udp_port={udp_port} another")
        udp_port = int(port_text)
    try:
        ip = str(ipaddress.ip_address(name))
    except ValueError:
        ip = socket.gethostbyname(name)
    return ctl.gid_from_ip(ip), DEFAULT_UDP_PORT if udp_port is None else udp_port


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


def connect(qp: QP, host: str | GID, port: int, *, udp_port: int | None = None, private_data: bytes = b"",
            ord: int = 0, ird: int = 0, timeout: float = 10.0) -> ConnParam:
    """Connect ``qp`` (RESET or INIT) to the listener on service ``port`` of the daemon ``host`` names.

    ``host`` is the peer daemon's address (or host name) or its GID, as
    ``udpverbs devinfo`` prints them, with its UDP port after a colon
    (``"192.0.2.2:18515"``, ``"[GID]:18515"``) or in ``udp_port``
    (default 18515).  ``ord``/``ird`` 0 mean the device maximum; the result
    is negotiated.  Returns the agreed ``ConnParam``; the QP is in RTS.  A
    failed connect leaves the QP as it was: it may connect again.

    Raises:
        VerbsError: ECONNREFUSED (nobody listens on ``port``, yet, or its
            backlog is full), ETIMEDOUT (no answer), ECONNRESET (the link to
            the peer failed).
        ConnectionRejected: the listening application rejected the request
            (``.private_data`` holds the reject's).
        UserError: a malformed ``host``, or a UDP port in ``host`` that
            ``udp_port`` contradicts.
    """
    qp._check_open()
    gid, udp = _peer(host, udp_port)
    c = _side_control(qp.ctx, timeout + 5)
    try:
        rep, _ = c.call(Op.CM_CONNECT, timeout_s=timeout + 5, qp_num=qp.qp_num, gid=gid, udp_port=udp,
                        port=port, ord=ord, ird=ird, timeout_ms=int(timeout * 1000), data=_pd(private_data))
    except VerbsError as e:
        if e.error_code == errno.ECONNABORTED:
            raise ConnectionRejected(f"connect to service port {port}: rejected by the peer application",
                                     e.error_code, e.private_data) from None
        raise
    finally:
        c.close()
    qp.qp_state = QPState.IBV_QPS_RTS
    return ConnParam(rep.remote_qpn, rep.ord, rep.ird, rep.data)


async def connect_async(qp: QP, host: str, port: int, **kw: Any) -> ConnParam:
    """trio flavour of ``connect``."""
    import trio

    return await trio.to_thread.run_sync(lambda: connect(qp, host, port, **kw))


def disconnect(qp: QP) -> None:
    """Move ``qp`` and its peer to ERR (both flush their queues)."""
    qp._check_open()
    qp.ctx.call(Op.CM_DISCONNECT, qp_num=qp.qp_num)
    qp.qp_state = QPState.IBV_QPS_ERR


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
        qp.qp_state = QPState.IBV_QPS_RTS

    def reject(self, req: ConnRequest, private_data: bytes = b"") -> None:
        """Refuse ``req``; the active side's ``connect`` raises ``ConnectionRejected`` with ``private_data``."""
        self._check_open()
        self._c.call(Op.CM_REJECT, conn_id=req.conn_id, data=_pd(private_data))

    def _release(self) -> None:
        try:
            self._c.call(Op.CM_DESTROY_LISTENER, listener_handle=self.handle)
        except Exception:  # the daemon drops the listener with the connection anyway
            pass
        self._c.close()
