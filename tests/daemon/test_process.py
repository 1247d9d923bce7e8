"""The daemon as a process: start/stop, refusing a second daemon, surviving bad input."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

from udpverbs import verbs
from udpverbs.daemon.device import DeviceConfig
from udpverbs.verbs.enums import IBV_ACCESS_LOCAL_WRITE, IBV_QPT_RC
from udpverbs.wire import ctl, link

from ..integration.daemons import DaemonProc


@pytest.fixture
def rundir():
    with tempfile.TemporaryDirectory(prefix="udpverbs-d-") as d:
        yield d


def test_start_logs_and_stops_cleanly_on_sigint(rundir) -> None:
    d = DaemonProc("uvS", "127.0.0.4", rundir).start()
    try:
        assert os.path.exists(d.socket_path)
        assert os.stat(d.socket_path).st_mode & 0o777 == 0o600
        assert f"udpverbsd uvS: udp 127.0.0.4:{d.port}" in d.log_text()
        assert d.proc is not None
        d.proc.send_signal(signal.SIGINT)
        assert d.proc.wait(10) == 0
        assert not os.path.exists(d.socket_path)  # removed on shutdown
    finally:
        d.stop()


def _run_second(args: list[str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "udpverbs.daemon", *args], capture_output=True, timeout=20)


def test_refuses_a_second_daemon_on_the_same_socket_or_port(rundir) -> None:
    with DaemonProc("uvT", "127.0.0.4", rundir) as d:
        r = _run_second(["--addr", "127.0.0.5", "--port", "0", "--socket", d.socket_path])
        assert r.returncode == 1 and b"another udpverbs daemon is serving" in r.stderr
        other = os.path.join(rundir, "other.sock")
        r = _run_second(["--addr", "127.0.0.4", "--port", str(d.port), "--socket", other])
        assert r.returncode == 1 and b"cannot bind UDP" in r.stderr
        # the first daemon is unaffected
        with verbs.Context(socket_path=d.socket_path) as ctx:
            assert ctx.query_port().lid == d.port


@pytest.mark.parametrize("mtu", [547, 65508, 65535])
def test_a_device_refuses_a_payload_no_datagram_can_carry(mtu: int) -> None:
    # Built in code rather than from flags, a device used to accept 65,535
    # and lose its first link to retransmit_budget (the kernel refused every
    # full datagram with EMSGSIZE).
    with pytest.raises(ValueError, match="mtu"):
        DeviceConfig(mtu=mtu)
    assert DeviceConfig(mtu=548).mtu == 548 and DeviceConfig(mtu=65507).mtu == 65507


def test_bad_flags_and_config(rundir) -> None:
    r = _run_second(["--mtu", "10"])
    assert r.returncode == 2 and b"mtu" in r.stderr
    cfg = os.path.join(rundir, "bad.toml")
    with open(cfg, "w") as f:
        f.write("colour = 'blue'\n")
    r = _run_second(["--config", cfg])
    assert r.returncode == 2 and b"unknown key" in r.stderr
    # refused up front with status 2, not a traceback from logging at start
    r = _run_second(["--log-level", "loud"])
    assert r.returncode == 2 and b"unknown log level 'loud'" in r.stderr and b"Traceback" not in r.stderr


def test_toml_config_is_used(rundir) -> None:
    cfg = os.path.join(rundir, "d.toml")
    with open(cfg, "w") as f:
        f.write('name = "uvcfg"\nmtu = 9000\n')
    with DaemonProc("uvC", "127.0.0.4", rundir, mtu=None, extra=("--config", cfg)) as d:
        with verbs.Context(socket_path=d.socket_path) as ctx:
            assert ctx.query_port().udp_payload == 9000  # from the file
            assert ctx.device_name == "uvC"  # the --name flag wins over the file


def test_survives_garbage_datagrams_and_control_messages(rundir) -> None:
    rng = random.Random(7)
    with DaemonProc("uvG", "127.0.0.4", rundir) as d:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.6", 0))
        try:
            for n in range(300):
                s.sendto(rng.randbytes(rng.randrange(0, 1500)), ("127.0.0.4", d.port))
            # a well-formed link INIT followed by garbage DATA on the opened link
            hdr = link.LinkHeader(link.PacketType.INIT, 0, 0, 0, 1, 0, 0, 0, 64)
            s.sendto(link.encode(hdr, link.encode_init(link.LinkInit(5, 1, 1440, 64, 3))), ("127.0.0.4", d.port))
            for n in range(100):
                s.sendto(rng.randbytes(rng.randrange(28, 200)), ("127.0.0.4", d.port))
        finally:
            s.close()
        u = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        u.settimeout(10)
        u.connect(d.socket_path)
        try:
            for blob in (b"", b"\x00", b"\xff\xff\x00\x00\x00\x00\x00\x00", rng.randbytes(100),
                         ctl.encode_request(ctl.Op.ALLOC_PD)):  # before HELLO: refused
                if blob:
                    u.send(blob)
                    status, _ = ctl.decode_reply(u.recv(4096), ctl.Op(int.from_bytes(blob[:2], "big"))
                                                 if int.from_bytes(blob[:2], "big") in ctl.Op._value2member_map_
                                                 else ctl.Op.HELLO)
                    assert status != 0
        finally:
            u.close()
        # still serving
        with verbs.Context(socket_path=d.socket_path) as ctx:
            verbs.PD(ctx)
        assert d.proc is not None and d.proc.poll() is None


def test_client_that_vanishes_is_torn_down(rundir) -> None:
    with DaemonProc("uvV", "127.0.0.4", rundir) as d:
        ctx = verbs.Context(socket_path=d.socket_path)
        pd = verbs.PD(ctx)
        verbs.MR(pd, 1 << 16, IBV_ACCESS_LOCAL_WRITE)
        cq = verbs.CQ(ctx, 8)
        verbs.QP(pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq))
        ctx._ctl.sock.close()  # the process "crashes": no destroy calls
        ctx._ctl.sock = None
        with verbs.Context(socket_path=d.socket_path) as ctx2:
            pd2 = verbs.PD(ctx2)
            cq2 = verbs.CQ(ctx2, 8)
            qp2 = verbs.QP(pd2, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=cq2, rcq=cq2))
            assert qp2.qp_num >= 1
        assert d.proc is not None and d.proc.poll() is None


def _reference() -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "REFERENCE.md"), encoding="utf-8") as f:
        return f.read()


def _start_with_ready_fd(args: list[str]) -> tuple[subprocess.Popen[bytes], bytes]:
    """Start a daemon with ``--ready-fd``; returns it and all it wrote on the pipe before closing it."""
    r, w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "udpverbs.daemon", *args, "--ready-fd", str(w)], pass_fds=(w,),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    finally:
        os.close(w)
    with open(r, "rb") as ready:
        return proc, ready.read()  # until the daemon closes it, or exits


def test_ready_fd_writes_the_documented_line_once_serving(rundir) -> None:
    # The line a launcher parses is the one docs/REFERENCE.md and --help describe.
    assert "```\nready IP PORT SOCKET\n```" in _reference()
    assert "'ready IP PORT SOCKET'" in " ".join(_run_second(["--help"]).stdout.decode().split())
    path = os.path.join(rundir, "uvR.sock")
    proc, line = _start_with_ready_fd(["--name", "uvR", "--addr", "127.0.0.4", "--port", "0", "--socket", path])
    try:
        word, ip, port, socket_path = line.decode().split(" ")
        assert (word, ip, socket_path) == ("ready", "127.0.0.4", path + "\n")
        with verbs.Context(socket_path=path) as ctx:
            assert ctx.query_port().lid == int(port) != 0  # the port --port 0 picked
        # a start that fails writes nothing: the pipe just ends
        second, nothing = _start_with_ready_fd(["--addr", "127.0.0.4", "--port", port,
                                                "--socket", os.path.join(rundir, "other.sock")])
        assert nothing == b"" and second.wait(20) == 1
        second.stderr.close()  # type: ignore[union-attr]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        proc.stderr.close()  # type: ignore[union-attr]
