"""Plots of a sweep: latency and bandwidth against message size.

Theory of operation
-------------------
One figure, one panel per kind of test present in the rows (latency, then
bandwidth), message size on a log-2 axis.  Each panel draws udpverbs and the
baseline measured in the same run, so the gap between the two curves is the
cost of udpverbs over bare UDP on this machine.  Latency panels show the
typical (median) half round trip with the 99th percentile as a faint band
edge; bandwidth panels show the average.

matplotlib is an optional dependency (``pip install 'udpverbs[plot]'``);
:func:`require_matplotlib` says so clearly, before a long sweep starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .report import Row
from .stats import LatencyStats

INSTALL_HINT = "plotting needs matplotlib: pip install 'udpverbs[plot]' (or: pip install matplotlib)"


class PlotUnavailable(Exception):
    """matplotlib is not installed."""


def require_matplotlib() -> Any:
    """Import matplotlib with a file-only backend.

    Returns: the ``matplotlib.pyplot`` module.
    Raises: PlotUnavailable with the install hint if matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed: we only write files
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailable(INSTALL_HINT) from e
    return plt


def _series(rows: Sequence[Row], which: str) -> tuple[list[int], list[Any]]:
    xs, ys = [], []
    for row in rows:
        stats = row.ours if which == "ours" else row.baseline
        if stats is not None:
            xs.append(row.bytes)
            ys.append(stats)
    return xs, ys


def plot_rows(rows: Sequence[Row], path: str | Path, title: str = "udpverbs vs raw UDP") -> Path:
    """Write a PNG of the rows.

    Takes: rows of one or more tests (latency and/or bandwidth), the output
    path, and the figure title.
    Returns: the path written.
    Raises: PlotUnavailable if matplotlib is missing; ValueError if there are no rows.
    """
    if not rows:
        raise ValueError("nothing to plot: no rows")
    plt = require_matplotlib()
    lat = [r for r in rows if isinstance(r.main, LatencyStats)]
    bw = [r for r in rows if not isinstance(r.main, LatencyStats)]
    panels = [(kind, rs) for kind, rs in (("lat", lat), ("bw", bw)) if rs]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.8), squeeze=False)
    for ax, (kind, rs) in zip(axes[0], panels):
        for which, style in (("ours", "o-"), ("baseline", "s--")):
            xs, stats = _series(rs, which)
            if not xs:
                continue
            label = "udpverbs" if which == "ours" else rs[0].baseline_name
            if kind == "lat":
                ax.plot(xs, [s.t_typical_us for s in stats], style, label=f"{label} typical")
                ax.plot(xs, [s.p99_us for s in stats], style[0] + ":", alpha=0.4, label=f"{label} 99%")
            else:
                ax.plot(xs, [s.bw_avg_MBps for s in stats], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size [bytes]")
        if kind == "lat":
            ax.set_yscale("log")
            ax.set_ylabel("half round trip [µs]")
            ax.set_title(f"latency ({rs[0].test})")
        else:
            ax.set_ylabel("bandwidth [MB/s] (MB = 10^6 B)")
            ax.set_title(f"bandwidth ({rs[0].test})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
