"""perftest-style output: the banner, the result table, and JSON rows.

Theory of operation
-------------------
The text output imitates perftest's so that people who read ``ib_write_lat``
and ``ib_write_bw`` output every day read ours without thinking: a banner
between dashed lines naming the test and its settings, the local and remote
addresses, then one line per message size under perftest's column titles.
When a baseline runs in the same invocation, its figures follow each row on
a line of their own, and the ours-over-baseline ratio of the headline figure
(typical latency, average bandwidth) closes the udpverbs line.

``--json`` replaces all of that with one JSON object per row (and nothing
else on stdout), keyed as documented in :func:`row_json`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Union

from .stats import BandwidthStats, LatencyStats

Stats = Union[LatencyStats, BandwidthStats]

RESULT_LINE = "-" * 87
_SIDES = ("client", "server")
LAT_COLUMNS = (
    " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]"
    "    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]"
)
BW_COLUMNS = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]"
#: perftest's --report_gbits titles (10**9 bits per second)
BW_COLUMNS_GBITS = " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]"
#: MB/s (10**6 bytes) to Gb/s (10**9 bits)
GBITS_PER_MBPS = 8 / 1000


@dataclass(frozen=True)
class DaemonLoad:
    """--cpu_util: what each daemon spent over a run, in % of its wall time, (client, server).

    ``cpu_pct`` is the daemon process's CPU time, the bounded spin of a
    waiting data loop included; ``busy_pct`` the time of its passes that
    found work.  A daemon near 100% busy is the one that sets the pace.
    """

    cpu_pct: tuple[float, float]
    busy_pct: tuple[float, float]


@dataclass(frozen=True)
class Row:
    """One message size's result: ours, and the baseline's when one ran."""

    test: str
    bytes: int
    ours: Stats | None
    baseline: Stats | None = None
    baseline_name: str = "raw-udp"
    #: send_lat's ``--rnr-delay-us``: the latencies include this server-side wait
    rnr_delay_us: int = 0
    #: -b: the bandwidths and rates are both directions' sums
    bidirectional: bool = False
    #: --cpu_util: what the two daemons spent over the run
    daemons: DaemonLoad | None = None
    #: atomic tests: the operation measured (perftest's -A), else None
    atomic_type: str | None = None

    @property
    def main(self) -> Stats:
        """The figures the row leads with (the baseline's in baseline-only runs)."""
        stats = self.ours if self.ours is not None else self.baseline
        assert stats is not None, "a row holds at least one measurement"
        return stats


def headline(stats: Stats) -> float:
    """Return the figure a ratio is quoted for: typical latency or average bandwidth."""
    if isinstance(stats, LatencyStats):
        return stats.t_typical_us
    return stats.bw_avg_MBps


def _ratios(ours: Stats, base: Stats) -> dict[str, float | None]:
    a, b = ours.as_dict(), base.as_dict()
    return {k: (a[k] / b[k] if b[k] else None) for k in a}


def row_json(row: Row) -> dict[str, Any]:
    """Return the JSON object of one row.

    Keys: ``test``, ``bytes``, ``iterations``, ``transport`` ("udpverbs", or
    the baseline's name in a baseline-only run), then the figures
    (``t_min_us t_max_us t_typical_us t_avg_us t_stdev_us p99_us p999_us``
    or ``bw_peak_MBps bw_avg_MBps msg_rate_Mpps``).  With a baseline beside
    ours: ``baseline`` (an object with ``iterations`` and the same figure
    keys) and ``ratio`` (ours / baseline for every figure; None where the
    baseline's figure is 0).  A send_lat run with ``--rnr-delay-us`` adds
    ``rnr_delay_us``: the server's delay before each receive, which the
    latencies include.  A ``-b`` run adds ``"bidirectional": true``: its
    bandwidths and message rates (and the baseline's) are the sums of both
    directions, and ``iterations`` counts one direction's messages, as
    perftest prints them.  ``--cpu_util`` adds ``daemon_cpu_pct`` and
    ``daemon_busy_pct``, each ``{"client": …, "server": …}``: each daemon's
    CPU time, and the time its data loop found work, over the run in % of
    the run's wall time (see :class:`DaemonLoad`).  The atomic tests'
    rows say which operation they measured: ``atomic_type``,
    ``"FETCH_AND_ADD"`` or ``"CMP_AND_SWAP"`` (``-A``).
    """
    main = row.main
    out: dict[str, Any] = {
        "test": row.test,
        "bytes": row.bytes,
        "iterations": main.iterations,
        "transport": "udpverbs" if row.ours is not None else row.baseline_name,
    }
    if row.rnr_delay_us:
        out["rnr_delay_us"] = row.rnr_delay_us
    if row.bidirectional:
        out["bidirectional"] = True
    if row.atomic_type is not None:
        out["atomic_type"] = row.atomic_type
    if row.daemons is not None:
        out["daemon_cpu_pct"] = dict(zip(_SIDES, row.daemons.cpu_pct))
        out["daemon_busy_pct"] = dict(zip(_SIDES, row.daemons.busy_pct))
    out.update(main.as_dict())
    if row.ours is not None and row.baseline is not None:
        out["baseline"] = {"name": row.baseline_name, **stats_json(row.baseline)}
        out["ratio"] = _ratios(row.ours, row.baseline)
    return out


def stats_json(stats: Stats) -> dict[str, Any]:
    """Return one side's figures as a JSON object: ``iterations`` and the figure keys."""
    return {"iterations": stats.iterations, **stats.as_dict()}


def stats_from_json(d: dict[str, Any]) -> Stats:
    """Rebuild one side's figures from their JSON object (``iterations`` and the figure keys).

    Raises: KeyError, TypeError or ValueError on an object that is not such figures.
    """
    cls: type[LatencyStats] | type[BandwidthStats] = LatencyStats if "t_typical_us" in d else BandwidthStats
    return cls(**{f.name: (int if f.name == "iterations" else float)(d[f.name]) for f in fields(cls)})


def row_from_json(obj: dict[str, Any]) -> Row:
    """Rebuild a row from :func:`row_json`'s object (the server prints the client's rows).

    Raises: KeyError or TypeError on an object that is not a row.
    """
    main = stats_from_json(obj)
    rnr = int(obj.get("rnr_delay_us", 0))
    both = obj.get("bidirectional") is True
    atomic = obj.get("atomic_type")
    if atomic is not None and not isinstance(atomic, str):
        raise TypeError(f"atomic_type {atomic!r} is not a name")
    if obj["transport"] == "udpverbs":
        base = stats_from_json(obj["baseline"]) if "baseline" in obj else None
        name = obj["baseline"]["name"] if "baseline" in obj else "raw-udp"
        load = None
        if "daemon_cpu_pct" in obj:
            cpu, busy = obj["daemon_cpu_pct"], obj["daemon_busy_pct"]
            load = DaemonLoad((float(cpu["client"]), float(cpu["server"])),
                              (float(busy["client"]), float(busy["server"])))
        return Row(str(obj["test"]), int(obj["bytes"]), main, base, name, rnr, both, load, atomic)
    return Row(str(obj["test"]), int(obj["bytes"]), None, main, str(obj["transport"]), rnr, both, atomic_type=atomic)


def columns(is_latency: bool, with_ratio: bool, *, gbits: bool = False) -> str:
    """Return the column-title line (perftest's, plus a ratio column with a baseline).

    ``gbits``: bandwidth in Gb/s (perftest's --report_gbits).
    """
    line = LAT_COLUMNS if is_latency else BW_COLUMNS_GBITS if gbits else BW_COLUMNS
    return line + ("   ratio" if with_ratio else "")


def _figures(bytes_: int, s: Stats, gbits: bool) -> str:
    if isinstance(s, LatencyStats):
        return (
            f" {bytes_:<7d} {s.iterations:<10d}    {s.t_min_us:<7.2f}        {s.t_max_us:<7.2f}"
            f"      {s.t_typical_us:<7.2f}            {s.t_avg_us:<7.2f}          {s.t_stdev_us:<7.2f}"
            f"         {s.p99_us:<7.2f}                 {s.p999_us:<7.2f}"
        )
    unit = GBITS_PER_MBPS if gbits else 1.0
    return (
        f" {bytes_:<7d}    {s.iterations:<10d}       {s.bw_peak_MBps * unit:<7.2f}            "
        f"{s.bw_avg_MBps * unit:<7.2f}               {s.msg_rate_Mpps:<7.6f}"
    )


def format_row(row: Row, *, gbits: bool = False) -> list[str]:
    """Return the table lines of one row: ours (with the ratio), then the baseline.

    ``gbits``: as :func:`columns`.
    """
    if row.ours is None:
        return [_figures(row.bytes, row.main, gbits) + f"   ({row.baseline_name})"]
    cpu = []
    if row.daemons is not None:
        (cc, cs), (bc, bs) = row.daemons.cpu_pct, row.daemons.busy_pct
        cpu = [f" daemon CPU[%]: client {cc:.1f} (busy {bc:.1f}), server {cs:.1f} (busy {bs:.1f})"]
    if row.baseline is None:
        return [_figures(row.bytes, row.ours, gbits), *cpu]
    b = headline(row.baseline)
    ratio = f"{headline(row.ours) / b:.2f}x" if b else "-"
    return [
        _figures(row.bytes, row.ours, gbits) + f"   {ratio}",
        *cpu,
        _figures(row.bytes, row.baseline, gbits) + f"   ({row.baseline_name})",
    ]


#: perftest's --output units: the one figure each row prints, and whether it is a latency test's
OUTPUT_UNITS = {"bandwidth": False, "message_rate": False, "latency": True, "latency_typical": True}


def figure_text(row: Row, unit: str, *, gbits: bool = False) -> str:
    """Return the one figure of ``row`` that perftest's ``--output=unit`` prints.

    ``bandwidth``: the average, in MB/s (Gb/s with ``gbits``);
    ``message_rate``: in Mpps; ``latency``: the average in µs, as
    perftest's help says it is; ``latency_typical``: the median.  The
    figure is ours, or the baseline's in a baseline-only run.
    """
    s = row.main
    if isinstance(s, LatencyStats):
        value = s.t_typical_us if unit == "latency_typical" else s.t_avg_us
    elif unit == "message_rate":
        value = s.msg_rate_Mpps
    else:
        value = s.bw_avg_MBps * (GBITS_PER_MBPS if gbits else 1.0)
    return f"{value:f}"


def banner(title: str, settings: list[tuple[str, str]], local: str | None, remote: str | None) -> list[str]:
    """Return perftest's banner lines: title, settings, local/remote addresses.

    Takes: the test title ("RDMA_Write Latency Test"), (name, value) pairs,
    and the address lines (None to leave one out).
    """
    lines = [RESULT_LINE, f"{'':20s}{title}"]
    lines += [f" {name:<16s}: {value}" for name, value in settings]
    lines.append(RESULT_LINE)
    for label, text in (("local", local), ("remote", remote)):
        if text is not None:
            lines.append(f" {label} address: {text}")
    if local is not None or remote is not None:
        lines.append(RESULT_LINE)
    return lines
