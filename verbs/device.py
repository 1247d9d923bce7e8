"""Context, device discovery and the control connection to the local daemon.

Theory of operation
-------------------
``Context(name)`` connects to the daemon serving device ``name`` through its
unix socket (``wire/ctl.py`` names the path), says HELLO and receives the
context page (``need_wakeup`` flag + async-event ring) and two eventfds: the
doorbell it rings after posting when the daemon sleeps, and the async-event
fd.  Every other object (PD, MR, CQ, QP, CompChannel) is created through
the same connection, one synchronous request/reply at a time, like
libibverbs' ioctl path; threads take turns on it (``_Control``'s lock), so
control verbs may be called from several threads.  Posting and polling
take a lock per ring (qp.py, cq.py); ``get_async_event`` is for one thread
at a time.  Objects form a tree (``Resource``): closing a parent
closes its children first, ``close()`` is safe twice, and every object is a
context manager.

Addressing for the manual (perftest-style) path: ``query_gid()`` returns the
daemon's UDP address as an IPv4-mapped IPv6 GID and ``query_port().lid`` is
the daemon's UDP port (iWARP has no LIDs); put both in ``AHAttr(dlid=...,
gr=GlobalRoute(dgid=...))`` when moving a QP to RTR.
"""

from __future__ import annotations

import enum
import errno
import glob
import mmap
import os
import select
import socket
import struct
import threading
import time
from typing import Any, Iterable

from ..wire import ctl, shm
from ..wire.ctl import Op
from ..wire.errors import WireError
from .errors import UserError, VerbsError

DEFAULT_TIMEOUT_S = 10.0
#: the requests that release an object: answered by the library once the daemon is gone
_RELEASES = frozenset({Op.DEALLOC_PD, Op.DEREG_MR, Op.DESTROY_COMP_CHANNEL, Op.DESTROY_CQ, Op.DESTROY_QP,
                       Op.DESTROY_SRQ, Op.CM_DESTROY_LISTENER, Op.GROUP_LEAVE})
#: poll() events that say the daemon's end of the control connection is gone
_HUNG_UP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0x2000)


class _Control:
    """One SOCK_SEQPACKET connection to the daemon (blocking, with timeouts)."""

    def __init__(self, path: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        problem = ctl.private_dir_problem(os.path.dirname(os.path.abspath(path)))
        if problem is not None:
            raise VerbsError(f"refusing the control socket {path}: {problem}; another user could serve it. "
                             "Fix: chmod 700 the directory if it is yours, else remove it", errno.EACCES)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        s.settimeout(timeout_s)
        try:
            s.connect(path)
        except OSError as e:
            s.close()
            raise VerbsError(f"no udpverbs daemon at {path} ({e.strerror}); start one with udpverbsd",
                             errno.ENODEV) from None
        try:
            _check_daemon_uid(s, path)
        except BaseException:
            s.close()
            raise
        self.sock: socket.socket | None = s

    def call(self, op: Op, fds: Iterable[int] = (), timeout_s: float | None = None, **fields: Any) -> tuple[Any, list[int]]:
        """Send one request, wait for its reply.

        Returns ``(reply fields, received fds)``.

        Raises:
            VerbsError: the daemon refused (its errno), or the connection broke.
            TimeoutError: no reply within the timeout.
        """
        try:
            msg = ctl.encode_request(op, **fields)
        except (struct.error, OverflowError) as e:  # a negative length or count, or one too large
            raise UserError(f"{op.name}: an argument is out of range ({e})") from None
        with self._lock:
            s = self.sock
            if s is None:
                raise UserError("the context is closed")
            s.settimeout(self.timeout_s if timeout_s is None else timeout_s)
            try:
                fds = list(fds)
                if fds:
                    socket.send_fds(s, [msg], fds)
                else:
                    s.send(msg)
                data, rfds, _flags, _ = socket.recv_fds(s, ctl.MAX_CTL_MESSAGE, ctl.MAX_FDS)
            except socket.timeout:
                # A late reply would answer the next request: this connection is done.
                s.close()
                self.sock = None
                raise TimeoutError(f"daemon did not answer {op.name} in time") from None
            except OSError as e:
                raise VerbsError(f"{op.name}: control connection failed: {e}", e.errno or errno.EIO) from None
        if not data:
            raise VerbsError(f"{op.name}: the daemon closed the connection", errno.ECONNRESET)
        try:
            status, body = ctl.decode_reply(data, op)
        except WireError as e:
            _close_all(rfds)
            raise VerbsError(f"{op.name}: bad reply from the daemon: {e}", errno.EPROTO) from None
        if status:
            _close_all(rfds)
            text, private = body
            raise VerbsError(f"{op.name} failed: {text}", status, private)
        return body, rfds

    def close(self) -> None:
        with self._lock:
            if self.sock is not None:
                self.sock.close()
                self.sock = None


def _check_daemon_uid(s: socket.socket, path: str) -> None:
    """Trust only a daemon of our own uid (or root), before anything is sent.

    The uid is the boundary, as between a user's own processes: a region
    registered with another user's "daemon" would hand it the memory.

    Raises:
        VerbsError: EACCES naming the uid that serves ``path``.
    """
    raw = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", raw)
    if uid not in (os.getuid(), 0):
        raise VerbsError(f"refusing the control socket {path}: it is served by uid {uid} (pid {pid}), "
                         f"not by our uid {os.getuid()} or root", errno.EACCES)


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class Resource:
    """Base of every verbs object: context manager, children closed first, close() idempotent."""

    def __init__(self) -> None:
        self._children: list[Resource] = []
        self._closed = False
        self._parent: Resource | None = None

    def _adopt(self, child: "Resource") -> None:
        child._parent = self
        self._children.append(child)

    def close(self) -> None:
        """Release the object and, first, every object created from it.  Safe twice."""
        if self._closed:
            return
        for child in reversed(list(self._children)):
            child.close()
        self._children.clear()
        self._closed = True
        try:
            self._release()
        finally:
            if self._parent is not None and self in self._parent._children:
                self._parent._children.remove(self)

    def _release(self) -> None:  # overridden
        pass

    def _check_open(self) -> None:
        if self._closed:
            raise UserError(f"{type(self).__name__} is closed")

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class GID:
    """A 16-byte GID; ``gid`` is its text form (``str(GID)`` too), ``raw`` its bytes."""

    def __init__(self, val: str | bytes | None = None) -> None:
        if val is None:
            self.raw = bytes(16)
        elif isinstance(val, (bytes, bytearray)):
            if len(val) != 16:
                raise UserError("a GID is 16 bytes")
            self.raw = bytes(val)
        else:
            import ipaddress

            text = val.replace(":", "")
            self.raw = bytes.fromhex(text) if len(text) == 32 else ipaddress.IPv6Address(val).packed

    @property
    def gid(self) -> str:
        h = self.raw.hex()
        return ":".join(h[i:i + 4] for i in range(0, 32, 4))

    @property
    def ip(self) -> str:
        """The daemon IP address this GID names."""
        return ctl.ip_from_gid(self.raw)

    def __str__(self) -> str:
        return self.gid

    def __repr__(self) -> str:
        return f"GID({self.gid!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GID) and other.raw == self.raw

    def __hash__(self) -> int:
        return hash(self.raw)


class _Attrs:
    """A plain attribute bag with a readable repr (DeviceAttr, PortAttr, ...)."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v.name if isinstance(v, enum.Enum) and v.name else repr(v)}"
                         for k, v in self.__dict__.items())
        return f"{type(self).__name__}({body})"


class DeviceAttr(_Attrs):
    pass


class PortAttr(_Attrs):
    pass


class AsyncEvent(_Attrs):
    """``event_type`` (an ``EventType`` member: IBV_EVENT_*) and ``element`` (QPN or CQ handle)."""


_EVENT_TYPES = {int(m): m for m in shm.EventType}


class Device(_Attrs):
    """An entry of ``get_device_list()``: ``name`` and the control socket ``path``."""


def get_device_list() -> list[Device]:
    """Devices whose daemons serve a control socket in the runtime directory."""
    out = []
    for path in sorted(glob.glob(os.path.join(ctl.runtime_dir(), "*.sock"))):
        name = os.path.basename(path)[: -len(".sock")]
        out.append(Device(name=name.encode(), path=path))
    return out


_MTU_ENUM = ((4096, 5), (2048, 4), (1024, 3), (512, 2), (256, 1))


class Context(Resource):
    """An open device: the connection to the local daemon (``ibv_context``).

    Args:
        name: device name (default ``$UDPVERBS_DEVICE`` or ``uv0``), or the
            path of its daemon's control socket (any name with a ``/``:
            ``./uvA.sock``, ``/tmp/d/uvA.sock``).
        socket_path: connect here instead of the runtime directory's socket.
        timeout_s: how long a control request may take.

    Raises:
        VerbsError: ENODEV when no daemon serves the device; EACCES when the
            socket's directory is not ours and 0700, or another uid (not
            root) serves the socket.
    """

    def __init__(self, name: str | bytes | None = None, *, socket_path: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__()
        if isinstance(name, bytes):
            name = name.decode()
        device = name or os.environ.get("UDPVERBS_DEVICE") or "uv0"
        self.name = ctl.device_name(device)
        self.socket_path = socket_path or ctl.socket_path(device)
        self.timeout_s = timeout_s
        self._ctl = _Control(self.socket_path, timeout_s)
        try:
            rep, fds = self._ctl.call(Op.HELLO, version=ctl.CTL_VERSION)
        except BaseException:
            self._ctl.close()
            raise
        if len(fds) != 3:
            _close_all(fds)
            self._ctl.close()
            raise VerbsError("HELLO reply without its file descriptors", errno.EPROTO)
        ctx_fd, self.doorbell_fd, self.async_fd = fds
        try:
            self._mm = mmap.mmap(ctx_fd, shm.CtxLayout.size)
        finally:
            os.close(ctx_fd)
        self._page_buf = shm.ffi.from_buffer(self._mm)
        self._page = shm.ffi.cast("struct uv_ctx_page *", self._page_buf)
        self._async = shm.Ring(self._mm, shm.CtxLayout.async_offset, "struct uv_async_event", rep.async_entries)
        self._hello = rep
        self.device_name = rep.data.decode(errors="replace")
        #: the daemon is gone (it exited or was killed): posts raise, waits end
        self._dead = False
        self._fatal_pending = False  # an IBV_EVENT_DEVICE_FATAL the library owes get_async_event

    # -- queries -----------------------------------------------------------------
    def query_device(self) -> DeviceAttr:
        """Device limits (``ibv_query_device``)."""
        r = self._hello
        return DeviceAttr(
            fw_ver="udpverbs-0.1", node_guid=r.node_guid, sys_image_guid=r.node_guid, max_mr_size=r.max_mr_size,
            page_size_cap=mmap.PAGESIZE, vendor_id=0, vendor_part_id=0, hw_ver=0, max_qp=r.max_qp,
            max_qp_wr=r.max_qp_wr, device_cap_flags=0, max_sge=r.max_sge, max_sge_rd=r.max_sge, max_cq=r.max_cq,
            max_cqe=r.max_cqe, max_mr=r.max_mr, max_pd=r.max_pd, max_qp_rd_atom=r.max_qp_rd_atom,
            max_qp_init_rd_atom=r.max_qp_init_rd_atom, max_res_rd_atom=r.max_qp * r.max_qp_rd_atom,
            atomic_cap=int(shm.AtomicCap.IBV_ATOMIC_HCA), max_inline_data=r.max_inline_data, phys_port_cnt=1,
        )

    def query_stats(self) -> dict[str, int]:
        """The daemon's counters, as ``rdma statistic show`` gives a real RNIC's.

        Among them: ``rnr_nack_sent`` / ``rnr_nack_received`` and
        ``rnr_resume_sent`` / ``rnr_resume_received`` (Modified ACK/NACK),
        ``rnr_retry_exceeded``, ``terminate_sent``, ``atomic_replayed``,
        ``rx_*`` (garbage from the network), ``link_*`` (the links), and
        ``process_cpu_user_ms`` / ``process_cpu_system_ms`` (the CPU time the
        daemon's process has used so far).
        """
        self._check_open()
        r, _ = self.call(Op.QUERY_STATS)
        out: dict[str, int] = {}
        for line in r.data.decode("ascii", "replace").splitlines():
            name, _, value = line.partition(" ")
            if value.isdigit():
                out[name] = int(value)
        return out

    def query_port(self, port_num: int = 1) -> PortAttr:
        """Port attributes; ``lid`` is the daemon's UDP port (see the module docstring)."""
        self._check_open()
        if port_num != 1:
            raise VerbsError(f"port {port_num} does not exist", errno.EINVAL)
        payload = self._hello.link_mtu
        mtu = next((e for size, e in _MTU_ENUM if size <= payload), 1)
        return PortAttr(state=4, max_mtu=mtu, active_mtu=mtu, gid_tbl_len=1, port_cap_flags=0,
                        max_msg_sz=shm.MAX_MSG_SZ, lid=self._hello.udp_port, sm_lid=0, lmc=0,
                        link_layer=2, active_width=1, active_speed=1, phys_state=5,
                        udp_payload=payload)

    def query_gid(self, port_num: int = 1, index: int = 0) -> GID:
        """The daemon's GID: its UDP IP address, IPv4-mapped."""
        self._check_open()
        if port_num != 1 or index != 0:
            raise VerbsError("only port 1, GID index 0 exist", errno.EINVAL)
        return GID(self._hello.gid)

    @property
    def udp_port(self) -> int:
        """The daemon's UDP port (the ``dlid`` peers put in their AHAttr)."""
        return int(self._hello.udp_port)

    # -- async events ------------------------------------------------------------
    def _pop_async(self) -> AsyncEvent | None:
        r = self._async
        if r.available():
            e = r.peek()
            kind = int(e.event_type)
            ev = AsyncEvent(event_type=_EVENT_TYPES.get(kind, kind), element=int(e.element))
            r.pop()
            return ev
        if self._fatal_pending:
            self._fatal_pending = False
            return AsyncEvent(event_type=shm.EventType.IBV_EVENT_DEVICE_FATAL, element=0)
        return None

    # -- the daemon's death --------------------------------------------------------
    def daemon_gone(self) -> bool:
        """Whether the daemon is gone: it exited or was killed, so nothing
        posted will complete.  One ``poll()`` on the control connection,
        which the kernel hangs up when the daemon's process ends.  The first
        time it finds the daemon gone it marks the device dead: posts raise
        ``VerbsError(ENODEV)`` from then on, and ``get_async_event`` returns
        IBV_EVENT_DEVICE_FATAL (unless the daemon sent it before it exited)."""
        if self._dead:
            return True
        sock = self._ctl.sock
        if sock is None or self._closed:
            return False
        p = select.poll()
        p.register(sock.fileno(), _HUNG_UP)
        if p.poll(0):
            self._mark_dead()
        return self._dead

    def _mark_dead(self) -> None:
        if self._dead:
            return
        self._dead = True
        if not self._page.device_fatal:  # a daemon that shut down in order queued the event itself
            self._fatal_pending = True
        try:
            os.eventfd_write(self.async_fd, 1)  # wake whoever waits for an async event
        except OSError:
            pass

    def _check_alive(self, what: str) -> None:
        """Raise ``VerbsError(ENODEV)`` for ``what`` if the daemon is gone (see :meth:`daemon_gone`)."""
        if self.daemon_gone():
            raise VerbsError(f"{what}: the device is gone (IBV_EVENT_DEVICE_FATAL): its daemon exited",
                             errno.ENODEV)

    def get_async_event(self, timeout: float | None = DEFAULT_TIMEOUT_S) -> AsyncEvent:
        """Wait for the next async event (QP fatal, CQ error, ...).

        Raises:
            TimeoutError: none within ``timeout`` seconds.
        """
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ev = self._pop_async()
            if ev is not None:
                return ev
            left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError("no async event")
            p = select.poll()
            p.register(self.async_fd, select.POLLIN)
            sock = None if self._dead else self._ctl.sock
            if sock is not None:
                p.register(sock.fileno(), _HUNG_UP)  # the daemon's death wakes us too
            for fd, events in p.poll(left * 1000):
                if fd == self.async_fd:
                    _drain_eventfd(self.async_fd)
                elif events & _HUNG_UP:
                    self._mark_dead()

    async def get_async_event_async(self, timeout: float | None = None) -> AsyncEvent:
        """trio flavour of ``get_async_event``."""
        import trio

        self._check_open()
        with trio.fail_after(timeout if timeout is not None else float("inf")):
            while True:
                ev = self._pop_async()
                if ev is not None:
                    return ev
                with trio.move_on_after(0.05):  # then look whether the daemon is still there
                    await trio.lowlevel.wait_readable(self.async_fd)
                    _drain_eventfd(self.async_fd)
                self.daemon_gone()

    @property
    def device_fatal(self) -> bool:
        """True once the daemon announced it is going away, or the library
        found it gone (IBV_EVENT_DEVICE_FATAL)."""
        return self._dead or bool(self._page.device_fatal)

    # -- used by QPs after posting ---------------------------------------------------
    def ring_doorbell(self, fenced: bool = False) -> None:
        """Wake the daemon if it sleeps (it set need_wakeup); ``fenced``: the caller fenced its stores already."""
        if not fenced:
            shm.full_fence()  # the producer index store must be visible before we read the flag
        if self._page.need_wakeup:
            os.eventfd_write(self.doorbell_fd, 1)

    def call(self, op: Op, fds: Iterable[int] = (), **fields: Any) -> tuple[Any, list[int]]:
        self._check_open()
        if self._dead:
            if op in _RELEASES:
                return None, []  # what the daemon held went with it: closing an object just works
            self._check_alive(op.name)
        try:
            return self._ctl.call(op, fds, **fields)
        except VerbsError as e:
            if e.error_code in (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN):
                self._mark_dead()  # the daemon hung up: it is gone
            raise

    def _release(self) -> None:
        self._ctl.close()
        self._async.release()
        shm.ffi.release(self._page_buf)
        self._page = shm.ffi.new("struct uv_ctx_page *")
        try:
            self._mm.close()
        except BufferError:
            pass
        _close_all((self.doorbell_fd, self.async_fd))


def _drain_eventfd(fd: int) -> None:
    try:
        os.set_blocking(fd, False)
        os.eventfd_read(fd)
    except (BlockingIOError, OSError):
        pass
