"""Congestion control on a simulated shared bottleneck: EFE vs AIMD vs fixed.

Theory of operation
-------------------
``transport.netsim.dumbbell`` runs N bulk flows of real ``transport.Link``
objects through one drop-tail bottleneck on the simulator's fake clock: a
10 Gb/s bottleneck, 100 µs base RTT, a buffer of one bandwidth-delay product
(125 kB, about 85 full-size packets), 1472-byte datagrams, 100 ms simulated
of which the first 20 ms are warm-up.  For 1, 4, 16 and 64 flows and each
controller it prints the bottleneck utilization, Jain's fairness index of
per-flow goodput, the median and 99th-percentile queueing delay of the
packets the bottleneck admitted and the loss rate at the bottleneck.  Every
run is seeded (``--seed``), so the table is reproducible to the digit.

The baseline is measured in the same run: AIMD (Reno-like, paced) is the
loss-based reference, the fixed window (64 packets, unpaced) is "no
congestion control".  The ratio column gives EFE's p99 queueing delay over
AIMD's at the same flow count.

``--lossy`` runs the other table: one flow of 9,000 full-size messages over
a 1 Gb/s path, 100 µs base RTT, buffer one BDP, clean, with 5% random loss
on both directions, and with 5% loss, 5% reordering (held up to 200 µs) and
2% duplication, with the daemon's link settings (``daemon/config.py``:
20 ms minimum RTO, pacing bursts of 32 packets or 1 ms).  For each
controller it prints the goodput, its ratio to the clean path's, the
datagrams the path dropped, retransmissions, RTOs, tail loss probes and
spurious retransmissions, and whether every message arrived once, in order.

Run as ``python -m udpverbs.bench.netsim [--json] [--flows 1,4] [--cc efe] [--lossy]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from udpverbs.daemon.config import DAEMON_MIN_RTO_S, DAEMON_PACING_BURST_PACKETS, DAEMON_PACING_BURST_S
from udpverbs.transport.link import LinkConfig
from udpverbs.transport.netsim import DumbbellResult, Impairments, dumbbell, lossy_path

RATE_BPS = 1.25e9  # 10 Gb/s
RTT_S = 100e-6
DURATION_S = 0.1
WARMUP_S = 0.02
CCS = ("efe", "aimd", "fixed")
FLOWS = (1, 4, 16, 64)
FIXED_PARAMS = {"window_packets": 64}
LOSSY_CCS = ("efe-host", "aimd", "fixed")  # (efe's fabric preset is for 10 Gb/s: below a packet time at 1 Gb/s)
LOSSY_MESSAGES = 9000
LOSSY_RATE_BPS = 1.25e8  # 1 Gb/s
LOSSY_PATHS = {
    "clean": None,
    "loss5": Impairments(loss=0.05),
    "mix": Impairments(loss=0.05, reorder=0.05, duplicate=0.02, reorder_delay_s=200e-6),
}


def run(cc: str, flows: int, seed: int) -> DumbbellResult:
    """One row of the table."""
    params = FIXED_PARAMS if cc == "fixed" else None
    return dumbbell(cc, flows, rate_Bps=RATE_BPS, rtt_s=RTT_S, buffer_bdp=1.0,
                    duration_s=DURATION_S, warmup_s=WARMUP_S, seed=seed, cc_params=params)


def lossy(ccs: list[str], seed: int, as_json: bool) -> None:
    """The --lossy table (see the module docstring)."""
    cfg = LinkConfig(min_rto_s=DAEMON_MIN_RTO_S, pacing_burst_packets=DAEMON_PACING_BURST_PACKETS,
                     pacing_burst_s=DAEMON_PACING_BURST_S)
    if not as_json:
        print(f"# one flow of {LOSSY_MESSAGES} x {cfg.max_payload} B, {LOSSY_RATE_BPS * 8 / 1e9:g} Gb/s, "
              f"base RTT {RTT_S * 1e6:g} us, buffer 1 BDP, the daemon's link settings, seed {seed}")
        print(f"{'cc':<9} {'path':<6} {'MB/s':>7} {'ratio':>6} {'lost':>6} {'retx':>6} {'rto':>4} {'tlp':>5} "
              f"{'spur':>5} {'exact':>5}")
    for cc in ccs:
        clean = 0.0
        for name, imp in LOSSY_PATHS.items():
            params = FIXED_PARAMS if cc == "fixed" else None
            r = lossy_path(cc, LOSSY_MESSAGES, impairments=imp, rate_Bps=LOSSY_RATE_BPS, rtt_s=RTT_S, seed=seed,
                           config=cfg, cc_params=params)
            clean = clean or r.goodput_Bps
            if as_json:
                print(json.dumps({"path": name, **r.row()}))
                continue
            print(f"{cc:<9} {name:<6} {r.goodput_Bps / 1e6:7.1f} {r.goodput_Bps / clean:6.2f} {r.lost:6} "
                  f"{r.retransmits:6} {r.rto_count:4} {r.tlp_probes:5} {r.spurious:5} {str(r.exact):>5}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    ap.add_argument("--flows", default=",".join(map(str, FLOWS)))
    ap.add_argument("--cc", default=",".join(CCS))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lossy", action="store_true", help="one flow on lossy paths, per controller (RTOs, probes)")
    args = ap.parse_args(argv)
    if args.lossy:
        lossy(args.cc.split(",") if args.cc != ",".join(CCS) else list(LOSSY_CCS), args.seed, args.json)
        return 0
    flows = [int(x) for x in args.flows.split(",")]
    ccs = args.cc.split(",")
    if not args.json:
        print(f"# bottleneck {RATE_BPS * 8 / 1e9:g} Gb/s, base RTT {RTT_S * 1e6:g} us, "
              f"buffer 1 BDP ({RATE_BPS * RTT_S / 1e3:g} kB), {DURATION_S * 1e3:g} ms simulated "
              f"(first {WARMUP_S * 1e3:g} ms warm-up), seed {args.seed}")
        print(f"{'cc':<6} {'flows':>5} {'util':>7} {'jain':>7} {'q_p50_us':>9} {'q_p99_us':>9} "
              f"{'loss':>9} {'p99/aimd':>9} {'wall_s':>7}")
    p99: dict[tuple[str, int], float] = {}
    rows = []
    for f in flows:
        for cc in ccs:
            t0 = time.perf_counter()
            r = run(cc, f, args.seed)
            wall = time.perf_counter() - t0
            p99[(cc, f)] = r.queue_p99_us
            rows.append((r, wall))
    for r, wall in rows:
        if args.json:
            print(json.dumps(r.row()))
            continue
        base = p99.get(("aimd", r.flows))
        ratio = f"{r.queue_p99_us / base:9.2f}" if base else f"{'-':>9}"
        print(f"{r.cc:<6} {r.flows:>5} {r.utilization:7.3f} {r.jain:7.3f} {r.queue_p50_us:9.1f} "
              f"{r.queue_p99_us:9.1f} {r.loss_rate:9.5f} {ratio} {wall:7.1f}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
