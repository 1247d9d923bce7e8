"""``--local``: both sides of a benchmark on this host, with nothing to set up.

Theory of operation
-------------------
``udpverbs perf TEST --local`` stands for two hosts with two loopback
addresses, 127.0.0.2 (server) and 127.0.0.3 (client): Linux answers on all
of 127.0.0.0/8 without configuration.  When udpverbs itself is measured,
one daemon per "host" is started first (:class:`LocalDaemons`); then the
server side runs as a child process of this one (:func:`start_server`), so
the two sides are two processes, as on two hosts, and this process is the
client.

Every child reports readiness on a pipe whose write end it inherits
(``--ready-fd N``): the parent blocks on the read end with a timeout instead
of sleeping or retrying a connect.  Children are stopped by pid in
``finally`` (terminate, then kill after a grace period), whatever happened.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import IO, Sequence

#: The two "hosts" of a local run.
SERVER_IP = "127.0.0.2"
CLIENT_IP = "127.0.0.3"
READY_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0


class LocalRunError(Exception):
    """A local child process failed to start or to report readiness."""


def spawn_ready(
    argv: Sequence[str],
    *,
    timeout_s: float = READY_TIMEOUT_S,
    stdout: int | IO[bytes] | None = None,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start a child and wait for the line it writes on its ready pipe.

    Takes: the command line, where ``{ready_fd}`` in any argument is replaced
    by the number of the inherited pipe's write end; the longest wait; where
    its stdout goes (its stderr is ours, so its errors are seen).
    Returns: (the process, the line it wrote, without the newline).
    Raises: LocalRunError if it exits or stays silent; the child is then
    stopped before raising.
    """
    r, w = os.pipe()
    try:
        args = [a.replace("{ready_fd}", str(w)) for a in argv]
        proc = subprocess.Popen(args, pass_fds=(w,), stdout=stdout, stdin=subprocess.DEVNULL, env=env)
    except BaseException:
        os.close(r)
        os.close(w)
        raise
    os.close(w)  # only the child holds the write end now: EOF means it died
    try:
        line = _read_line(r, timeout_s)
    except LocalRunError:
        stop_process(proc)
        raise
    finally:
        os.close(r)
    if line is None:
        code = stop_process(proc)
        raise LocalRunError(f"{' '.join(argv[:4])} … exited (status {code}) before it was ready")
    return proc, line


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
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                return None
    return proc.returncode


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


def start_server(
    test: str, *, device: str | None, json_out: bool = False, quiet: bool = True
) -> tuple[subprocess.Popen[bytes], int]:
    """Start the server side of a local run as a child process.

    Takes: the test; the server's daemon (None for a baseline-only run);
    whether its output is thrown away (the client prints the same rows).
    Returns: (the process, the TCP port it listens on at SERVER_IP).
    Raises: LocalRunError if it does not come up.
    """
    argv = cli_argv("perf", test, "--bind", SERVER_IP, "--port", "0", "--ready-fd", "{ready_fd}")
    if device is not None:
        argv += ["--device", device]
    if json_out:
        argv.append("--json")
    proc, line = spawn_ready(argv, stdout=subprocess.DEVNULL if quiet else None)
    try:
        return proc, int(line)
    except ValueError:
        stop_process(proc)
        raise LocalRunError(f"server reported {line!r} instead of its port") from None


@dataclass
class LocalDaemons:
    """Two udpverbs daemons, one per loopback "host", started and stopped by pid.

    Takes: the path MTU (the daemons carry ``mtu - 28`` bytes per datagram).
    Use as a context manager; ``server_device`` / ``client_device`` are the
    control socket paths each side passes as ``--device``.  The sockets live
    in a private temporary directory removed at the end.
    """

    mtu: int = 1500
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    server_device: str | None = None
    client_device: str | None = None
    runtime_dir: str | None = None

    def __enter__(self) -> "LocalDaemons":
        from . import verbs_perf

        try:
            self.runtime_dir = tempfile.mkdtemp(prefix="udpverbs-local-")
            for ip, name in ((SERVER_IP, "uvlocal-s"), (CLIENT_IP, "uvlocal-c")):
                path = os.path.join(self.runtime_dir, f"{name}.sock")
                argv = verbs_perf.daemon_command(ip, name, path, self.mtu - 28)
                proc, _ = spawn_ready(argv, stdout=subprocess.DEVNULL)
                self.procs.append(proc)
                if ip == SERVER_IP:
                    self.server_device = path
                else:
                    self.client_device = path
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every daemon started and remove the runtime directory (safe twice)."""
        while self.procs:
            stop_process(self.procs.pop())
        if self.runtime_dir is not None:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
            self.runtime_dir = None

    def __exit__(self, *exc: object) -> None:
        self.close()
