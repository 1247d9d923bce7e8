"""Whether a delivery is worth a sched_yield: only if a client application may share a CPU with the daemon."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Iterator

import pytest

from udpverbs.daemon.device import may_share_a_cpu


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A child process that sleeps until stopped (by pid, at the end)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield p
    finally:
        p.kill()
        p.wait()


def test_no_application_shares_nothing() -> None:
    assert not may_share_a_cpu([])


def test_an_application_on_our_cpus_shares(sleeper: subprocess.Popen[bytes]) -> None:
    assert may_share_a_cpu([os.getpid()])
    assert may_share_a_cpu([sleeper.pid])  # unpinned: it inherited our CPUs


def test_applications_pinned_elsewhere_share_nothing(sleeper: subprocess.Popen[bytes]) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to pin the daemon and the application apart")
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(sleeper.pid, {cpus[1]})
    os.sched_setaffinity(0, {cpus[0]})  # this process plays the daemon
    try:
        assert not may_share_a_cpu([sleeper.pid])
        assert may_share_a_cpu([sleeper.pid, os.getpid()])  # one that may share is enough
    finally:
        os.sched_setaffinity(0, before)


def test_a_mask_that_cannot_be_read_counts_as_shared() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process (until reused, which would read as a real mask)
    assert may_share_a_cpu([gone.pid])
