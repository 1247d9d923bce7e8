"""``udpverbs run``: start a job's daemons and ranks on this host, as mpirun does.

Theory of operation
-------------------
A *job* is N copies (*ranks*) of one command, each told by its environment
which device to open and who the others are (the ``ENV_*`` contract of
:mod:`udpverbs.verbs.group`): its rank, the job's size, the job's name and
the *member list*, where member r is the address (IP, UDP port) of rank r's
daemon.  Two ways to get daemons:

* **local** (default): M daemons ``uv0..uv{M-1}`` on 127.0.0.2, 127.0.0.3, …
  with ephemeral UDP ports (each reports its port on its readiness pipe,
  :func:`udpverbs.bench.local.spawn`) and their control sockets in a private
  temporary runtime directory; rank r uses daemon ``r * M // N`` (block
  placement, mpirun's default "map by slot").
* **--hosts FILE**: the daemons are already running, possibly on other hosts
  (:func:`parse_hosts` gives the file's format).  Every host runs its own
  launcher for its slice of the ranks (``--rank-base B -n N``: ranks
  B..B+N-1); the member list is the same on all of them.

One thread supervises everything through one selector: every rank's stdout
and stderr pipe (each complete line goes out at once with a ``[rank] ``
prefix, in one write, so lines never mix), and a pidfd per child (readable
when it exits, so exits are seen without polling or SIGCHLD).  The first
rank to exit non-zero (or be killed by signal S: 128+S) sets the job's
status; the other ranks then get SIGTERM and, after a grace period, SIGKILL.
SIGINT, SIGTERM and SIGHUP to the launcher do the same with status 128+S
(Ctrl-C: 130), and ``--timeout`` with 124.  Whatever happens, every process
started is stopped by its pid (ranks first, then daemons) and the private
runtime directory is removed; children run in process groups of their own,
so a terminal's Ctrl-C reaches only the launcher, which stops them in that
order.  A signal arriving while a child is being started is held until the
child is recorded, so none escapes the clean-up.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Callable, Iterator, Mapping, Sequence

from .bench import local, verbs_perf
from .daemon.config import DEFAULT_MTU, DEFAULT_NAME
from .verbs.group import ENV_DEVICE, ENV_RUNTIME_DIR, format_members
from .wire import ctl

#: Local daemon i binds 127.0.0.(2 + i) (``bench.local.daemon_ip``); the last usable is .254.
MAX_LOCAL_DAEMONS = local.MAX_DAEMONS
#: A line longer than this goes out in pieces (a rank printing without newlines must not fill our memory).
MAX_LINE_BYTES = 1 << 16
#: Exit status of a job stopped by ``--timeout`` (as timeout(1)).
TIMEOUT_STATUS = 124
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_DEVICE_NAME = re.compile(r"[A-Za-z0-9_.-]+\Z")


class RunUsageError(ValueError):
    """The ``udpverbs run`` command line or its hosts file is wrong (exit status 2)."""


class HostsFileError(RunUsageError):
    """The ``--hosts`` file is malformed; the message names the file and line."""


class Interrupted(Exception):
    """The launcher got SIGINT, SIGTERM or SIGHUP; its exit status is 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# -- the job's plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostLine:
    """One daemon of a ``--hosts`` file: its address, UDP port, slots and device name (None: not given)."""

    address: str
    port: int
    slots: int = 1
    device: str | None = None


@dataclass(frozen=True)
class Plan:
    """What every rank started here is told.

    ``members``: the whole job's member list, rank order; ``here``: the
    (rank, device name) of each rank this launcher starts.
    """

    group: str
    members: tuple[tuple[str, int], ...]
    here: tuple[tuple[int, str], ...]
    runtime_dir: str

    def env(self, rank: int, device: str, base: Mapping[str, str]) -> dict[str, str]:
        """The environment of ``rank``: ``base`` plus the ``ENV_*`` contract and unbuffered Python output."""
        return local.rank_environment(rank, self.members, device=device, runtime_dir=self.runtime_dir,
                                      group=self.group, base=base)


block_placement = local.block_placement


def local_plan(daemons: Sequence[tuple[str, str, int]], size: int, group: str, runtime_dir: str) -> Plan:
    """The plan of a local job: ``size`` ranks over ``daemons`` (name, IP, UDP port), block placement."""
    homes = [daemons[block_placement(r, size, len(daemons))] for r in range(size)]
    return Plan(group=group, members=tuple((ip, port) for _, ip, port in homes),
                here=tuple((r, name) for r, (name, _, _) in enumerate(homes)), runtime_dir=runtime_dir)


def hosts_plan(lines: Sequence[HostLine], rank_base: int, count: int | None, default_device: str, group: str,
               runtime_dir: str) -> Plan:
    """The plan of a ``--hosts`` job: each line's address ``slots`` times, in file order, makes the member list.

    Takes: the parsed file; the first rank started here and how many (None:
    all the rest); the device of a rank whose line names none.
    Raises: RunUsageError if the ranks asked for are not all in the job.
    """
    homes = [line for line in lines for _ in range(line.slots)]
    size = len(homes)
    ranks = f"{size} rank{'s' if size != 1 else ''} (0..{size - 1})"
    if rank_base >= size:
        raise RunUsageError(f"--rank-base {rank_base} is not in the job: the hosts file makes a job of {ranks}")
    if count is None:
        count = size - rank_base
    if rank_base + count > size:
        raise RunUsageError(f"ranks {rank_base}..{rank_base + count - 1} asked for (--rank-base {rank_base} -n "
                            f"{count}), but the hosts file makes a job of {ranks}")
    return Plan(group=group, members=tuple((h.address, h.port) for h in homes),
                here=tuple((r, homes[r].device or default_device) for r in range(rank_base, rank_base + count)),
                runtime_dir=runtime_dir)


def parse_hosts(text: str, source: str = "hosts file") -> list[HostLine]:
    """Parse a ``--hosts`` file.

    Format: one daemon per line, ``ADDRESS PORT [slots=K] [device=NAME]``:
    ADDRESS is the daemon's IP address (its ``--addr``, a literal: names are
    not resolved), PORT its UDP port, K how many ranks it serves (default 1),
    NAME its device name (its ``--name``), which the ranks started on its host
    open.  ``#`` starts a comment; blank lines are skipped.  The member list
    is each line repeated K times, in file order, and the job's size is the
    sum of the slots.

    Returns: the lines, in order.
    Raises: HostsFileError naming ``source`` and the line.
    """
    out: list[HostLine] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{source}:{lineno}"
        if len(words) < 2:
            raise HostsFileError(f"{where}: expected 'ADDRESS PORT [slots=K] [device=NAME]', got {raw.strip()!r}")
        try:
            address = str(ipaddress.ip_address(words[0]))
        except ValueError:
            raise HostsFileError(f"{where}: {words[0]!r} is not an IP address") from None
        port = _whole(words[1], 1, 65535, f"{where}: port")
        options: dict[str, str] = {}
        for word in words[2:]:
            key, sep, value = word.partition("=")
            if not sep or key not in ("slots", "device"):
                raise HostsFileError(f"{where}: unknown field {word!r} (expected slots=K or device=NAME)")
            if key in options:
                raise HostsFileError(f"{where}: {key}= given twice")
            options[key] = value
        slots = _whole(options.get("slots", "1"), 1, 1 << 16, f"{where}: slots")
        device = options.get("device")
        if device is not None and not _DEVICE_NAME.match(device):
            raise HostsFileError(f"{where}: device={device!r} is not a device name (letters, digits, '_.-')")
        out.append(HostLine(address, port, slots, device))
    if not out:
        raise HostsFileError(f"{source}: names no daemon")
    return out


def _whole(text: str, low: int, high: int, what: str) -> int:
    if not text.isdigit() or not low <= int(text) <= high:
        raise HostsFileError(f"{what} must be a whole number from {low} to {high}, got {text!r}")
    return int(text)


# -- options -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunOptions:
    """``udpverbs run``'s command line (see ``udpverbs run --help``); check it with :meth:`check`."""

    command: tuple[str, ...]
    ranks: int | None = None
    daemons: int | None = None
    daemon_args: tuple[str, ...] = ()
    hosts: str | None = None
    rank_base: int | None = None
    device: str | None = None
    name: str | None = None
    timeout_s: float | None = None
    grace_s: float = local.STOP_GRACE_S
    verbose: bool = False

    def check(self) -> "RunOptions":
        """Return self if the options make sense together.

        Raises: RunUsageError naming the problem.  (``--daemon-arg``'s flags
        are checked by ``bench.local.check_daemon_args``.)
        """
        if not self.command:
            raise RunUsageError("no command: write it after '--', e.g. udpverbs run -n 2 -- python job.py")
        if self.ranks is not None and self.ranks < 1:
            raise RunUsageError(f"-n must be 1 or more, got {self.ranks}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise RunUsageError(f"--timeout must be more than 0 seconds, got {self.timeout_s:g}")
        if not 0 <= self.grace_s <= 3600:
            raise RunUsageError(f"--grace must be from 0 to 3600 seconds, got {self.grace_s:g}")
        if self.name is not None and not self.name.strip():
            raise RunUsageError("--name must not be empty")
        if self.hosts is None:
            self._check_local()
        else:
            self._check_hosts()
        return self

    def _check_local(self) -> None:
        for given, flag in ((self.rank_base, "--rank-base"), (self.device, "--device")):
            if given is not None:
                raise RunUsageError(f"{flag} goes with --hosts: a local job names its own daemons")
        if self.ranks is None:
            raise RunUsageError("-n N is required: how many ranks to start")
        m = self.local_daemons
        if not 1 <= m <= MAX_LOCAL_DAEMONS:
            raise RunUsageError(f"--daemons must be from 1 to {MAX_LOCAL_DAEMONS}, got {m}")
        if m > self.ranks:
            raise RunUsageError(f"--daemons {m} is more than -n {self.ranks}: a daemon would serve no rank")

    def _check_hosts(self) -> None:
        if self.daemons is not None:
            raise RunUsageError("--daemons goes without --hosts: the hosts file names the daemons")
        if self.daemon_args:
            raise RunUsageError("--daemon-arg goes without --hosts: a daemon you started keeps the flags you gave it")
        if self.rank_base is not None and self.rank_base < 0:
            raise RunUsageError(f"--rank-base must be 0 or more, got {self.rank_base}")
        if self.device is not None and not _DEVICE_NAME.match(self.device):
            raise RunUsageError(f"--device {self.device!r} is not a device name (letters, digits, '_.-')")

    @property
    def local_daemons(self) -> int:
        """How many daemons a local job starts (``--daemons``, default 1)."""
        return 1 if self.daemons is None else self.daemons


def default_group_name() -> str:
    """A job name unique to this launch: ``run-<pid>-<unix time>``."""
    return f"run-{os.getpid()}-{int(time.time())}"


def read_hosts_plan(opts: RunOptions, environ: Mapping[str, str]) -> Plan:
    """Read ``opts.hosts`` and make the plan of the ranks started here.

    Raises: RunUsageError (HostsFileError for the file's content) if the file
    cannot be read, is malformed, or the ranks asked for are not in the job;
    or if ranks elsewhere would not learn this launch's default group name.
    """
    assert opts.hosts is not None
    try:
        with open(opts.hosts, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise RunUsageError(f"--hosts {opts.hosts}: {e}") from None
    lines = parse_hosts(text, opts.hosts)
    device = opts.device or environ.get(ENV_DEVICE) or DEFAULT_NAME
    base = opts.rank_base or 0
    plan = hosts_plan(lines, base, opts.ranks, device, opts.name or default_group_name(),
                      environ.get(ENV_RUNTIME_DIR) or ctl.runtime_dir())
    if opts.name is None and len(plan.here) != len(plan.members):
        raise RunUsageError("--name is required when the ranks here are not the whole job: "
                            "every launcher of the job must give the same group name")
    return plan


# -- running -------------------------------------------------------------------------------------------


class _SignalGuard:
    """SIGINT/SIGTERM/SIGHUP become :class:`Interrupted` while armed; otherwise they are only recorded.

    Installed only in the main thread (elsewhere Python cannot set handlers),
    and not over a signal we were started ignoring (``nohup``, a shell's
    background job); the previous handlers come back at the end.
    """

    def __init__(self) -> None:
        self.pending: int | None = None
        self._armed = False
        self._old: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}

    def __enter__(self) -> "_SignalGuard":
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                if signal.getsignal(s) != signal.SIG_IGN:
                    self._old[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        self._armed = False
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.pending is None:
            self.pending = signum
        if self._armed:
            self._armed = False  # one raise: the clean-up that follows must not be cut short
            raise Interrupted(signum)

    def arm(self) -> None:
        """Raise :class:`Interrupted` now for a signal already recorded, and at the next one."""
        if self.pending is not None:
            raise Interrupted(self.pending)
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold signals while a child starts, so that it is recorded (and later stopped) before we react;
        one that came meanwhile is raised when the block ends (if it raised nothing itself)."""
        was = self._armed
        self._armed = False
        try:
            yield
        finally:
            self._armed = was
        if was:
            self.arm()


class _Sink:
    """Where prefixed lines go (our stdout or stderr); a reader that went away is ignored from then on."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream: IO[bytes] | None = stream

    def write(self, data: bytes) -> None:
        if self.stream is None:
            return
        try:
            self.stream.write(data)
            self.stream.flush()
        except (BrokenPipeError, ValueError):
            self.stream = None


class _Lines:
    """One rank's stdout or stderr: whole lines out, each with the rank's prefix, in one write per read."""

    def __init__(self, pipe: IO[bytes], prefix: bytes, sink: _Sink) -> None:
        self.pipe = pipe
        self.fd = pipe.fileno()
        os.set_blocking(self.fd, False)
        self.prefix = prefix
        self.sink = sink
        self.buf = b""

    def feed(self, data: bytes) -> None:
        self.buf += data
        head, sep, self.buf = self.buf.rpartition(b"\n")
        out = b"".join(self.prefix + line + b"\n" for line in head.split(b"\n")) if sep else b""
        if len(self.buf) >= MAX_LINE_BYTES:
            out += self.prefix + self.buf + b"\n"
            self.buf = b""
        if out:
            self.sink.write(out)

    def finish(self) -> None:
        """The stream ended: a last line without a newline still goes out, with one added."""
        if self.buf:
            self.sink.write(self.prefix + self.buf + b"\n")
            self.buf = b""


@dataclass
class _Daemon:
    name: str
    child: local.Child
    ip: str = ""
    port: int = 0
    pidfd: int | None = None


@dataclass
class _Rank:
    rank: int
    device: str
    proc: subprocess.Popen[bytes]
    pidfd: int | None = None  # registered with the selector until the rank is reaped
    streams: list[_Lines] = field(default_factory=list)
    reaped: bool = False


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: its exit code, or 128 + S if signal S killed it."""
    return returncode if returncode >= 0 else 128 - returncode


class Job:
    """One launch: the daemons (local jobs), the ranks, their output, their exit, and the clean-up.

    Takes: the checked options; the environment the ranks inherit (default
    ours); where the ranks' stdout and stderr lines go (default ours).
    Use :meth:`run` once.
    """

    def __init__(self, opts: RunOptions, *, environ: Mapping[str, str] | None = None,
                 stdout: IO[bytes] | None = None, stderr: IO[bytes] | None = None) -> None:
        self.opts = opts
        self.environ = dict(os.environ if environ is None else environ)
        self.out = _Sink(stdout or sys.stdout.buffer)
        self.err = _Sink(stderr or sys.stderr.buffer)
        self.daemons: list[_Daemon] = []
        self.ranks: list[_Rank] = []
        self.runtime_dir: str | None = None  # ours to remove (local jobs)
        self.status: int | None = None
        self.sel = selectors.DefaultSelector()
        self._kill_at: float | None = None
        self._deadline: float | None = None

    def say(self, text: str) -> None:
        """One line of the launcher's own on stderr."""
        sys.stderr.flush()
        self.err.write(f"udpverbs run: {text}\n".encode())

    def run(self) -> int:
        """Start everything, supervise until every rank has exited, stop everything.

        Returns: the job's exit status (0, the first failing rank's, 124 on
        timeout, 128+S on signal S, 127/126 if the command cannot be started,
        1 if a daemon failed).
        Raises: RunUsageError from the hosts file; local.LocalRunError if a
        daemon does not start (everything started is stopped first).
        """
        if self.opts.timeout_s is not None:
            self._deadline = time.monotonic() + self.opts.timeout_s
        with _SignalGuard() as guard:
            try:
                try:
                    guard.arm()
                    self._start(guard)
                    self._supervise()
                finally:
                    guard.disarm()
            except Interrupted as e:
                self.say(f"{signal.Signals(e.signum).name}: stopping every process started")
                self._set_status(128 + e.signum)
            finally:
                self._clean_up()
        return self.status or 0

    # -- start ---------------------------------------------------------------------------------------------

    def _start(self, guard: _SignalGuard) -> None:
        if self.opts.hosts is not None:
            plan = read_hosts_plan(self.opts, self.environ)
        else:
            plan = self._start_daemons(guard)
        if self.opts.verbose:
            self.say(f"job {plan.group}: ranks {plan.here[0][0]}..{plan.here[-1][0]} of {len(plan.members)} here, "
                     f"members {format_members(plan.members)}, runtime dir {plan.runtime_dir}")
        for rank, device in plan.here:
            if not self._start_rank(guard, rank, device, plan.env(rank, device, self.environ)):
                return

    def _start_daemons(self, guard: _SignalGuard) -> Plan:
        self.runtime_dir = tempfile.mkdtemp(prefix="udpverbs-run-")
        for i in range(self.opts.local_daemons):
            name, ip = f"uv{i}", local.daemon_ip(i)
            argv = verbs_perf.daemon_command(ip, name, os.path.join(self.runtime_dir, f"{name}.sock"), DEFAULT_MTU,
                                             self.opts.daemon_args)
            with guard.held():
                self.daemons.append(_Daemon(name, local.spawn(argv, stdout=subprocess.DEVNULL, own_group=True)))
        for d in self.daemons:
            d.ip, d.port = local.daemon_address(d.child.wait_ready(), f"daemon {d.name}")
            d.pidfd = os.pidfd_open(d.child.proc.pid)
            self.sel.register(d.pidfd, selectors.EVENT_READ, lambda d=d: self._daemon_exited(d))
            if self.opts.verbose:
                self.say(f"daemon {d.name} pid {d.child.proc.pid} at {d.ip}:{d.port}")
        assert self.opts.ranks is not None
        return local_plan([(d.name, d.ip, d.port) for d in self.daemons], self.opts.ranks,
                          self.opts.name or default_group_name(), self.runtime_dir)

    def _start_rank(self, guard: _SignalGuard, rank: int, device: str, env: dict[str, str]) -> bool:
        """Start one rank; False (and the job's status set, as a shell's) if the command cannot run."""
        with guard.held():
            try:
                proc = subprocess.Popen(self.opts.command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, process_group=0)
            except OSError as e:
                self.say(f"cannot start rank {rank}: {self.opts.command[0]}: {e.strerror or e}")
                self._stop_ranks(127 if e.errno == errno.ENOENT else 126 if e.errno == errno.EACCES else 1)
                return False
            r = _Rank(rank, device, proc)
            self.ranks.append(r)
        r.pidfd = os.pidfd_open(proc.pid)
        assert proc.stdout is not None and proc.stderr is not None
        prefix = f"[{rank}] ".encode()
        for pipe, sink in ((proc.stdout, self.out), (proc.stderr, self.err)):
            lines = _Lines(pipe, prefix, sink)
            r.streams.append(lines)
            self.sel.register(lines.fd, selectors.EVENT_READ, lambda r=r, lines=lines: self._readable(r, lines))
        self.sel.register(r.pidfd, selectors.EVENT_READ, lambda r=r: self._rank_exited(r))
        if self.opts.verbose:
            self.say(f"rank {rank} pid {proc.pid} on {device}")
        return True

    # -- supervise -----------------------------------------------------------------------------------------

    def _supervise(self) -> None:
        while any(not r.reaped for r in self.ranks):
            wake = min((t for t in (self._deadline, self._kill_at) if t is not None), default=None)
            timeout = None if wake is None else max(0.0, wake - time.monotonic())
            for key, _ in self.sel.select(timeout):
                key.data()
            now = time.monotonic()
            if self._deadline is not None and now >= self._deadline:
                self._deadline = None
                self.say(f"--timeout {self.opts.timeout_s:g} s reached: stopping every rank")
                self._stop_ranks(TIMEOUT_STATUS)
            if self._kill_at is not None and now >= self._kill_at:
                self._kill_at = None
                for r in self.ranks:
                    if r.proc.poll() is None:
                        r.proc.kill()

    def _readable(self, r: _Rank, lines: _Lines) -> None:
        if lines not in r.streams:  # closed by an earlier event of the same select
            return
        if not self._read(lines):
            self._close_stream(r, lines)

    @staticmethod
    def _read(lines: _Lines) -> bool:
        """Read what the pipe holds now; False at its end."""
        while True:
            try:
                data = os.read(lines.fd, 1 << 16)
            except BlockingIOError:
                return True
            if not data:
                return False
            lines.feed(data)

    def _close_stream(self, r: _Rank, lines: _Lines) -> None:
        r.streams.remove(lines)
        lines.finish()
        self.sel.unregister(lines.fd)
        lines.pipe.close()

    def _rank_exited(self, r: _Rank) -> None:
        if r.reaped:
            return
        code = r.proc.wait()
        self._reaped(r)
        # Everything it wrote is in its pipes now; what a child of its own writes later is dropped.
        for lines in list(r.streams):
            self._read(lines)
            self._close_stream(r, lines)
        if code != 0 and self.status is None:
            self.say(f"rank {r.rank} (pid {r.proc.pid}) exited with status {exit_status(code)}"
                     f"{'' if len(self.ranks) == 1 else ': stopping the other ranks'}")
            self._stop_ranks(exit_status(code))

    def _reaped(self, r: _Rank) -> None:
        r.reaped = True
        if r.pidfd is not None:
            self.sel.unregister(r.pidfd)
            os.close(r.pidfd)
            r.pidfd = None

    def _daemon_exited(self, d: _Daemon) -> None:
        if d.pidfd is None:
            return
        code = d.child.proc.wait()
        self.sel.unregister(d.pidfd)
        os.close(d.pidfd)
        d.pidfd = None
        if self.status is None:
            self.say(f"daemon {d.name} (pid {d.child.proc.pid}) exited with status {exit_status(code)}: "
                     "stopping every rank")
            self._stop_ranks(1)

    def _set_status(self, status: int) -> None:
        if self.status is None:
            self.status = status

    def _stop_ranks(self, status: int) -> None:
        """The job failed with ``status``: SIGTERM to the ranks still running, SIGKILL after the grace."""
        self._set_status(status)
        self._deadline = None
        for r in self.ranks:
            if r.proc.poll() is None:
                r.proc.terminate()
        self._kill_at = time.monotonic() + self.opts.grace_s

    # -- clean up ------------------------------------------------------------------------------------------

    def _clean_up(self) -> None:
        """Stop every rank, then every daemon, by pid; remove our runtime dir; print what the ranks left
        in their pipes.  It relies on no state a signal may have cut short: only on the lists of children."""
        try:
            local.stop_processes([r.proc for r in self.ranks], self.opts.grace_s)
            local.stop_processes([d.child.proc for d in self.daemons])  # theirs, not --grace: they shut down cleanly
        finally:
            try:
                for d in self.daemons:
                    d.child.stop()  # the readiness pipe, if it was never read
                if self.runtime_dir is not None:
                    shutil.rmtree(self.runtime_dir, ignore_errors=True)
                    self.runtime_dir = None
            finally:
                self._release()

    def _release(self) -> None:
        """Print what the (stopped) ranks left in their pipes and close every descriptor we hold."""
        for r in self.ranks:
            for lines in r.streams:
                with contextlib.suppress(OSError):
                    self._read(lines)
                lines.finish()
                lines.pipe.close()
            r.streams.clear()
        for fd_owner in (*self.ranks, *self.daemons):
            if fd_owner.pidfd is not None:
                os.close(fd_owner.pidfd)
                fd_owner.pidfd = None
        self.sel.close()  # closing a descriptor took it out of the epoll set already


def run(opts: RunOptions, **kw: object) -> int:
    """Check ``opts`` and run the job (keywords: as :class:`Job`).

    Returns: the job's exit status.
    Raises: RunUsageError; local.LocalRunError if a daemon does not start.
    """
    return Job(opts.check(), **kw).run()  # type: ignore[arg-type]
