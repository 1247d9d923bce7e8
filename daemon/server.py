"""The control server: the unix socket, its accept loop and one task per session.

Theory of operation
-------------------
``serve_control`` binds the SOCK_SEQPACKET socket (mode 0600, in the per-user
runtime directory), calls ``task_status.started()`` once it accepts
connections, and runs one session task per client (``control.Session``
serves its requests).  Only a process of our uid gets a session (SO_PEERCRED).
Running out of file descriptors or memory while accepting or setting a
session up is an error to that client, never the daemon's exit.  A rank's
group connection is handed to the data loop once it has joined
(``groups.py``).
"""

from __future__ import annotations

import array
import errno
import logging
import os
import socket
import struct
from typing import Any, Awaitable, Callable

import trio

from ..wire import ctl
from ..wire.ctl import Op
from ..wire.errors import WireError
from . import quota
from .control import Session
from .device import Device
from .tables import TableError

log = logging.getLogger("udpverbs.daemon")


def _peer_pid(conn: trio.socket.SocketType) -> int:
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", raw)
    except OSError:
        return -1
    return pid if uid == os.getuid() else -1


async def _session_task(device: Device, conn: trio.socket.SocketType) -> None:
    pid = _peer_pid(conn)
    if pid < 0:
        conn.close()
        return
    try:
        quota.check(device.config.quota, [s for s in device.sessions if s.pid == pid], "context")
        sess = Session(device, conn, pid)
    except (TableError, OSError) as e:
        # Refused to this client alone: the answer to the HELLO it sends first.
        code = e.errno if isinstance(e, TableError) or e.errno in quota.RESOURCE_ERRNOS else errno.EIO
        log.warning("refusing a context to pid %d: %s", pid, e)
        await _refuse(conn, code, f"cannot open a context: {e}")
        return
    device.sessions.add(sess)
    device.sessions_changed()
    device.loop.add_doorbell(sess.doorbell)
    device.loop.watch(conn.fileno())
    log.info("client pid %d (%s) connected", pid, _command_of(pid))
    try:
        while True:
            data, anc, flags, _ = await conn.recvmsg(ctl.MAX_CTL_MESSAGE, socket.CMSG_SPACE(ctl.MAX_FDS * 4))
            fds = _fds_from(anc)
            if not data:
                for fd in fds:
                    os.close(fd)
                break
            reply, out_fds = await _serve_one(sess, data, fds, flags)
            for fd in fds:  # the handlers keep what they need (mmap holds its own ref)
                os.close(fd)
            if reply is not None:
                anc_out = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", out_fds))] if out_fds else []
                await conn.sendmsg([reply], anc_out)
            if sess.group_member is not None and device.groups is not None:
                await device.groups.adopt(sess)  # a rank's connection: the data loop reads it now
                break
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
        log.info("session pid %d ended: %s", pid, e)
    except Exception:
        log.exception("session pid %d failed; tearing it down", pid)
    finally:
        device.loop.unwatch(conn.fileno())  # before the close: the fd number may be reused
        conn.close()
        if sess.group_member is None:  # (a rank's connection lives on in the data loop)
            left = ", ".join(f"{n} {what}" for n, what in ((len(sess.qps), "QPs"), (len(sess.cqs), "CQs"),
                                                          (len(sess.mrs), "MRs")) if n)
            log.info("client pid %d disconnected%s", pid, f"; destroying what it left: {left}" if left else "")
        sess.teardown()
        device.loop.wake()


async def _serve_one(sess: Session, data: bytes, fds: list[int], flags: int) -> tuple[bytes | None, list[int]]:
    try:
        op, req = ctl.decode_request_untrusted(data)
    except WireError as e:
        op = _op_of(data)
        return ctl.encode_error(op, errno.EINVAL, f"malformed request: {e}"), []
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        return ctl.encode_error(op, errno.EINVAL, "request or fds truncated"), []
    try:
        if op >= Op.GROUP_JOIN:  # on a group's own connection, no HELLO
            groups = sess.device.groups
            if groups is None:
                raise TableError(errno.EOPNOTSUPP, "this daemon runs no process groups")
            return groups.handle(sess, op, req), []
        if op >= Op.CM_LISTEN:
            if not sess.hello:
                raise TableError(errno.EPROTO, "HELLO first")
            rep = await _unless_hung_up(sess.conn, lambda: sess.handle_async(op, req))
            if rep is None:
                raise TableError(errno.EOPNOTSUPP, "no connection manager")
            return rep, []
        return sess.handle(op, req, fds)
    except TableError as e:
        return ctl.encode_error(op, e.errno, str(e), getattr(e, "private_data", b"")), []
    except OSError as e:
        if e.errno not in quota.RESOURCE_ERRNOS:
            raise
        # memfd_create, mmap or eventfd found the process out of fds or memory
        return ctl.encode_error(op, e.errno, f"the daemon is out of resources: {e}"), []


async def _unless_hung_up(conn: trio.socket.SocketType, work: Callable[[], Awaitable[bytes | None]]) -> bytes | None:
    """``await work()``, unless the client hangs up first.

    A connection-manager request may wait for as long as the client asked
    (days); a client that dies meanwhile must not keep its listener, QPs and
    regions until then.  Raises trio.BrokenResourceError on the hang-up,
    which ends the session.
    """
    result: list[bytes | None] = []
    failed: list[Exception] = []

    async def run(cancel: trio.CancelScope) -> None:
        try:
            result.append(await work())
        except Exception as e:  # raised below as itself, not inside the nursery's ExceptionGroup
            failed.append(e)
        cancel.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, nursery.cancel_scope)
        await _hang_up(conn)
        nursery.cancel_scope.cancel()
    if failed:
        raise failed[0]
    if not result:
        raise trio.BrokenResourceError("the client hung up while its request waited")
    return result[0]


async def _hang_up(conn: trio.socket.SocketType) -> None:
    """Return once the client has closed its end (EOF or an error on the socket)."""
    try:
        peek = await conn.recv(1, socket.MSG_PEEK)
    except OSError:
        return
    if not peek:
        return
    await trio.sleep_forever()  # a request queued behind this one: served after it


async def _refuse(conn: trio.socket.SocketType, code: int, text: str) -> None:
    """Answer the client's first request (HELLO) with ``code``, then hang up.

    The request is read first: closing a socket with a message still unread
    resets the connection, and the client would see ECONNRESET, not why."""
    try:
        with trio.move_on_after(1.0):
            await conn.recv(ctl.MAX_CTL_MESSAGE)
            await conn.send(ctl.encode_error(Op.HELLO, code, text))
    except OSError:
        pass
    finally:
        conn.close()


async def _refuse_waiting(sock: trio.socket.SocketType, spare: int | None, code: int) -> int | None:
    """Out of fds: accept the waiting client on the spare fd and refuse it.

    Returns the new spare fd (None when none could be taken back: then the
    next failure waits a little instead, so as not to spin).
    """
    if spare is None:
        await trio.sleep(0.05)
    else:
        os.close(spare)
        try:
            conn, _ = sock._sock.accept()  # the client is waiting: this does not block
        except OSError:
            await trio.sleep(0.05)
        else:
            await _refuse(trio.socket.from_stdlib_socket(conn), code, "the daemon is out of file descriptors")
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _command_of(pid: int) -> str:
    """The command name of process ``pid`` (for the log), or ``?``."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().decode(errors="replace").strip() or "?"
    except OSError:
        return "?"


def _op_of(data: bytes) -> Op:
    # Too short to name an op: answered as an unknown op is, not with the op
    # a lone first byte would spell.
    if len(data) < 2:
        return Op.HELLO
    try:
        return Op(int.from_bytes(data[:2], "big"))
    except ValueError:
        return Op.HELLO


def _fds_from(anc: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, typ, payload in anc:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(payload[: len(payload) - len(payload) % a.itemsize])
            fds.extend(a)
    return fds


def check_socket_free(path: str) -> None:
    """Refuse to start if a daemon already serves ``path``; remove a stale socket.

    Raises:
        OSError: EADDRINUSE with a clear message when another daemon answers.
    """
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: a previous daemon died
        return
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"another udpverbs daemon is serving {path}")


async def serve_control(device: Device, path: str, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Accept verbs-library connections on ``path`` until cancelled."""
    check_socket_free(path)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old_umask = os.umask(0o177)  # the socket is born 0600
    try:
        await sock.bind(path)
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(128)
    device.loop.watch(sock.fileno())
    # One fd kept in reserve: when accept() finds none free, this one is
    # given up to accept the waiting client and tell it why, then taken back.
    spare: int | None = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                try:
                    conn, _ = await sock.accept()
                except OSError as e:
                    if e.errno not in quota.RESOURCE_ERRNOS:
                        raise
                    log.warning("control socket: cannot accept a client: %s", e)
                    spare = await _refuse_waiting(sock, spare, e.errno)
                    continue
                nursery.start_soon(_session_task, device, conn)
    finally:
        if spare is not None:
            os.close(spare)
        device.loop.unwatch(sock.fileno())
        sock.close()
        try:
            os.unlink(path)
        except OSError:
            pass
