"""Process groups against real daemons: barriers, locks, deaths, errors.

Ranks are processes (``group_worker.py``), so a rank can be killed with
SIGKILL as a crashing application would be.  Waits are synchronised on the
daemons' counters (``group_lock_waits``, ``group_barrier_waits``), never on
sleeps.
"""

from __future__ import annotations

import errno
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
import trio

from udpverbs import verbs
from udpverbs.verbs.group import format_members

from .daemons import DaemonProc

ROOT = Path(__file__).resolve().parents[2]
#: the bound within which the others must hear of a death (the default group timeout)
BOUND_S = 2.0


@pytest.fixture(scope="module")
def four() -> Iterator[list[DaemonProc]]:
    with tempfile.TemporaryDirectory(prefix="udpverbs-group-") as d:
        ds = [DaemonProc(f"uvg{i}", f"127.0.0.{2 + i}", d, seed=20 + i) for i in range(4)]
        try:
            for x in ds:
                x.start()
            yield ds
        finally:
            for x in ds:
                assert x.stop() in (0, None), x.log_text()


class Rank:
    """One worker process and its output, read line by line with a deadline."""

    def __init__(self, daemon: DaemonProc, name: str, rank: int, members: str, mode: str, *args: str) -> None:
        self.rank = rank
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.group_worker", daemon.socket_path, name, str(rank), members,
             mode, *args], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._buf = b""

    def line(self, timeout_s: float = 60.0) -> list[str]:
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(0.0, left))
            if not ready:
                raise AssertionError(f"rank {self.rank}: no line in {timeout_s} s")
            chunk = os.read(fd, 4096)
            if not chunk:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise AssertionError(f"rank {self.rank} ended (rc {self.proc.wait()}): {err[-3000:]}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode().split()

    def expect(self, word: str, timeout_s: float = 60.0) -> list[str]:
        got = self.line(timeout_s)
        assert got and got[0] == word, f"rank {self.rank}: expected {word!r}, got {got}"
        return got

    def tell(self, text: str = "go") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")
        self.proc.stdin.flush()

    def kill(self) -> float:
        self.proc.send_signal(signal.SIGKILL)
        t = time.monotonic()
        self.proc.wait(10)
        return t

    def finish(self, timeout_s: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            self.stop()

    def stop(self) -> str:
        """Kill the rank if it still runs; returns the end of what it wrote on stderr."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        err = ""
        if self.proc.stderr is not None and not self.proc.stderr.closed:
            err = self.proc.stderr.read().decode(errors="replace")[-1500:]
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        return f"rank {self.rank} (rc {self.proc.returncode}): {err}" if err else ""


_names = iter(range(1, 1 << 30))


def start(ds: list[DaemonProc], n: int, modes: dict[int, tuple[str, ...]]) -> list[Rank]:
    """``n`` ranks spread over ``ds`` in blocks; ``modes[r]`` is rank r's mode and arguments."""
    where = [ds[r * len(ds) // n] for r in range(n)]
    members = format_members([(d.addr, d.port) for d in where])
    name = f"test-{os.getpid()}-{next(_names)}"
    ranks: list[Rank] = []
    try:
        for r in range(n):
            ranks.append(Rank(where[r], name, r, members, *modes[r]))
        for rk in ranks:
            rk.expect("joined")
    except AssertionError as e:
        raise AssertionError(f"{e}\n" + "\n".join(rk.stop() for rk in ranks)) from None
    except BaseException:
        for rk in ranks:
            rk.stop()
        raise
    return ranks


def counter(ds: list[DaemonProc], name: str) -> int:
    total = 0
    for d in ds:
        with verbs.Context(socket_path=d.socket_path) as ctx:
            total += ctx.query_stats().get(name, 0)
    return total


def wait_counter(ds: list[DaemonProc], name: str, target: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while counter(ds, name) < target:
        assert time.monotonic() < deadline, f"{name} did not reach {target}"


@pytest.mark.parametrize("algorithm", ["tree", "dissemination", "central"])
def test_a_thousand_barriers_of_sixteen_ranks_let_nobody_through_early(four: list[DaemonProc], algorithm: str) -> None:
    with tempfile.NamedTemporaryFile(prefix="udpverbs-region-") as region:
        region.write(bytes(8 * 16))
        region.flush()
        ranks = start(four, 16, {r: ("barriers", algorithm, "1000", region.name) for r in range(16)})
        try:
            for rk in ranks:
                assert rk.expect("done", 240) == ["done", "1000"]
                assert rk.finish() == 0
        finally:
            for rk in ranks:
                rk.stop()


def test_a_killed_lock_holder_fails_the_waiters_within_the_bound_and_the_lock_passes_on(
        four: list[DaemonProc]) -> None:
    ds = four[:2]  # ranks 0, 1 on the first daemon, 2, 3 on the second
    lock = 1  # managed by rank 1's daemon: the holder (rank 2) is remote to its manager
    waits0 = counter(ds, "group_lock_waits")
    ranks = start(ds, 4, {0: ("wait_lock", str(lock)), 1: ("wait_lock", str(lock)), 2: ("hold", str(lock)),
                          3: ("wait_lock", str(lock))})
    try:
        ranks[2].expect("held")
        for r in (0, 1, 3):
            ranks[r].expect("ready")
            ranks[r].tell()
        wait_counter(ds, "group_lock_waits", waits0 + 4)  # the holder's and three waits
        killed = ranks[2].kill()
        reacquired = []
        for r in (0, 1, 3):
            _, who, when = ranks[r].expect("group_error", 30)
            assert int(who) == 2
            assert float(when) - killed < BOUND_S
        for r in (0, 1, 3):
            reacquired.append(float(ranks[r].expect("reacquired", 30)[1]))
            assert ranks[r].finish() == 0
        assert len(reacquired) == 3
    finally:
        for rk in ranks:
            rk.stop()


def test_a_rank_killed_inside_a_barrier_fails_the_others_barriers(four: list[DaemonProc]) -> None:
    waits0 = counter(four, "group_barrier_waits")
    ranks = start(four, 8, {r: ("barrier_on_go",) for r in range(8)})
    try:
        for rk in ranks:
            rk.expect("ready")
        ranks[5].tell()
        wait_counter(four, "group_barrier_waits", waits0 + 1)
        died0 = counter(four, "group_ranks_died")
        killed = ranks[5].kill()
        # Until its daemon sees the death, rank 5's arrival counts, and the
        # others arriving would complete the barrier, rightly.
        wait_counter(four, "group_ranks_died", died0 + 1)
        for r in range(8):
            if r != 5:
                ranks[r].tell()
        for r in range(8):
            if r != 5:
                _, who, when, _ = ranks[r].expect("group_error", 30)
                assert int(who) == 5
                assert float(when) - killed < BOUND_S
        for r in range(8):
            if r != 5:
                ranks[r].tell()
                assert ranks[r].finish() == 0
    finally:
        for rk in ranks:
            rk.stop()


def test_a_dead_daemon_fails_the_barrier_of_the_ranks_waiting_elsewhere() -> None:
    with tempfile.TemporaryDirectory(prefix="udpverbs-group-") as d:
        ds = [DaemonProc(f"uvk{i}", f"127.0.0.{6 + i}", d, seed=40 + i) for i in range(2)]
        ranks: list[Rank] = []
        try:
            for x in ds:
                x.start()
            ranks = start(ds, 4, {r: ("barrier_on_go",) for r in range(4)})
            for rk in ranks:
                rk.expect("ready")
            ranks[0].tell()
            ranks[1].tell()
            wait_counter(ds[:1], "group_barrier_waits", 2)
            assert ds[1].proc is not None
            ds[1].proc.send_signal(signal.SIGKILL)  # the whole second host goes away
            killed = time.monotonic()
            for r in (0, 1):
                _, who, when, _ = ranks[r].expect("group_error", 30)
                assert int(who) in (2, 3)
                assert float(when) - killed < BOUND_S
        finally:
            for rk in ranks:
                rk.stop()
            for x in ds:
                x.stop()


# -- the API's errors, in one process --------------------------------------------------------------

def _solo(d: DaemonProc, name: str) -> tuple[verbs.Context, verbs.Group]:
    ctx = verbs.Context(socket_path=d.socket_path)
    return ctx, verbs.Group(ctx, name, 0, [(d.addr, d.port)])


def test_lock_misuse_is_an_error_and_loses_nothing(four: list[DaemonProc]) -> None:
    ctx, g = _solo(four[0], f"misuse-{os.getpid()}")
    with ctx:
        g.acquire(3)
        with pytest.raises(verbs.VerbsError) as e:
            g.acquire(3)
        assert e.value.error_code == errno.EDEADLK
        with pytest.raises(verbs.VerbsError) as e:
            g.trylock(3)
        assert e.value.error_code == errno.EDEADLK
        g.release(3)
        assert g.trylock(3) is True
    ctx, g = _solo(four[0], f"misuse2-{os.getpid()}")
    with ctx:
        with pytest.raises(verbs.VerbsError) as e:
            g.release(4)
        assert e.value.error_code == errno.EPERM
        assert g.trylock(4) is True
        g.release(4)
        with g.lock(0xFFFFFFFF):
            pass
        with pytest.raises(verbs.UserError):
            g.acquire(1 << 32)
        with pytest.raises(verbs.UserError):
            g.barrier("ring")
        with pytest.raises(verbs.UserError):
            g.barrier("tree", arity=1)
        assert [g.barrier(a) for a in ("tree", "dissemination", "central")] == [1, 2, 3]


def test_join_refuses_a_member_list_that_does_not_name_this_daemon(four: list[DaemonProc]) -> None:
    with verbs.Context(socket_path=four[0].socket_path) as ctx:
        with pytest.raises(verbs.VerbsError) as e:
            verbs.Group(ctx, "wrong", 0, [(four[1].addr, four[1].port)])
        assert e.value.error_code == errno.EINVAL
        with pytest.raises(verbs.UserError):
            verbs.Group(ctx, "bad", 1, [(four[0].addr, four[0].port)])
        with pytest.raises(verbs.UserError):
            verbs.Group(ctx, "bad", 0, [("not an address", 1)])


def test_a_rank_joins_once(four: list[DaemonProc]) -> None:
    name = f"once-{os.getpid()}"
    ctx, g = _solo(four[0], name)
    with ctx:
        with pytest.raises(verbs.VerbsError) as e:
            verbs.Group(ctx, name, 0, [(four[0].addr, four[0].port)])
        assert e.value.error_code == errno.EADDRINUSE


def test_join_times_out_naming_the_ranks_that_never_came(four: list[DaemonProc]) -> None:
    d = four[0]
    with verbs.Context(socket_path=d.socket_path) as ctx:
        t0 = time.monotonic()
        with pytest.raises(verbs.GroupError) as e:
            verbs.Group(ctx, f"lonely-{os.getpid()}", 0, [(d.addr, d.port)] * 3, join_timeout=0.5)
        assert time.monotonic() - t0 < 5
        assert e.value.rank == 1 and "1, 2" in str(e.value)


def test_members_that_disagree_on_the_algorithm_get_an_error_not_a_hang(four: list[DaemonProc]) -> None:
    ds = four[:2]
    members = [(ds[0].addr, ds[0].port), (ds[1].addr, ds[1].port)]
    name = f"disagree-{os.getpid()}"
    errors: list[BaseException] = []

    def rank(r: int, alg: str) -> None:
        with verbs.Context(socket_path=ds[r].socket_path) as ctx:
            with verbs.Group(ctx, name, r, members) as g:
                try:
                    g.barrier(alg, timeout=20)
                except verbs.VerbsError as e:
                    errors.append(e)

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(trio.to_thread.run_sync, rank, 0, "tree")
            n.start_soon(trio.to_thread.run_sync, rank, 1, "central")

    trio.run(main)
    assert len(errors) == 2 and all("disagree" in str(e) for e in errors)


async def test_the_async_flavours_lock_and_barrier_in_trio(four: list[DaemonProc]) -> None:
    d0, d1 = four[0], four[1]
    members = [(d0.addr, d0.port), (d1.addr, d1.port), (d0.addr, d0.port)]
    name = f"async-{os.getpid()}"
    ctxs = [verbs.Context(socket_path=(d0 if r != 1 else d1).socket_path) for r in range(3)]
    groups: list[verbs.Group] = [None] * 3  # type: ignore[list-item]

    async def join(r: int) -> None:
        groups[r] = await trio.to_thread.run_sync(verbs.Group, ctxs[r], name, r, members)

    inside = []
    order = []

    async def work(r: int) -> None:
        g = groups[r]
        for i in range(20):
            async with g.lock_async(9):
                inside.append(r)
                assert len(inside) == 1
                await trio.sleep(0)
                inside.remove(r)
            order.append(await g.barrier_async("dissemination"))

    try:
        async with trio.open_nursery() as n:
            for r in range(3):
                n.start_soon(join, r)
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                for r in range(3):
                    n.start_soon(work, r)
        assert sorted(order) == sorted(list(range(1, 21)) * 3)
        assert await groups[0].trylock_async(5) is True
        assert await groups[2].trylock_async(5) is False
        await groups[0].release_async(5)
    finally:
        for c in ctxs:
            c.close()
