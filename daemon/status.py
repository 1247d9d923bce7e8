"""What the operator's tools see of a running daemon: QUERY_STATUS's answers.

Theory of operation
-------------------
``udpverbs devices``, ``devinfo`` and ``stat`` ask the daemon over its
control socket (``wire/ctl.py``, ``Op.QUERY_STATUS``), and the Prometheus
endpoint (``metrics.py``) asks the same functions.  Each answer is read
from the tables the data loop keeps anyway (the links' and QPs' counters,
the rings' indices): nothing here is counted on the data path for the
tools' sake but the bytes each link moved (``PeerLink.tx_bytes`` /
``rx_bytes``) and a QP's RNR NACKs.  A query runs between two passes of the
data loop, so it must stay cheap: the links and QPs come in pages
(``LINKS_PER_PAGE``, ``QPS_PER_PAGE``), one page per request.

The answers are JSON objects (``ctl.StatusSection``):

``DEVICE``
    ``name version ctl_version pid state addr udp_port gid node_guid mtu cc
    gso native started uptime_s clients qps links cqs mrs pds metrics``
    (the Prometheus endpoint's URL, or null), ``addrs`` (every local
    address, the first ``addr``), ``cluster_key`` (set or not),
    ``impair`` (what ``--impair`` does, or null), ``limits``
    (``max_qp max_cq max_mr max_pd max_qp_wr max_cqe max_sge
    max_inline_data max_mr_size max_msg_sz max_qp_rd_atom
    max_qp_init_rd_atom atomic_cap``) and ``counters`` (QUERY_STATS's).
``LINKS``
    ``{"links": [...]}``, each ``peer addr port state qps datagrams_sent
    datagrams_received bytes_sent bytes_received retransmits duplicates
    bad_crc srtt_us min_rtt_us rto_ms cwnd_bytes pacing_Bps
    bytes_in_flight``, ``plpmtu`` (the largest datagram the link sends now,
    UDP payload bytes as ``--mtu`` counts them: what path MTU discovery
    found, ``transport/pmtud.py``), ``pmtud`` (the search's state),
    ``counters`` (the link's own, ``LinkStats``) and, on a link of several
    paths, ``paths``: each ``path local remote state datagrams_sent
    bytes_sent datagrams_received bytes_received retransmissions srtt_us
    min_rtt_us cwnd_bytes pacing_Bps times_down plpmtu``.
``QPS``
    ``{"qps": [...]}``, each ``qpn pid state peer dest_qp_num sq_posted
    sq_completed rq_posted rq_completed srq outstanding rnr_nacks_received
    rnr_nacks_sent``.  The posted and completed counts are the work
    queues' ring indices, so they wrap at 2**32.
"""

from __future__ import annotations

import json
import os
import resource
import time
from typing import Any, Callable

import udpverbs

from ..wire import ctl, shm
from ..wire.shm import QPState
from .device import Device

#: links and QPs one page carries: each page is built between two passes of
#: the data loop, so it must take well under a millisecond, and its JSON
#: (at most about 700 bytes a link, 400 a QP) must fit a control message
LINKS_PER_PAGE = 32
QPS_PER_PAGE = 64
#: ... links per page on a device of several addresses (each path adds about 400 bytes)
MULTIPATH_LINKS_PER_PAGE = 8
#: the largest region (``max_mr_size``)
MAX_MR_SIZE = 1 << 40
_U32 = 0xFFFFFFFF


def device_limits(device: Device) -> dict[str, int]:
    """What the device allows (``ibv_query_device``'s limits), as HELLO tells them."""
    c = device.config
    return {"max_qp": c.max_qp, "max_cq": c.max_cq, "max_mr": c.max_mr, "max_pd": c.max_pd,
            "max_qp_wr": c.max_qp_wr, "max_cqe": c.max_cqe, "max_sge": shm.MAX_SGE,
            "max_inline_data": shm.MAX_INLINE, "max_mr_size": MAX_MR_SIZE,
            "max_qp_rd_atom": c.max_qp_rd_atom, "max_qp_init_rd_atom": c.max_qp_rd_atom}


def counters(device: Device, paths: bool = False) -> dict[str, int]:
    """The device's counters (QUERY_STATS), with the process's CPU time so far
    (``paths``: and, with several local addresses, every path's figures:
    :func:`path_counters`).

    getrusage, not os.times: the latter counts in clock ticks (10 ms), as
    long as a whole short run."""
    stats = device.dump_stats()
    if paths and len(device.ports) > 1:
        stats.update(path_counters(device))
    t = resource.getrusage(resource.RUSAGE_SELF)
    stats["process_cpu_user_ms"] = int(t.ru_utime * 1000)
    stats["process_cpu_system_ms"] = int(t.ru_stime * 1000)
    return stats


def device_report(device: Device, asker: Any = None) -> dict[str, Any]:
    """The DEVICE section (see the module docstring); ``clients`` leaves out
    ``asker``, the session asking (a tool is no client worth counting)."""
    c = device.config
    fatal = any(s.fatal_sent for s in device.sessions)
    wall, mono = device.started
    limits: dict[str, Any] = {**device_limits(device), "max_msg_sz": shm.MAX_MSG_SZ,
                              "atomic_cap": shm.AtomicCap.IBV_ATOMIC_HCA.name}
    return {
        "name": c.name, "version": udpverbs.__version__, "ctl_version": ctl.CTL_VERSION, "pid": os.getpid(),
        "state": "stopping" if fatal else "serving", "addr": c.addr, "udp_port": c.port,
        "gid": ":".join(device.gid.hex()[i:i + 4] for i in range(0, 32, 4)), "node_guid": f"{device.node_guid:016x}",
        "mtu": c.mtu, "cc": c.cc, "gso": bool(device.udp.gso), "native": device.native is not None,
        "started": wall, "uptime_s": round(time.monotonic() - mono, 3),
        "clients": len(device.sessions - {asker}), "qps": len(device.qps), "links": len(device.links),
        "cqs": len(device.cqs), "mrs": len(device.mrs), "pds": len(device.pds), "metrics": device.metrics_url,
        "addrs": [str(a) for a in c.addrs], "cluster_key": c.key is not None,
        "impair": None if c.impair is None else c.impair.describe() + (f" from {c.impair_addr}"
                                                                        if c.impair_addr else ""),
        "limits": limits, "counters": counters(device),
    }


def _us(seconds: float | None) -> float | None:
    return None if seconds is None or seconds == float("inf") else round(seconds * 1e6, 1)


def link_report(pl: Any) -> dict[str, Any]:
    """One link to a peer daemon (see the module docstring)."""
    link = pl.link
    st = link.stats
    rate = link.pacer.rate_Bps
    return {
        "peer": f"{pl.addr[0]}:{pl.addr[1]}", "addr": pl.addr[0], "port": pl.addr[1], "state": link.state.name,
        "qps": len(pl.qps), "datagrams_sent": st.datagrams_sent, "datagrams_received": st.datagrams_received,
        "bytes_sent": pl.tx_bytes, "bytes_received": pl.rx_bytes, "retransmits": st.retransmits,
        "duplicates": st.duplicate, "bad_crc": st.bad_crc, "srtt_us": _us(link.srtt_s),
        "min_rtt_us": _us(link.rtt.min_s), "rto_ms": round(link.rtt.rto_s * 1e3, 3),
        "cwnd_bytes": int(link.cwnd_bytes), "pacing_Bps": None if rate == float("inf") else int(rate),
        "bytes_in_flight": link.bytes_in_flight, "plpmtu": plpmtu(pl), "pmtud": link.pmtud.state.name,
        "counters": st.as_dict(), **({} if pl.routes is None else {"paths": path_reports(pl)}),
    }


#: the figures of a path that are counters, and those that are its state
PATH_COUNTERS = ("datagrams_sent", "bytes_sent", "datagrams_received", "bytes_received", "retransmissions",
                 "times_down")


def path_reports(pl: Any) -> list[dict[str, Any]]:
    """Every path of ``pl``'s link (``Link.path_stats``), with its addresses."""
    out = []
    extra = pl.host.config.mtu - pl.link.config.max_payload  # as plpmtu: header, CRC and seal
    for p in pl.link.path_stats(pl.host.clock()):
        local, remote = pl.route_names(p.path)
        rate = p.pacing_rate
        out.append({"path": p.path, "local": local, "remote": remote, "state": p.state,
                    **{k: getattr(p, k) for k in PATH_COUNTERS},
                    "srtt_us": _us(p.srtt_s), "min_rtt_us": _us(p.min_rtt_s), "cwnd_bytes": int(p.cwnd_bytes),
                    "pacing_Bps": None if rate is None or rate == float("inf") else int(rate),
                    "plpmtu": None if not p.plpmtu else int(p.plpmtu + extra)})
    return out


#: paths whose figures QUERY_STATS carries one by one (beyond, totals only): the
#: answer must fit a control message
STATS_PATHS = 64


def path_counters(device: Device) -> dict[str, int]:
    """The links' paths as QUERY_STATS counters: per path
    ``path_<local>_<remote>_<figure>`` (the first STATS_PATHS paths), and
    ``paths``, ``paths_up``, ``paths_down`` over every link."""
    out = {"paths": 0, "paths_up": 0, "paths_down": 0}
    for _, pl in sorted(device.links.items()):
        if pl.routes is None:
            continue
        for p in path_reports(pl):
            out["paths"] += 1
            out["paths_up"] += p["state"] == "up"
            out["paths_down"] += p["state"] == "down"
            if out["paths"] > STATS_PATHS:
                continue
            name = f"path_{p['local']}_{p['remote']}_"
            out[name + "up"] = int(p["state"] == "up")
            for k in (*PATH_COUNTERS, "srtt_us", "min_rtt_us", "cwnd_bytes", "pacing_Bps", "plpmtu"):
                if p[k] is not None:
                    out[name + k] = int(p[k])
    return out


def plpmtu(pl: Any) -> int:
    """The largest datagram ``pl``'s link sends now, in UDP payload bytes
    (the link counts bodies: a datagram adds its header, CRC and seal)."""
    link = pl.link
    return int(pl.host.config.mtu - link.config.max_payload + link.payload_limit)


def qp_report(qp: Any) -> dict[str, Any]:
    """One QP (see the module docstring)."""
    sq, rq = qp.sq, qp.rq
    own_rq = qp.srq is None
    receiving = 1 if own_rq and qp.rx_recv is not None else 0  # taken off the ring, not yet complete
    pl = qp.link
    return {
        "qpn": qp.qpn, "pid": qp.session.pid, "state": QPState(qp.state).name,
        "peer": None if pl is None else f"{pl.addr[0]}:{pl.addr[1]}", "dest_qp_num": qp.dest_qpn,
        "sq_posted": int(sq.hdr.producer), "sq_completed": (sq.cons - len(qp.outstanding)) & _U32,
        "rq_posted": int(rq.hdr.producer) if own_rq else None,
        "rq_completed": (rq.cons - receiving) & _U32 if own_rq else None,
        "srq": not own_rq, "outstanding": len(qp.outstanding),
        "rnr_nacks_received": qp.rnr_nacks_received, "rnr_nacks_sent": qp.rnr_nacks_sent,
    }


def _page(key: str, items: list[Any], report: Callable[[Any], dict[str, Any]], per_page: int,
          cursor: Callable[[Any], int]) -> tuple[int, bytes]:
    """``{key: [...]}`` of the first ``per_page`` of ``items``, and the
    cursor of the first left out (0: none)."""
    page = [report(item) for item in items[:per_page]]
    nxt = cursor(items[per_page]) if len(items) > per_page else 0
    return nxt, json.dumps({key: page}, separators=(",", ":")).encode()


def page(device: Device, section: int, start: int, asker: Any = None) -> tuple[int, bytes]:
    """The JSON of ``section`` from ``start`` and where its next page starts
    (0: none), asked by the session ``asker``.

    Links are numbered from 1 in address order (``start`` 0 or 1: the first),
    QPs by QPN (``start``: the first QPN looked at).

    Raises:
        ValueError: an unknown section.
    """
    if section == ctl.StatusSection.DEVICE:
        return 0, json.dumps(device_report(device, asker), separators=(",", ":")).encode()
    if section == ctl.StatusSection.LINKS:
        links = sorted(device.links.items())
        first = max(start, 1)
        index = {addr: i for i, (addr, _) in enumerate(links, 1)}
        # a link of several paths reports each (at most device.MAX_PATHS): fewer links fit a page
        per_page = LINKS_PER_PAGE if len(device.ports) == 1 else MULTIPATH_LINKS_PER_PAGE
        return _page("links", [pl for _, pl in links[first - 1:]], link_report, per_page,
                     lambda pl: index[pl.addr])
    if section == ctl.StatusSection.QPS:
        qps = sorted(qpn for qpn in device.qps if qpn >= start)
        return _page("qps", [device.qps[n] for n in qps], qp_report, QPS_PER_PAGE, lambda qp: qp.qpn)
    raise ValueError(f"no status section {section}")
