"""The operator's tools: ``udpverbs devices``, ``devinfo`` and ``stat``.

Theory of operation
-------------------
What ``ibv_devices``, ``ibv_devinfo -v`` and ``rdma statistic`` are to an
RDMA NIC.  The local daemons are the control sockets in the runtime
directory (``wire/ctl.py``'s ``runtime_dir``), or the one ``-d`` names (a
device name or a socket path).  Each is asked over its control socket, as
any application would: a verbs ``Context`` says HELLO, then QUERY_STATUS
asks for the device (identity, limits, counters), its links and its QPs
(``daemon/status.py`` describes the answers; the daemon answers between
two passes of its data loop, from counters it keeps anyway).  A socket
nobody serves (its daemon died) shows as ``stale``, one whose daemon does
not answer within ``--timeout`` as ``not answering``; neither hangs the tool.

``stat --watch [SECS]`` keeps one connection per daemon and redraws a
table every SECS seconds, with rates per second computed from the
difference between two samples; on a terminal the screen is redrawn in
place, elsewhere (a pipe, a file) each sample is printed after the last.
Every command takes ``--json``.

Exit status: 0 on success; 1 when a daemon asked for (or, for ``devinfo``
and ``stat``, every daemon) could not be asked; 2 for a usage error.
"""

from __future__ import annotations

import argparse
import errno
import glob
import json
import os
import sys
import time
from typing import Any, Callable, TextIO

from udpverbs import verbs
from udpverbs.wire import ctl
from udpverbs.wire.ctl import Op, StatusSection

COMMANDS = ("devices", "devinfo", "stat")


DEFAULT_TIMEOUT_S = 2.0
_U32 = 1 << 32


class ToolUsageError(ValueError):
    """A flag's value, or a combination of flags, makes no sense (exit status 2)."""


# -- asking the daemons ---------------------------------------------------------
def find_sockets(device: str | None = None) -> list[str]:
    """The control sockets to ask: ``device`` (a name, or a path with a
    ``/``), else every ``*.sock`` in the runtime directory."""
    if device:
        return [ctl.socket_path(device)]
    return sorted(glob.glob(os.path.join(ctl.runtime_dir(), "*.sock")))


def _query_pages(ctx: verbs.Context, section: StatusSection, key: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    start = 0
    while True:
        rep, _ = ctx.call(Op.QUERY_STATUS, section=int(section), start=start)
        out += json.loads(rep.data)[key]
        if not rep.next or rep.next <= start:
            return out
        start = rep.next


class Daemon:
    """One control socket and, while its daemon answers, a connection to it."""

    def __init__(self, path: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.path = path
        self.name = os.path.basename(path).removesuffix(".sock")
        self.timeout_s = timeout_s
        self.ctx: verbs.Context | None = None
        self.state = "unknown"
        self.error: str | None = None

    def query(self, detail: bool = False) -> dict[str, Any] | None:
        """The daemon's DEVICE report, or with ``detail`` ``{"device": …,
        "links": […], "qps": […]}``; None when it cannot be asked (``state``
        and ``error`` then say why)."""
        try:
            if self.ctx is None:
                self.ctx = verbs.Context(socket_path=self.path, timeout_s=self.timeout_s)
            rep, _ = self.ctx.call(Op.QUERY_STATUS, section=int(StatusSection.DEVICE), start=0)
            dev: dict[str, Any] = json.loads(rep.data)
            out = dev if not detail else {"device": dev, "links": _query_pages(self.ctx, StatusSection.LINKS, "links"),
                                          "qps": _query_pages(self.ctx, StatusSection.QPS, "qps")}
        except (verbs.VerbsError, TimeoutError, OSError, ValueError, KeyError) as e:
            self.close()
            self.state, self.error = _failure(self.path, e)
            return None
        self.name, self.state, self.error = dev["name"], dev["state"], None
        return out

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.close()
            self.ctx = None


def _failure(path: str, e: Exception) -> tuple[str, str]:
    """``(state, explanation)`` of a daemon that could not be asked."""
    if isinstance(e, TimeoutError):
        return "not answering", f"the daemon behind {path} did not answer in time (stopped, or hung)"
    if isinstance(e, verbs.VerbsError) and e.error_code == errno.ENODEV:  # nothing listens
        if os.path.exists(path):
            return "stale", f"{path} was left by a daemon that is gone: nobody serves it"
        return "absent", f"no control socket {path}: no daemon serves it (start one with udpverbsd)"
    # a daemon that does not know the op answers with an error for another op (EPROTO) or EINVAL
    if isinstance(e, verbs.VerbsError) and e.error_code in (errno.EINVAL, errno.EPROTO) and "QUERY_STATUS" in str(e):
        return "too old", f"the daemon does not know QUERY_STATUS (an older udpverbs): {e}"
    return "error", str(e)


# -- formatting ---------------------------------------------------------------------
def duration(seconds: float) -> str:
    """``H:MM:SS``, with days in front past one."""
    s = int(seconds)
    days, s = divmod(s, 86400)
    text = f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{days}d {text}" if days else text


def nbytes(n: float) -> str:
    """Bytes in decimal units (MB = 10^6 bytes, as the benchmarks count)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _is_number(text: str) -> bool:
    try:
        float(text.split()[0])
    except (ValueError, IndexError):
        return text == "-"
    return True


def table(headers: list[str], rows: list[list[Any]], indent: str = "  ") -> list[str]:
    """Rows under headers, each column as wide as its widest cell; numbers
    (and sizes such as ``1.5 MB``) to the right, ``-`` for None."""
    cells = [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    right = [bool(cells) and all(_is_number(r[i]) for r in cells) for i in range(len(headers))]

    def line(values: list[str]) -> str:
        return indent + "  ".join(v.rjust(w) if right[i] else v.ljust(w)
                                  for i, (v, w) in enumerate(zip(values, widths))).rstrip()

    return [line(headers)] + [line(r) for r in cells]


# -- udpverbs devices -------------------------------------------------------------------
def devices_rows(daemons: list[Daemon], reports: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """One object per control socket (the JSON of ``devices``)."""
    out = []
    for d, dev in zip(daemons, reports):
        row: dict[str, Any] = {"name": d.name, "socket": d.path, "state": d.state}
        if dev is None:
            row["error"] = d.error
        else:
            row.update({k: dev[k] for k in ("pid", "addr", "udp_port", "gid", "mtu", "cc", "uptime_s", "version",
                                            "clients", "qps", "links", "metrics")})
        out.append(row)
    return out


def print_devices(rows: list[dict[str, Any]], out: TextIO) -> None:
    """``ibv_devices``' table: one line per daemon, then why any could not be asked."""
    body = [[r["name"], r["state"], r.get("addr"), r.get("udp_port"), r.get("mtu"), r.get("cc"),
             duration(r["uptime_s"]) if "uptime_s" in r else None, r.get("pid"), r["socket"]] for r in rows]
    for line in table(["device", "state", "address", "udp port", "mtu", "cc", "uptime", "pid", "socket"], body,
                      indent=""):
        print(line, file=out)
    for r in rows:
        if r.get("error"):
            print(f"{r['name']}: {r['error']}", file=out)


def no_daemon_line(device: str | None) -> str:
    """What the tools say when there is nobody to ask."""
    if device:
        return f"no udpverbs daemon: nothing serves {find_sockets(device)[0]} (start one with udpverbsd)"
    return (f"no udpverbs daemon: no control socket in {ctl.runtime_dir()} (start one with udpverbsd; "
            "one started with --socket elsewhere is asked with -d PATH)")


# -- udpverbs devinfo ---------------------------------------------------------------------
def devinfo_lines(dev: dict[str, Any], path: str, verbose: bool) -> list[str]:
    """``ibv_devinfo``'s block for one daemon (``-v``: its limits too)."""
    lim = dev["limits"]
    fields: list[tuple[str, Any]] = [
        ("transport", f"iWARP over UDP (udpverbs {dev['version']}, control protocol {dev['ctl_version']})"),
        ("state", f"{dev['state']}, up {duration(dev['uptime_s'])}, pid {dev['pid']}"),
        ("node_guid", ":".join(dev["node_guid"][i:i + 4] for i in range(0, 16, 4))),
        ("control socket", path),
        ("address", " ".join(dev.get("addrs") or [dev["addr"]])),
        ("udp port", f"{dev['udp_port']} (the port's LID)"),
        ("gid", dev["gid"]),
        ("mtu", f"{dev['mtu']} (UDP payload bytes per datagram)"),
        ("congestion control", dev["cc"]),
        ("in use", f"clients {dev['clients']}, QPs {dev['qps']}, CQs {dev['cqs']}, MRs {dev['mrs']}, "
                   f"links {dev['links']}"),
        ("metrics", dev["metrics"] or "off (udpverbsd --metrics ADDR:PORT)"),
        ("cluster key", "set: every datagram authenticated" if dev.get("cluster_key") else "none"),
    ]
    if dev.get("impair"):
        fields.append(("impaired", f"{dev['impair']} (udpverbsd --impair: for testing only)"))
    if verbose:
        fields += [(k, lim[k]) for k in ("max_qp", "max_qp_wr", "max_sge", "max_cq", "max_cqe", "max_mr",
                                          "max_pd", "max_inline_data")]
        fields += [("max_mr_size", f"{lim['max_mr_size']:#x}"), ("max_msg_sz", f"{lim['max_msg_sz']:#x}"),
                   ("max_qp_rd_atom", f"{lim['max_qp_rd_atom']} (IRD: Reads and atomics a QP answers at once)"),
                   ("max_qp_init_rd_atom", f"{lim['max_qp_init_rd_atom']} (ORD: Reads and atomics a QP has out)"),
                   ("atomic_cap", f"{lim['atomic_cap']} (atomic among all QPs of the daemon)"),
                   ("batching", "UDP_SEGMENT/UDP_GRO" if dev["gso"] else "off (a system call per datagram)"),
                   ("compiled lanes", "on" if dev["native"] else "off (Python only)")]
    width = max(len(k) for k, _ in fields) + 2
    return [f"hca_id: {dev['name']}"] + [f"\t{(k + ':').ljust(width)}{v}" for k, v in fields]


# -- udpverbs stat ------------------------------------------------------------------------
#: (JSON key, rate key) of the figures ``--watch`` turns into rates, per link and per QP
LINK_RATES = (("datagrams_sent", "datagrams_sent_per_s"), ("datagrams_received", "datagrams_received_per_s"),
              ("bytes_sent", "bytes_sent_per_s"), ("bytes_received", "bytes_received_per_s"),
              ("retransmits", "retransmits_per_s"))
QP_RATES = (("sq_completed", "sq_completed_per_s"), ("rq_completed", "rq_completed_per_s"))


def add_rates(now: dict[str, Any], before: dict[str, Any] | None, dt: float) -> None:
    """Put in the links and QPs of ``now`` (a daemon's ``query(detail=True)``)
    their figures per second (``"rates"``) since ``before``, the same
    daemon's sample ``dt`` seconds earlier (the QPs' ring counts wrap at 2**32)."""
    if before is None or dt <= 0 or before["device"]["pid"] != now["device"]["pid"]:
        return
    old_links = {link["peer"]: link for link in before["links"]}
    for link in now["links"]:
        prev = old_links.get(link["peer"])
        if prev is not None:
            link["rates"] = {r: max(0, link[k] - prev[k]) / dt for k, r in LINK_RATES}
    old_qps = {qp["qpn"]: qp for qp in before["qps"]}
    for qp in now["qps"]:
        prev = old_qps.get(qp["qpn"])
        if prev is not None:
            qp["rates"] = {r: None if qp[k] is None or prev[k] is None else ((qp[k] - prev[k]) % _U32) / dt
                           for k, r in QP_RATES}


def _rate(item: dict[str, Any], key: str, fmt: Callable[[float], str]) -> str | None:
    r = item.get("rates")
    return None if r is None or r[key] is None else fmt(r[key])


def link_table(links: list[dict[str, Any]], rates: bool) -> list[str]:
    """The links of one daemon, one line each."""
    headers = ["peer", "state", "qps", "dgrams out", "dgrams in", "bytes out", "bytes in", "retx", "dup", "crc",
               "srtt us", "min rtt us", "cwnd", "mtu"]
    rows: list[list[Any]] = []
    for k in links:
        rows.append([k["peer"], k["state"], k["qps"], k["datagrams_sent"], k["datagrams_received"],
                     nbytes(k["bytes_sent"]), nbytes(k["bytes_received"]), k["retransmits"], k["duplicates"],
                     k["bad_crc"], k["srtt_us"], k["min_rtt_us"], nbytes(k["cwnd_bytes"]), k.get("plpmtu")])
        if rates:
            rows[-1] += [_rate(k, "bytes_sent_per_s", lambda v: nbytes(v) + "/s"),
                         _rate(k, "bytes_received_per_s", lambda v: nbytes(v) + "/s"),
                         _rate(k, "datagrams_sent_per_s", lambda v: f"{v:.0f}"),
                         _rate(k, "retransmits_per_s", lambda v: f"{v:.0f}")]
    if rates:
        headers += ["out/s", "in/s", "dgrams out/s", "retx/s"]
    return table(headers, rows)


def path_table(links: list[dict[str, Any]]) -> list[str]:
    """The paths of the links that have several (``udpverbsd --addr A --addr B``), one line each."""
    headers = ["peer", "path", "local", "remote", "state", "dgrams out", "dgrams in", "bytes out", "bytes in",
               "retx", "srtt us", "min rtt us", "cwnd", "rate/s", "downs", "mtu"]
    rows: list[list[Any]] = []
    for k in links:
        for p in k.get("paths", ()):
            rate = p["pacing_Bps"]
            rows.append([k["peer"], p["path"], p["local"], p["remote"], p["state"], p["datagrams_sent"],
                         p["datagrams_received"], nbytes(p["bytes_sent"]), nbytes(p["bytes_received"]),
                         p["retransmissions"], p["srtt_us"], p["min_rtt_us"], nbytes(p["cwnd_bytes"]),
                         None if rate is None else nbytes(rate), p["times_down"], p["plpmtu"]])
    return table(headers, rows) if rows else []


def qp_table(qps: list[dict[str, Any]], rates: bool) -> list[str]:
    """The QPs of one daemon, one line each."""
    headers = ["qpn", "pid", "state", "peer", "peer qpn", "sq posted", "sq done", "rq posted", "rq done",
               "in flight", "rnr in", "rnr out"]
    rows: list[list[Any]] = []
    for q in qps:
        state = q["state"].removeprefix("IBV_QPS_")
        rows.append([q["qpn"], q["pid"], state, q["peer"], q["dest_qp_num"] if q["peer"] else None, q["sq_posted"],
                     q["sq_completed"], "srq" if q["srq"] else q["rq_posted"], "srq" if q["srq"] else q["rq_completed"],
                     q["outstanding"], q["rnr_nacks_received"], q["rnr_nacks_sent"]])
        if rates:
            rows[-1] += [_rate(q, "sq_completed_per_s", lambda v: f"{v:.0f}"),
                         _rate(q, "rq_completed_per_s", lambda v: f"{v:.0f}")]
    if rates:
        headers += ["sq done/s", "rq done/s"]
    return table(headers, rows)


def stat_lines(d: Daemon, detail: dict[str, Any] | None, rates: bool, show_all: bool) -> list[str]:
    """``rdma statistic``'s view of one daemon: its counters, links and QPs."""
    if detail is None:
        return [f"{d.name}: {d.state}: {d.error}"]
    dev, links, qps = detail["device"], detail["links"], detail["qps"]
    lines = [f"{dev['name']}: {dev['state']}, {dev['addr']}:{dev['udp_port']}, up {duration(dev['uptime_s'])}, "
             f"pid {dev['pid']}, clients {dev['clients']}"]
    counters = {k: v for k, v in dev["counters"].items() if not k.startswith("link_")}  # per link below
    shown = sorted((k, v) for k, v in counters.items() if v or show_all)
    lines.append("  counters:" + ("" if shown else " all zero"))
    width = max((len(k) for k, _ in shown), default=0)
    for i in range(0, len(shown), 3):
        lines.append("    " + "    ".join(f"{k.ljust(width)} {v:>12}" for k, v in shown[i:i + 3]).rstrip())
    if len(shown) < len(counters):
        lines.append(f"    ({len(counters) - len(shown)} counters at zero not shown; --all shows them)")
    lines.append(f"  links: {len(links)}")
    if links:
        lines += link_table(links, rates)
        paths = path_table(links)
        if paths:
            lines.append("  paths:")
            lines += paths
    lines.append(f"  qps: {len(qps)}")
    if qps:
        lines += qp_table(qps, rates)
    return lines


# -- the commands -------------------------------------------------------------------------
def add_parsers(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add ``devices``, ``devinfo`` and ``stat`` to the ``udpverbs`` command's sub-commands."""
    def common(p: argparse.ArgumentParser, device: bool = True) -> None:
        if device:
            p.add_argument("-d", "--device", metavar="DEV",
                           help="one daemon: a device name or a control socket path (default: every daemon "
                           "in the runtime directory)")
        p.add_argument("--json", action="store_true", help="print JSON instead of text")
        p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                       help=f"how long a daemon has to answer (default {DEFAULT_TIMEOUT_S:g} s)")

    devices = sub.add_parser("devices", help="the local daemons: address, UDP port, MTU, uptime (as ibv_devices)")
    common(devices, device=False)
    info = sub.add_parser("devinfo", help="one daemon's identity and limits (as ibv_devinfo)")
    common(info)
    info.add_argument("-v", "--verbose", action="store_true", help="the device's limits too (as ibv_devinfo -v)")
    stat = sub.add_parser("stat", help="counters per daemon, per peer link and per QP (as rdma statistic)")
    common(stat)
    stat.add_argument("--watch", nargs="?", type=float, const=1.0, metavar="SECS",
                      help="redraw every SECS seconds (default 1) with rates per second, until Ctrl-C")
    stat.add_argument("-c", "--count", type=int, metavar="N", help="with --watch: stop after N samples")
    stat.add_argument("-a", "--all", action="store_true", help="show the counters at zero too")


def _open(args: argparse.Namespace) -> list[Daemon]:
    return [Daemon(p, args.timeout) for p in find_sockets(getattr(args, "device", None))]


def cmd_devices(args: argparse.Namespace, out: TextIO) -> int:
    """``udpverbs devices``: one line per local daemon."""
    daemons = _open(args)
    reports = [d.query() for d in daemons]
    for d in daemons:
        d.close()
    rows = devices_rows(daemons, reports)
    if args.json:
        print(json.dumps(rows, indent=2), file=out)
    elif not rows:
        print(no_daemon_line(None), file=out)
    else:
        print_devices(rows, out)
    return 0


def cmd_devinfo(args: argparse.Namespace, out: TextIO) -> int:
    """``udpverbs devinfo``: each daemon's identity (and limits with -v)."""
    daemons = _open(args)
    if not daemons:
        print(no_daemon_line(None), file=sys.stderr)
        return 1
    docs, failed = [], 0
    for i, d in enumerate(daemons):
        dev = d.query()
        d.close()
        if dev is None:
            failed += 1
            docs.append({"name": d.name, "socket": d.path, "state": d.state, "error": d.error})
            if not args.json:
                print(f"{d.name}: {d.state}: {d.error}", file=sys.stderr)
            continue
        docs.append({"socket": d.path, **dev})
        if not args.json:
            print(("\n" if i else "") + "\n".join(devinfo_lines(dev, d.path, args.verbose)), file=out)
    if args.json:
        print(json.dumps(docs, indent=2), file=out)
    return 1 if failed and (args.device or failed == len(daemons)) else 0


def stat_sample(daemons: dict[str, Daemon], args: argparse.Namespace,
                before: dict[str, dict[str, Any]], dt: float) -> list[tuple[Daemon, dict[str, Any] | None]]:
    """Ask every daemon (those found now: one may have come or gone) for its
    counters, links and QPs, with rates since ``before`` (by socket)."""
    paths = find_sockets(args.device)
    for path in list(daemons):
        if path not in paths:
            daemons.pop(path).close()
    sample = []
    for path in paths:
        d = daemons.setdefault(path, Daemon(path, args.timeout))
        detail = d.query(detail=True)
        if detail is not None:
            add_rates(detail, before.get(path), dt)
        sample.append((d, detail))
    return sample


def _stat_json(sample: list[tuple[Daemon, dict[str, Any] | None]], t: float, dt: float | None) -> str:
    devs = [{"name": d.name, "socket": d.path, "state": d.state, **({"error": d.error} if x is None else x)}
            for d, x in sample]
    return json.dumps({"time": round(t, 3), "interval_s": dt, "devices": devs})


def cmd_stat(args: argparse.Namespace, out: TextIO) -> int:
    """``udpverbs stat``: counters per daemon, link and QP; ``--watch`` redraws them."""
    if args.watch is not None and args.watch <= 0 or args.count is not None and args.count < 1:
        raise ToolUsageError("--watch needs a positive interval and --count a positive number")
    daemons: dict[str, Daemon] = {}
    before: dict[str, dict[str, Any]] = {}
    redraw = args.watch is not None and not args.json and out.isatty()
    t_prev, n, ok = 0.0, 0, False
    try:
        while True:
            t = time.time()
            sample = stat_sample(daemons, args, before, t - t_prev)
            ok = any(dev is not None for _, dev in sample)
            n += 1
            if args.json:
                print(_stat_json(sample, t, None if n == 1 else round(t - t_prev, 3)), file=out, flush=True)
            else:
                frame = [f"udpverbs stat, every {args.watch:g} s, {time.strftime('%H:%M:%S')} (Ctrl-C stops)"] \
                    if args.watch is not None else []
                for d, dev in sample:
                    frame += stat_lines(d, dev, args.watch is not None, args.all) + [""]
                if not sample:
                    frame.append(no_daemon_line(args.device))
                out.write(("\x1b[H\x1b[2J" if redraw else "") + "\n".join(frame) + "\n")
                out.flush()
            before = {d.path: x for d, x in sample if x is not None}
            t_prev = t
            if args.watch is None or args.count is not None and n >= args.count:
                break
            time.sleep(max(0.0, t + args.watch - time.time()))
    except KeyboardInterrupt:
        pass
    finally:
        for d in daemons.values():
            d.close()
    return 0 if ok else 1


def main(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the tool ``args.command`` names; returns the exit status.

    Raises: ToolUsageError for a bad value or combination of flags.
    """
    out = out or sys.stdout
    if args.timeout <= 0:
        raise ToolUsageError("--timeout must be positive")
    run = {"devices": cmd_devices, "devinfo": cmd_devinfo, "stat": cmd_stat}[args.command]
    return run(args, out)
