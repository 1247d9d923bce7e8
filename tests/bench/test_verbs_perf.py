"""perftest's tests over real udpverbs daemons on loopback (tiny runs: outcomes, not speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from udpverbs import cli

LAT = {"t_min_us", "t_max_us", "t_typical_us", "t_avg_us", "t_stdev_us", "p99_us", "p999_us"}
BW = {"bw_peak_MBps", "bw_avg_MBps", "msg_rate_Mpps"}


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[dict], str]:
    rc = cli.main(["perf", *argv])
    out, err = capsys.readouterr()
    return rc, [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


@pytest.mark.parametrize(
    "argv, keys, iters",
    [
        # 3000 B: a Write of three DDP segments, with the baseline beside it
        (["write_lat", "-s", "3000", "-n", "20", "--baseline", "raw-udp"], LAT, 20),
        (["read_lat", "-s", "2", "-n", "20"], LAT, 20),
        # two QPs share the iterations; 41 is odd so one QP ends on its quota, not on cq_mod
        (["write_bw", "-s", "5000", "-n", "41", "-q", "2", "-t", "8"], BW, 41),
        (["read_bw", "-s", "4096", "-n", "30", "-t", "4", "--baseline", "raw-udp"], BW, 30),
        # -e: sleep on the CQ's completion events instead of busy-polling
        (["write_bw", "-s", "2", "-n", "20", "-e"], BW, 20),
    ],
    ids=["write_lat", "read_lat", "write_bw_2qps", "read_bw", "write_bw_events"],
)
def test_local_run_reports_a_sane_row(capsys: pytest.CaptureFixture[str], argv: list[str], keys: set[str], iters: int) -> None:
    rc, rows, err = _run(capsys, *argv, "--local", "--json")
    assert rc == 0, err
    assert len(rows) == 1
    row = rows[0]
    assert row["transport"] == "udpverbs" and row["iterations"] == iters and row["test"] == argv[0]
    assert keys <= set(row) and all(row[k] > 0 for k in keys - {"t_stdev_us"})
    if keys is LAT:
        assert row["t_min_us"] <= row["t_typical_us"] <= row["p99_us"] <= row["p999_us"] <= row["t_max_us"]
    if "--baseline" in argv:
        assert set(row["ratio"]) == keys and row["baseline"]["iterations"] == iters


def test_send_and_atomic_tests_say_they_are_not_available_yet(capsys: pytest.CaptureFixture[str]) -> None:
    rc, rows, err = _run(capsys, "send_lat", "--local", "-n", "5")
    assert rc == 1 and rows == []
    assert "issue 4" in err and "send_lat" in err


def test_demo_prints_both_sweeps_and_writes_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import matplotlib  # noqa: F401

        have_matplotlib = True
    except ImportError:
        have_matplotlib = False
    png = tmp_path / "demo.png"
    rc = cli.main(["demo", "--max-size", "4", "-n", "10", "--plot", str(png), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["test"], r["bytes"]) for r in rows] == [("write_lat", 2), ("write_lat", 4), ("write_bw", 2), ("write_bw", 4)]
    assert all("baseline" in r for r in rows)
    if have_matplotlib:
        assert png.read_bytes()[:4] == b"\x89PNG"
    else:  # the demo still succeeds, and says how to get the plot
        assert not png.exists() and "udpverbs[plot]" in err
