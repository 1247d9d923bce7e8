"""--local plumbing: readiness over an inherited pipe, children stopped by pid."""

from __future__ import annotations

import io
import sys

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


def test_silent_child_is_stopped_after_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    started = []
    real_popen = local.subprocess.Popen

    def recording_popen(*a, **kw):  # type: ignore[no-untyped-def]
        p = real_popen(*a, **kw)
        started.append(p)
        return p

    monkeypatch.setattr(local.subprocess, "Popen", recording_popen)
    try:
        with pytest.raises(local.LocalRunError, match="not ready"):
            local.spawn([PY, "-c", "import time; time.sleep(30)", "{ready_fd}"]).wait_ready(0.5)
    finally:
        for p in started:
            local.stop_process(p)
    assert started and started[0].poll() is not None


def test_progress_line_redraws_and_clears() -> None:
    buf = io.StringIO()
    show = tty_progress(buf)
    show(0, 4, 2)
    show(2, 4, 8)
    show(4, 4, 0)
    text = buf.getvalue()
    assert "0/4  2 B" in text and "2/4  8 B" in text and text.endswith("\r")
