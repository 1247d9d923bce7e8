"""The RHiNET queue lock of one process group, as one daemon runs it (sans-IO).

Theory of operation
-------------------
Every lock has a *manager*: the daemon of rank ``lock_id % size`` (so locks
spread over the members' daemons by id).  The manager keeps only the last
requester of each lock it manages; a lock nobody holds or waits for has no
record, so any 32-bit id works with no set-up.  Each acquisition is
``(rank, seq)``; its state (:class:`LockState`) changes only along
:data:`TRANSITIONS`, a table in the style of ``daemon/tables.py``'s QP
states::

    rank A        A's daemon          manager            B's daemon      rank B
    acquire ──►   LOCK_REQ  ────────►  last = A
                  LOCK_REPLY ◄───────  (no record: granted)
    granted ◄──   (LAST)
                                       LOCK_REQ ◄──────  (WAIT)   ◄──── acquire
                  LOCK_FORW ◄────────  last = B
                  (LOCK: B follows)
    release ──►   LOCK_REPLY ─────────────────────────►  (LAST)   ────► granted

Grants are FIFO in the order the manager saw the requests: each request is
forwarded to the one before it, and a release hands the lock to exactly
that successor.  A holder that knows no successor (``LAST``) sends UNLOCK to
the manager, which clears its record only if that holder is still the last
requester; a ``LOCK_FORW`` that crossed the UNLOCK names an acquisition that
is over, and its target grants the successor at once.

Trylock asks the manager: with no record the lock is free (nobody holds or
waits, since a record is cleared only by the UNLOCK of the last requester,
who held the lock after everyone before it), so the manager records the
caller as last requester and answers GRANTED; otherwise BUSY.

An acquisition whose rank gives up (its process died, or its wait failed
with a group error or timed out) is *abandoned*: it stays in the queue, and
when the lock reaches it, it is released at once; asking again takes it
back.  A dead rank's held locks are released at once, the grant marked
OWNER_DIED (naming it), and the mark travels with the lock through every
abandoned acquisition until it reaches a rank that waits: that rank's wait
ends in an error (what the lock protected may be half-updated) unless it
already knew of the death, and it passes the lock on, marked, in turn.
So the others learn of the death and can use the lock again.

Messages to this daemon (a lock it manages, a rank it serves) are handled
in place, in order; :attr:`LockEngine.out` collects the ones for other
daemons and :attr:`LockEngine.events` what the waiting ranks learn.
"""

from __future__ import annotations

import collections
import enum
from typing import Callable, NamedTuple

from ..wire.lock import LockMessage, LockStatus, LockType

#: a manager's table of lock records, per group: REFUSED beyond it
MAX_MANAGED_LOCKS = 65536
#: acquisitions (held or waited for) one rank may have at once
MAX_RANK_LOCKS = 4096
_U32 = 0xFFFFFFFF


class LockState(enum.Enum):
    WAIT = "wait"  #: requested, not granted, no successor known
    QUEUED = "queued"  #: requested, not granted, a successor is queued behind
    LAST = "last"  #: holding, no successor known (perhaps the last requester)
    LOCK = "lock"  #: holding, a successor is queued behind
    TRYING = "trying"  #: trylock asked, no answer yet
    IDLE = "idle"  #: released (the record is then dropped)


class LockEvent(enum.Enum):
    FORW = "forw"  #: the manager names our successor
    GRANT = "grant"  #: LOCK_REPLY / TRYLOCK_REPLY GRANTED (or OWNER_DIED)
    BUSY = "busy"  #: TRYLOCK_REPLY BUSY
    REFUSED = "refused"  #: the manager's table is full
    RELEASE = "release"  #: the rank (or its abandonment) lets go


S, E = LockState, LockEvent
#: (state, event) -> next state; a missing key is a protocol error
TRANSITIONS: dict[tuple[LockState, LockEvent], LockState] = {
    (S.WAIT, E.FORW): S.QUEUED,
    (S.WAIT, E.GRANT): S.LAST,
    (S.WAIT, E.REFUSED): S.IDLE,
    (S.QUEUED, E.GRANT): S.LOCK,
    (S.LAST, E.FORW): S.LOCK,
    (S.LAST, E.RELEASE): S.IDLE,  # UNLOCK to the manager
    (S.LOCK, E.RELEASE): S.IDLE,  # LOCK_REPLY to the successor
    (S.TRYING, E.GRANT): S.LAST,
    (S.TRYING, E.BUSY): S.IDLE,
    (S.TRYING, E.REFUSED): S.IDLE,
}
HOLDING = frozenset((S.LAST, S.LOCK))


class LockUsageError(Exception):
    """A rank asked for something its lock state forbids (``errno`` says what)."""

    def __init__(self, errno_: int, text: str) -> None:
        super().__init__(text)
        self.errno = errno_


class Outcome(NamedTuple):
    """What a waiting rank learns: its acquisition ``lock_id`` ended
    ``status``; with OWNER_DIED (the rank holds the lock), ``dead`` is the
    rank that died holding it."""

    rank: int
    lock_id: int
    status: LockStatus
    dead: int = -1


class Acquisition:
    __slots__ = ("seq", "state", "succ", "abandoned")

    def __init__(self, seq: int, state: LockState) -> None:
        self.seq = seq
        self.state = state
        self.succ: tuple[int, int] | None = None
        self.abandoned = False


class LockEngine:
    """The locks of one group at one daemon.

    Args:
        group: the group id (on every message).
        size: the number of ranks.
        daemon_of: rank -> daemon index (the same function at every member).
        me: this daemon's index.
    """

    def __init__(self, group: int, size: int, daemon_of: Callable[[int], int], me: int) -> None:
        self.group = group
        self.size = size
        self.daemon_of = daemon_of
        self.me = me
        #: managed here: lock id -> (rank, seq) of its last requester
        self.last: dict[int, tuple[int, int]] = {}
        #: acquisitions of the ranks served here: (rank, lock id) -> Acquisition
        self.acq: dict[tuple[int, int], Acquisition] = {}
        self._per_rank: collections.Counter[int] = collections.Counter()
        self._seq: dict[int, int] = {}
        self.dead: set[int] = set()
        #: (rank, lock id) released with no successor known while passing
        #: on a death -> the dead rank: a LOCK_FORW that crossed the UNLOCK
        #: passes the lock on as OWNER_DIED too
        self.died_holding: dict[tuple[int, int], int] = {}
        #: (daemon index, message) for other daemons, in send order
        self.out: list[tuple[int, LockMessage]] = []
        self.events: list[Outcome] = []
        self.stats: collections.Counter[str] = collections.Counter()
        self._local: collections.deque[LockMessage] = collections.deque()
        self._busy = False

    def manager_of(self, lock_id: int) -> int:
        """The daemon index that manages ``lock_id``."""
        return self.daemon_of(lock_id % self.size)

    # -- what the ranks ask ------------------------------------------------------------
    def acquire(self, rank: int, lock_id: int) -> None:
        """Ask for ``lock_id``; an :class:`Outcome` reports the grant.

        A wait the rank gave up (a group error, a timeout) is still queued:
        asking again takes it back, keeping its place.

        Raises:
            LockUsageError: the rank already holds or waits for it (EDEADLK),
                has too many acquisitions (ENOMEM), or a trylock of it is
                still unanswered (EAGAIN).
        """
        a = self.acq.get((rank, lock_id))
        if a is not None and a.abandoned and rank not in self.dead:
            if a.state == S.TRYING:
                raise LockUsageError(11, f"a trylock of lock {lock_id} is still unanswered")  # EAGAIN
            a.abandoned = False
            return
        seq = self._start(rank, lock_id, S.WAIT)
        self._send(self.manager_of(lock_id), LockMessage(LockType.LOCK_REQ, self.group, lock_id, rank, seq))
        self._drain()

    def trylock(self, rank: int, lock_id: int) -> None:
        """Ask the manager whether ``lock_id`` is free; the Outcome is GRANTED or BUSY."""
        a = self.acq.get((rank, lock_id))
        if a is not None and a.abandoned:  # our own given-up wait is queued: not free
            self.events.append(Outcome(rank, lock_id, LockStatus.BUSY))
            return
        seq = self._start(rank, lock_id, S.TRYING)
        self._send(self.manager_of(lock_id), LockMessage(LockType.TRYLOCK_REQ, self.group, lock_id, rank, seq))
        self._drain()

    def release(self, rank: int, lock_id: int, dead: int = -1) -> None:
        """Let go of a held lock; with ``dead``, pass on the news that that
        rank died holding it (the rank was given it with OWNER_DIED and its
        wait failed).  Raises LockUsageError (EPERM) if not held."""
        a = self.acq.get((rank, lock_id))
        if a is None or a.state not in HOLDING:
            raise LockUsageError(1, f"rank {rank} does not hold lock {lock_id}")  # EPERM
        self._release(rank, lock_id, a, dead)
        self._drain()

    def abandon(self, rank: int, lock_id: int) -> None:
        """The rank stops waiting for ``lock_id``: when granted, it is released at once."""
        a = self.acq.get((rank, lock_id))
        if a is not None and a.state not in HOLDING:
            a.abandoned = True

    def rank_gone(self, rank: int) -> None:
        """The rank's process died (or left): release what it holds, abandon what it waits for."""
        self.dead.add(rank)
        for (r, lock_id), a in list(self.acq.items()):
            if r != rank:
                continue
            if a.state in HOLDING:
                self._release(rank, lock_id, a, rank)
            else:
                a.abandoned = True
        self._drain()

    def waiting(self, rank: int) -> list[int]:
        """The locks ``rank`` waits for (not abandoned)."""
        return [lk for (r, lk), a in self.acq.items() if r == rank and a.state not in HOLDING and not a.abandoned]

    def holds(self, rank: int, lock_id: int) -> bool:
        a = self.acq.get((rank, lock_id))
        return a is not None and a.state in HOLDING

    # -- from the network ----------------------------------------------------------------
    def on_message(self, sender: int, m: LockMessage) -> None:
        """A lock message from daemon ``sender``.  Never raises: a message
        that breaks the protocol is counted and dropped."""
        if not self._plausible(sender, m):
            self.stats["lock_bad_message"] += 1
            return
        self._local.append(m)
        self._drain()

    def _plausible(self, sender: int, m: LockMessage) -> bool:
        if m.group != self.group or not m.proc < self.size:
            return False
        t = m.ltype
        if t in (LockType.LOCK_REQ, LockType.UNLOCK, LockType.TRYLOCK_REQ):
            return self.manager_of(m.lock_id) == self.me and self.daemon_of(m.proc) == sender
        if t == LockType.LOCK_FORW:
            return (self.manager_of(m.lock_id) == sender and self.daemon_of(m.proc) == self.me
                    and m.succ_proc < self.size)
        return self.daemon_of(m.proc) == self.me  # LOCK_REPLY, TRYLOCK_REPLY

    # -- the engine ------------------------------------------------------------------------
    def _start(self, rank: int, lock_id: int, state: LockState) -> int:
        if (rank, lock_id) in self.acq:
            raise LockUsageError(35, f"rank {rank} already holds or waits for lock {lock_id}")  # EDEADLK
        if self._per_rank[rank] >= MAX_RANK_LOCKS:
            raise LockUsageError(12, f"rank {rank} has {MAX_RANK_LOCKS} locks held or pending")  # ENOMEM
        seq = self._seq[rank] = (self._seq.get(rank, 0) + 1) & _U32
        self.acq[(rank, lock_id)] = Acquisition(seq, state)
        self._per_rank[rank] += 1
        return seq

    def _send(self, daemon: int, m: LockMessage) -> None:
        if daemon == self.me:
            self._local.append(m)
        else:
            self.out.append((daemon, m))

    def _drain(self) -> None:
        if self._busy:
            return  # a message handled here sent one to ourselves: the outer loop takes it
        self._busy = True
        try:
            while self._local:
                self._handle(self._local.popleft())
        finally:
            self._busy = False

    def _handle(self, m: LockMessage) -> None:
        t = m.ltype
        if t == LockType.LOCK_REQ:
            self._manager_request(m)
        elif t == LockType.UNLOCK:
            if self.last.get(m.lock_id) == (m.proc, m.seq):
                del self.last[m.lock_id]
            else:
                self.stats["lock_unlock_crossed"] += 1  # a LOCK_FORW is on its way to that holder
        elif t == LockType.TRYLOCK_REQ:
            self._manager_trylock(m)
        elif t == LockType.LOCK_FORW:
            self._forwarded(m)
        else:  # LOCK_REPLY, TRYLOCK_REPLY
            ev = {LockStatus.GRANTED: E.GRANT, LockStatus.BUSY: E.BUSY, LockStatus.REFUSED: E.REFUSED,
                  LockStatus.OWNER_DIED: E.GRANT}[m.status]
            self._answered(m, ev)

    def _manager_request(self, m: LockMessage) -> None:
        prev = self.last.get(m.lock_id)
        if prev is None:
            if len(self.last) >= MAX_MANAGED_LOCKS:
                self._send(self.daemon_of(m.proc), LockMessage(LockType.LOCK_REPLY, self.group, m.lock_id, m.proc,
                                                               m.seq, status=LockStatus.REFUSED))
                return
            self.last[m.lock_id] = (m.proc, m.seq)
            self._send(self.daemon_of(m.proc), LockMessage(LockType.LOCK_REPLY, self.group, m.lock_id, m.proc, m.seq))
            return
        self.last[m.lock_id] = (m.proc, m.seq)
        self._send(self.daemon_of(prev[0]),
                   LockMessage(LockType.LOCK_FORW, self.group, m.lock_id, prev[0], prev[1], m.proc, m.seq))

    def _manager_trylock(self, m: LockMessage) -> None:
        status = LockStatus.BUSY
        if m.lock_id not in self.last:
            if len(self.last) >= MAX_MANAGED_LOCKS:
                status = LockStatus.REFUSED
            else:
                self.last[m.lock_id] = (m.proc, m.seq)
                status = LockStatus.GRANTED
        self._send(self.daemon_of(m.proc),
                   LockMessage(LockType.TRYLOCK_REPLY, self.group, m.lock_id, m.proc, m.seq, status=status))

    def _forwarded(self, m: LockMessage) -> None:
        a = self.acq.get((m.proc, m.lock_id))
        if a is None or a.seq != m.seq:
            # That acquisition is over (its UNLOCK crossed this forward): the
            # lock is free as far as it is concerned, so the successor has it.
            dead = self.died_holding.pop((m.proc, m.lock_id), -1)
            self._grant(m.lock_id, m.succ_proc, m.succ_seq, dead)
            return
        a.state = TRANSITIONS[(a.state, E.FORW)]
        a.succ = (m.succ_proc, m.succ_seq)

    def _answered(self, m: LockMessage, ev: LockEvent) -> None:
        a = self.acq.get((m.proc, m.lock_id))
        if a is None or a.seq != m.seq or (a.state, ev) not in TRANSITIONS:
            self.stats["lock_stale_grant"] += 1
            if ev == E.GRANT and (a is None or a.seq != m.seq):
                # A grant for an acquisition that is over must not lose the
                # lock: give it back (the manager drops an UNLOCK that is not
                # its last requester's).  One for the acquisition under way
                # (held already) changes nothing.
                self._send(self.manager_of(m.lock_id), LockMessage(LockType.UNLOCK, self.group, m.lock_id, m.proc, m.seq))
            return
        a.state = TRANSITIONS[(a.state, ev)]
        if a.state == S.IDLE:
            self._forget(m.proc, m.lock_id)
        dead = m.succ_proc if m.status == LockStatus.OWNER_DIED else -1
        if a.abandoned or m.proc in self.dead:
            if a.state in HOLDING:
                self._release(m.proc, m.lock_id, a, dead)  # the news travels on with the lock
            return
        self.events.append(Outcome(m.proc, m.lock_id, m.status, dead))

    def _release(self, rank: int, lock_id: int, a: Acquisition, dead: int = -1) -> None:
        state = a.state
        a.state = TRANSITIONS[(state, E.RELEASE)]
        self._forget(rank, lock_id)
        if state == S.LOCK:
            assert a.succ is not None
            self._grant(lock_id, *a.succ, dead)
        else:
            if dead >= 0:
                self.died_holding[(rank, lock_id)] = dead
            self._send(self.manager_of(lock_id), LockMessage(LockType.UNLOCK, self.group, lock_id, rank, a.seq))

    def _grant(self, lock_id: int, rank: int, seq: int, dead: int = -1) -> None:
        if dead < 0:
            m = LockMessage(LockType.LOCK_REPLY, self.group, lock_id, rank, seq)
        else:
            m = LockMessage(LockType.LOCK_REPLY, self.group, lock_id, rank, seq, dead, status=LockStatus.OWNER_DIED)
        self._send(self.daemon_of(rank), m)

    def _forget(self, rank: int, lock_id: int) -> None:
        del self.acq[(rank, lock_id)]
        self._per_rank[rank] -= 1
