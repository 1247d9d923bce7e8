"""Process groups in the daemon: membership, the lock and barrier engines' glue.

Theory of operation
-------------------
A rank joins a group on a control connection of its own (``verbs.Group``);
that connection *is* its membership: it closing without GROUP_LEAVE means
the process died.  Requests that wait (joining, a lock, a barrier) get no
reply until the wait ends; the reply is then written straight from the data
path that learned it (a grant, a release), so no trio task wakes in
between, and the session task keeps reading the connection meanwhile, which
is how a death during a wait is seen at once.

The engines are pure (``qlock.py``, ``gbarrier.py``); this module feeds them
what arrives (``Kind.LOCK``/``BARRIER``/``GROUP`` messages on the daemons'
reliable links, the ranks' requests), sends what they produce and turns
their outcomes into replies.  Membership (``wire/group.py``):

* **Join** is collective: JOIN goes to every other member's daemon, and a
  rank's join completes when its daemon has heard of every rank (a JOIN that
  arrives before any local rank joined is kept, in a bounded table).
* **Leave / death** is announced with LEAVE.  A death, or a leave while
  holding or waiting for a lock, fails every pending lock wait of the group
  (the dead rank's locks pass on: its held locks are released, its waits
  abandoned); any leave fails every barrier after the leaver's last one.
* **A daemon that goes silent** while one of ours waits (no answer to PING
  within the group's timeout) or whose link fails takes all its ranks with
  it; since the locks it managed are lost with it, the group's locks fail
  from then on, as do its barriers.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import socket
import struct
from typing import TYPE_CHECKING, Any

import trio

from ..wire import ctl, envelope
from ..wire import group as wgroup
from ..wire import lock as wlock
from ..wire import barrier as wbarrier
from ..wire.ctl import Op
from ..wire.envelope import Kind
from ..wire.errors import WireError
from ..wire.group import GroupMessage, GroupType, LeaveStatus
from ..wire.lock import LockStatus
from .gbarrier import BarrierEngine, BarrierUsageError
from .qlock import LockEngine, LockUsageError
from .tables import TableError

if TYPE_CHECKING:
    from .device import Device
    from .peer import PeerLink

log = logging.getLogger("udpverbs.daemon")

#: groups with a JOIN heard but no local rank yet, and JOINs kept per group
MAX_PENDING_GROUPS = 256
MAX_GROUPS = 1024
#: the errno of a group error reply; its private data is the rank (u32)
GROUP_ERRNO = errno.ECONNABORTED
NO_RANK = 0xFFFFFFFF
#: while a rank waits, its daemon pings the group's other daemons every
#: PING_EVERY of the group's timeout and counts one silent for SILENT of it as dead
PING_EVERY = 0.125
SILENT = 0.75
_RANK = struct.Struct("!I")


class GroupFailure(TableError):
    """A wait that ends because a member died or left (``rank``)."""

    def __init__(self, rank: int, text: str) -> None:
        super().__init__(GROUP_ERRNO, text)
        self.private_data = _RANK.pack(rank if rank >= 0 else NO_RANK)


class Wait:
    """A request of a local rank that is answered later."""

    __slots__ = ("op", "key", "deadline", "since", "known_dead")

    def __init__(self, op: Op, key: int, since: float, deadline: float, known_dead: frozenset[int] = frozenset()) -> None:
        self.op = op
        self.key = key  # the lock id, or the barrier generation
        self.since = since
        self.deadline = deadline
        #: the members its rank had been told were gone when it asked
        self.known_dead = known_dead


class Member:
    """A rank served by this daemon."""

    __slots__ = ("group", "rank", "sess", "wait", "released", "gone", "told")

    def __init__(self, group: "Group", rank: int, sess: Any) -> None:
        self.group = group
        self.rank = rank
        self.sess = sess
        self.wait: Wait | None = None
        self.released = 0  # the last barrier generation this rank left
        self.gone = False
        #: members whose death or leave this rank has been told of (an error reply)
        self.told: set[int] = set()


class Group:
    """One group as this daemon sees it."""

    def __init__(self, gid: int, name: str, members: list[tuple[str, int]], me_addr: tuple[str, int],
                 timeout_s: float) -> None:
        self.gid = gid
        self.name = name
        self.members = members
        self.size = len(members)
        self.daemons: list[tuple[str, int]] = list(dict.fromkeys(members))
        index = {a: i for i, a in enumerate(self.daemons)}
        self.daemon_index = index
        self.rank_daemon = [index[a] for a in members]
        self.me = index[me_addr]
        self.local_ranks = [r for r in range(self.size) if self.rank_daemon[r] == self.me]
        self.timeout_s = timeout_s
        self.lock = LockEngine(gid, self.size, self.rank_daemon.__getitem__, self.me)
        self.barrier = BarrierEngine(gid, len(self.daemons), self.me, len(self.local_ranks))
        self.joined: set[int] = set()
        self.local: dict[int, Member] = {}
        self.left: dict[int, int] = {}  # rank -> LeaveStatus
        self.dead_daemons: set[int] = set()
        #: barriers after this generation fail (a member left after it)
        self.barrier_limit: tuple[int, int, str] | None = None  # (generation, rank, why)
        self.locks_broken: tuple[int, str] | None = None
        self.heard: dict[int, float] = {}

    def complete(self) -> bool:
        return len(self.joined) == self.size


class GroupService:
    """The device's process groups (see the module docstring)."""

    def __init__(self, device: "Device") -> None:
        self.device = device
        device.groups = self
        self.groups: dict[int, Group] = {}
        self.pending: collections.OrderedDict[int, set[tuple[tuple[str, int], int]]] = collections.OrderedDict()
        self.stats = device.stats
        self._changed = trio.Event()

    # -- a group's connection, read by the data loop ------------------------------------
    async def adopt(self, sess: Any) -> None:
        """Read ``sess``'s connection from the data loop from now on (its
        requests are answered in the pass that sees them, with no trio task
        woken); returns when the client closes it."""
        ended = trio.Event()
        fd = sess.conn.fileno()
        sock = socket.socket(fileno=os.dup(fd))  # the session keeps (and closes) its own
        try:
            self.device.loop.serve_here(fd, lambda: self._serve_connection(sess, sock, fd, ended))
            self._serve_connection(sess, sock, fd, ended)  # what arrived while it was trio's
            await ended.wait()
        finally:
            self.device.loop.stop_serving(fd)
            sock.close()

    def _serve_connection(self, sess: Any, sock: socket.socket, fd: int, ended: trio.Event) -> None:
        while not ended.is_set():
            try:
                data = sock.recv(ctl.MAX_CTL_MESSAGE, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # the process closed it, or died
                self.device.loop.stop_serving(fd)
                ended.set()
                return
            reply = self._request(sess, data)
            if reply is not None:
                try:
                    sock.send(reply, socket.MSG_DONTWAIT)
                except OSError as e:
                    self.stats["group_reply_failed"] += 1
                    log.info("group reply to pid %d failed: %s", sess.pid, e)

    def _request(self, sess: Any, data: bytes) -> bytes | None:
        try:
            op, req = ctl.decode_request_untrusted(data)
        except WireError as e:
            return ctl.encode_error(Op.GROUP_LEAVE, errno.EINVAL, f"malformed request: {e}")
        if op < Op.GROUP_JOIN:
            return ctl.encode_error(op, errno.EINVAL, "a group's connection serves group requests only")
        try:
            return self.handle(sess, op, req)
        except TableError as e:
            return ctl.encode_error(op, e.errno, str(e), getattr(e, "private_data", b""))

    # -- requests of the local ranks --------------------------------------------------
    def handle(self, sess: Any, op: Op, req: Any) -> bytes | None:  # noqa: C901 (a switch on op)
        """Serve one group request; None: the reply comes later.  Raises TableError to refuse."""
        if op == Op.GROUP_JOIN:
            return self._join(sess, req)
        m: Member | None = getattr(sess, "group_member", None)
        if op == Op.LOCK_RELEASE:
            self._release(m, req.lock_id)
            return None
        if m is None or m.gone:
            raise TableError(errno.ENOTCONN, "this connection has not joined a group")
        if m.wait is not None:
            raise TableError(errno.EBUSY, "a group request is still waiting on this connection")
        g = m.group
        now = self.device.clock()
        if op == Op.GROUP_LEAVE:
            self._leave(m, died=False)
            return ctl.encode_reply(op)
        if op in (Op.LOCK_ACQUIRE, Op.LOCK_TRY):
            if g.locks_broken is not None:
                rank, why = g.locks_broken
                raise GroupFailure(rank, why)
            timeout = req.timeout_ms / 1000 if op == Op.LOCK_ACQUIRE and req.timeout_ms else float("inf")
            m.wait = Wait(op, req.lock_id, now, now + timeout, frozenset(m.told))
            self.stats["group_lock_waits"] += 1
            try:
                (g.lock.acquire if op == Op.LOCK_ACQUIRE else g.lock.trylock)(m.rank, req.lock_id)
            except LockUsageError as e:
                m.wait = None
                raise TableError(e.errno, str(e)) from None
            self._flush(g)
            return self._waiting(m)
        if op == Op.BARRIER:
            gen = m.released + 1
            lim = g.barrier_limit
            if lim is not None and gen > lim[0]:
                raise GroupFailure(lim[1], lim[2])
            m.wait = Wait(op, gen, now, float("inf"))
            self.stats["group_barrier_waits"] += 1
            try:
                g.barrier.arrive(gen, req.algorithm, req.arity)
            except BarrierUsageError as e:
                m.wait = None
                raise TableError(errno.EINVAL, str(e)) from None
            self._flush(g)
            return self._waiting(m)
        raise TableError(errno.EOPNOTSUPP, op.name)

    def _release(self, m: Member | None, lock_id: int) -> None:
        """LOCK_RELEASE has no reply (the library knows what its rank holds,
        and the next waiter should not wait for our answer): a release that
        cannot be is counted and logged."""
        if m is None or m.gone:
            self.stats["group_release_refused"] += 1
            return
        try:
            m.group.lock.release(m.rank, lock_id)
        except LockUsageError as e:
            self.stats["group_release_refused"] += 1
            log.info("group %r: %s", m.group.name, e)
            return
        self._flush(m.group)

    def _waiting(self, m: Member) -> None:
        """No reply from the session task: the engines may have answered
        already (a free lock managed here, the last arrival of a barrier on
        one daemon), through :meth:`_reply`, or will later."""
        if m.wait is not None:
            self._changed.set()  # a deadline and pings to look after
        return None

    def _join(self, sess: Any, req: Any) -> bytes | None:
        if getattr(sess, "group_member", None) is not None:
            raise TableError(errno.EISCONN, "this connection already joined a group")
        if req.version != ctl.CTL_VERSION:
            raise TableError(errno.EPROTO, f"library speaks version {req.version}, daemon {ctl.CTL_VERSION}")
        try:
            name, members = ctl.decode_members_untrusted(req.data)
        except WireError as e:
            raise TableError(errno.EINVAL, f"bad member list: {e}") from None
        if len(members) != req.size or not req.rank < req.size:
            raise TableError(errno.EINVAL, f"rank {req.rank} of {req.size} with {len(members)} members")
        me = members[req.rank]
        ip, port = self.device.config.addr, self.device.config.port
        if port != me[1] or ip not in ("0.0.0.0", "::", me[0]):
            raise TableError(errno.EINVAL, f"member {req.rank} is {me[0]}:{me[1]}, but this daemon is {ip}:{port}")
        gid = wgroup.group_id(name, members)
        g = self.groups.get(gid)
        if g is None:
            if len(self.groups) >= MAX_GROUPS:
                raise TableError(errno.ENOMEM, "too many groups")
            timeout = max(0.05, req.timeout_ms / 1000)
            g = self.groups[gid] = Group(gid, name, members, me, timeout)
            for addr, rank in self.pending.pop(gid, ()):
                if rank < g.size and g.members[rank] == addr:
                    g.joined.add(rank)
        if g.rank_daemon[req.rank] != g.me:
            raise TableError(errno.EINVAL, f"member {req.rank} names another daemon than the group's other ranks here")
        if req.rank in g.joined or req.rank in g.left:
            raise TableError(errno.EADDRINUSE, f"rank {req.rank} already joined group {name!r}; a new job needs a new name")
        if g.left or g.dead_daemons:
            raise GroupFailure(next(iter(g.left), -1), f"group {name!r} has lost members")
        m = Member(g, req.rank, sess)
        sess.group_member = m
        g.local[req.rank] = m
        g.joined.add(req.rank)
        now = self.device.clock()
        m.wait = Wait(Op.GROUP_JOIN, 0, now, now + max(0.05, req.join_timeout_ms / 1000))
        for d in range(len(g.daemons)):
            if d != g.me:
                self._send_group(g, d, GroupMessage(GroupType.JOIN, gid, req.rank))
        if g.complete():
            self._joined(g)
        self.device.loop.wake()
        return self._waiting(m)

    def _join_reply(self, g: Group) -> bytes:
        return ctl.encode_reply(Op.GROUP_JOIN, group_id=g.gid, daemons=len(g.daemons), local_ranks=len(g.local_ranks))

    def _joined(self, g: Group) -> None:
        for m in g.local.values():
            if m.wait is not None and m.wait.op == Op.GROUP_JOIN:
                m.wait = None
                self._reply(m, self._join_reply(g))

    def _leave(self, m: Member, died: bool) -> None:
        """``m`` leaves (GROUP_LEAVE) or its connection closed (``died``)."""
        if m.gone:
            return
        g = m.group
        holding = any(r == m.rank for r, _ in g.lock.acq)
        status = LeaveStatus.DIED if died or holding or m.wait is not None else LeaveStatus.LEFT
        m.gone = True
        m.wait = None
        self.stats["group_ranks_died" if status == LeaveStatus.DIED else "group_ranks_left"] += 1
        g.lock.rank_gone(m.rank)
        self._flush(g)  # the locks it passes on travel ahead of the news on every link
        for d in range(len(g.daemons)):
            if d != g.me and d not in g.dead_daemons:
                self._send_group(g, d, GroupMessage(GroupType.LEAVE, g.gid, m.rank, m.released, status))
        self._member_gone(g, m.rank, status, m.released)
        # Its arrival at a barrier it was not released from may already be
        # counted here: this daemon must not complete that barrier for it.
        # Every later one fails everywhere (the LEAVE says after which).
        g.barrier.fail(f"rank {m.rank} {'died' if status == LeaveStatus.DIED else 'left the group'}"
                       f" after barrier {m.released}")
        self._flush(g)

    def session_closed(self, sess: Any) -> None:
        m = getattr(sess, "group_member", None)
        if m is not None:
            self._leave(m, died=True)
            self._forget_if_done(m.group)

    def _forget_if_done(self, g: Group) -> None:
        if all(m.gone for m in g.local.values()) and len(g.local) == len(g.local_ranks):
            if not g.lock.last and not g.lock.acq:  # nothing we manage is still in use
                self.groups.pop(g.gid, None)

    # -- what members' deaths do -------------------------------------------------------------
    def _member_gone(self, g: Group, rank: int, status: int, generation: int) -> None:
        if rank in g.left:
            return
        g.left[rank] = status
        what = "died" if status == LeaveStatus.DIED else "left the group"
        why = f"rank {rank} {what}"
        if not g.complete():
            for m in list(g.local.values()):
                if m.wait is not None and m.wait.op == Op.GROUP_JOIN:
                    self._fail(m, rank, f"{why} before everyone joined")
        lim = g.barrier_limit
        if lim is None or generation < lim[0]:
            g.barrier_limit = (generation, rank, f"{why} after barrier {generation}")
        for m in list(g.local.values()):
            w = m.wait
            if w is not None and w.op == Op.BARRIER and w.key > generation:
                self._fail(m, rank, f"{why} after barrier {generation}")
        if status == LeaveStatus.DIED:
            for m in list(g.local.values()):
                w = m.wait
                # (a rank already told of this death, by the lock it passed
                # on, is waiting again on purpose)
                if w is not None and w.op == Op.LOCK_ACQUIRE and rank not in m.told:
                    g.lock.abandon(m.rank, w.key)
                    self._fail(m, rank, f"{why}: the data its locks protected may be half-updated")

    def _daemon_gone(self, g: Group, d: int, why: str) -> None:
        if d in g.dead_daemons or d == g.me:
            return
        g.dead_daemons.add(d)
        log.warning("group %r: daemon %s:%d %s", g.name, *g.daemons[d], why)
        first = next((r for r in range(g.size) if g.rank_daemon[r] == d), -1)
        g.locks_broken = (first, f"the daemon of rank {first} {why}; the locks it managed are lost")
        for r in range(g.size):
            if g.rank_daemon[r] == d and r not in g.left:
                self._member_gone(g, r, LeaveStatus.DIED, g.barrier.done)
        for m in list(g.local.values()):
            if m.wait is not None and m.wait.op in (Op.LOCK_ACQUIRE, Op.LOCK_TRY):
                g.lock.abandon(m.rank, m.wait.key)
                self._fail(m, first, g.locks_broken[1])

    def on_link_failed(self, pl: "PeerLink") -> None:
        for g in list(self.groups.values()):
            d = g.daemon_index.get(pl.addr)
            if d is not None:
                self._daemon_gone(g, d, f"is unreachable ({pl.failed_reason or 'link failed'})")

    # -- from the network -----------------------------------------------------------------------
    def on_message(self, pl: "PeerLink", kind: int, body: memoryview) -> None:
        """A LOCK, BARRIER or GROUP message from the daemon behind ``pl``.  Never raises."""
        try:
            if kind == Kind.LOCK:
                msg: Any = wlock.decode_untrusted(body)
            elif kind == Kind.BARRIER:
                msg = wbarrier.decode_untrusted(body)
            else:
                msg = wgroup.decode_untrusted(body)
        except WireError as e:
            self.stats["group_" + e.reason] += 1
            return
        g = self.groups.get(msg.group)
        if g is None:
            if kind == Kind.GROUP and msg.gtype == GroupType.JOIN:
                self._pending_join(pl.addr, msg)
            elif kind == Kind.GROUP and msg.gtype == GroupType.PING:
                self._send_to(pl, Kind.GROUP, wgroup.encode(GroupMessage(GroupType.PONG, msg.group)))
            else:
                self.stats["group_unknown"] += 1
            return
        d = g.daemon_index.get(pl.addr)
        if d is None or d == g.me or d in g.dead_daemons:
            self.stats["group_not_member"] += 1
            return
        g.heard[d] = self.device.clock()
        if kind == Kind.LOCK:
            g.lock.on_message(d, msg)
        elif kind == Kind.BARRIER:
            g.barrier.on_message(d, msg)
        else:
            self._group_message(g, d, msg)
        self._flush(g)

    def _group_message(self, g: Group, d: int, msg: GroupMessage) -> None:
        t = msg.gtype
        if t == GroupType.PING:
            self._send_group(g, d, GroupMessage(GroupType.PONG, g.gid))
        elif t == GroupType.PONG:
            pass
        elif not msg.rank < g.size or g.rank_daemon[msg.rank] != d:
            self.stats["group_not_member"] += 1
        elif t == GroupType.JOIN:
            g.joined.add(msg.rank)
            if g.complete():
                self._joined(g)
        else:  # LEAVE
            self._member_gone(g, msg.rank, msg.status, msg.generation)

    def _pending_join(self, addr: tuple[str, int], msg: GroupMessage) -> None:
        joins = self.pending.get(msg.group)
        if joins is None:
            if len(self.pending) >= MAX_PENDING_GROUPS:
                self.pending.popitem(last=False)
                self.stats["group_pending_evicted"] += 1
            joins = self.pending[msg.group] = set()
        if len(joins) < ctl.MAX_GROUP_SIZE:
            joins.add((addr, msg.rank))

    # -- replies and sends ---------------------------------------------------------------------------
    def _flush(self, g: Group) -> None:
        """Send what the engines produced; answer the waits they ended."""
        lk, br = g.lock, g.barrier
        for d, m in lk.out:
            self._send_to_daemon(g, d, Kind.LOCK, wlock.encode(m))
        lk.out.clear()
        for d, bm in br.out:
            self._send_to_daemon(g, d, Kind.BARRIER, wbarrier.encode(bm))
        br.out.clear()
        while lk.events:
            ev = lk.events.pop(0)
            m = g.local.get(ev.rank)
            w = m.wait if m is not None else None
            if w is None or w.key != ev.lock_id or w.op not in (Op.LOCK_ACQUIRE, Op.LOCK_TRY):
                if lk.holds(ev.rank, ev.lock_id):  # nobody waits for this grant any more
                    lk.release(ev.rank, ev.lock_id, ev.dead)
                    self._flush(g)
                continue
            m.wait = None
            if ev.status == LockStatus.OWNER_DIED and ev.dead not in w.known_dead:
                lk.release(ev.rank, ev.lock_id, ev.dead)
                self._fail(m, ev.dead, f"rank {ev.dead} died holding lock {ev.lock_id}: "
                                       "the data it protected may be half-updated", op=w.op)
                self._flush(g)
            elif ev.status == LockStatus.REFUSED:
                self._reply(m, ctl.encode_error(w.op, errno.ENOMEM, f"the manager of lock {w.key} has no room"))
            elif w.op == Op.LOCK_TRY:
                self._reply(m, ctl.encode_reply(Op.LOCK_TRY, granted=int(ev.status == LockStatus.GRANTED)))
            else:
                self._reply(m, ctl.encode_reply(Op.LOCK_ACQUIRE))
        for gen in br.released:
            for m in g.local.values():
                if not m.gone and m.released < gen:
                    m.released = gen
                    if m.wait is not None and m.wait.op == Op.BARRIER and m.wait.key == gen:
                        m.wait = None
                        self._reply(m, ctl.encode_reply(Op.BARRIER, generation=gen))
        br.released.clear()
        if br.failure:  # the members disagreed on a barrier's algorithm or arity
            for m in list(g.local.values()):
                if m.wait is not None and m.wait.op == Op.BARRIER:
                    self._fail(m, -1, br.failure)
            if g.barrier_limit is None or g.barrier_limit[0] > br.done:
                g.barrier_limit = (br.done, -1, br.failure)

    def _fail(self, m: Member, rank: int, why: str, op: Op | None = None) -> None:
        if op is None:
            op = m.wait.op if m.wait is not None else Op.GROUP_JOIN
        m.wait = None
        m.told.add(rank)
        e = GroupFailure(rank, why)
        self._reply(m, ctl.encode_error(op, e.errno, str(e), e.private_data))

    def _reply(self, m: Member, data: bytes) -> None:
        """Answer a waiting request from the data path (the session task is reading, not replying)."""
        sess = m.sess
        if sess is None or sess.closed:
            return
        try:
            os.write(sess.conn.fileno(), data)
        except OSError as e:  # the client is gone or not reading: its session ends
            self.stats["group_reply_failed"] += 1
            log.info("group reply to pid %d failed: %s", sess.pid, e)

    def _send_group(self, g: Group, d: int, msg: GroupMessage) -> None:
        self._send_to_daemon(g, d, Kind.GROUP, wgroup.encode(msg))

    def _send_to_daemon(self, g: Group, d: int, kind: int, body: bytes) -> None:
        if d in g.dead_daemons:
            return
        try:
            pl = self.device.get_link(g.daemons[d])
        except TableError:
            self._daemon_gone(g, d, "cannot be reached (no room for a link)")
            return
        self._send_to(pl, kind, body)

    def _send_to(self, pl: "PeerLink", kind: int, body: bytes) -> None:
        if pl.up:
            msg = envelope.encode(kind, envelope.CM_QPN, envelope.CM_QPN, body)
            if pl.send_alone(msg) is None:
                pl.send(msg)
            self.device.loop.wake()

    # -- time: request deadlines and liveness --------------------------------------------------------
    def tick(self, now: float) -> float:
        """Expire waits, ping silent daemons, declare dead the ones silent
        past the timeout; returns when to tick next."""
        nxt = float("inf")
        for g in list(self.groups.values()):
            # Joining has its own timeout: a daemon whose ranks start late is not dead.
            waits = [m.wait for m in g.local.values() if m.wait is not None and m.wait.op != Op.GROUP_JOIN]
            if not waits and not any(m.wait is not None for m in g.local.values()):
                continue
            # Silence past SILENT of the timeout is death, so that the
            # error reaches the waiting ranks within the timeout.
            period, silent = g.timeout_s * PING_EVERY, g.timeout_s * SILENT
            since = min((w.since for w in waits), default=now)
            for d in range(len(g.daemons)):
                if not waits or d == g.me or d in g.dead_daemons:
                    continue
                heard = max(g.heard.get(d, since), since)
                if now - heard > silent:
                    self._daemon_gone(g, d, f"did not answer for {silent:.3g} s")
                    continue
                if now - g.heard.get(d, 0.0) >= period:
                    self._send_group(g, d, GroupMessage(GroupType.PING, g.gid))
                nxt = min(nxt, now + period, heard + silent + 1e-3)
            for m in list(g.local.values()):
                w = m.wait
                if w is None:
                    continue
                if w.deadline <= now:
                    if w.op == Op.GROUP_JOIN:
                        missing = sorted(set(range(g.size)) - g.joined)
                        self._fail(m, missing[0] if missing else -1,
                                   f"ranks {_ranges(missing)} did not join group {g.name!r} in time")
                    elif w.op == Op.LOCK_ACQUIRE:
                        g.lock.abandon(m.rank, w.key)
                        m.wait = None
                        self._reply(m, ctl.encode_error(Op.LOCK_ACQUIRE, errno.ETIMEDOUT,
                                                        f"lock {w.key} not granted in time"))
                else:
                    nxt = min(nxt, w.deadline)
            self._flush(g)
        return nxt

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Tick while anything waits (trio timer; the data loop honours it)."""
        task_status.started()
        while True:
            nxt = self.tick(self.device.clock())
            self._changed = trio.Event()
            with trio.move_on_at(nxt):
                await self._changed.wait()


def _ranges(ranks: list[int]) -> str:
    if len(ranks) > 8:
        return ", ".join(map(str, ranks[:8])) + f" and {len(ranks) - 8} more"
    return ", ".join(map(str, ranks))
