"""The process-group examples (examples/counter.py, examples/cannon.py) run through ``udpverbs run``.

Each launch starts its own daemons (127.0.0.2 and up, ephemeral ports, a
private runtime directory) and its ranks, so these tests need no fixture.
Cannon's block arithmetic is also checked alone, without daemons.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")


def _load_cannon():
    spec = importlib.util.spec_from_file_location("cannon_example", os.path.join(EXAMPLES, "cannon.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cannon = _load_cannon()


def launch(ranks: int, daemons: int, example: str, *args: str) -> tuple[int, str]:
    """``udpverbs run -n ranks --daemons daemons -- python examples/<example> args``: exit status, all output."""
    cmd = [sys.executable, "-m", "udpverbs.cli", "run", "-n", str(ranks), "--daemons", str(daemons),
           "--timeout", "100", "--", sys.executable, os.path.join(EXAMPLES, example), *args]
    r = subprocess.run(cmd, capture_output=True, timeout=120)
    return r.returncode, r.stdout.decode(errors="replace") + r.stderr.decode(errors="replace")


def counter_of(out: str) -> tuple[int, int]:
    m = re.search(r"^\[0\] counter = (\d+) \(expected (\d+)\)", out, re.MULTILINE)
    assert m, out
    return int(m[1]), int(m[2])


# -- counter.py -------------------------------------------------------------------------------------------
def test_counter_with_lock_loses_nothing() -> None:
    iters = 40
    rc, out = launch(16, 4, "counter.py", "--iters", str(iters))
    assert rc == 0, out
    assert counter_of(out) == (16 * iters, 16 * iters)


def test_counter_without_lock_loses_updates() -> None:
    # Ranks released together by a barrier interleave their reads and writes
    # all the time: a run loses most of its updates, not a few (16 ranks lost
    # 70 to 80% of them, 8 ranks 50 to 60%).
    iters = 40
    rc, out = launch(8, 2, "counter.py", "--iters", str(iters), "--no-lock")
    assert rc == 0, out
    counter, expected = counter_of(out)
    assert expected == 8 * iters
    assert 0 < counter < expected, out
    assert f"{expected - counter} updates lost without the lock" in out


# -- cannon.py: the block arithmetic alone ---------------------------------------------------------------
@pytest.mark.parametrize("n,q", [(5, 1), (8, 2), (12, 3), (16, 4)])
def test_cannon_blocks_sum_to_the_product(n: int, q: int) -> None:
    c = cannon.simulate(n, q, seed=3)
    b = n // q
    for rank, blk in c.items():
        i, j = cannon.coords(rank, q)
        assert np.max(np.abs(blk - cannon.reference(3, i, j, q, b))) <= cannon.tolerance(n)


def test_cannon_torus_neighbours() -> None:
    q = 3
    assert cannon.left(cannon.rank_at(1, 0, q), q) == cannon.rank_at(1, 2, q)
    assert cannon.up(cannon.rank_at(0, 1, q), q) == cannon.rank_at(2, 1, q)
    assert cannon.first_k(2, 2, q) == 1
    # the blocks are the same wherever they are built, and differ between A and B
    assert np.array_equal(cannon.block(7, "A", 1, 2, 4), cannon.block(7, "A", 1, 2, 4))
    assert not np.array_equal(cannon.block(7, "A", 1, 2, 4), cannon.block(7, "B", 1, 2, 4))


# -- cannon.py through the launcher ----------------------------------------------------------------------
def _cannon_line(out: str, n: int, p: int) -> float:
    m = re.search(rf"^\[0\] C = A @ B, N = {n} on {p} ranks .*: max error (\S+), multiply", out, re.MULTILINE)
    assert m, out
    return float(m[1])


def test_cannon_4_ranks() -> None:
    rc, out = launch(4, 2, "cannon.py", "-N", "96", "--seed", "5")
    assert rc == 0, out
    assert _cannon_line(out, 96, 4) <= cannon.tolerance(96)


def test_cannon_16_ranks() -> None:
    rc, out = launch(16, 4, "cannon.py", "-N", "512")
    assert rc == 0, out
    assert _cannon_line(out, 512, 16) <= cannon.tolerance(512)


def test_cannon_refuses_other_sizes() -> None:
    rc, out = launch(2, 1, "cannon.py", "-N", "8")
    assert rc == 2 and "needs a square number of ranks" in out, out
