"""``udpverbs perf write_bw`` over one shaped network and over two: what striping gains.

Theory of operation
-------------------
Two namespaces joined by two veth pairs (``netns.py``), each direction of
each shaped to ``--rate-mbit`` by a token bucket.  A round runs
``udpverbs perf write_bw`` twice, client in namespace A and server in B,
each with its own daemon: once with daemons given one address each (one
path), once with both addresses (two paths).  Rounds alternate the two, so
a change in the machine's load lands on both; the median and range over the
rounds and the ratio two/one are printed as a markdown table (``--json``:
one JSON object).  Needs root; run as
``python -m udpverbs.bench.multipath``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from typing import Sequence

from . import local, verbs_perf
from .netns import NamespaceError, NamespacePair, Wire

MTU = 1500


class MultipathRunError(RuntimeError):
    """A daemon or a perf side failed."""


def _daemon(pair: NamespacePair, side: int, paths: int, runtime_dir: str) -> tuple[local.Child, str]:
    name = f"uvmp{'ab'[side]}"
    path = f"{runtime_dir}/{name}.sock"
    extra: list[str] = []
    for ip in pair.addrs[side][1:paths]:
        extra += ["--addr", ip]
    argv = verbs_perf.daemon_command(pair.addrs[side][0], name, path, MTU - 28, extra)
    return local.spawn([*pair.prefix(side), *argv], stdout=subprocess.DEVNULL), path


def one_run(pair: NamespacePair, paths: int, perf_args: Sequence[str]) -> float:
    """``write_bw`` A -> B with daemons on ``paths`` addresses each; returns its average MB/s.

    Raises: MultipathRunError naming the side that failed.
    """
    children: list[local.Child] = []
    with tempfile.TemporaryDirectory(prefix="udpverbs-mp-") as d:
        try:
            (da, dev_a), (db, dev_b) = _daemon(pair, 0, paths, d), _daemon(pair, 1, paths, d)
            children += [da, db]
            da.wait_ready()
            db.wait_ready()
            server = local.spawn([*pair.prefix(1), *local.cli_argv(
                "perf", "write_bw", "--bind", pair.addrs[1][0], "--port", "0", "--ready-fd", "{ready_fd}",
                "--device", dev_b)], stdout=subprocess.DEVNULL)
            children.append(server)
            port = local.server_port(server)
            client = subprocess.run(
                [*pair.prefix(0), *local.cli_argv("perf", "write_bw", "--peer", pair.addrs[1][0], "--port", str(port),
                                                  "--bind", pair.addrs[0][0], "--device", dev_a, "--json",
                                                  *perf_args)],
                capture_output=True, text=True, timeout=600)
            if client.returncode != 0:
                raise MultipathRunError(f"write_bw over {paths} path(s) failed: {client.stderr.strip()}")
            rows = [json.loads(line) for line in client.stdout.splitlines() if line.startswith("{")]
            if local.wait_process(server.proc, local.SERVER_EXIT_S) != 0:
                raise MultipathRunError(f"the server over {paths} path(s) failed")
            return float(rows[-1]["bw_avg_MBps"])
        except local.LocalRunError as e:
            raise MultipathRunError(str(e)) from None
        finally:
            for child in reversed(children):
                child.stop()


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):,.1f} ({min(values):,.1f}–{max(values):,.1f})"


def table(rate_mbit: float, one: list[float], two: list[float]) -> str:
    """The markdown table of a measurement (see the module docstring)."""
    ratios = [b / a for a, b in zip(one, two)]
    return "\n".join([
        f"| `write_bw`, networks of {rate_mbit:g} Mbit/s each | MB/s | ÷ one network |",
        "|---|---:|---:|",
        f"| one network | {_cell(one)} | 1 |",
        f"| two networks | {_cell(two)} | {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f}–{max(ratios):.2f}) |",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m udpverbs.bench.multipath", description=__doc__.split("\n")[0])
    p.add_argument("--rate-mbit", type=float, default=200.0, help="each network's rate each way (default 200)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running one path then two (default 3)")
    p.add_argument("-n", "--iters", type=int, default=1000, help="64 KiB Writes per run (default 1000)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    perf_args = ["-n", str(args.iters)]
    one: list[float] = []
    two: list[float] = []
    try:
        with NamespacePair([Wire(MTU, args.rate_mbit), Wire(MTU, args.rate_mbit)]) as pair:
            for r in range(args.rounds):
                for paths, into in ((1, one), (2, two)):
                    into.append(one_run(pair, paths, perf_args))
                    print(f"round {r + 1}: {paths} path(s) {into[-1]:.1f} MB/s", file=sys.stderr, flush=True)
    except (NamespaceError, MultipathRunError) as e:
        print(f"udpverbs multipath: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"rate_mbit": args.rate_mbit, "one_path_MBps": one, "two_paths_MBps": two}))
    else:
        print(table(args.rate_mbit, one, two))
    return 0


if __name__ == "__main__":
    sys.exit(main())
