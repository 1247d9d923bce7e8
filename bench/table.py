"""``udpverbs perf all``: the README's results tables in one command.

Theory of operation
-------------------
Every row of the README's latency, bandwidth and both-directions tables is
one ``udpverbs perf ... --local --baseline raw-udp`` command (:data:`ROWS`),
so the udpverbs figure and its raw-UDP baseline come from the same run.
The rows are run in rounds, one run of every row per round, so that what
else the host does weighs on every row alike (:func:`schedule`), and each
cell reports the median of its rounds and their range.  The ratio's cell is
the median of the rounds' ratios, not the ratio of the medians: each round's
ratio compares two figures taken seconds apart on the same machine.

The runs themselves are the single tests' own machinery: the caller (the
``udpverbs`` command) hands in ``prepare``, which turns a row's command
line into a run, checked before any row starts; this module only chooses
the order, gathers the results and prints them.  The tables are printed
only once every run succeeded: a failing row ends the command naming the
row, never with a partial table.

The process-group tables (``lock_lat``, ``barrier_lat``) are not rows
here: they have a format of their own and ``barrier_lat`` up to 32 ranks
takes minutes by itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TextIO

import udpverbs

from .report import Row, row_json
from .stats import BandwidthStats, LatencyStats

#: Rounds of a full run; ``--quick`` makes one.
DEFAULT_ROUNDS = 5


class TableUsageError(Exception):
    """The ``perf all`` command line is wrong (exit status 2)."""


class TableRunError(Exception):
    """A row's run failed (exit status 1); the message names the row."""


@dataclass(frozen=True)
class TableRow:
    """One row of the README's tables and the command that measures it."""

    #: what ``--rows`` calls it
    key: str
    #: "latency", "bandwidth" or "both"
    table: str
    #: the README's label, markdown included
    label: str
    test: str
    iters: int
    #: ``-n`` under ``--quick``
    quick_iters: int
    flags: tuple[str, ...] = ()
    #: decimals of the latency cells (p99 has none)
    decimals: int = 1

    def argv(self, quick: bool) -> list[str]:
        """The words after ``udpverbs perf`` that measure this row (without ``--local`` and the baseline)."""
        return [self.test, "-n", str(self.quick_iters if quick else self.iters), *self.flags]

    @property
    def per_operation(self) -> bool:
        """Whether the row counts operations per second (the atomic streams) rather than MB/s."""
        return self.test == "atomic_bw"


def _lat(key: str, label: str, test: str, iters: int, *flags: str, decimals: int = 1, quick: int = 200) -> TableRow:
    return TableRow(key, "latency", label, test, iters, quick, flags, decimals)


def _bw(key: str, table: str, label: str, test: str, *flags: str, iters: int = 8000, quick: int = 500) -> TableRow:
    return TableRow(key, table, label, test, iters, quick, flags, 0)


#: The README's rows, in its order.
ROWS: tuple[TableRow, ...] = (
    _lat("write_lat", "`write_lat`, 2 B (inline)", "write_lat", 5000),
    _lat("send_lat", "`send_lat`, 2 B (inline), receive posted", "send_lat", 5000),
    _lat("send_lat-rnr", "`send_lat --rnr-delay-us 1000`: no receive posted when the Send arrives", "send_lat", 200,
         "--rnr-delay-us", "1000", decimals=0, quick=20),
    _lat("read_lat", "`read_lat`, 2 B", "read_lat", 3000, decimals=0),
    _lat("atomic_lat", "`atomic_lat`, 8 B Fetch-and-Add", "atomic_lat", 3000, decimals=0),
    _lat("write_lat-s2048", "`write_lat -s 2048` (2 datagrams)", "write_lat", 3000, "-s", "2048"),
    _lat("write_lat-s8192", "`write_lat -s 8192` (6 datagrams)", "write_lat", 3000, "-s", "8192"),
    _lat("send_lat-s4096", "`send_lat -s 4096` (3 datagrams)", "send_lat", 3000, "-s", "4096"),
    _lat("read_lat-s4096", "`read_lat -s 4096` (3 datagrams back)", "read_lat", 3000, "-s", "4096"),
    _bw("write_bw", "bandwidth", "`write_bw`, 1472-byte datagrams", "write_bw"),
    _bw("write_bw-m65535", "bandwidth", "`write_bw -m 65535`, 65,507-byte datagrams", "write_bw", "-m", "65535"),
    _bw("write_bw-q64", "bandwidth", "`write_bw -q 64`, 1472-byte datagrams", "write_bw", "-q", "64"),
    _bw("read_bw", "bandwidth", "`read_bw`, 1472-byte datagrams", "read_bw"),
    _bw("send_bw", "bandwidth", "`send_bw`, 1472-byte datagrams", "send_bw"),
    _bw("atomic_bw", "bandwidth", "`atomic_bw`, 8 B Fetch-and-Add, operations/s", "atomic_bw",
        iters=20000, quick=1000),
    _bw("write_bw-b", "both", "`write_bw -b`, 1472-byte datagrams", "write_bw", "-b"),
    _bw("read_bw-b", "both", "`read_bw -b`", "read_bw", "-b"),
    _bw("send_bw-b", "both", "`send_bw -b`", "send_bw", "-b"),
    _bw("atomic_bw-b", "both", "`atomic_bw -b`, operations/s", "atomic_bw", "-b", iters=20000, quick=1000),
)

#: Each table's caption and column titles, in the README's order.
TABLES = {
    "latency": ("**Latency** in µs.",
                "| test | udpverbs typical | udpverbs p99 | raw UDP typical | ratio |\n|---|---:|---:|---:|---:|"),
    "bandwidth": ("**Bandwidth** in MB/s (10^6 bytes); `atomic_bw` in operations per second.",
                  "| test | udpverbs | raw UDP | ratio |\n|---|---:|---:|---:|"),
    "both": ("**Both directions at once** (`-b`): each figure is the sum of the two directions.",
             "| test | udpverbs, both directions | raw UDP, both directions | ratio |\n|---|---:|---:|---:|"),
}


def command_argv(row: TableRow, quick: bool, extra: Sequence[str] = ()) -> list[str]:
    """The words after ``udpverbs perf`` of one run of ``row``: its test and
    flags, ``--local --baseline raw-udp``, then ``extra`` (the table's
    ``--daemon-arg``s and ``--no-pin``)."""
    return [*row.argv(quick), "--local", "--baseline", "raw-udp", *extra]


def schedule(rows: Sequence[TableRow], rounds: int) -> list[tuple[int, TableRow]]:
    """The order of the runs: one run of every row (in table order) per round, round after round.

    Returns: (round, row) pairs, rounds counted from 1.
    """
    return [(r, row) for r in range(1, rounds + 1) for row in rows]


# -- the cells ------------------------------------------------------------------------------


def cell_values(row: TableRow, result: Row) -> dict[str, float]:
    """One run's figures for the row's cells: ``udpverbs`` (and ``udpverbs_p99``
    for latency), ``raw_udp`` and ``ratio`` (udpverbs over raw UDP).

    Latency: the typical (median) half round trip in µs; bandwidth: the
    average in MB/s, or operations per second for ``atomic_bw``.
    Raises: TableRunError if the run lacks either side.
    """
    ours, base = result.ours, result.baseline
    if ours is None or base is None:
        raise TableRunError(f"row {row.key}: the run did not measure both udpverbs and its raw-UDP baseline")
    if isinstance(ours, LatencyStats):
        assert isinstance(base, LatencyStats)
        return {"udpverbs": ours.t_typical_us, "udpverbs_p99": ours.p99_us, "raw_udp": base.t_typical_us,
                "ratio": ours.t_typical_us / base.t_typical_us}
    assert isinstance(base, BandwidthStats)
    if row.per_operation:
        mine, theirs = ours.msg_rate_Mpps * 1e6, base.msg_rate_Mpps * 1e6
    else:
        mine, theirs = ours.bw_avg_MBps, base.bw_avg_MBps
    return {"udpverbs": mine, "raw_udp": theirs, "ratio": mine / theirs}


@dataclass(frozen=True)
class Spread:
    """A cell over the rounds: the median and the range."""

    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        return cls(statistics.median(values), min(values), max(values), len(values))

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "min": self.low, "max": self.high}


def number(value: float, decimals: int) -> str:
    """``value`` with thousands separators and ``decimals`` decimals, as the README writes figures."""
    return f"{value:,.{decimals}f}"


def spread_text(s: Spread, decimals: int) -> str:
    """``median (low–high)``; one round has no range, so it is the value alone."""
    if s.count == 1:
        return number(s.median, decimals)
    return f"{number(s.median, decimals)} ({number(s.low, decimals)}–{number(s.high, decimals)})"


def summarize(row: TableRow, results: Sequence[Row]) -> dict[str, Spread]:
    """Each cell of ``row`` over its rounds' results.  Raises: TableRunError as :func:`cell_values`."""
    per_round = [cell_values(row, r) for r in results]
    return {k: Spread.of([v[k] for v in per_round]) for k in per_round[0]}


def table_line(row: TableRow, cells: dict[str, Spread]) -> str:
    """The markdown line of one row: median (range) per cell, the p99 as a median alone."""
    figures = 0 if row.table != "latency" else row.decimals
    parts = [row.label, spread_text(cells["udpverbs"], figures)]
    if "udpverbs_p99" in cells:
        parts.append(number(cells["udpverbs_p99"].median, 0))
    parts += [spread_text(cells["raw_udp"], figures), spread_text(cells["ratio"], 2)]
    return "| " + " | ".join(parts) + " |"


def format_tables(summaries: Sequence[tuple[TableRow, dict[str, Spread]]]) -> list[str]:
    """The tables' lines, README format, each table after its caption; a table with no row is left out."""
    lines: list[str] = []
    for table, (caption, columns) in TABLES.items():
        mine = [table_line(row, cells) for row, cells in summaries if row.table == table]
        if mine:
            lines += ["", caption, "", *columns.split("\n"), *mine]
    return lines


# -- the machine ----------------------------------------------------------------------------


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name as /proc/cpuinfo gives it (the platform's processor name elsewhere)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                name, sep, value = line.partition(":")
                if sep and name.strip() in ("model name", "Model", "cpu model"):
                    return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or "CPU model unknown"


def machine() -> dict[str, Any]:
    """What the figures were measured on: date, CPUs, kernel, Python and udpverbs."""
    total = os.cpu_count() or 0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else total
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": total,
        "cpus_usable": usable,
        "cpu_model": cpu_model(),
        "kernel": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        "udpverbs": udpverbs.__version__,
    }


def machine_line(m: dict[str, Any], rounds: int, quick: bool) -> str:
    """The line before the tables: the date, the machine and how the cells were made."""
    day, _, clock = m["date"].partition(" ")
    cpus = f"{m['cpus']} CPUs" + (f" ({m['cpus_usable']} usable)" if m["cpus_usable"] != m["cpus"] else "")
    runs = f"{rounds} runs of each row, made round-robin over all the rows; median (range)" if rounds > 1 \
        else "1 run of each row"
    if quick:
        runs += "; --quick: fewer messages per row, a smoke check, not a measurement"
    return (f"Measured on **{day}** ({clock}) on {cpus}, {m['cpu_model']}, {m['kernel']}, Python {m['python']}, "
            f"udpverbs {m['udpverbs']}: {runs}.")


# -- the command ----------------------------------------------------------------------------

#: What ``prepare`` turns a row's command line into: a run returning its result rows.
Prepare = Callable[[Sequence[str]], Callable[[], Sequence[Row]]]


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``udpverbs perf all`` (the words after ``perf``)."""
    p = argparse.ArgumentParser(
        prog="udpverbs perf all",
        description="Run every row of the README's results tables (latency, bandwidth, both directions), each "
        "with its raw-UDP baseline in the same invocation, in rounds made round-robin over the rows, and print "
        "median (range) per cell as the README's markdown tables. Progress goes to stderr. Exit status: 0 if "
        "every run succeeded, 1 naming the row that failed (and no table), 2 for a usage error.")
    p.add_argument("test", choices=["all"])
    p.add_argument("--local", action="store_true", help="start the daemons here for every run (required)")
    p.add_argument("--rounds", type=int, help=f"runs of each row (default {DEFAULT_ROUNDS}; 1 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke check: fewer messages per row and 1 round (under a minute on 2 CPUs)")
    p.add_argument("--rows", metavar="LIST",
                   help="only these rows, comma-separated, e.g. write_lat,write_bw (default: all of them: "
                   + ",".join(r.key for r in ROWS) + ")")
    p.add_argument("--json", action="store_true",
                   help="print every run's JSON row and each cell's median and range as one JSON object")
    p.add_argument("--daemon-arg", dest="daemon_args", action="append", default=[], metavar="=FLAG",
                   help="pass FLAG to the daemons of every run, as perf --local's --daemon-arg (repeatable)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="leave the processes' CPUs to the scheduler, as perf --local's --no-pin")
    return p


def rows_from(text: str | None) -> list[TableRow]:
    """The rows ``--rows`` names, in table order.  Raises: TableUsageError for an unknown name."""
    if text is None:
        return list(ROWS)
    wanted = {w.strip() for w in text.split(",") if w.strip()}
    unknown = wanted - {r.key for r in ROWS}
    if unknown or not wanted:
        what = f"unknown row {', '.join(sorted(unknown))}" if unknown else "no row named"
        raise TableUsageError(f"--rows: {what}; the rows are " + ",".join(r.key for r in ROWS))
    return [r for r in ROWS if r.key in wanted]


def run_rows(rows: Sequence[TableRow], rounds: int, runs: dict[str, Callable[[], Sequence[Row]]],
             errors: tuple[type[BaseException], ...], err: TextIO) -> dict[str, list[tuple[Row, float]]]:
    """Run every row ``rounds`` times in :func:`schedule`'s order, a progress line each on ``err``.

    Takes: the rows, the rounds, each row's run by key, and the errors a
    failed run raises.
    Returns: each row's (result, seconds) per round, by key.
    Raises: TableRunError naming the row and round on any of ``errors``.
    """
    results: dict[str, list[tuple[Row, float]]] = {row.key: [] for row in rows}
    order = schedule(rows, rounds)
    for i, (r, row) in enumerate(order, 1):
        started = time.monotonic()
        try:
            got = list(runs[row.key]())
        except errors as e:
            raise TableRunError(f"row {row.key} ({row.label}), round {r} of {rounds}: {e}") from e
        seconds = time.monotonic() - started
        if len(got) != 1:
            raise TableRunError(f"row {row.key}, round {r} of {rounds}: {len(got)} result rows instead of 1")
        cells = cell_values(row, got[0])
        results[row.key].append((got[0], seconds))
        figures = 0 if row.table != "latency" else row.decimals
        print(f"[{i}/{len(order)}] round {r}/{rounds} {row.key}: udpverbs {number(cells['udpverbs'], figures)}, "
              f"raw UDP {number(cells['raw_udp'], figures)}, ratio {cells['ratio']:.2f} ({seconds:.1f} s)",
              file=err, flush=True)
    return results


def report_json(m: dict[str, Any], rows: Sequence[TableRow], rounds: int, quick: bool, extra: Sequence[str],
                results: dict[str, list[tuple[Row, float]]]) -> dict[str, Any]:
    """The ``--json`` document: the machine, and per row its command, every run's JSON row and the cells."""
    out_rows = []
    for row in rows:
        done = results[row.key]
        out_rows.append({
            "row": row.key, "table": row.table, "label": row.label,
            "command": " ".join(["udpverbs", "perf", *command_argv(row, quick, extra)]),
            "runs": [{"round": r, "seconds": round(s, 3), "result": row_json(res)}
                     for r, (res, s) in enumerate(done, 1)],
            "cells": {k: v.as_dict() for k, v in summarize(row, [res for res, _ in done]).items()},
        })
    return {"machine": m, "rounds": rounds, "quick": quick, "rows": out_rows}


@dataclass(frozen=True)
class TableOptions:
    """``perf all``'s command line, checked."""

    rows: tuple[TableRow, ...]
    rounds: int
    quick: bool
    json_out: bool
    #: what every run's command line ends with: the ``--daemon-arg``s and ``--no-pin``
    extra: tuple[str, ...]


def parse_options(argv: Sequence[str]) -> TableOptions:
    """Parse and check ``perf all``'s words after ``perf``.

    Raises: TableUsageError; SystemExit (status 2) for what argparse refuses.
    """
    args = build_parser().parse_args(list(argv))
    if not args.local:
        raise TableUsageError("perf all runs both sides on this host, with daemons of its own: give --local")
    rounds = args.rounds if args.rounds is not None else 1 if args.quick else DEFAULT_ROUNDS
    if rounds < 1:
        raise TableUsageError("--rounds must be at least 1")
    extra = [f"--daemon-arg={a}" for a in args.daemon_args] + ([] if args.pin else ["--no-pin"])
    return TableOptions(tuple(rows_from(args.rows)), rounds, args.quick, args.json, tuple(extra))


def main(argv: Sequence[str], prepare: Prepare, errors: tuple[type[BaseException], ...],
         out: TextIO | None = None, err: TextIO | None = None) -> int:
    """``udpverbs perf all ...`` (``argv``: the words after ``perf``); returns 0.

    ``prepare`` turns the words after ``udpverbs perf`` of one run into
    the run (raising its usage error at once); ``errors`` are those a run
    raises when it fails.
    Raises: TableUsageError (or ``prepare``'s usage error) for a bad command
    line, before any run; TableRunError when a run failed.
    """
    out, err = out or sys.stdout, err or sys.stderr
    opts = parse_options(argv)
    rows, rounds = opts.rows, opts.rounds
    runs = {row.key: prepare(command_argv(row, opts.quick, opts.extra)) for row in rows}
    m = machine()
    print(f"perf all: {len(rows)} rows, {rounds} round{'s' if rounds > 1 else ''}", file=err, flush=True)
    started = time.monotonic()
    results = run_rows(rows, rounds, runs, errors, err)
    print(f"perf all: done in {time.monotonic() - started:.0f} s", file=err, flush=True)
    if opts.json_out:
        json.dump(report_json(m, rows, rounds, opts.quick, opts.extra, results), out, indent=1)
        out.write("\n")
        return 0
    summaries = [(row, summarize(row, [res for res, _ in results[row.key]])) for row in rows]
    print("\n".join([machine_line(m, rounds, opts.quick), *format_tables(summaries)]), file=out)
    return 0
