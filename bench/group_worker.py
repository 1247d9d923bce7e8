"""One rank of ``udpverbs perf lock_lat`` / ``barrier_lat``: a child process driven over its stdin and stdout.

Theory of operation
-------------------
:mod:`udpverbs.bench.group_perf` starts P of these (``python -m
udpverbs.bench.group_worker``), each with the environment ``udpverbs run``
gives a rank (``UDPVERBS_DEVICE``, ``UDPVERBS_RUNTIME_DIR``,
``UDPVERBS_RANK``, ``UDPVERBS_SIZE``, ``UDPVERBS_MEMBERS``,
``UDPVERBS_GROUP``; :mod:`udpverbs.verbs.group`), and drives them in lock
step: it writes one JSON command a line to every rank's stdin and reads one
JSON answer a line from each stdout before the next step, so the ranks need
no channel of their own besides the verbs.  What a rank would print goes to
stderr: stdout carries the answers alone.  A rank that fails answers
``{"op": "error", "message": ...}`` and exits 1; one whose stdin closes (its
parent died) exits.

Commands (``op``) and what each answers:

* ``open``: open the device, answer its GID and UDP port.
* ``group``: join the process group (``verbs.Group.from_env``; collective:
  every rank is sent it at once).
* ``cas-open``: set up the Compare-and-Swap lock's verbs (an MR with
  remote atomic access and a QP; rank 0, which holds the words, one
  responder QP per rank, its own included, so that it reaches its own
  memory through its daemon as the others do); answer the QP numbers.
* ``cas-connect``: move the QPs to RTS towards the table of every rank's
  answer to ``cas-open``.
* ``run``: one measured phase, see :func:`Rank.run`; answers the samples
  (ns) or timestamps (``CLOCK_MONOTONIC`` ns, which every process of the
  host shares, so the parent can lay ranks' timelines side by side).
* ``bye``: leave the group, close the device, exit 0.

The Compare-and-Swap lock (:class:`CasLock`) is the lock one builds from
verbs atomics without help from the NIC: a 64-bit word in rank 0's memory
that holds ``rank + 1`` while ``rank`` holds the lock, and when it is free 0
(never taken) or ``0x100 | rank + 1`` (released last by ``rank``).  Acquire
is a Compare-and-Swap from the free value expected to ``rank + 1``, posted
again until it succeeds (spinning on the word, one atomic round trip per
try; a failed one returns the word, which says what to expect next);
release is an unsignaled RDMA Write of the free value (inline), not waited
for, as a spin lock's store-release is not: the QP executes it before
anything posted after it, so the rank's next atomic completes only once the
release has landed, and a critical section's own Writes land before it.

Saying who released it lets the hand-off run make the lock alternate: there
each rank expects its predecessor's release.  Plain, this spin lock almost
never changes hands between two contending ranks, because the releasing
rank's next Compare-and-Swap follows its release on the same QP, ahead of
the other rank's (measured: 1 hand-off in 600 acquisitions); the group's
queue lock alternates by itself (first come, first served).
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from typing import Any, Callable, TextIO

#: Where a rank's atomics return old values, its Reads land and its Writes
#: come from, in its own MR.
FETCH_OFF, READ_OFF, WRITE_OFF = 0, 64, 128
#: The words in rank 0's MR, apart from those: the Compare-and-Swap lock, a
#: counter the mutual-exclusion checks increment non-atomically, and the
#: word of the atomic round trips.
LOCK_OFF, COUNTER_OFF, ATOMIC_OFF = 1024, 1032, 1040
#: The hand-off runs' lock words, a fresh one for each (rank 0's MR, from here on).
HANDOFF_OFF = 1088
MR_BYTES = 4096
#: A run that makes no progress for this long has failed.
STALL_S = 60.0
#: How often (in spins) a waiting rank looks at the clock.
CHECK_EVERY = 256
#: The Group's timeouts: generous, since on a small host dozens of ranks and
#: their daemons share two CPUs.
GROUP_TIMEOUT_S = 60.0
JOIN_TIMEOUT_S = 180.0

_U64 = (1 << 64) - 1
_WORD = struct.Struct("=Q")


def now_ns() -> int:
    """``CLOCK_MONOTONIC`` in ns: one clock for every process of the host."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class WorkerError(Exception):
    """A phase failed (a bad completion, a stall, a word that does not hold what it must)."""


class Verbs:
    """This rank's verbs for the Compare-and-Swap lock, the atomic round trips and the counter."""

    def __init__(self, verbs: Any, ctx: Any, rank: int, size: int) -> None:
        from udpverbs.verbs import enums as E

        self.v, self.E, self.rank, self.size = verbs, E, rank, size
        self.access = (E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_READ
                       | E.IBV_ACCESS_REMOTE_ATOMIC)  # fmt: skip
        self.pd = verbs.PD(ctx)
        self.mr = verbs.MR(self.pd, MR_BYTES, self.access)
        self.cq = verbs.CQ(ctx, 64)
        cap = verbs.QPCap(max_send_wr=16, max_recv_wr=1, max_send_sge=1, max_recv_sge=1, max_inline_data=8)
        init = verbs.QPInitAttr(qp_type=E.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
        self.qp = verbs.QP(self.pd, init)
        # rank 0 holds the words: one responder QP for every rank's QP, its own too
        self.responders = [verbs.QP(self.pd, init) for _ in range(size)] if rank == 0 else []
        self.gid = ctx.query_gid()
        self.port = ctx.query_port().lid
        self.rkey = self.addr = 0  # rank 0's, after connect
        self.cas = self._wr(E.IBV_WR_ATOMIC_CMP_AND_SWP, FETCH_OFF, 8, E.IBV_SEND_SIGNALED)
        self.read = self._wr(E.IBV_WR_RDMA_READ, READ_OFF, 8, E.IBV_SEND_SIGNALED)
        self.write = self._wr(E.IBV_WR_RDMA_WRITE, WRITE_OFF, 8, E.IBV_SEND_SIGNALED)
        self._releases = 0

    def _wr(self, opcode: int, off: int, length: int, flags: int) -> Any:
        v = self.v
        return v.SendWR(opcode=opcode, sg=[v.SGE(self.mr.buf + off, length, self.mr.lkey)], send_flags=flags)

    def describe(self) -> dict[str, Any]:
        """What ``cas-open`` answers: where this rank's QPs are (and rank 0's words)."""
        out: dict[str, Any] = {"qpn": self.qp.qp_num, "gid": self.gid.gid, "port": self.port}
        if self.rank == 0:
            out.update(responders=[q.qp_num for q in self.responders], rkey=self.mr.rkey, addr=self.mr.buf)
        return out

    def connect(self, table: list[dict[str, Any]]) -> None:
        """Move this rank's QP to RTS towards rank 0's responder for it (rank 0: every responder too).

        Raises: WorkerError on a malformed table.
        """
        v = self.v
        try:
            owner = table[0]
            self.rkey, self.addr = int(owner["rkey"]), int(owner["addr"])
            pairs = [(self.qp, owner, int(owner["responders"][self.rank]))]
            if self.rank == 0:
                pairs += [(q, table[r], int(table[r]["qpn"])) for r, q in enumerate(self.responders)]
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise WorkerError(f"malformed QP table: {e!r}") from e
        for qp, peer, dest in pairs:
            qp.to_rts(v.QPAttr(qp_access_flags=self.access, dest_qp_num=dest, max_rd_atomic=1, max_dest_rd_atomic=1,
                               ah_attr=v.AHAttr(dlid=int(peer["port"]), gr=v.GlobalRoute(dgid=str(peer["gid"]))),
                               rnr_retry=7))  # fmt: skip
        self.cas.set_wr_atomic(self.rkey, self.addr + LOCK_OFF, 0, 0)
        self.read.set_wr_rdma(self.rkey, self.addr + COUNTER_OFF)
        self.write.set_wr_rdma(self.rkey, self.addr + COUNTER_OFF)

    def release_to(self, offset: int, value: int) -> Any:
        """The unsignaled work request that stores ``value`` in rank 0's word at ``offset``: an RDMA
        Write, inline (a lock's release)."""
        slot = WRITE_OFF + 8 * (1 + self._releases)
        self._releases += 1
        self.mr.write(_WORD.pack(value), 8, slot)
        wr = self._wr(self.E.IBV_WR_RDMA_WRITE, slot, 8, self.E.IBV_SEND_INLINE)
        wr.set_wr_rdma(self.rkey, self.addr + offset)
        return wr

    # -- one work request at a time --------------------------------------------------
    def _complete(self) -> None:
        """Busy-poll (yielding the CPU each turn) for the one signaled completion outstanding.

        Raises: WorkerError on a bad status or after STALL_S without it.
        """
        poll, yield_cpu = self.cq.poll, os.sched_yield
        spins = 0
        since = 0.0
        while True:
            n, wcs = poll(1)
            if n:
                break
            spins += 1
            if spins % CHECK_EVERY == 0:  # the clock is read only once a wait is long
                if spins == CHECK_EVERY:
                    since = time.monotonic()
                elif time.monotonic() - since > STALL_S:
                    raise WorkerError(f"no completion for {STALL_S:g} s")
            yield_cpu()
        wc = wcs[0]
        if wc.status != self.E.IBV_WC_SUCCESS:
            raise WorkerError(f"work request completed with {self.E.WcStatus(wc.status).name}")

    def compare_swap(self, offset: int, expect: int, swap: int) -> int:
        """One Compare-and-Swap on rank 0's word at ``offset``, waited for; returns the word's old value."""
        wr = self.cas
        wr.set_wr_atomic(self.rkey, self.addr + offset, expect & _U64, swap & _U64)
        self.qp.post_send(wr)
        self._complete()
        return int(_WORD.unpack(self.mr.read(8, FETCH_OFF))[0])

    def read_counter(self) -> int:
        """RDMA Read of rank 0's counter word, waited for."""
        self.qp.post_send(self.read)
        self._complete()
        return int(_WORD.unpack(self.mr.read(8, READ_OFF))[0])

    def write_counter(self, value: int) -> None:
        """RDMA Write of rank 0's counter word, waited for."""
        self.mr.write(_WORD.pack(value & _U64), 8, WRITE_OFF)
        self.qp.post_send(self.write)
        self._complete()


class CasLock:
    """The Compare-and-Swap spin lock on a word of rank 0's (see the module docstring).

    The word holds ``rank + 1`` while ``rank`` holds the lock, and when it is
    free, 0 (never taken) or ``FREED | rank + 1`` (released last by ``rank``),
    so a rank can wait for one rank's release in particular (the hand-off).
    """

    FREED = 0x100

    def __init__(self, vb: Verbs, offset: int = LOCK_OFF) -> None:
        self.vb = vb
        self.offset = offset
        self.mine = vb.rank + 1
        self.free = 0  # the free value the next Compare-and-Swap expects
        self.release_wr = vb.release_to(offset, self.FREED | self.mine)
        self.tries = 0  # Compare-and-Swaps posted, successful or not

    def acquire(self, after: int | None = None) -> None:
        """Spin with Compare-and-Swap(free -> rank + 1) until it finds the word free.

        ``after``: take the lock only once rank ``after`` has released it
        (``after=-1``: only as it was never taken); else whatever released it
        last.  A failed swap returns the word: a free one is expected next, a
        held one's release (``FREED | holder``) after it.
        Raises: WorkerError if the word already holds this rank's own mark
        (a release lost) or nothing frees it within STALL_S.
        """
        vb, mine, freed = self.vb, self.mine, self.FREED
        expect = self.free if after is None else (0 if after < 0 else freed | (after + 1))
        since = None
        while True:
            self.tries += 1
            old = vb.compare_swap(self.offset, expect, mine)
            if old == expect:
                self.free = freed | mine
                return
            if old == mine:
                raise WorkerError(f"rank {vb.rank} found the lock word already its own")
            if after is None:
                expect = old if (old == 0 or old & freed) else freed | old
            if since is None:
                since = time.monotonic()
            elif time.monotonic() - since > STALL_S:
                raise WorkerError(f"the lock word stayed {old:#x} for {STALL_S:g} s")

    def release(self) -> None:
        """Post the Write of ``FREED | rank + 1`` to the word, unsignaled (the next signaled WR retires it)."""
        self.vb.qp.post_send(self.release_wr)


class Rank:
    """This process's state and the commands (see the module docstring)."""

    def __init__(self, env: dict[str, str]) -> None:
        from udpverbs.verbs import group as G

        self.rank = int(env[G.ENV_RANK])
        self.size = int(env[G.ENV_SIZE])
        self.verbs: Any = None
        self.ctx: Any = None
        self.group: Any = None
        self.vb: Verbs | None = None
        self.cas_lock: CasLock | None = None
        self._handoffs = 0  # hand-off runs so far: each takes a fresh lock word

    # -- set-up ------------------------------------------------------------------
    def open(self, msg: dict[str, Any]) -> dict[str, Any]:
        from udpverbs import verbs

        self.verbs = verbs
        self.ctx = verbs.Context()  # $UDPVERBS_DEVICE in $UDPVERBS_RUNTIME_DIR
        return {"gid": self.ctx.query_gid().gid, "port": self.ctx.query_port().lid, "pid": os.getpid()}

    def join(self, msg: dict[str, Any]) -> dict[str, Any]:
        if not hasattr(self.verbs, "Group"):
            raise WorkerError("udpverbs.verbs has no Group (the process-group API) in this version")
        self.group = self.verbs.Group.from_env(self.ctx, timeout=float(msg.get("timeout", GROUP_TIMEOUT_S)),
                                               join_timeout=JOIN_TIMEOUT_S)
        return {}

    def cas_open(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.vb = Verbs(self.verbs, self.ctx, self.rank, self.size)
        return self.vb.describe()

    def cas_connect(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.vb is not None, "cas-open first"
        self.vb.connect(msg["table"])
        self.cas_lock = CasLock(self.vb)
        return {}

    # -- phases --------------------------------------------------------------------
    def run(self, msg: dict[str, Any]) -> dict[str, Any]:
        """One phase: ``phase`` names it; ranks not in ``ranks`` (default: all) answer at once.

        * ``atomic``: ``iters`` Compare-and-Swaps on rank 0's atomic word,
          one at a time; answers each one's round trip (``samples``, ns).
        * ``cas-uncontended`` / ``group-uncontended``: ``iters`` acquire +
          release of the Compare-and-Swap lock or of the group's lock
          ``lock``; answers each pair's time (``samples``), and the
          acquire's and the release's alone (``acquire``, ``release``).
        * ``cas-handoff`` / ``group-handoff``: the same, every rank in
          ``ranks`` at once, each holding the lock ``hold_us`` (asleep)
          before its release; answers ``acquired`` (when each acquire
          returned) and ``released`` (when each release was called).
        * ``cas-counter`` / ``group-counter``: ``iters`` increments of
          rank 0's counter by RDMA Read and Write, each under the lock.
        * ``counter``: answers rank 0's counter (``value``).
        * ``barrier``: ``iters`` consecutive barriers of ``algorithm``
          (``arity``); answers when each returned (``exits``), the last
          warm-up barrier's return first.

        Each begins with ``warmup`` unmeasured iterations (not answered).
        """
        ranks = msg.get("ranks")
        if ranks is not None and self.rank not in ranks:
            return {}
        phase = str(msg["phase"])
        iters, warmup = int(msg.get("iters", 0)), int(msg.get("warmup", 0))
        if phase == "barrier":
            # from the last warm-up barrier on: its return starts the first sample
            exits = self._barriers(str(msg["algorithm"]), msg.get("arity"), iters + warmup)
            return {"exits": exits[max(0, warmup - 1):]}
        if phase == "counter":
            return {"value": int(_WORD.unpack(self._own_word(COUNTER_OFF))[0])}
        kind, _, what = phase.partition("-")
        if phase == "atomic":
            return {"samples": self._atomics(iters + warmup)[warmup:]}
        if phase == "cas-handoff":
            acquire, release = self._cas_ring(list(msg["ranks"]))
        else:
            acquire, release = self._lock(kind, msg.get("lock"))
        if what == "uncontended":
            marks = _pairs(acquire, release, iters + warmup)[warmup:]
            return {"samples": [c - a for a, _, c in marks], "acquire": [b - a for a, b, _ in marks],
                    "release": [c - b for _, b, c in marks]}
        if what == "handoff":
            hold_s = float(msg.get("hold_us", 0)) / 1e6
            acquired, released = _timeline(acquire, release, iters + warmup, hold_s)
            return {"acquired": acquired[warmup:], "released": released[warmup:]}
        if what == "counter":
            self._increments(acquire, release, iters)
            return {}
        raise WorkerError(f"unknown phase {phase!r}")

    def _own_word(self, offset: int) -> bytes:
        """Rank 0's word at ``offset``, read from its own memory."""
        assert self.vb is not None and self.rank == 0, "rank 0 holds the words"
        return self.vb.mr.read(8, offset)

    def _lock(self, kind: str, lock_id: Any) -> tuple[Callable[[], Any], Callable[[], Any]]:
        if kind == "cas":
            assert self.cas_lock is not None, "cas-open first"
            return self.cas_lock.acquire, self.cas_lock.release
        if kind == "group":
            if self.group is None:
                raise WorkerError("the group lock phases need the group joined first")
            g, lid = self.group, int(lock_id)
            return (lambda: g.acquire(lid)), (lambda: g.release(lid))
        raise WorkerError(f"unknown lock {kind!r}")

    def _cas_ring(self, order: list[int]) -> tuple[Callable[[], Any], Callable[[], Any]]:
        """A fresh Compare-and-Swap lock that the ranks of ``order`` take in turn, each after the one before it.

        The first rank of ``order`` takes it first, as never taken; then each
        waits for its predecessor's release (:meth:`CasLock.acquire`'s ``after``).
        """
        assert self.vb is not None, "cas-open first"
        self._handoffs += 1
        lock = CasLock(self.vb, HANDOFF_OFF + 8 * self._handoffs)
        j = order.index(self.rank)
        prev = order[j - 1]
        state = {"after": -1 if j == 0 else prev}

        def acquire() -> None:
            lock.acquire(after=state["after"])
            state["after"] = prev

        return acquire, lock.release

    def _atomics(self, n: int) -> list[int]:
        vb = self.vb
        assert vb is not None, "cas-open first"
        clock = now_ns
        samples = []
        expect = 0
        for _ in range(n):
            t0 = clock()
            old = vb.compare_swap(ATOMIC_OFF, expect, expect + 1)
            samples.append(clock() - t0)
            expect = old + 1 if old == expect else old  # another rank's swaps move it too
        return samples

    def _increments(self, acquire: Callable[[], Any], release: Callable[[], Any], n: int) -> None:
        """``n`` times: under the lock, read rank 0's counter and write it back plus one (not atomic by itself)."""
        vb = self.vb
        assert vb is not None, "cas-open first"
        for _ in range(n):
            acquire()
            vb.write_counter(vb.read_counter() + 1)
            release()

    def _barriers(self, algorithm: str, arity: Any, n: int) -> list[int]:
        g = self.group
        if g is None:
            raise WorkerError("barriers need the group joined first")
        clock = now_ns
        kw = {"algorithm": algorithm}
        if arity is not None:
            kw["arity"] = int(arity)
        barrier = g.barrier
        exits = []
        for _ in range(n):
            barrier(**kw)
            exits.append(clock())
        return exits

    def close(self) -> None:
        """Leave the group and close the device (safe twice; errors on the way out are not reported)."""
        for obj in (self.group, self.ctx):
            if obj is not None:
                try:
                    obj.close()
                except Exception:  # the daemon may be gone already
                    pass
        self.group = self.ctx = None


def _pairs(acquire: Callable[[], Any], release: Callable[[], Any], n: int) -> list[tuple[int, int, int]]:
    """``n`` acquire + release; for each, when the acquire was called, when it returned, and when the release returned."""
    clock = now_ns
    marks = []
    for _ in range(n):
        t0 = clock()
        acquire()
        t1 = clock()
        release()
        marks.append((t0, t1, clock()))
    return marks


def _timeline(acquire: Callable[[], Any], release: Callable[[], Any], n: int,
              hold_s: float) -> tuple[list[int], list[int]]:
    """``n`` times: acquire, hold the lock ``hold_s`` (asleep), release, and at once acquire again.

    Returns: when each acquire returned and when each release was called.
    """
    clock, sleep = now_ns, time.sleep
    acquired, released = [], []
    for _ in range(n):
        acquire()
        acquired.append(clock())
        if hold_s:
            sleep(hold_s)
        released.append(clock())
        release()
    return acquired, released


COMMANDS: dict[str, Callable[[Rank, dict[str, Any]], dict[str, Any]]] = {
    "open": Rank.open,
    "group": Rank.join,
    "cas-open": Rank.cas_open,
    "cas-connect": Rank.cas_connect,
    "run": Rank.run,
}


def serve(rank: Rank, commands: TextIO, answers: TextIO) -> int:
    """Answer commands until ``bye`` or the end of ``commands``; returns the exit status."""

    def answer(obj: dict[str, Any]) -> None:
        answers.write(json.dumps(obj, separators=(",", ":")) + "\n")
        answers.flush()

    try:
        for line in commands:
            msg = json.loads(line)
            op = msg.get("op")
            if op == "bye":
                rank.close()
                answer({"op": "bye"})
                return 0
            handler = COMMANDS.get(op)
            if handler is None:
                raise WorkerError(f"unknown command {op!r}")
            answer({"op": op, **handler(rank, msg)})
        return 0  # the parent went away
    except Exception as e:  # reported to the parent, which names the rank
        try:
            answer({"op": "error", "message": f"{type(e).__name__}: {e}"})
        except OSError:
            pass
        return 1
    finally:
        rank.close()


def main() -> int:
    """Entry point: stdout carries the answers alone; anything else printed goes to stderr."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr
    os.dup2(sys.stderr.fileno(), 1)
    return serve(Rank(dict(os.environ)), sys.stdin, answers)


if __name__ == "__main__":
    sys.exit(main())
