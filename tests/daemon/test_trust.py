"""Local trust (issue 41, hole 1): the uid is the boundary.

The daemon serves its control socket only from a directory that is the
user's and mode 0700; the client uses a socket only in such a directory and
only once SO_PEERCRED shows that the socket is served by its own uid (or
root), before it sends a byte.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
from typing import Iterator

import pytest

from udpverbs import verbs
from udpverbs.wire import ctl

from ..integration.daemons import DaemonProc

NOBODY = 65534
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="another uid is played by a root-started child")


@pytest.fixture
def rundir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="udpverbs-t-") as d:
        yield d


def _daemon(args: list[str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "udpverbs.daemon", "--addr", "127.0.0.4", "--port", "0", *args],
                          capture_output=True, timeout=20)


def test_the_daemon_refuses_a_runtime_dir_open_to_others(rundir: str) -> None:
    open_dir = os.path.join(rundir, "open")
    os.mkdir(open_dir)
    os.chmod(open_dir, 0o777)  # ours, but anyone could replace the socket
    r = _daemon(["--socket", os.path.join(open_dir, "uv0.sock")])
    assert r.returncode == 2, r.stderr
    assert b"mode 0777, must be 0700" in r.stderr and b"chmod 700 " + open_dir.encode() in r.stderr
    assert not os.listdir(open_dir)
    # $XDG_RUNTIME_DIR/udpverbs at 0777 is refused the same way
    os.mkdir(os.path.join(open_dir, "udpverbs"), 0o777)
    os.chmod(os.path.join(open_dir, "udpverbs"), 0o777)
    env = {k: v for k, v in os.environ.items() if k != "UDPVERBS_RUNTIME_DIR"}
    r = subprocess.run([sys.executable, "-m", "udpverbs.daemon", "--addr", "127.0.0.4", "--port", "0"],
                       capture_output=True, timeout=20, env=dict(env, XDG_RUNTIME_DIR=open_dir))
    assert r.returncode == 2 and b"must be 0700" in r.stderr


@needs_root
def test_the_daemon_refuses_a_runtime_dir_another_uid_made_first(rundir: str) -> None:
    squatted = os.path.join(rundir, "squat")
    os.mkdir(squatted, 0o700)
    os.chown(squatted, NOBODY, NOBODY)  # as another user's /tmp/udpverbs-<uid> would be
    r = _daemon(["--socket", os.path.join(squatted, "uv0.sock")])
    assert r.returncode == 2 and f"belongs to uid {NOBODY}".encode() in r.stderr and b"remove it" in r.stderr


def test_the_client_refuses_a_socket_in_a_dir_open_to_others(rundir: str) -> None:
    with DaemonProc("uvP", "127.0.0.4", rundir) as d:
        os.chmod(rundir, 0o777)
        try:
            with pytest.raises(verbs.VerbsError) as e:
                verbs.Context(socket_path=d.socket_path)
            assert e.value.error_code == errno.EACCES and "mode 0777, must be 0700" in str(e.value)
        finally:
            os.chmod(rundir, 0o700)
        with verbs.Context(socket_path=d.socket_path) as ctx:  # private again: served
            verbs.PD(ctx)


@needs_root
def test_a_symlink_another_uid_owns_is_refused(rundir: str) -> None:
    real = os.path.join(rundir, "real")
    os.mkdir(real, 0o700)
    link = os.path.join(rundir, "link")
    os.symlink(real, link)
    assert ctl.private_dir_problem(link) is None
    os.lchown(link, NOBODY, NOBODY)
    assert f"the symlink to it belongs to uid {NOBODY}" in (ctl.private_dir_problem(link) or "")


# An impostor: binds in our private directory while root, becomes nobody,
# then listens (SO_PEERCRED names the uid at listen()), and reports how many
# bytes the client sent it.
_IMPOSTOR = """
import os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.bind(sys.argv[1])
os.chmod(sys.argv[1], 0o777)
os.setgid(%d); os.setuid(%d)
s.listen(1)
print("ready", flush=True)
s.settimeout(20)
c, _ = s.accept()
c.settimeout(2)
try:
    got = len(c.recv(65536))
except socket.timeout:
    got = 0
print(got, flush=True)
""" % (NOBODY, NOBODY)


@needs_root
def test_the_client_refuses_a_daemon_of_another_uid_before_sending_anything(rundir: str) -> None:
    path = os.path.join(rundir, "uv0.sock")
    p = subprocess.Popen([sys.executable, "-c", _IMPOSTOR, path], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        with pytest.raises(verbs.VerbsError) as e:
            verbs.Context(socket_path=path, timeout_s=5)
        assert e.value.error_code == errno.EACCES
        assert f"served by uid {NOBODY} (pid {p.pid})" in str(e.value)
        assert p.stdout.readline() == "0\n"  # the impostor got not a byte (no HELLO)
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
