"""Resources never kill the daemon (issue 41, hole 2).

A greedy application opens contexts, regions and CQs until it is refused.
It must get clean errors (ENOMEM from its quota, or the errno of the
resource that ran out), the daemon must stay up, and another application
must still open a context on it and complete an RDMA Write.  The daemon
runs under a 64-fd limit, so on a daemon without quotas the greedy one
exhausts the fds within a few contexts (it used to die there: unhandled
EMFILE in the session set-up and in accept()).
"""

from __future__ import annotations

import errno
import os
import resource
import subprocess
import sys
import tempfile
from typing import Iterator

import pytest

from udpverbs import verbs
from udpverbs.verbs.enums import IBV_SEND_SIGNALED, IBV_WC_SUCCESS, IBV_WR_RDMA_WRITE

from ..integration.conftest import Side, connect_manual
from ..integration.daemons import DaemonProc

FD_LIMIT = 64


def _low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


# The greedy application, a process of its own (quotas are per process).
# Prints one line per kind: how many it got and the errnos of its refusals;
# then holds everything until its stdin closes.
_GREEDY = """
import sys
from udpverbs import verbs
from udpverbs.verbs.enums import IBV_ACCESS_LOCAL_WRITE
path = sys.argv[1]
held = []
def grab(kind, make, most=400):
    got, errs = 0, set()
    for _ in range(most):
        try:
            held.append(make())
            got += 1
        except verbs.VerbsError as e:
            errs.add(e.error_code)
            if len(errs) > 0 and got + len(errs) > 3:
                break
    print(kind, got, *sorted(errs), flush=True)
grab("context", lambda: verbs.Context(socket_path=path, timeout_s=10))
first = held[0]
pd = verbs.PD(first)
grab("mr", lambda: verbs.MR(pd, 4096, IBV_ACCESS_LOCAL_WRITE))
grab("cq", lambda: verbs.CQ(first, 8))
sys.stdin.read()
"""


@pytest.fixture
def rundir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="udpverbs-r-") as d:
        yield d


def _greedy(path: str) -> tuple[subprocess.Popen[str], dict[str, list[int]]]:
    p = subprocess.Popen([sys.executable, "-c", _GREEDY, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None
    out = {}
    for _ in range(3):
        line = p.stdout.readline().split()
        assert line, "the greedy client died"
        out[line[0]] = [int(x) for x in line[1:]]
    return p, out


def _write_works(limited: DaemonProc, other: DaemonProc) -> None:
    a, b = Side(limited, mr_size=1 << 16), Side(other, mr_size=1 << 16)
    try:
        connect_manual(a, a.qp, b, b.qp)
        a.mr.write(b"spared" * 100, 600, 0)
        wr = verbs.SendWR(wr_id=7, opcode=IBV_WR_RDMA_WRITE, send_flags=IBV_SEND_SIGNALED,
                          sg=[verbs.SGE(a.mr.buf, 600, a.mr.lkey)])
        wr.set_wr_rdma(b.mr.rkey, b.mr.buf)
        a.qp.post_send(wr)
        (wc,) = a.cq.poll_blocking(1, timeout=30)
        assert (wc.status, wc.wr_id) == (IBV_WC_SUCCESS, 7)
        assert b.mr.read(600, 0) == b"spared" * 100
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("share", ["0.25", "1"])
def test_a_greedy_client_cannot_deny_service_to_another(rundir: str, share: str) -> None:
    # share 0.25 (the default): the quota refuses the greedy one (ENOMEM)
    # while fds are left for others; share 1: no quota short of the fd
    # limit, so the fds themselves run out: refused too, never an exit.
    limited = DaemonProc("uvL", "127.0.0.8", rundir, preexec_fn=_low_fd_limit,
                         extra=("--quota", f"fd_share={share}"))
    with limited, DaemonProc("uvN", "127.0.0.9", rundir) as other:
        p, got = _greedy(limited.socket_path)
        try:
            assert got["context"][0] >= 1 and got["context"][1:], got
            if share == "0.25":
                assert all(g[1:] == [errno.ENOMEM] for g in got.values()), got
                _write_works(limited, other)  # while the greedy one holds all it could get
            else:
                from udpverbs.daemon.quota import RESOURCE_ERRNOS

                assert set(sum((g[1:] for g in got.values()), [])) <= set(RESOURCE_ERRNOS), got
        finally:
            assert p.stdin is not None
            p.stdin.close()
            p.wait(20)
        assert limited.proc is not None and limited.proc.poll() is None, limited.log_text()
        _write_works(limited, other)  # and once it is gone, everything came back
        assert "Traceback" not in limited.log_text()


def test_quotas_come_from_flags_and_toml(rundir: str) -> None:
    cfg = os.path.join(rundir, "q.toml")
    with open(cfg, "w") as f:
        f.write("[quota]\nqp = 1\nmr = 2\n")
    with DaemonProc("uvQ", "127.0.0.8", rundir, extra=("--config", cfg, "--quota", "mr=3")) as d:
        ctx = verbs.Context(socket_path=d.socket_path)
        try:
            side_pd = verbs.PD(ctx)
            mrs = [verbs.MR(side_pd, 4096, 1) for _ in range(3)]  # the flag (3) wins over the file (2)
            with pytest.raises(verbs.VerbsError) as e:
                verbs.MR(side_pd, 4096, 1)
            assert e.value.error_code == errno.ENOMEM and "quota" in str(e.value)
            mrs.pop().close()
            verbs.MR(side_pd, 4096, 1)  # freed: counted back
        finally:
            ctx.close()
    from udpverbs.daemon import quota

    with pytest.raises(ValueError, match="unknown quota"):
        quota.Quota.from_settings({"qps": 1})
    with pytest.raises(ValueError, match="fd_share"):
        quota.Quota.from_settings({"fd_share": "2"})
