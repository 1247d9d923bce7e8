"""``--local``: both sides of a benchmark on this host, with nothing to set up.

Theory of operation
-------------------
``udpverbs perf TEST --local`` stands for two hosts with two loopback
addresses, 127.0.0.2 (server) and 127.0.0.3 (client): Linux answers on all
of 127.0.0.0/8 without configuration.  When udpverbs itself is measured,
one daemon per "host" is started (:class:`LocalDaemons`), and at the same
time the server side as a child process of this one (:func:`spawn_server`;
it opens its daemon only when the client asks, by then ready), so the two
sides are two processes, as on two hosts, and this process is the client.

Two hosts would not share CPUs; here four busy processes share this host's.
On a 2-CPU host the scheduler, left alone, often puts an application on its
own daemon's CPU, and every handover between them is then a context switch.
So each process is pinned (:func:`crossed_placement`): each daemon has a CPU
of its own, and each application shares the *other* side's daemon's CPU.  A
one-way trip (application, its daemon, the peer daemon, the peer
application) then alternates CPUs: the next process on the path is already
running on the other CPU when the previous one hands over.  Measured on
2 vCPUs (4 alternating runs each, medians, against no pinning): write_bw at
1500 B 343 against 279 MB/s, write_lat 156 against 186 µs, read_lat 286
against 335 µs; "each application on its own daemon's CPU" was the worst
placement.  With four CPUs or more each process gets one; ``--no-pin``
leaves placement to the scheduler.  The raw-UDP baseline runs in the two
applications, so its sides are on different CPUs too, as on two hosts.

A process group's benchmarks (``udpverbs perf lock_lat|barrier_lat``,
:mod:`udpverbs.bench.group_perf`) start M daemons the same way, on
127.0.0.2, 127.0.0.3, ... (:func:`daemon_ip`), and learn each one's UDP port
from its ready line.

Every child reports readiness on a pipe whose write end it inherits
(``--ready-fd N``): the parent blocks on the read end with a timeout instead
of sleeping or retrying a connect.  Children are stopped by pid in
``finally`` (terminate, then kill after a grace period), whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import IO, Iterable, Iterator, Mapping, Sequence

#: The two "hosts" of a local run.
SERVER_IP = "127.0.0.2"
CLIENT_IP = "127.0.0.3"
READY_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0
REPORT_GRACE_S = 1.0  # a failed run: how long the server may take to say why it failed
#: A finished client: how long the server may take to check its side and
#: close.  Not a speed limit but a hang guard: on a loaded host closing a
#: context after a sweep has taken over 5 s.
SERVER_EXIT_S = 30.0


class LocalRunError(Exception):
    """A local child process failed to start or to report readiness."""


class Child:
    """A child process started with a readiness pipe (see :func:`spawn`)."""

    def __init__(self, proc: subprocess.Popen[bytes], ready_r: int, what: str) -> None:
        self.proc = proc
        self._ready_r: int | None = ready_r
        self.what = what

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> str:
        """Wait for the line the child writes on its ready pipe.

        Returns: the line, without the newline.
        Raises: LocalRunError if it exits or stays silent; the child is then
        stopped before raising.
        """
        r = self._ready_r
        assert r is not None, "wait_ready called twice"
        self._ready_r = None
        try:
            line = _read_line(r, timeout_s)
        except LocalRunError:
            stop_process(self.proc)
            raise
        finally:
            os.close(r)
        if line is None:
            code = stop_process(self.proc)
            raise LocalRunError(f"{self.what} exited (status {code}) before it was ready")
        return line

    def stop(self) -> None:
        """Stop the child by pid and drop the pipe (safe twice)."""
        if self._ready_r is not None:
            os.close(self._ready_r)
            self._ready_r = None
        stop_process(self.proc)


@dataclass(frozen=True)
class Placement:
    """The CPUs each process of a local run is pinned to."""

    server_daemon: frozenset[int]
    client_daemon: frozenset[int]
    server_app: frozenset[int]
    client_app: frozenset[int]

    def describe(self, daemons: bool = True) -> str:
        """One line for the banner, e.g. ``daemons CPU 0 (server), 1 (client); applications CPU 1 (server), 0 (client)``
        (``daemons=False``: a baseline-only run, which starts none)."""
        def cpus(s: frozenset[int]) -> str:
            return ",".join(map(str, sorted(s)))
        apps = f"applications CPU {cpus(self.server_app)} (server), {cpus(self.client_app)} (client)"
        if not daemons:
            return apps
        return f"daemons CPU {cpus(self.server_daemon)} (server), {cpus(self.client_daemon)} (client); {apps}"


def crossed_placement(cpus: Iterable[int]) -> Placement | None:
    """Where the four processes of a local run go, given the CPUs this process may use.

    Four CPUs or more: one each.  Two or three: each daemon on a CPU of its
    own, each application on the other side's daemon's CPU (see the module
    docstring for why and what it measured).  One: None (nothing to place).
    """
    cpus = sorted(set(cpus))
    if len(cpus) >= 4:
        sd, cd, sa, ca = (frozenset([c]) for c in cpus[:4])
        return Placement(sd, cd, sa, ca)
    if len(cpus) >= 2:
        a, b = frozenset([cpus[0]]), frozenset([cpus[1]])
        return Placement(server_daemon=a, client_daemon=b, server_app=b, client_app=a)
    return None


def default_placement(pin: bool = True) -> Placement | None:
    """:func:`crossed_placement` over the CPUs this process may run on; None if ``pin`` is false."""
    return crossed_placement(os.sched_getaffinity(0)) if pin else None


@contextlib.contextmanager
def pinned(cpus: frozenset[int] | None) -> Iterator[None]:
    """Run this thread on ``cpus`` (None: as it is) and give it back its CPUs afterwards."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def spawn(argv: Sequence[str], *, stdout: int | IO[bytes] | None = None, cpus: frozenset[int] | None = None,
          own_group: bool = False) -> Child:
    """Start a child that will report readiness on an inherited pipe.

    Takes: the command line, where ``{ready_fd}`` in any argument is replaced
    by the number of the pipe's write end; where its stdout goes (its stderr
    is ours, so its errors are seen); the CPUs to pin it to (None: any);
    whether it gets a process group of its own (so that a terminal's Ctrl-C
    reaches only us, and we stop it in our order).
    Returns: the :class:`Child`; call ``wait_ready`` (several children may
    start at once and be waited for in turn).
    Raises: LocalRunError if it cannot be pinned (it is stopped first).
    """
    r, w = os.pipe()
    try:
        args = [a.replace("{ready_fd}", str(w)) for a in argv]
        proc = subprocess.Popen(args, pass_fds=(w,), stdout=stdout, stdin=subprocess.DEVNULL,
                                process_group=0 if own_group else None)
    except BaseException:
        os.close(r)
        os.close(w)
        raise
    os.close(w)  # only the child holds the write end now: EOF means it died
    child = Child(proc, r, " ".join(argv[:4]) + " …")
    if cpus is not None:
        # Pinned from the parent at once: the interpreter it starts is still
        # importing, well before it starts a thread that would keep the old
        # mask (threads inherit their creator's; a test checks every thread).
        try:
            os.sched_setaffinity(proc.pid, cpus)
        except OSError as e:
            child.stop()
            raise LocalRunError(f"cannot pin {child.what} to CPU {sorted(cpus)}: {e}") from None
    return child


def _read_line(fd: int, timeout_s: float) -> str | None:
    deadline = time.monotonic() + timeout_s
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise LocalRunError(f"child not ready within {timeout_s:g} s")
        readable, _, _ = select.select([fd], [], [], left)
        if not readable:
            continue
        chunk = os.read(fd, 256)
        if not chunk:
            return None
        buf += chunk
    return buf.split(b"\n", 1)[0].decode(errors="replace")


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> int | None:
    """Stop one child we started, by its pid: SIGTERM, then SIGKILL after ``grace_s``.

    Returns: its exit status (None if it could not be reaped).
    """
    return stop_processes([proc], grace_s)[0]


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = STOP_GRACE_S) -> list[int | None]:
    """Stop children we started, by pid, all at once: SIGTERM to each, then
    SIGKILL to those still running ``grace_s`` later (one grace for all, not
    one each).

    Returns: their exit statuses, in order (None where one could not be reaped).
    """
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    codes: list[int | None] = []
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        codes.append(proc.returncode)
    return codes


def wait_process(proc: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """Wait for a child to exit by itself; stop it if it does not in time.

    Returns: its exit status.
    """
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return stop_process(proc)


def cli_argv(*args: str) -> list[str]:
    """Return the command line running the ``udpverbs`` CLI with this interpreter."""
    return [sys.executable, "-m", "udpverbs.cli", *args]


def spawn_server(test: str, *, device: str | None, quiet: bool = True, cpus: frozenset[int] | None = None) -> Child:
    """Start the server side of a local run as a child process (not waited for).

    Takes: the test; the server's daemon (None for a baseline-only run: the
    server opens it only once the client asks for udpverbs, so it may start
    before its daemon is ready); whether its output is thrown away (the
    client prints the same rows); the CPUs to pin it to (None: any).
    Returns: the child; its ready line is the TCP port it listens on at SERVER_IP.
    """
    argv = cli_argv("perf", test, "--bind", SERVER_IP, "--port", "0", "--ready-fd", "{ready_fd}",
                    "--device-on-request")
    if device is not None:
        argv += ["--device", device]
    return spawn(argv, stdout=subprocess.DEVNULL if quiet else None, cpus=cpus)


def server_port(child: Child) -> int:
    """Wait for the server child to listen; return its port.

    Raises: LocalRunError if it does not come up.
    """
    line = child.wait_ready()
    try:
        return int(line)
    except ValueError:
        child.stop()
        raise LocalRunError(f"server reported {line!r} instead of its port") from None


#: Daemon flags ``--local`` sets itself: each "host" has its own address,
#: port and control socket, ``-m`` sets the MTU, and a TOML file could set
#: any of them.
LOCAL_DAEMON_FLAGS = ("--name", "--addr", "--port", "--socket", "--mtu", "--ready-fd", "--config")


def check_daemon_args(args: Sequence[str], setter: str = "--local") -> list[str]:
    """Check the flags ``--daemon-arg`` passes to the local daemons, as the
    daemon itself would, before anything starts.

    Takes: the flags; who sets the daemons' own flags, for the messages
    (``--local``, or ``udpverbs run``, which starts them the same way).
    Returns: the flags.
    Raises: ValueError naming the problem: a flag the daemon does not know
    or a bad value (an unknown ``--cc``, say), or one ``setter`` sets
    itself (abbreviated too, as argparse accepts ``--mt``).
    """
    from ..daemon import config as dconfig

    args = list(args)
    try:
        given = dconfig.parse_flags(args)
        for flag in LOCAL_DAEMON_FLAGS:  # before configure reads a --config file
            if getattr(given, flag[2:].replace("-", "_")) is not None:
                if flag == "--config":
                    raise ValueError(f"a --config file could set what {setter} sets; pass its settings as flags")
                why = " (-m sets the MTU)" if flag == "--mtu" and setter == "--local" else ""
                raise ValueError(f"{setter} sets {flag} itself{why}")
        dconfig.configure(args, exit_on_error=False)
    except ValueError as e:
        raise ValueError(f"--daemon-arg: {e}") from None
    return args


def daemon_address(line: str, what: str = "the daemon") -> tuple[str, int]:
    """The ``(ip, udp_port)`` a daemon's ready line names: ``ready IP PORT SOCKET`` (``daemon/__main__.py``).

    Raises: LocalRunError naming ``what`` if the line is not one.
    """
    words = line.split()
    if len(words) != 4 or words[0] != "ready" or not words[2].isdigit():
        raise LocalRunError(f"{what} reported {line!r}, not 'ready IP PORT SOCKET'")
    return words[1], int(words[2])


def block_placement(rank: int, size: int, daemons: int) -> int:
    """The daemon of ``rank`` when ``size`` ranks share ``daemons`` daemons in consecutive blocks
    (mpirun's default map-by-slot): ``rank * daemons // size``."""
    return rank * daemons // size


def rank_environment(rank: int, members: Sequence[tuple[str, int]], *, device: str, runtime_dir: str, group: str,
                     base: Mapping[str, str]) -> dict[str, str]:
    """The environment of one rank of a process group, as ``udpverbs run`` gives it (the ``ENV_*``
    contract of :mod:`udpverbs.verbs.group`), and unbuffered Python output.

    Takes: the rank, every rank's daemon (``members``, rank order), the
    device this rank opens and the directory of its control socket, the
    group's name, and the environment to start from.
    """
    from ..verbs import group as G

    env = dict(base)
    env.update({
        G.ENV_DEVICE: device, G.ENV_RUNTIME_DIR: runtime_dir, G.ENV_RANK: str(rank), G.ENV_SIZE: str(len(members)),
        G.ENV_MEMBERS: G.format_members(members), G.ENV_GROUP: group, "PYTHONUNBUFFERED": "1",
    })  # fmt: skip
    return env


#: Local daemon i binds 127.0.0.(2 + i), up to 127.0.0.254.
MAX_DAEMONS = 253


def daemon_ip(index: int) -> str:
    """The loopback address of a local run's daemon ``index``: 127.0.0.2, 127.0.0.3, ... (the
    first two are SERVER_IP and CLIENT_IP).

    Raises: ValueError past 127.0.0.254.
    """
    if not 0 <= index < MAX_DAEMONS:
        raise ValueError(f"a local run has at most {MAX_DAEMONS} daemons (127.0.0.2 .. 127.0.0.254), not {index + 1}")
    return f"127.0.0.{index + 2}"


def path_addresses(index: int, paths: int) -> list[str]:
    """The ``--addr`` values of local daemon ``index`` with ``paths``
    addresses: :func:`daemon_ip` ``(index)``, then the same host number in
    127.1.0.0/24, 127.2.0.0/24, ... (loopback answers on all of
    127.0.0.0/8), each with its /24, so that every daemon pairs its k-th
    address with every other daemon's k-th (``daemon/paths.py``).

    Raises: ValueError past 127.0.0.254 or for paths outside 1..MAX_ADDRESSES.
    """
    from ..daemon.paths import MAX_ADDRESSES

    if not 1 <= paths <= MAX_ADDRESSES:
        raise ValueError(f"a local daemon has 1 to {MAX_ADDRESSES} addresses, not {paths}")
    ip = daemon_ip(index)
    if paths == 1:
        return [ip]
    host = ip.rsplit(".", 1)[1]
    return [f"{ip}/24"] + [f"127.{k}.0.{host}/24" for k in range(1, paths)]


@dataclass
class LocalDaemons:
    """``count`` udpverbs daemons, one per loopback "host", started and stopped by pid.

    Takes: the path MTU (the daemons carry ``mtu - 28`` bytes per datagram),
    more daemon flags for all of them (checked by :func:`check_daemon_args`),
    where to pin them (``placement``, for the two of a perftest run; None:
    anywhere), and ``count`` (default 2: a perftest run's server and client)
    with ``daemon_cpus``, the CPUs of each of them when there are not two
    (None, or None for one: anywhere).
    Use as a context manager.  Daemon ``i`` listens on :func:`daemon_ip`
    ``(i)`` (so the first two on SERVER_IP and CLIENT_IP) on a UDP port of
    its choosing; ``devices[i]`` is its control socket path (what a side
    passes as ``--device``; ``server_device`` / ``client_device`` are the
    first two), ``names[i]`` its device name and, once :meth:`wait_ready`
    has returned, ``members[i]`` its ``(ip, udp_port)``.  The sockets live
    in a private temporary directory (``runtime_dir``) removed at the end.
    ``paths`` > 1 gives each daemon that many addresses (:func:`path_addresses`).
    """

    mtu: int = 1500
    daemon_args: Sequence[str] = ()
    placement: Placement | None = None
    count: int = 2
    daemon_cpus: Sequence[frozenset[int] | None] | None = None
    children: list[Child] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    members: list[tuple[str, int]] = field(default_factory=list)
    runtime_dir: str | None = None
    paths: int = 1

    @property
    def server_device(self) -> str | None:
        """The first daemon's control socket (None before :meth:`start`)."""
        return self.devices[0] if self.devices else None

    @property
    def client_device(self) -> str | None:
        """The second daemon's control socket (None before :meth:`start`)."""
        return self.devices[1] if len(self.devices) > 1 else None

    def _name(self, i: int) -> str:
        if self.count == 2:
            return ("uvlocal-s", "uvlocal-c")[i]
        return f"uvlocal-{i}"

    def _cpus(self, i: int) -> frozenset[int] | None:
        if self.daemon_cpus is not None:
            return self.daemon_cpus[i]
        pl = self.placement
        if pl is None or i > 1:
            return None
        return pl.server_daemon if i == 0 else pl.client_daemon

    def start(self) -> None:
        """Start every daemon without waiting; ``devices`` are known at once.

        Call :meth:`wait_ready` before using them (start the server meanwhile).
        Raises: ValueError for a count out of range or CPUs not given for each.
        """
        from . import verbs_perf

        if self.daemon_cpus is not None and len(self.daemon_cpus) != self.count:
            raise ValueError(f"daemon_cpus names {len(self.daemon_cpus)} daemons' CPUs, count is {self.count}")
        ips = [daemon_ip(i) for i in range(self.count)]
        self.runtime_dir = tempfile.mkdtemp(prefix="udpverbs-local-")
        for i, ip in enumerate(ips):
            name = self._name(i)
            path = os.path.join(self.runtime_dir, f"{name}.sock")
            addrs = path_addresses(i, self.paths)
            more = [f for a in addrs[1:] for f in ("--addr", a)]
            argv = verbs_perf.daemon_command(addrs[0], name, path, self.mtu - 28, [*more, *self.daemon_args])
            self.children.append(spawn(argv, stdout=subprocess.DEVNULL, cpus=self._cpus(i)))
            self.devices.append(path)
            self.names.append(name)

    def wait_ready(self) -> None:
        """Wait until every daemon serves and note its ``(ip, udp_port)`` in ``members``.

        Raises: LocalRunError if one does not come up, or says something else than its ready line.
        """
        self.members = [daemon_address(child.wait_ready(), child.what) for child in self.children]

    def __enter__(self) -> "LocalDaemons":
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every daemon started and remove the runtime directory (safe twice)."""
        children, self.children = self.children, []
        # All at once: each daemon takes a few hundred ms to wind down, and
        # a table of runs stops two per run.
        stop_processes([c.proc for c in children])
        for child in children:
            child.stop()  # its ready pipe; the process is reaped already
        if self.runtime_dir is not None:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
            self.runtime_dir = None

    def __exit__(self, *exc: object) -> None:
        self.close()
