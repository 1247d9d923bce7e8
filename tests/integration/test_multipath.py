"""Two real daemons with two addresses each: one link over two paths, and a path that fails mid-transfer.

Loopback answers on all of 127.0.0.0/8, so 127.0.43.x and 127.0.44.x stand
for two networks: daemon A has 127.0.43.1/24 and 127.0.44.1/24, daemon B
127.0.43.2/24 and 127.0.44.2/24, and the pairing rule (same subnet first)
makes path 0 on 43 and path 1 on 44.  The failing path is a real loss:
both daemons drop everything they send from their 44 address for a few
seconds (``--impair loss=100%,start=..,stop=.. --impair-addr``), while
the test keeps writing and reading back.
"""

from __future__ import annotations

import hashlib
import os
import random
import tempfile
import threading
import time
from typing import Any

import pytest

from udpverbs import tools, verbs
from udpverbs.daemon.clusterkey import write_new_key
from udpverbs.verbs.enums import IBV_SEND_SIGNALED, IBV_WC_SUCCESS, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE

from .conftest import Side, connect_manual
from .daemons import DaemonProc

A_IPS = ("127.0.43.1", "127.0.44.1")
B_IPS = ("127.0.43.2", "127.0.44.2")
#: bytes written and read back per round, in Writes of CHUNK bytes
ROUND = 1 << 20
CHUNK = 64 << 10
#: the failing path: a silent path is down after this long
FAST_PATHS = ("--link", "path_dead_s=0.3")


def _daemon(name: str, ips: tuple[str, str], d: str, seed: int, extra: tuple[str, ...] = ()) -> DaemonProc:
    return DaemonProc(name, f"{ips[0]}/24", d, seed=seed, extra=("--addr", f"{ips[1]}/24", *FAST_PATHS, *extra))


def _wr(opcode: int, local: Side, offset: int, remote: Side, size: int, wr_id: int) -> verbs.SendWR:
    wr = verbs.SendWR(wr_id=wr_id, opcode=opcode, sg=[verbs.SGE(local.mr.buf + offset, size, local.mr.lkey)],
                      send_flags=IBV_SEND_SIGNALED)
    wr.set_wr_rdma(remote.mr.rkey, remote.mr.buf + (offset % ROUND))
    return wr


def _complete(side: Side, n: int, timeout_s: float = 60.0) -> None:
    for wc in side.cq.poll_blocking(n, timeout=timeout_s):
        assert wc.status == IBV_WC_SUCCESS, wc


def one_round(a: Side, b: Side, rng: random.Random) -> None:
    """Write ROUND fresh random bytes from A to B in CHUNK-byte Writes, read
    them back into A's second half by Reads, and check both copies' digests."""
    data = rng.randbytes(ROUND)
    a.mr.write(data, ROUND, 0)
    count = ROUND // CHUNK
    for i in range(count):
        a.qp.post_send(_wr(IBV_WR_RDMA_WRITE, a, i * CHUNK, b, CHUNK, i))
    _complete(a, count)
    for i in range(count):
        a.qp.post_send(_wr(IBV_WR_RDMA_READ, a, ROUND + i * CHUNK, b, CHUNK, 1000 + i))
    _complete(a, count)
    want = hashlib.sha256(data).digest()
    assert hashlib.sha256(b.mr.read(ROUND, 0)).digest() == want, "the data placed at B differs"
    assert hashlib.sha256(a.mr.read(ROUND, ROUND)).digest() == want, "the data read back differs"


def path_figures(ctx: verbs.Context, local: str, remote: str) -> dict[str, int]:
    """``ctx.query_stats()``'s figures of the path ``local`` -> ``remote`` (``ip:port`` each)."""
    prefix = f"path_{local}_{remote}_"
    return {k.removeprefix(prefix): v for k, v in ctx.query_stats().items() if k.startswith(prefix)}


#: the most rounds the two-path stream runs before its paths' figures are judged
MAX_ROUNDS = 30


def _sides(da: DaemonProc, db: DaemonProc) -> tuple[Side, Side]:
    a, b = Side(da, 2 * ROUND, cap=verbs.QPCap(64, 64, 1, 1)), Side(db, 2 * ROUND)
    connect_manual(a, a.qp, b, b.qp, rd=16)
    return a, b


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "cluster-key"])
def test_one_link_runs_over_both_paths_and_the_data_is_exact(keyed: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="udpverbs-mp-") as d:
        extra: tuple[str, ...] = ()
        if keyed:
            # each address pair has its own pair key: a path's datagrams check only on that path
            write_new_key(os.path.join(d, "key"))
            extra = ("--key-file", os.path.join(d, "key"))
        with _daemon("uvMa", A_IPS, d, 43, extra) as da, _daemon("uvMb", B_IPS, d, 44, extra) as db:
            a, b = _sides(da, db)
            try:
                rng = random.Random(43)
                pa, pb = da.port, db.port

                def figures() -> list[tuple[str, dict[str, int]]]:
                    return [(mine[i], path_figures(ctx, f"{mine[i]}:{pa if mine is A_IPS else pb}",
                                                   f"{theirs[i]}:{pb if mine is A_IPS else pa}"))
                            for ctx, (mine, theirs) in ((a.ctx, (A_IPS, B_IPS)), (b.ctx, (B_IPS, A_IPS)))
                            for i in range(2)]

                def both_ways(f: dict[str, int]) -> bool:
                    return f["datagrams_sent"] > 50 and f["datagrams_received"] > 50

                # The scheduler sends on the path of lowest RTT that has room, so how the
                # stream splits moves with the CPUs' load: more rounds until every path has
                # carried it both ways (6 on a quiet machine), within a bound.
                for done in range(1, MAX_ROUNDS + 1):
                    one_round(a, b, rng)
                    if done >= 6 and all(both_ways(f) for _, f in figures()):
                        break
                for ip, f in figures():
                    assert f.get("up") == 1, (ip, f)
                    assert both_ways(f), (ip, f)
                    assert f["bytes_sent"] > 0 and f["bytes_received"] > 0, (ip, f)
                stats = a.ctx.query_stats()
                assert stats["paths"] == 2 and stats["paths_up"] == 2, stats
                for ctx in (a.ctx, b.ctx):
                    # the Writes (A to B) and Read Responses (B to A) of both paths: most framed and
                    # placed by the compiled lanes
                    s = ctx.query_stats()
                    assert s.get("tx_native_datagrams", 0) > s["link_data_sent"] * 3 // 4, s
                    assert s.get("rx_native_datagrams", 0) > s["link_data_received"] * 3 // 4, s
                assert stats.get("auth_failed", 0) == 0 and stats.get("rx_unknown_path", 0) == 0, stats
                # what udpverbs stat shows: a paths table with both pairs
                daemon = tools.Daemon(da.socket_path)
                try:
                    lines = "\n".join(tools.stat_lines(daemon, daemon.query(detail=True), False, False))
                    info = "\n".join(tools.devinfo_lines(daemon.query(), da.socket_path, False))  # type: ignore[arg-type]
                finally:
                    daemon.close()
                assert "paths:" in lines and f"127.0.44.1:{pa}" in lines and f"127.0.44.2:{pb}" in lines, lines
                assert "127.0.43.1/24 127.0.44.1/24" in info, info
            finally:
                a.close()
                b.close()
            assert "path 1 127.0.44.1" in da.log_text() or "path 1 127.0.44.1" in db.log_text()


#: seconds after its start during which each daemon's 44 address sends nothing
FAIL_FROM, FAIL_UNTIL = 5.0, 8.0


def _uptime(daemon: tools.Daemon) -> float:
    report: Any = daemon.query()
    return float(report["uptime_s"])


def test_a_path_that_fails_mid_transfer_costs_no_wr_and_comes_back() -> None:
    blackhole = ("--impair", f"loss=100%,start={FAIL_FROM}s,stop={FAIL_UNTIL}s")
    with tempfile.TemporaryDirectory(prefix="udpverbs-mp-") as d:
        da = _daemon("uvMc", A_IPS, d, 45, (*blackhole, "--impair-addr", A_IPS[1]))
        db = _daemon("uvMd", B_IPS, d, 46, (*blackhole, "--impair-addr", B_IPS[1]))
        # started together, so that their windows (from each one's start) nearly coincide
        t = threading.Thread(target=db.start)
        t.start()
        try:
            da.start()
        finally:
            t.join()
        try:
            assert db.port, db.log_text()
            a, b = _sides(da, db)
            status = tools.Daemon(da.socket_path)
            local, remote = f"{A_IPS[1]}:{da.port}", f"{B_IPS[1]}:{db.port}"
            rng = random.Random(45)
            samples: list[tuple[float, dict[str, int]]] = []
            rounds = 0
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                one_round(a, b, rng)  # every WR succeeds and the data matches, whatever the paths do
                rounds += 1
                up = _uptime(status)
                samples.append((up, path_figures(a.ctx, local, remote)))
                if up > FAIL_UNTIL + 2.5:
                    break
            before = [f for t_, f in samples if t_ < FAIL_FROM]
            assert before and before[-1]["datagrams_sent"] > 0 and before[-1]["datagrams_received"] > 0, \
                f"path 1 carried nothing before it failed (daemon too slow to start?): {samples[:3]}"
            during = [f for t_, f in samples if FAIL_FROM + 1 < t_ < FAIL_UNTIL]
            assert during, f"no round completed while path 1 was down: {[t_ for t_, _ in samples]}"
            last = samples[-1][1]
            assert last["times_down"] >= 1, last
            assert last["up"] == 1, last
            # used again once it answers: it carries data both ways after the window
            assert last["datagrams_received"] > during[-1]["datagrams_received"] + 20, (during[-1], last)
            assert last["bytes_sent"] > during[-1]["bytes_sent"], (during[-1], last)
            status.close()
            a.close()
            b.close()
        finally:
            db.stop()
            da.stop()
        log = da.log_text()
        assert f"path 1 {local} -> {remote} down" in log, log
        assert f"path 1 {local} -> {remote} up" in log, log
