"""--local plumbing: readiness over an inherited pipe, children stopped by pid, CPU placement."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from udpverbs.bench import local
from udpverbs.bench.perf import tty_progress

PY = sys.executable


def test_child_reports_readiness_on_its_pipe() -> None:
    code = "import os,sys,time; os.write(int(sys.argv[1]), b'4242\\n'); time.sleep(30)"
    child = local.spawn([PY, "-c", code, "{ready_fd}"])
    try:
        assert child.wait_ready(20) == "4242" and child.proc.poll() is None
    finally:
        child.stop()
    assert child.proc.poll() is not None


def test_child_dying_before_ready_is_an_error() -> None:
    with pytest.raises(local.LocalRunError, match="exited"):
        local.spawn([PY, "-c", "raise SystemExit(3)", "{ready_fd}"]).wait_ready(20)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Every child ``local`` starts, stopped at the end whatever the test did."""
    children: list[subprocess.Popen[bytes]] = []
    real_popen = local.subprocess.Popen

    def recording_popen(*a, **kw):  # type: ignore[no-untyped-def]
        p = real_popen(*a, **kw)
        children.append(p)
        return p

    monkeypatch.setattr(local.subprocess, "Popen", recording_popen)
    try:
        yield children
    finally:
        for p in children:
            local.stop_process(p)


def test_silent_child_is_stopped_after_the_timeout(started: list[subprocess.Popen[bytes]]) -> None:
    with pytest.raises(local.LocalRunError, match="not ready"):
        local.spawn([PY, "-c", "import time; time.sleep(30)", "{ready_fd}"]).wait_ready(0.5)
    assert started and started[0].poll() is not None


def F(*cpus: int) -> frozenset[int]:
    return frozenset(cpus)


@pytest.mark.parametrize(
    "cpus, expected",
    [
        ([0], None),  # nothing to place
        # each daemon alone with the other side's application
        ([0, 1], local.Placement(server_daemon=F(0), client_daemon=F(1), server_app=F(1), client_app=F(0))),
        ([5, 2], local.Placement(server_daemon=F(2), client_daemon=F(5), server_app=F(5), client_app=F(2))),
        ([0, 1, 2], local.Placement(server_daemon=F(0), client_daemon=F(1), server_app=F(1), client_app=F(0))),
        # enough for one each
        ([3, 1, 0, 2, 7], local.Placement(server_daemon=F(0), client_daemon=F(1), server_app=F(2), client_app=F(3))),
    ],
)
def test_crossed_placement(cpus: list[int], expected: local.Placement | None) -> None:
    assert local.crossed_placement(cpus) == expected


def test_placement_says_where_each_process_runs() -> None:
    p = local.crossed_placement([0, 1])
    assert p is not None
    assert p.describe() == "daemons CPU 0 (server), 1 (client); applications CPU 1 (server), 0 (client)"
    assert p.describe(daemons=False) == "applications CPU 1 (server), 0 (client)"  # a baseline-only run


def test_no_pin_places_nothing() -> None:
    assert local.default_placement(False) is None


def _allowed(pid: int) -> set[frozenset[int]]:
    """The CPU sets of every thread of ``pid`` (a thread keeps the mask it was created with)."""
    return {frozenset(os.sched_getaffinity(int(t.name))) for t in Path(f"/proc/{pid}/task").iterdir()}


def test_local_daemons_and_server_run_where_placed() -> None:
    mine = sorted(os.sched_getaffinity(0))
    first, last = F(mine[0]), F(mine[-1])  # the same CPU on a 1-CPU host: the pinning is still checked
    placement = local.Placement(server_daemon=first, client_daemon=last, server_app=last, client_app=first)
    with local.LocalDaemons(mtu=1500, placement=placement) as daemons:
        server = local.spawn_server("write_lat", device=daemons.server_device, cpus=placement.server_app)
        try:
            local.server_port(server)  # up and listening: its interpreter has started what threads it has
            s_daemon, c_daemon = (c.proc.pid for c in daemons.children)
            assert _allowed(s_daemon) == {first} and _allowed(c_daemon) == {last}
            assert _allowed(server.proc.pid) == {last}
        finally:
            server.stop()


def test_pinned_gives_the_cpus_back() -> None:
    before = os.sched_getaffinity(0)
    one = F(min(before))
    with local.pinned(one):
        assert os.sched_getaffinity(0) == one
    assert os.sched_getaffinity(0) == before
    with pytest.raises(RuntimeError), local.pinned(one):
        raise RuntimeError("the run failed")
    assert os.sched_getaffinity(0) == before


def test_a_child_that_cannot_be_pinned_is_stopped(started: list[subprocess.Popen[bytes]]) -> None:
    nowhere = F(max(os.sched_getaffinity(0)) + 4096)  # no such CPU
    with pytest.raises(local.LocalRunError, match="cannot pin"):
        local.spawn([PY, "-c", "import time; time.sleep(30)", "{ready_fd}"], cpus=nowhere)
    assert started and started[0].returncode is not None  # stopped (and reaped) by spawn itself


def test_progress_line_redraws_and_clears() -> None:
    buf = io.StringIO()
    show = tty_progress(buf)
    show(0, 4, 2)
    show(2, 4, 8)
    show(4, 4, 0)
    text = buf.getvalue()
    assert "0/4  2 B" in text and "2/4  8 B" in text and text.endswith("\r")


def test_daemon_ready_line_and_addresses() -> None:
    assert local.daemon_address("ready 127.0.0.4 40123 /tmp/x/uvlocal-2.sock") == ("127.0.0.4", 40123)
    with pytest.raises(local.LocalRunError, match="uvlocal-2"):
        local.daemon_address("serving", "uvlocal-2")
    assert [local.daemon_ip(i) for i in (0, 1, 252)] == [local.SERVER_IP, local.CLIENT_IP, "127.0.0.254"]
    with pytest.raises(ValueError):
        local.daemon_ip(253)


def test_a_local_daemon_of_several_paths_has_one_address_per_loopback_network() -> None:
    assert local.path_addresses(0, 1) == [local.SERVER_IP]
    assert local.path_addresses(1, 3) == ["127.0.0.3/24", "127.1.0.3/24", "127.2.0.3/24"]
    with pytest.raises(ValueError, match="1 to 8"):
        local.path_addresses(0, 0)


def test_block_placement_and_rank_environment() -> None:
    assert [local.block_placement(r, 8, 3) for r in range(8)] == [0, 0, 0, 1, 1, 1, 2, 2]
    env = local.rank_environment(1, [("127.0.0.2", 5), ("127.0.0.3", 6)], device="uv1", runtime_dir="/r", group="g",
                                 base={"KEEP": "1"})
    assert env == {"KEEP": "1", "UDPVERBS_DEVICE": "uv1", "UDPVERBS_RUNTIME_DIR": "/r", "UDPVERBS_RANK": "1",
                   "UDPVERBS_SIZE": "2", "UDPVERBS_MEMBERS": "127.0.0.2:5,127.0.0.3:6", "UDPVERBS_GROUP": "g",
                   "PYTHONUNBUFFERED": "1"}
