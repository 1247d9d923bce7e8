"""The newcomer's example runs end to end: two daemons, a server and a client process."""

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
