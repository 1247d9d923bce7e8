"""Process groups: locks and barriers that the daemons run for their ranks.

Theory of operation
-------------------
A ``Group`` is a set of ranks, each an application process on one of the
members' daemons (several ranks may share a daemon).  Every rank passes the
same member list, ``members[i]`` naming rank i's daemon as ``(ip, udp
port)``, as RHiNET's ``barrier_init`` took the same process-id array; every
daemon derives the same structures from it.  The locks and barriers run in
the daemons (``daemon/groups.py``): a waiting rank sleeps in one blocking
read of its group connection until its daemon answers, and no application
forwards anything for another.

Each Group talks to its daemon over a connection of its own, which is its
membership: closing the group, or the process dying, leaves it.  A member
that dies or leaves makes the others' pending barriers, and (if it died or
held a lock) their pending lock waits, raise :class:`GroupError` naming it,
within the group's ``timeout`` when a whole daemon goes silent; locks pass
on (a dead holder's lock is released, a dead waiter removed), so the rest
can go on using them.  Nothing rolls back what a dead holder wrote: a
:class:`GroupError` from a lock wait says that data may be half-updated.

The ``*_async`` flavours wait in trio without a thread; cancelling one
while it waits leaves the group (the daemon would still answer it).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import struct
from typing import Any, AsyncIterator, Iterator, Sequence

import trio

from ..wire import ctl
from ..wire.ctl import Op
from ..wire.errors import WireError
from .device import GID, Context, Resource, _Control
from .errors import UserError, VerbsError

#: the environment ``udpverbs run`` gives every rank
ENV_DEVICE = "UDPVERBS_DEVICE"  # the device (daemon) this rank opens
ENV_RUNTIME_DIR = "UDPVERBS_RUNTIME_DIR"  # where the launcher's daemons' sockets are
ENV_RANK = "UDPVERBS_RANK"
ENV_SIZE = "UDPVERBS_SIZE"
ENV_MEMBERS = "UDPVERBS_MEMBERS"  # member list, rank order: "ip:port,ip:port,..." ("[v6]:port" for IPv6)
ENV_GROUP = "UDPVERBS_GROUP"  # the job's group name

#: barrier algorithms by name (wire/barrier.py's Algorithm)
ALGORITHMS = {"tree": 1, "dissemination": 2, "central": 3}
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_JOIN_TIMEOUT_S = 30.0


class GroupError(VerbsError):
    """A group wait failed because member ``rank`` died or left (-1: unknown)."""

    def __init__(self, msg: str, rank: int, error_code: int = errno.ECONNABORTED) -> None:
        super().__init__(msg, error_code)
        self.rank = rank


def _member(m: Any) -> tuple[str, int]:
    try:
        host, port = m
    except (TypeError, ValueError):
        raise UserError(f"a member is (gid_or_ip, udp_port), not {m!r}") from None
    if isinstance(host, (bytes, GID)):
        host = GID(host).ip if isinstance(host, bytes) else host.ip
    try:
        ip = str(ipaddress.ip_address(str(host)))
    except ValueError:
        try:
            ip = str(GID(str(host)).ip)
        except Exception:
            raise UserError(f"member address {host!r} is neither an IP address nor a GID") from None
    if not isinstance(port, int) or not 0 < port <= 0xFFFF:
        raise UserError(f"member UDP port {port!r} is not 1..65535")
    return ip, port


class Group(Resource):
    """Rank ``rank`` of the process group ``name`` (see the module docstring).

    Args:
        ctx: the rank's open device (its daemon serves the group).
        name: the group's name; one job, one name.
        rank: this process's rank, 0 ≤ rank < len(members).
        members: rank i's daemon as ``(ip or GID, udp_port)``, the same list at every rank.
        timeout: how long a silent daemon may take before its ranks count as dead.
        join_timeout: how long to wait for every rank to join.

    The constructor returns once every rank has joined.

    Raises:
        GroupError: a rank left or died, or did not join in time.
        VerbsError: the daemon refused (a bad member list, a rank joined twice).
        UserError: bad arguments.
    """

    def __init__(self, ctx: Context, name: str, rank: int, members: Sequence[Any], *,
                 timeout: float = DEFAULT_TIMEOUT_S, join_timeout: float = DEFAULT_JOIN_TIMEOUT_S) -> None:
        super().__init__()
        ctx._check_open()
        self.name = str(name)
        self.members = [_member(m) for m in members]
        self.size = len(self.members)
        if not isinstance(rank, int) or not 0 <= rank < self.size:
            raise UserError(f"rank {rank!r} is not in 0..{self.size - 1}")
        if timeout <= 0 or join_timeout <= 0:
            raise UserError("timeouts must be positive")
        self.rank = rank
        self.timeout = timeout
        try:
            tail = ctl.encode_members(self.name, self.members)
        except ValueError as e:
            raise UserError(str(e)) from None
        self._ctl = _Control(ctx.socket_path, None)  # waits are the daemon's to end
        self._busy = False
        #: the locks this rank holds (a release is sent, not waited for)
        self.held: set[int] = set()
        try:
            rep = self._call(Op.GROUP_JOIN, join_timeout + 5, version=ctl.CTL_VERSION, rank=rank, size=self.size,
                             timeout_ms=int(timeout * 1000), join_timeout_ms=int(join_timeout * 1000), data=tail)
        except BaseException:
            self._ctl.close()
            raise
        #: the group's id (the same at every member) and how many daemons serve it
        self.group_id = rep.group_id
        self.daemons = rep.daemons
        ctx._adopt(self)

    @classmethod
    def from_env(cls, ctx: Context, **kw: Any) -> "Group":
        """The group ``udpverbs run`` set up: UDPVERBS_GROUP, _RANK, _SIZE, _MEMBERS.

        Raises:
            UserError: a variable is missing or malformed.
        """
        try:
            name = os.environ[ENV_GROUP]
            rank = int(os.environ[ENV_RANK])
            members = parse_members(os.environ[ENV_MEMBERS])
            size = int(os.environ.get(ENV_SIZE, len(members)))
        except KeyError as e:
            raise UserError(f"{e.args[0]} is not set: start the job with udpverbs run") from None
        except ValueError as e:
            raise UserError(f"bad group environment: {e}") from None
        if size != len(members):
            raise UserError(f"{ENV_SIZE}={size} but {ENV_MEMBERS} names {len(members)} members")
        return cls(ctx, name, rank, members, **kw)

    def __repr__(self) -> str:
        return f"Group({self.name!r}, rank {self.rank} of {self.size})"

    # -- locks ---------------------------------------------------------------------------
    def acquire(self, lock_id: int, timeout: float | None = None) -> None:
        """Wait until this rank holds ``lock_id`` (any 32-bit number).

        Raises:
            GroupError: a member died while we waited (we do not hold the lock).
            TimeoutError: not granted within ``timeout`` seconds (None: no limit).
            VerbsError: EDEADLK if this rank already holds or waits for it.
        """
        ms = 0 if timeout is None else max(1, int(timeout * 1000))
        self._call(Op.LOCK_ACQUIRE, None, lock_id=_lock_id(lock_id), timeout_ms=ms)
        self.held.add(lock_id)

    def release(self, lock_id: int) -> None:
        """Let go of ``lock_id``; the next waiter gets it.  Returns at once:
        the daemon passes the lock on.  VerbsError EPERM if not held."""
        self._send_release(lock_id)

    def trylock(self, lock_id: int) -> bool:
        """Take ``lock_id`` if nobody holds or waits for it; never waits for it."""
        got = bool(self._call(Op.LOCK_TRY, None, lock_id=_lock_id(lock_id)).granted)
        if got:
            self.held.add(lock_id)
        return got

    @contextlib.contextmanager
    def lock(self, lock_id: int, timeout: float | None = None) -> Iterator[None]:
        """``with group.lock(n):`` holds lock n for the block."""
        self.acquire(lock_id, timeout)
        try:
            yield
        finally:
            if not self._closed:
                self.release(lock_id)

    async def acquire_async(self, lock_id: int, timeout: float | None = None) -> None:
        """trio flavour of :meth:`acquire`."""
        ms = 0 if timeout is None else max(1, int(timeout * 1000))
        await self._call_async(Op.LOCK_ACQUIRE, lock_id=_lock_id(lock_id), timeout_ms=ms)
        self.held.add(lock_id)

    async def release_async(self, lock_id: int) -> None:
        """trio flavour of :meth:`release` (which never waits)."""
        self._send_release(lock_id)
        await trio.lowlevel.checkpoint()

    async def trylock_async(self, lock_id: int) -> bool:
        got = bool((await self._call_async(Op.LOCK_TRY, lock_id=_lock_id(lock_id))).granted)
        if got:
            self.held.add(lock_id)
        return got

    @contextlib.asynccontextmanager
    async def lock_async(self, lock_id: int, timeout: float | None = None) -> AsyncIterator[None]:
        """``async with group.lock_async(n):``"""
        await self.acquire_async(lock_id, timeout)
        try:
            yield
        finally:
            if not self._closed:
                with trio.CancelScope(shield=True):
                    await self.release_async(lock_id)

    # -- barriers ------------------------------------------------------------------------
    def barrier(self, algorithm: str = "tree", arity: int = 2, timeout: float | None = None) -> int:
        """Wait until every rank has entered this barrier; returns its generation (1, 2, …).

        ``algorithm``: "tree" (``arity``-ary, over the daemons), "dissemination"
        (⌈log2 daemons⌉ rounds) or "central" (every daemon reports to rank 0's).
        Every rank must pass the same algorithm and arity.

        Raises:
            GroupError: a member died or left before this barrier.
            TimeoutError: not released within ``timeout`` (the group is then closed:
                a rank that gave up on a barrier cannot take part in the next).
        """
        return int(self._call(Op.BARRIER, timeout, **_barrier_args(algorithm, arity)).generation)

    async def barrier_async(self, algorithm: str = "tree", arity: int = 2) -> int:
        """trio flavour of :meth:`barrier`."""
        return int((await self._call_async(Op.BARRIER, **_barrier_args(algorithm, arity))).generation)

    # -- the connection --------------------------------------------------------------------
    def _send_release(self, lock_id: int) -> None:
        self._check_open()
        if _lock_id(lock_id) not in self.held:
            raise VerbsError(f"rank {self.rank} does not hold lock {lock_id}", errno.EPERM)
        if self._busy:
            raise UserError("one request at a time per Group (use one Group per thread or task)")
        sock = self._ctl.sock
        if sock is None:
            raise UserError("the group's connection is closed")
        try:
            sock.send(ctl.encode_request(Op.LOCK_RELEASE, lock_id=lock_id))
        except OSError as e:
            raise VerbsError(f"LOCK_RELEASE: control connection failed: {e}", e.errno or errno.EIO) from None
        self.held.discard(lock_id)

    def _call(self, op: Op, timeout_s: float | None, **fields: Any) -> Any:
        self._check_open()
        if self._busy:
            raise UserError("one request at a time per Group (use one Group per thread or task)")
        self._busy = True
        try:
            rep, _ = self._ctl.call(op, timeout_s=timeout_s, **fields)
        except VerbsError as e:
            raise self._error(op, e) from None
        except TimeoutError:
            self.close()  # the connection is gone: a late reply would answer the next request
            raise
        finally:
            self._busy = False
        return rep

    async def _call_async(self, op: Op, **fields: Any) -> Any:
        self._check_open()
        if self._busy:
            raise UserError("one request at a time per Group (use one Group per thread or task)")
        sock = self._ctl.sock
        if sock is None:
            raise UserError("the group's connection is closed")
        self._busy = True
        try:
            sock.send(ctl.encode_request(op, **fields))
            try:
                await trio.lowlevel.wait_readable(sock)
            except BaseException:
                self.close()  # the answer would still come: this connection is done
                raise
            data = sock.recv(ctl.MAX_CTL_MESSAGE)
        except OSError as e:
            raise VerbsError(f"{op.name}: control connection failed: {e}", e.errno or errno.EIO) from None
        finally:
            self._busy = False
        if not data:
            raise VerbsError(f"{op.name}: the daemon closed the connection", errno.ECONNRESET)
        try:
            status, body = ctl.decode_reply(data, op)
        except WireError as e:
            raise VerbsError(f"{op.name}: bad reply from the daemon: {e}", errno.EPROTO) from None
        if status:
            text, private = body
            raise self._error(op, VerbsError(f"{op.name} failed: {text}", status, private))
        return body

    def _error(self, op: Op, e: VerbsError) -> Exception:
        if e.error_code == errno.ECONNABORTED:
            rank = struct.unpack("!I", e.private_data[:4])[0] if len(e.private_data) >= 4 else 0xFFFFFFFF
            return GroupError(str(e).split(". Errno")[0], -1 if rank == 0xFFFFFFFF else rank)
        if e.error_code == errno.ETIMEDOUT and op == Op.LOCK_ACQUIRE:
            return TimeoutError(str(e).split(". Errno")[0])
        return e

    def _release(self) -> None:
        """Leave the group (the daemon releases what this rank holds)."""
        c = self._ctl
        if c.sock is not None and not self._busy:
            try:
                c.sock.settimeout(5.0)
                c.call(Op.GROUP_LEAVE, timeout_s=5.0)
            except (VerbsError, TimeoutError, OSError):
                pass
        c.close()


def _lock_id(lock_id: int) -> int:
    if not isinstance(lock_id, int) or not 0 <= lock_id <= 0xFFFFFFFF:
        raise UserError(f"a lock id is a 32-bit unsigned number, not {lock_id!r}")
    return lock_id


def _barrier_args(algorithm: str, arity: int) -> dict[str, int]:
    alg = ALGORITHMS.get(algorithm)
    if alg is None:
        raise UserError(f"barrier algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    if alg == ALGORITHMS["tree"] and not (isinstance(arity, int) and 2 <= arity <= 255):
        raise UserError(f"a tree barrier's arity is 2..255, not {arity!r}")
    return {"algorithm": alg, "arity": arity if alg == ALGORITHMS["tree"] else 0}


def format_members(members: Sequence[tuple[str, int]]) -> str:
    """``[("127.0.0.2", 4791), ("::1", 5000)]`` -> ``"127.0.0.2:4791,[::1]:5000"``."""
    out = []
    for ip, port in members:
        addr = ipaddress.ip_address(ip)
        out.append(f"[{addr}]:{port}" if addr.version == 6 else f"{addr}:{port}")
    return ",".join(out)


def parse_members(text: str) -> list[tuple[str, int]]:
    """The inverse of :func:`format_members`.

    Raises:
        ValueError: an entry is not ``ip:port`` / ``[ip6]:port`` with a port in 1..65535.
    """
    members: list[tuple[str, int]] = []
    for item in text.split(","):
        item = item.strip()
        if item.startswith("["):
            host, sep, port = item[1:].partition("]:")
        else:
            host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) <= 0xFFFF:
            raise ValueError(f"member {item!r} is not ip:port")
        members.append((str(ipaddress.ip_address(host)), int(port)))
    return members
