"""``udpverbs perf lock_lat`` and ``udpverbs perf barrier_lat``: the process group's locks and barriers, measured.

Theory of operation
-------------------
Both tests run on this host only (``--local``): :class:`local.LocalDaemons`
starts M daemons on 127.0.0.2, 127.0.0.3, ..., and :class:`Ranks` starts P
rank processes (:mod:`udpverbs.bench.group_worker`), rank ``r`` on daemon
``r * M // P`` (:func:`local.block_placement`), each with the environment
``udpverbs run`` gives a rank (:func:`local.rank_environment`, which the
launcher uses too), from which it joins the group
(``verbs.Group.from_env``).  This process drives the ranks in lock step
over their stdin and stdout (one JSON command a line, one answer a line
from each, every wait bounded) and computes the figures from what they
answer; the ranks measure with ``CLOCK_MONOTONIC``, which every process of
the host shares, so their timestamps can be laid side by side.

``lock_lat`` (2 ranks on 2 daemons) reports:

* *uncontended*: rank 0 alone acquires and releases a lock, each pair
  timed, once for a lock its own daemon manages and once for one the other
  daemon manages (:func:`manager_of` says which daemon manages a lock id);
* *hand-off*: both ranks take the same lock (one rank 0's daemon
  manages) in turn: each acquires, holds it ``--hold-us`` (asleep, so that
  the other rank's request is waiting in the queue by then), releases and
  asks again at once; each time the lock passes from one rank to the
  other, the time from the release call to the other's acquire returning
  is one sample.  Back to back, without the hold, a release often reached
  the manager before the other rank's request, and the lock changed hands
  in only about half the acquisitions.  The merged timeline also proves
  mutual exclusion: no acquire may return before the previous holder's
  release was called (:func:`handoff_samples` raises).

Every row's iterations are run in LOCK_ROUNDS rounds over all the rows, so
that what else the host does meanwhile weighs on every row alike.

``--baseline cas-lock`` measures, in the same run, the same rows for the
lock built from verbs atomics (a Compare-and-Swap spin lock on a 64-bit word
in rank 0's memory, :class:`group_worker.CasLock`; rank 0 reaches its own
word through its daemon, as a NIC would), and the atomic round trip itself
(``atomic_lat``: one Compare-and-Swap, posted and polled), from rank 0 to
its own memory and from rank 1 to rank 0's.  Every lock row carries its
typical time over the remote atomic round trip's: a lock offloaded to the
daemons should take no longer, uncontended, than the one round trip the
cheapest remote lock needs.

``barrier_lat`` runs, for each P of ``-P``, ``-n`` consecutive barriers of
each algorithm on every rank; each rank notes when each barrier returned.
Barrier ``i`` takes, as a sample, from the last rank's return from barrier
``i - 1`` to the last rank's return from barrier ``i`` (their sum is the
run's length, so the mean is what OSU's ``osu_barrier`` reports).  No
rank may return from a barrier before every rank returned from the one
before it (:func:`barrier_samples` checks).

CPU placement (``--no-pin`` leaves it to the scheduler): daemon ``d`` runs
on CPU ``d mod n`` of the ``n`` this process may use, and the ranks of
daemon ``d`` on CPU ``(d + 1) mod n``, so that, as in a local perftest run
(:func:`local.crossed_placement`, which ``lock_lat``'s four processes use),
a message from a rank to its daemon changes CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import select
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence, TextIO

from . import local
from .report import RESULT_LINE, banner
from .stats import LatencyStats, latency_stats

TESTS = ("lock_lat", "barrier_lat")
ALGORITHMS = ("tree", "dissemination", "central")
BASELINES = ("cas-lock",)
DEFAULT_ITERS = 1000
#: lock_lat's hand-off: each holder holds the lock this long (asleep), so
#: that the other rank's request waits in the queue when it lets go
DEFAULT_HOLD_US = 2000
MAX_HOLD_US = 1_000_000
#: lock_lat measures its rows round-robin, in this many rounds
LOCK_ROUNDS = 5
DEFAULT_PROCS = (2, 4, 8)
#: barrier_lat's daemons without --daemons: min(this, P)
DEFAULT_DAEMONS = 4
MAX_PROCS = 256
#: The longest a step of set-up (starting, joining, connecting) may take: P
#: interpreters start on few CPUs.
SETUP_TIMEOUT_S = 180.0
#: The longest one measured phase may take (every wait is bounded).
RUN_TIMEOUT_S = 900.0
STOP_GRACE_S = 5.0


class GroupRunError(Exception):
    """A rank failed, went away, or answered what cannot be (a lock held twice, a barrier passed early)."""


class GroupUsageError(Exception):
    """The command line is wrong (exit status 2)."""


# -- where lock managers and processes are ---------------------------------------------------
def manager_of(lock_id: int, members: Sequence[tuple[str, int]]) -> tuple[str, int]:
    """The daemon that manages lock ``lock_id``: rank ``lock_id % size``'s (``daemon/qlock.py``).

    The one place the benchmarks write this rule down.
    """
    return members[lock_id % len(members)]


def lock_managed_by(daemon: tuple[str, int], members: Sequence[tuple[str, int]], start: int = 1) -> int:
    """The smallest lock id from ``start`` on that ``daemon`` manages.

    Raises: ValueError if ``daemon`` is not one of the group's.
    """
    if daemon not in members:
        raise ValueError(f"daemon {daemon} is not one of the group's")
    lock_id = start
    while manager_of(lock_id, members) != daemon:
        lock_id += 1
    return lock_id


def spread_placement(daemons: int, rank_daemons: Sequence[int],
                     cpus: Sequence[int]) -> tuple[list[frozenset[int] | None], list[frozenset[int] | None]]:
    """CPUs of each daemon and each rank (see the module docstring); all None on one CPU.

    Takes: the number of daemons, each rank's daemon, the CPUs this process may use.
    """
    cpus = sorted(set(cpus))
    n = len(cpus)
    if n < 2:
        return [None] * daemons, [None] * len(rank_daemons)
    return ([frozenset([cpus[d % n]]) for d in range(daemons)],
            [frozenset([cpus[(d + 1) % n]]) for d in rank_daemons])


# -- the rank processes -----------------------------------------------------------------
class Ranks:
    """P rank processes on started daemons, driven in lock step (see the module docstring).

    Takes: the daemons (ready), each rank's daemon index, the CPUs of each
    rank (None: anywhere), and the group's name (default: a fresh one).
    Use as a context manager: every rank is stopped by pid at the end.
    """

    def __init__(self, daemons: local.LocalDaemons, rank_daemons: Sequence[int],
                 cpus: Sequence[frozenset[int] | None] | None = None, group: str | None = None) -> None:
        self.daemons = daemons
        self.rank_daemons = list(rank_daemons)
        self.size = len(self.rank_daemons)
        self.members = [daemons.members[d] for d in self.rank_daemons]
        self.cpus = list(cpus) if cpus is not None else [None] * self.size
        self.group = group or f"perf-{uuid.uuid4().hex[:12]}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self._bufs: list[bytes] = []

    def start(self) -> None:
        """Start every rank (not waited for: the first :meth:`ask` waits).

        Raises: GroupRunError if a rank cannot be pinned (all are stopped first).
        """
        assert self.daemons.runtime_dir is not None, "the daemons are not started"
        for r, d in enumerate(self.rank_daemons):
            env = local.rank_environment(r, self.members, device=self.daemons.names[d],
                                         runtime_dir=self.daemons.runtime_dir, group=self.group, base=os.environ)
            proc = subprocess.Popen([sys.executable, "-m", "udpverbs.bench.group_worker"], env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self.procs.append(proc)
            self._bufs.append(b"")
            if self.cpus[r] is not None:
                try:
                    os.sched_setaffinity(proc.pid, self.cpus[r])  # before its interpreter starts threads
                except OSError as e:
                    self.close()
                    raise GroupRunError(f"cannot pin rank {r} to CPU {sorted(self.cpus[r])}: {e}") from None

    def ask(self, msgs: dict[str, Any] | Sequence[dict[str, Any]], timeout_s: float) -> list[dict[str, Any]]:
        """Send every rank its command (one for all, or one each) and wait for every answer.

        Returns: the answers in rank order.
        Raises: GroupRunError naming the rank that answered an error, exited
        or stayed silent past ``timeout_s``.
        """
        each = [msgs] * self.size if isinstance(msgs, dict) else list(msgs)
        assert len(each) == self.size
        for r, (proc, msg) in enumerate(zip(self.procs, each)):
            assert proc.stdin is not None
            try:
                proc.stdin.write((json.dumps(msg, separators=(",", ":")) + "\n").encode())
                proc.stdin.flush()
            except OSError as e:
                raise GroupRunError(f"rank {r} went away: {e}") from None
        answers: list[dict[str, Any] | None] = [None] * self.size
        deadline = time.monotonic() + timeout_s
        while any(a is None for a in answers):
            waiting = {self.procs[r].stdout.fileno(): r for r, a in enumerate(answers) if a is None}  # type: ignore[union-attr]
            left = deadline - time.monotonic()
            if left <= 0:
                late = sorted(waiting.values())
                raise GroupRunError(f"rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did not answer "
                                    f"{each[late[0]].get('op')!r} within {timeout_s:g} s")
            readable, _, _ = select.select(list(waiting), [], [], left)
            for fd in readable:
                r = waiting[fd]
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    status = self.procs[r].wait()
                    raise GroupRunError(f"rank {r} exited (status {status}) during {each[r].get('op')!r}")
                self._bufs[r] += chunk
                if b"\n" in self._bufs[r]:
                    line, self._bufs[r] = self._bufs[r].split(b"\n", 1)
                    answers[r] = self._answer(r, line, each[r].get("op"))
        return answers  # type: ignore[return-value]

    @staticmethod
    def _answer(r: int, line: bytes, op: Any) -> dict[str, Any]:
        try:
            msg = json.loads(line)
        except ValueError:
            raise GroupRunError(f"rank {r} answered {line[:200]!r}, not JSON") from None
        if not isinstance(msg, dict):
            raise GroupRunError(f"rank {r} answered {msg!r}")
        if msg.get("op") == "error":
            raise GroupRunError(f"rank {r}: {msg.get('message')}")
        if msg.get("op") != op:
            raise GroupRunError(f"rank {r} answered {msg.get('op')!r} to {op!r}")
        return msg

    def __enter__(self) -> "Ranks":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Ask every rank still running to leave, then stop each by pid (safe twice)."""
        for proc in self.procs:
            if proc.poll() is None and proc.stdin is not None:
                try:
                    proc.stdin.write(b'{"op":"bye"}\n')
                    proc.stdin.close()
                except OSError:
                    pass
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        local.stop_processes(self.procs)  # those that did not leave in time
        for proc in self.procs:
            if proc.stdout is not None:
                proc.stdout.close()
        self.procs = []

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- figures --------------------------------------------------------------------------------
def handoff_samples(acquired: Sequence[Sequence[int]], released: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """The hand-offs of a lock several ranks took in turn, from their timelines.

    Takes: per rank, when each of its acquires returned and when each of its
    releases was called (ns, one clock).
    Returns: each hand-off's time (the release call to the next holder's
    acquire returning, when the next holder is another rank), and how many
    acquisitions there were.
    Raises: GroupRunError if an acquire returned before the previous
    holder's release was called (the lock was held twice at once).
    """
    events = sorted((a, r, rel) for r, (acq, rels) in enumerate(zip(acquired, released)) for a, rel in zip(acq, rels))
    samples = []
    for (a0, r0, rel0), (a1, r1, _) in zip(events, events[1:]):
        if a1 < rel0:
            raise GroupRunError(f"rank {r1} acquired the lock {(rel0 - a1) / 1e3:.1f} µs before rank {r0} "
                                "released it: the lock was held twice at once")
        if r1 != r0:
            samples.append(a1 - rel0)
    return samples, len(events)


def barrier_samples(exits: Sequence[Sequence[int]]) -> list[int]:
    """Each barrier's time from every rank's return times (ns, one clock).

    Takes: per rank, when each barrier returned; the first is the one before
    the measured ones (a warm-up barrier).
    Returns: for each later barrier, the last return from it less the last
    return from the one before.
    Raises: GroupRunError if the ranks did not all pass the same number of
    barriers, or one returned before every rank had returned from the barrier before.
    """
    counts = {len(e) for e in exits}
    if len(counts) != 1 or counts == {0}:
        raise GroupRunError(f"the ranks report {sorted(counts)} barriers")
    samples = []
    last_before = max(e[0] for e in exits)
    for i in range(1, counts.pop()):
        first = min(e[i] for e in exits)
        if first < last_before:
            raise GroupRunError(f"barrier {i}: a rank returned {(last_before - first) / 1e3:.1f} µs before every "
                                "rank had left the barrier before it")
        last = max(e[i] for e in exits)
        samples.append(last - last_before)
        last_before = last
    return samples


@dataclass(frozen=True)
class GroupRow:
    """One row: a lock case or a barrier algorithm at one P."""

    test: str  # "lock_lat" or "barrier_lat"
    procs: int
    daemons: int
    stats: LatencyStats
    #: lock_lat: "group", "cas-lock" or "atomic"; and the case
    lock: str | None = None
    case: str | None = None
    #: barrier_lat
    algorithm: str | None = None
    arity: int | None = None
    #: hand-off rows: how many acquisitions the timeline had
    acquisitions: int | None = None
    #: lock rows: typical time over the remote atomic round trip's (with --baseline)
    ratio_to_atomic: float | None = None
    #: uncontended rows: the acquire's and the release's typical times alone (µs)
    acquire_us: float | None = None
    release_us: float | None = None
    #: hand-off rows: how long each holder held the lock (µs)
    hold_us: int | None = None
    #: barrier rows: CPU time per barrier of all the ranks and of all the daemons (µs)
    cpu_us: tuple[float, float] | None = None


#: lock_lat's cases, as the table names them
CASES = {
    "uncontended-own": "uncontended, managed by own daemon",
    "uncontended-remote": "uncontended, managed by other daemon",
    "handoff": "hand-off between 2 ranks",
    "round-trip-own": "round trip to own daemon",
    "round-trip-remote": "round trip to other daemon",
}
CAS_CASES = {
    "uncontended-own": "uncontended, word in own memory",
    "uncontended-remote": "uncontended, word in rank 0's memory",
}


def figures_json(s: LatencyStats) -> dict[str, float]:
    """A row's figures in µs: ``t_min_us t_max_us t_typical_us t_avg_us t_stdev_us t_p99_us t_p999_us``."""
    return {"t_min_us": s.t_min_us, "t_max_us": s.t_max_us, "t_typical_us": s.t_typical_us, "t_avg_us": s.t_avg_us,
            "t_stdev_us": s.t_stdev_us, "t_p99_us": s.p99_us, "t_p999_us": s.p999_us}


def row_json(row: GroupRow) -> dict[str, Any]:
    """The JSON object of a row.

    Keys: ``test``, ``procs``, ``daemons``, ``iterations`` and the figures
    (:func:`figures_json`); ``lock_lat`` rows add ``lock`` (``group``,
    ``cas-lock`` or ``atomic``), ``case`` (a key of :data:`CASES`),
    ``t_acquire_typical_us`` and ``t_release_typical_us`` (uncontended
    rows: the median of each call alone), ``acquisitions`` and ``hold_us``
    (hand-off rows: ``iterations`` counts the hand-offs among the
    acquisitions; each holder held the lock ``hold_us``) and
    ``ratio_to_atomic`` (with the baseline); ``barrier_lat``
    rows add ``algorithm``, ``arity`` (None but for the tree) and
    ``cpu_us_per_barrier`` (``{"ranks": …, "daemons": …}``: the CPU time
    all the ranks, and all the daemons, spent per barrier, warm-up
    included; beside the time per barrier it says how much of it the CPUs
    were busy, e.g. more than the CPUs can give means the host is the limit).
    """
    out: dict[str, Any] = {"test": row.test, "procs": row.procs, "daemons": row.daemons,
                           "iterations": row.stats.iterations}
    if row.test == "lock_lat":
        out.update(lock=row.lock, case=row.case)
        if row.acquisitions is not None:
            out["acquisitions"] = row.acquisitions
        if row.ratio_to_atomic is not None:
            out["ratio_to_atomic"] = row.ratio_to_atomic
        if row.acquire_us is not None:
            out.update(t_acquire_typical_us=row.acquire_us, t_release_typical_us=row.release_us)
        if row.hold_us is not None:
            out["hold_us"] = row.hold_us
    else:
        out.update(algorithm=row.algorithm, arity=row.arity)
        if row.cpu_us is not None:
            out["cpu_us_per_barrier"] = {"ranks": row.cpu_us[0], "daemons": row.cpu_us[1]}
    out.update(figures_json(row.stats))
    return out


def _figures_text(s: LatencyStats) -> str:
    return (f"{s.iterations:<10d} {s.t_min_us:>9.2f} {s.t_max_us:>10.2f} {s.t_typical_us:>10.2f} {s.t_avg_us:>10.2f}"
            f" {s.t_stdev_us:>9.2f} {s.p99_us:>10.2f} {s.p999_us:>10.2f}")


FIGURE_COLUMNS = (f"{'#iterations':<10s} {'t_min':>9s} {'t_max':>10s} {'t_typical':>10s} {'t_avg':>10s}"
                  f" {'t_stdev':>9s} {'99%':>10s} {'99.9%':>10s}")
LOCK_COLUMNS = f" {'lock':<9s} {'case':<38s} " + FIGURE_COLUMNS + "  vs atomic   [usec]"
BARRIER_COLUMNS = (f" {'#procs':>6s} {'#daemons':>8s} {'algorithm':<14s} {'arity':>5s}  " + FIGURE_COLUMNS
                   + f" {'CPU':>10s}  [usec]")


def format_row(row: GroupRow) -> str:
    """The table line of a row (columns :data:`LOCK_COLUMNS` or :data:`BARRIER_COLUMNS`)."""
    if row.test == "lock_lat":
        names = {**CASES, **CAS_CASES} if row.lock == "cas-lock" else CASES
        case = names.get(row.case or "", row.case or "")
        if row.acquisitions is not None:
            case += f" ({row.stats.iterations}/{row.acquisitions})"
        ratio = f"{row.ratio_to_atomic:9.2f}x" if row.ratio_to_atomic is not None else f"{'':10s}"
        return f" {row.lock:<9s} {case:<38s} {_figures_text(row.stats)} {ratio}"
    arity = str(row.arity) if row.arity is not None else "-"
    cpu = f" {sum(row.cpu_us):>10.0f}" if row.cpu_us is not None else ""
    return f" {row.procs:>6d} {row.daemons:>8d} {row.algorithm:<14s} {arity:>5s}  {_figures_text(row.stats)}{cpu}"


# -- parameters -------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupParams:
    """What ``udpverbs perf lock_lat|barrier_lat`` was asked (validated by :func:`params_from_args`)."""

    test: str
    iters: int = DEFAULT_ITERS
    #: lock_lat's hand-off runs: how long each holder holds the lock
    hold_us: int = DEFAULT_HOLD_US
    json_out: bool = False
    pin: bool = True
    mtu: int = 1500
    daemon_args: tuple[str, ...] = ()
    #: lock_lat
    baseline: str | None = None
    baseline_only: bool = False
    #: barrier_lat
    procs: tuple[int, ...] = DEFAULT_PROCS
    algorithms: tuple[str, ...] = ("tree",)
    arity: int = 2
    daemons: int | None = None
    plot: str | None = None

    def daemons_for(self, procs: int) -> int:
        """barrier_lat's daemons at ``procs`` ranks: ``--daemons`` (or DEFAULT_DAEMONS), at most one per rank."""
        return min(self.daemons or DEFAULT_DAEMONS, procs)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``udpverbs perf lock_lat|barrier_lat`` (the words after ``perf``)."""
    p = argparse.ArgumentParser(
        prog="udpverbs perf", description="The process group's locks (lock_lat) and barriers (barrier_lat), "
        "measured on this host with daemons and rank processes of their own (--local).")
    p.add_argument("test", choices=TESTS)
    p.add_argument("--local", action="store_true", help="start the daemons and the ranks here (required)")
    p.add_argument("-n", "--iters", type=int, default=DEFAULT_ITERS,
                   help=f"measured iterations per row (default {DEFAULT_ITERS}), after a tenth as many (at most "
                   "100) to warm up; lock_lat runs them in 5 rounds over its rows, each warmed up")
    p.add_argument("--json", action="store_true", help="print one JSON object per row instead of the table")
    p.add_argument("-m", "--mtu", type=int, default=1500, help="IP path MTU of the local daemons (default 1500)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="leave the processes' CPUs to the scheduler (see docs/REFERENCE.md)")
    p.add_argument("--daemon-arg", dest="daemon_args", action="append", default=[], metavar="=FLAG",
                   help="pass FLAG to every local daemon, e.g. --daemon-arg=--cc=aimd (repeatable)")
    lock = p.add_argument_group("lock_lat")
    lock.add_argument("--baseline", choices=BASELINES,
                      help="also measure a Compare-and-Swap spin lock on a word in rank 0's memory, and one "
                      "atomic round trip, in the same run")
    lock.add_argument("--baseline-only", action="store_true", help="measure only the baseline (no group)")
    lock.add_argument("--hold-us", type=int, default=DEFAULT_HOLD_US, metavar="US",
                      help=f"hand-off runs: each holder holds the lock this long before its release, so that the "
                      f"other rank is already waiting (default {DEFAULT_HOLD_US}; not in the figures)")
    bar = p.add_argument_group("barrier_lat")
    bar.add_argument("-P", "--procs", help="comma-separated rank counts (default 2,4,8)")
    bar.add_argument("--algorithm", default="tree", choices=(*ALGORITHMS, "all"),
                     help="barrier algorithm, or all three (default tree)")
    bar.add_argument("--arity", type=int, default=2, help="the tree's fan-in (default 2)")
    bar.add_argument("--daemons", type=int, help=f"daemons (default min({DEFAULT_DAEMONS}, P); at most P are used)")
    bar.add_argument("--plot", metavar="FILE.png", help="draw barrier latency against P (needs matplotlib)")
    return p


def _procs(text: str) -> tuple[int, ...]:
    try:
        procs = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise GroupUsageError(f"-P {text!r}: give rank counts separated by commas, e.g. -P 2,4,8") from None
    if not procs or not all(2 <= p <= MAX_PROCS for p in procs):
        raise GroupUsageError(f"-P: every rank count must be between 2 and {MAX_PROCS}")
    return procs


def params_from_args(args: argparse.Namespace) -> GroupParams:
    """Check the flags together.  Raises: GroupUsageError naming the flag."""
    if not args.local:
        raise GroupUsageError(f"{args.test} runs on this host only, with daemons of its own: give --local")
    if args.iters < 1:
        raise GroupUsageError("-n must be at least 1")
    if not 576 <= args.mtu <= 65535:
        raise GroupUsageError("-m (the IP path MTU) must be between 576 and 65535 bytes")
    try:
        daemon_args = tuple(local.check_daemon_args(args.daemon_args)) if args.daemon_args else ()
    except ValueError as e:
        raise GroupUsageError(str(e)) from None
    common = dict(test=args.test, iters=args.iters, json_out=args.json, pin=args.pin, mtu=args.mtu,
                  daemon_args=daemon_args)
    if args.test == "lock_lat":
        barrier_flags = [flag for flag, given in (("-P", args.procs is not None), ("--plot", args.plot is not None),
                                                  ("--daemons", args.daemons is not None),
                                                  ("--algorithm", args.algorithm != "tree"),
                                                  ("--arity", args.arity != 2)) if given]
        if barrier_flags:
            raise GroupUsageError(f"{', '.join(barrier_flags)}: barrier_lat's flags; lock_lat runs 2 ranks on 2 daemons")
        if args.baseline_only and args.baseline is None:
            raise GroupUsageError("--baseline-only needs --baseline cas-lock")
        if not 0 <= args.hold_us <= MAX_HOLD_US:
            raise GroupUsageError(f"--hold-us must be between 0 and {MAX_HOLD_US}")
        return GroupParams(baseline=args.baseline, baseline_only=args.baseline_only, hold_us=args.hold_us,
                           **common)  # type: ignore[arg-type]
    if args.baseline is not None or args.baseline_only or args.hold_us != DEFAULT_HOLD_US:
        raise GroupUsageError("--baseline and --hold-us apply to lock_lat: barrier_lat's three algorithms are each "
                              "other's baseline")
    if args.arity < 2:
        raise GroupUsageError("--arity must be at least 2")
    if args.daemons is not None and not 1 <= args.daemons <= 253:
        raise GroupUsageError("--daemons must be between 1 and 253")
    if args.plot is not None:
        from .plot import require_matplotlib

        require_matplotlib()  # fail before the run, not after it
    algorithms = ALGORITHMS if args.algorithm == "all" else (args.algorithm,)
    procs = _procs(args.procs) if args.procs is not None else DEFAULT_PROCS
    return GroupParams(procs=procs, algorithms=algorithms, arity=args.arity, daemons=args.daemons, plot=args.plot,
                       **common)  # type: ignore[arg-type]


# -- the runs -------------------------------------------------------------------------------
def _warmup(iters: int) -> int:
    from .perf import warmup_iters

    return warmup_iters(iters)


class Printer:
    """Prints rows as they come: a banner and a table, or JSON lines."""

    def __init__(self, params: GroupParams, out: TextIO) -> None:
        self.params, self.out = params, out
        self.rows: list[GroupRow] = []

    def banner(self, title: str, settings: list[tuple[str, str]], columns: str) -> None:
        if self.params.json_out:
            return
        for line in banner(title, settings, None, None):
            print(line, file=self.out)
        print(columns, file=self.out, flush=True)

    def row(self, row: GroupRow) -> None:
        self.rows.append(row)
        text = json.dumps(row_json(row)) if self.params.json_out else format_row(row)
        print(text, file=self.out, flush=True)

    def end(self) -> None:
        if not self.params.json_out:
            print(RESULT_LINE, file=self.out, flush=True)


def _placement_text(daemon_cpus: Sequence[frozenset[int] | None], rank_cpus: Sequence[frozenset[int] | None]) -> str:
    def cpus(s: frozenset[int] | None) -> str:
        return "any" if s is None else ",".join(map(str, sorted(s)))
    if all(c is None for c in (*daemon_cpus, *rank_cpus)):
        return "not pinned"
    ranks = sorted({cpus(c) for c in rank_cpus})
    return (f"daemons CPU {' '.join(cpus(c) for c in daemon_cpus)}; "
            f"ranks CPU {' '.join(cpus(c) for c in rank_cpus) if len(rank_cpus) <= 8 else '/'.join(ranks)}")


def cpu_seconds(pids: Sequence[int]) -> float:
    """The CPU time (user + system) the processes ``pids`` have used so far, in seconds (0 for one gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)
    return total / tick


def _stats(samples_ns: Sequence[int], what: str) -> LatencyStats:
    if not samples_ns:
        raise GroupRunError(f"{what}: no sample")
    return latency_stats(list(samples_ns))


@dataclass(frozen=True)
class _LockCase:
    """One row of lock_lat: what it measures, which phase the ranks run, who runs it, which lock."""

    lock: str
    case: str
    phase: str
    ranks: tuple[int, ...]
    lock_id: int | None = None


def _lock_cases(params: GroupParams, members: Sequence[tuple[str, int]]) -> list[_LockCase]:
    """lock_lat's rows in the order they are printed (see the module docstring)."""
    cases = []
    if params.baseline:
        cases += [_LockCase("atomic", "round-trip-own", "atomic", (0,)),
                  _LockCase("atomic", "round-trip-remote", "atomic", (1,)),
                  _LockCase("cas-lock", "uncontended-own", "cas-uncontended", (0,)),
                  _LockCase("cas-lock", "uncontended-remote", "cas-uncontended", (1,)),
                  _LockCase("cas-lock", "handoff", "cas-handoff", (0, 1))]
    if not params.baseline_only:
        own = lock_managed_by(members[0], members)
        other = lock_managed_by(members[1], members)
        cases += [_LockCase("group", "uncontended-own", "group-uncontended", (0,), own),
                  _LockCase("group", "uncontended-remote", "group-uncontended", (0,), other),
                  _LockCase("group", "handoff", "group-handoff", (0, 1),
                            lock_managed_by(members[0], members, start=max(own, other) + 1))]
    return cases


def _chunks(iters: int) -> list[int]:
    """``iters`` shared out among at most LOCK_ROUNDS rounds (none empty)."""
    n = min(LOCK_ROUNDS, iters)
    return [iters // n + (1 if k < iters % n else 0) for k in range(n)]


def run_lock_lat(params: GroupParams, out: TextIO) -> list[GroupRow]:
    """lock_lat: 2 ranks on 2 daemons; rows as the module docstring says.

    The iterations of every row are run in LOCK_ROUNDS rounds, each round
    going over all the rows in turn, so that what the host does meanwhile
    weighs on every row alike (the rows are compared with each other).
    Raises: GroupRunError, LocalRunError.
    """
    p = params
    pl = local.default_placement(p.pin)
    daemon_cpus = [pl.server_daemon, pl.client_daemon] if pl else [None, None]
    rank_cpus = [pl.server_app, pl.client_app] if pl else [None, None]
    printer = Printer(p, out)
    with local.LocalDaemons(mtu=p.mtu, daemon_args=p.daemon_args, count=2, daemon_cpus=daemon_cpus) as daemons, \
            Ranks(daemons, [0, 1], rank_cpus) as ranks:
        ranks.ask({"op": "open"}, SETUP_TIMEOUT_S)
        chunks = _chunks(p.iters)
        warmups = [_warmup(c) for c in chunks]
        settings = [("Ranks", "2, rank r on daemon r (127.0.0.2, 127.0.0.3)"),
                    ("Lock managers", "rank (lock id mod ranks)'s daemon"),
                    ("Iterations", f"{p.iters} measured in {len(chunks)} rounds over the rows, each after "
                     f"{warmups[0]} warm-up"),
                    ("Hand-off", f"each holder holds the lock {p.hold_us} usec, not counted")]
        if p.baseline:
            settings.append(("Baseline", "cas-lock: Compare-and-Swap spin lock on a 64-bit word in rank 0's memory"
                             + (" (only)" if p.baseline_only else "")))
        if p.daemon_args:
            settings.append(("Daemon flags", " ".join(p.daemon_args)))
        settings.append(("CPU placement", _placement_text(daemon_cpus, rank_cpus)))
        printer.banner("Lock Latency Test (udpverbs process group)", settings, LOCK_COLUMNS)
        if not p.baseline_only:
            ranks.ask({"op": "group"}, SETUP_TIMEOUT_S)
        if p.baseline:
            table = ranks.ask({"op": "cas-open"}, SETUP_TIMEOUT_S)
            ranks.ask({"op": "cas-connect", "table": table}, SETUP_TIMEOUT_S)
        cases = _lock_cases(p, ranks.members)
        got: dict[_LockCase, dict[str, list[int]]] = {c: {} for c in cases}
        acquisitions = dict.fromkeys(cases, 0)
        for iters, warmup in zip(chunks, warmups):
            for c in cases:
                msg = {"op": "run", "phase": c.phase, "ranks": list(c.ranks), "iters": iters, "warmup": warmup,
                       "lock": c.lock_id, "hold_us": p.hold_us}
                ans = ranks.ask(msg, RUN_TIMEOUT_S)
                if c.case == "handoff":
                    samples, n = handoff_samples([a["acquired"] for a in ans], [a["released"] for a in ans])
                    got[c].setdefault("samples", []).extend(samples)
                    acquisitions[c] += n
                    continue
                for key, values in ans[c.ranks[0]].items():
                    if key != "op":
                        got[c].setdefault(key, []).extend(values)
        atomic_remote: float | None = None
        for c in cases:
            stats = _stats(got[c]["samples"], f"{c.lock} {c.case}")
            row = GroupRow("lock_lat", 2, 2, stats, c.lock, c.case)
            if c.case.startswith("uncontended"):
                row = dataclasses.replace(row, acquire_us=_stats(got[c]["acquire"], "acquire").t_typical_us,
                                          release_us=_stats(got[c]["release"], "release").t_typical_us)
            if c.case == "handoff":
                row = dataclasses.replace(row, acquisitions=acquisitions[c], hold_us=p.hold_us)
            if c.lock == "atomic" and c.case == "round-trip-remote":
                atomic_remote = stats.t_typical_us
            elif c.lock != "atomic" and atomic_remote:
                row = dataclasses.replace(row, ratio_to_atomic=stats.t_typical_us / atomic_remote)
            printer.row(row)
    printer.end()
    return printer.rows


def run_barrier_lat(params: GroupParams, out: TextIO) -> list[GroupRow]:
    """barrier_lat: for each P, fresh daemons and ranks, every algorithm in turn.  Raises: GroupRunError, LocalRunError."""
    p = params
    printer = Printer(p, out)
    iters, warmup = p.iters, _warmup(p.iters)
    settings = [("Ranks", f"{','.join(map(str, p.procs))}; rank r of P on daemon r*M//P"),
                ("Daemons (M)", f"{p.daemons or f'min({DEFAULT_DAEMONS}, P)'} on 127.0.0.2, 127.0.0.3, ..."),
                ("Algorithms", ", ".join(f"{a} (arity {p.arity})" if a == "tree" else a for a in p.algorithms)),
                ("Iterations", f"{iters} consecutive barriers measured after {warmup} warm-up"),
                ("Sample", "from the last rank's return from one barrier to the last's from the next"),
                ("CPU", "CPU time of all ranks and daemons per barrier")]
    if p.daemon_args:
        settings.append(("Daemon flags", " ".join(p.daemon_args)))
    settings.append(("CPU placement", "daemon d on CPU d mod n, its ranks on CPU (d+1) mod n" if p.pin
                     else "not pinned"))
    printer.banner("Barrier Latency Test (udpverbs process group)", settings, BARRIER_COLUMNS)
    cpus = sorted(os.sched_getaffinity(0)) if p.pin else [0]
    for procs in p.procs:
        m = p.daemons_for(procs)
        rank_daemons = [local.block_placement(r, procs, m) for r in range(procs)]
        daemon_cpus, rank_cpus = spread_placement(m, rank_daemons, cpus)
        with local.LocalDaemons(mtu=p.mtu, daemon_args=p.daemon_args, count=m, daemon_cpus=daemon_cpus) as daemons, \
                Ranks(daemons, rank_daemons, rank_cpus) as ranks:
            ranks.ask({"op": "open"}, SETUP_TIMEOUT_S)
            ranks.ask({"op": "group"}, SETUP_TIMEOUT_S)
            pids = ([proc.pid for proc in ranks.procs], [c.proc.pid for c in daemons.children])
            for algorithm in p.algorithms:
                arity = p.arity if algorithm == "tree" else None
                before = [cpu_seconds(group) for group in pids]
                ans = ranks.ask({"op": "run", "phase": "barrier", "algorithm": algorithm, "arity": arity,
                                 "iters": iters, "warmup": warmup}, RUN_TIMEOUT_S)
                cpu = tuple(1e6 * (cpu_seconds(group) - b) / (iters + warmup) for group, b in zip(pids, before))
                samples = barrier_samples([a["exits"] for a in ans])
                printer.row(GroupRow("barrier_lat", procs, m, _stats(samples, f"{algorithm} at P={procs}"),
                                     algorithm=algorithm, arity=arity, cpu_us=cpu))  # type: ignore[arg-type]
    printer.end()
    if p.plot:
        plot_barriers(printer.rows, p.plot)
        print(f"plot written to {p.plot}", file=sys.stderr)
    return printer.rows


def plot_barriers(rows: Sequence[GroupRow], path: str, title: str | None = None) -> str:
    """Draw barrier latency (typical, and p99 faintly) against P, one line per algorithm, log2 x axis.

    ``title``: the figure's (default: names the test and the daemons).

    Raises: PlotUnavailable without matplotlib; ValueError without barrier rows.
    """
    from .plot import require_matplotlib

    rows = [r for r in rows if r.test == "barrier_lat"]
    if not rows:
        raise ValueError("nothing to plot: no barrier_lat rows")
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for k, algorithm in enumerate(dict.fromkeys(r.algorithm for r in rows)):
        rs = sorted((r for r in rows if r.algorithm == algorithm), key=lambda r: r.procs)
        xs = [r.procs for r in rs]
        color = f"C{k}"
        label = f"{algorithm} (arity {rs[0].arity})" if rs[0].arity else str(algorithm)
        ax.plot(xs, [r.stats.t_typical_us for r in rs], "o-", color=color, label=f"{label} typical")
        ax.plot(xs, [r.stats.p99_us for r in rs], ":", color=color, alpha=0.5, label=f"{label} 99%")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks (P)")
    ax.set_ylabel("time per barrier [µs]")
    daemons = sorted({r.daemons for r in rows})
    ax.set_title(title or f"udpverbs barrier_lat ({'/'.join(map(str, daemons))} daemons)", fontsize="medium")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Sequence[str], out: TextIO | None = None) -> int:
    """``udpverbs perf lock_lat|barrier_lat ...`` (``argv``: the words after ``perf``); returns 0.

    Raises: GroupUsageError or PlotUnavailable for a usage error (the
    ``udpverbs`` command's exit status 2); GroupRunError, LocalRunError or
    OSError if the run failed (1).
    """
    args = build_parser().parse_args(list(argv))
    params = params_from_args(args)
    if params.test == "lock_lat":
        run_lock_lat(params, out or sys.stdout)
    else:
        run_barrier_lat(params, out or sys.stdout)
    return 0
