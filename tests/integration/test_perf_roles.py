"""``udpverbs perf`` as two processes, as on two hosts: a server and its client, each with its own daemon."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import tempfile
import time
from typing import Iterator

import pytest

from udpverbs import cli
from udpverbs.bench import local

from .daemons import DaemonProc

WAITING = b"Waiting for client to connect"


class Server:
    """``udpverbs perf ARGS`` as a server child on 127.0.0.2, on a TCP port it picks and reports."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        r, w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                local.cli_argv("perf", *args, "--bind", local.SERVER_IP, "--port", "0", "--ready-fd", str(w)),
                pass_fds=(w,), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        finally:
            os.close(w)
        self._ready = r

    def port(self, timeout_s: float = 20.0) -> int | None:
        """The port it listens on; None if it exited first."""
        try:
            assert select.select([self._ready], [], [], timeout_s)[0], "the server neither listened nor exited"
            line = os.read(self._ready, 64)
        finally:
            os.close(self._ready)
        return int(line) if line else None

    def stdout_until(self, text: bytes, timeout_s: float = 20.0) -> bytes:
        assert self.proc.stdout is not None
        seen = b""
        deadline = time.monotonic() + timeout_s
        while text not in seen:
            left = deadline - time.monotonic()
            assert left > 0 and select.select([self.proc.stdout], [], [], left)[0], seen
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            assert chunk, seen
            seen += chunk
        return seen

    def finish(self, timeout_s: float = 30.0) -> tuple[int, str, str]:
        """Wait for it to exit by itself; returns (status, the rest of its stdout, its stderr)."""
        try:
            out, err = self.proc.communicate(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.communicate()
        return self.proc.returncode, out.decode(), err.decode()


@pytest.fixture
def no_daemon() -> Iterator[dict[str, str]]:
    """An environment whose runtime directory holds no daemon."""
    with tempfile.TemporaryDirectory(prefix="udpverbs-none-") as d:
        yield dict(os.environ, UDPVERBS_RUNTIME_DIR=d)


def test_a_server_without_its_daemon_fails_at_once(no_daemon: dict[str, str]) -> None:
    server = Server("write_lat", env=no_daemon)
    try:
        assert server.port() is None  # it never listened
        rc, out, err = server.finish(timeout_s=20)
    finally:
        server.proc.kill()
    assert rc == 1, err
    assert "cannot open udpverbs device" in err and "--baseline raw-udp --baseline-only" in err
    assert WAITING.decode() not in out


def test_a_server_opens_its_device_before_it_waits_and_runs_with_it(
        daemons: tuple[DaemonProc, DaemonProc], capsys: pytest.CaptureFixture[str]) -> None:
    a, b = daemons
    server = Server("write_lat", "-d", a.socket_path)
    try:
        port = server.port()
        assert port is not None, server.finish()
        server.stdout_until(WAITING)
        assert f"client pid {server.proc.pid} " in a.log_text()  # the device is open before any client came
        rc = cli.main(["perf", "write_lat", "--peer", f"{local.SERVER_IP}:{port}", "--bind", local.CLIENT_IP,
                       "-d", b.socket_path, "-n", "50", "--json"])
        assert rc == 0, capsys.readouterr().err
        status, _, err = server.finish()
        assert status == 0, err
    finally:
        server.proc.kill()
        server.proc.communicate()
    assert '"test": "write_lat"' in capsys.readouterr().out


def test_an_interrupted_client_is_reported_as_interrupted(no_daemon: dict[str, str]) -> None:
    baseline = ("--baseline", "raw-udp", "--baseline-only")  # needs no daemon
    server = Server("write_bw", *baseline, env=no_daemon)
    client = None
    try:
        port = server.port()
        assert port is not None, server.finish()
        client = subprocess.Popen(
            local.cli_argv("perf", "write_bw", *baseline, "--peer", f"{local.SERVER_IP}:{port}", "--bind",
                           local.CLIENT_IP, "-D", "30"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=no_daemon)
        server.stdout_until(b"Baseline")  # the banner: the streams are about to start
        time.sleep(0.3)  # into the stream
        client.send_signal(signal.SIGINT)  # as Ctrl-C
        _, client_err = client.communicate(timeout=30)
        status, _, err = server.finish()
    finally:
        server.proc.kill()
        if client is not None and client.poll() is None:
            client.kill()
            client.communicate()
    assert client.returncode == 130, client_err.decode()
    assert status == 1 and "udpverbs perf: failed: the peer was interrupted" in err, err
    assert "KeyboardInterrupt" not in err
