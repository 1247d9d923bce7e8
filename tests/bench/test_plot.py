"""The plot: a PNG with ours and the baseline; a clear error without matplotlib."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from udpverbs.bench import plot
from udpverbs.bench.report import Row
from udpverbs.bench.stats import bandwidth_stats, latency_stats


def _rows() -> list[Row]:
    rows = []
    for k in range(1, 6):
        size = 2**k
        rows.append(Row("write_lat", size, latency_stats([40_000 + k, 50_000]), latency_stats([10_000, 12_000])))
        rows.append(Row("write_bw", size, bandwidth_stats(size, 0, [10**6, 2 * 10**6], 1), bandwidth_stats(size, 0, [10**5], 1)))
    return rows


def test_plot_writes_a_png_with_two_panels(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = plot.plot_rows(_rows(), tmp_path / "sweep.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_nothing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        plot.plot_rows([], tmp_path / "x.png")


def test_missing_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(plot.PlotUnavailable, match=r"udpverbs\[plot\]"):
        plot.plot_rows(_rows(), tmp_path / "x.png")
