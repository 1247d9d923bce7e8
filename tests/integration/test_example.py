"""The examples run end to end: two daemons, and the programs a reader copies from."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_rdma_write_example_local() -> None:
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "rdma_write.py"), "--local",
                        "--size", str(300_000), "--timeout", "20"], capture_output=True, timeout=90)
    out = r.stdout.decode()
    assert r.returncode == 0, out + r.stderr.decode()
    assert "client: wrote 300000 bytes" in out and "match" in out and "rdma_write example: OK" in out


def _run_example(daemons, name: str) -> str:
    """Run ``examples/<name>`` against the two test daemons (uvA on
    127.0.0.2, uvB on 127.0.0.3, found by name in their runtime dir)."""
    env = dict(os.environ, UDPVERBS_RUNTIME_DIR=os.path.dirname(daemons[0].socket_path))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name)], capture_output=True, timeout=90,
                       env=env)
    out = r.stdout.decode()
    assert r.returncode == 0, out + r.stderr.decode()
    return out


def test_async_write_example(daemons) -> None:
    out = _run_example(daemons, "async_write.py")
    assert out.strip() == str([(i, "IBV_WC_SUCCESS") for i in range(8)])


def test_errors_example(daemons) -> None:
    out = _run_example(daemons, "errors.py").splitlines()
    assert out[0].startswith("control path: E") and out[1].startswith("control path: E")
    assert out[2] == "data path: IBV_WC_REM_ACCESS_ERR and QP A is now IBV_QPS_ERR"
    assert out[3].startswith("async event on A: IBV_EVENT_") and out[4].startswith("async event on B: IBV_EVENT_")


def test_sendrecv_example(daemons) -> None:
    out = _run_example(daemons, "sendrecv.py").splitlines()
    assert out[0] == "received b'ping' imm 7 with imm: True"
    assert out[1] == "old 41 new 42"
    assert out[2].startswith("B's daemon: {")
