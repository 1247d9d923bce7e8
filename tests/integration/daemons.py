"""Start and stop real udpverbs daemons for tests (subprocesses, readiness by pipe, no sleeps)."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator


class DaemonProc:
    """One ``python -m udpverbs.daemon`` on a loopback address, on an ephemeral UDP port unless ``port`` names one."""

    def __init__(self, name: str, addr: str, runtime_dir: str, *, mtu: int | None = 1472, seed: int = 1,
                 extra: tuple[str, ...] = (), preexec_fn: Any = None, port: int = 0,
                 prefix: tuple[str, ...] = ()) -> None:
        self.name = name
        self.addr = addr
        self.socket_path = os.path.join(runtime_dir, f"{name}.sock")
        self.mtu = mtu
        self.seed = seed
        self.extra = extra
        self.preexec_fn = preexec_fn  # e.g. to lower the daemon's fd limit
        self.prefix = prefix  # a command that execs the daemon, e.g. ("ip", "netns", "exec", NS)
        self.requested_port = port  # 0: the daemon picks a free one at each start
        self.port = 0  # the one it bound, once started
        self.proc: subprocess.Popen[bytes] | None = None
        self._final_log: str | None = None
        self.log = tempfile.NamedTemporaryFile(prefix=f"udpverbsd-{name}-", suffix=".log", delete=False)

    def start(self, timeout_s: float = 20.0) -> "DaemonProc":
        r, w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [*self.prefix, sys.executable, "-m", "udpverbs.daemon", "--name", self.name, "--addr", self.addr,
                 "--port", str(self.requested_port), "--socket", self.socket_path, "--seed", str(self.seed),
                 "--ready-fd", str(w), *(("--mtu", str(self.mtu)) if self.mtu else ()), *self.extra],
                pass_fds=(w,), stdout=self.log, stderr=self.log, preexec_fn=self.preexec_fn,
            )
        finally:
            os.close(w)
        try:
            line = b""
            deadline = time.monotonic() + timeout_s
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                ready, _, _ = select.select([r], [], [], max(0.0, left))
                if not ready:
                    raise TimeoutError(f"daemon {self.name} not ready in {timeout_s} s: {self.log_text()}")
                chunk = os.read(r, 256)
                if not chunk:
                    raise RuntimeError(f"daemon {self.name} exited: {self.log_text()}")
                line += chunk
        except BaseException:
            self.stop()
            raise
        finally:
            os.close(r)
        _, ip, port, _ = line.decode().split()
        self.port = int(port)
        return self

    def log_text(self) -> str:
        if self._final_log is not None:
            return self._final_log
        with open(self.log.name, "rb") as f:
            return f.read().decode(errors="replace")[-4000:]

    def stop(self, timeout_s: float = 10.0) -> int | None:
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout_s)
        self.proc = None
        self._final_log = None
        text = self.log_text()
        self._final_log = text  # keep the tail in memory, leave no file behind
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass
        return p.returncode

    def __enter__(self) -> "DaemonProc":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@contextlib.contextmanager
def running(*procs: DaemonProc) -> Iterator[tuple[DaemonProc, ...]]:
    """Start ``procs`` in order; stop them in reverse order, each asserted to exit 0."""
    with contextlib.ExitStack() as stack:
        for p in procs:
            p.start()
            stack.callback(_stopped_cleanly, p)
        yield procs


def _stopped_cleanly(p: DaemonProc) -> None:
    assert p.stop() == 0, p.log_text()
