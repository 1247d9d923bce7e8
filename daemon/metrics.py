"""An optional Prometheus endpoint (``udpverbsd --metrics ADDR:PORT``).

Theory of operation
-------------------
``prometheus_client``'s HTTP server runs in a thread of its own and binds
only the address given.  A scrape must not read the daemon's tables while
the data loop changes them, so the collector asks the trio thread for a
snapshot (``trio.from_thread.run_sync``, after waking the loop if it sleeps
in its epoll): the snapshot is ``status.py``'s DEVICE section and every
link's report, taken between two passes as a control request is, and the
thread formats it.  The data loop never waits on the endpoint.

What is exported, each with a ``device`` label: the device's counters as
``udpverbs_<name>_total`` (the links' sums left out: each link has its own),
``udpverbs_info`` (version, address, port, congestion control, MTU),
gauges of the device's uptime, clients, QPs and links, and per link (label
``peer``, ``ip:port``) its datagrams and bytes each way, retransmissions,
duplicates and CRC failures as counters, its smoothed and minimum RTT,
congestion window and bytes in flight as gauges.  A link of several paths
(``udpverbsd --addr A --addr B``) has the same per path too (labels
``peer``, ``path``, ``local``, ``remote``), with ``link_path_up`` and the
times each went down.  QPs are not exported one
by one (``udpverbs stat`` shows them): a label per QP would make a series
per QP ever created.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import trio

from .device import Device
from . import status

log = logging.getLogger("udpverbs.daemon")

#: the device's gauges: (metric name, DEVICE report key, help)
DEVICE_GAUGES = (
    ("uptime_seconds", "uptime_s", "seconds since the daemon started"),
    ("clients", "clients", "client connections (verbs contexts)"),
    ("qps", "qps", "queue pairs"),
    ("links", "links", "links to peer daemons"),
)
#: per-link figures exported as counters: (metric name, report key, help)
LINK_COUNTERS = (
    ("link_datagrams_sent", "datagrams_sent", "datagrams sent to the peer"),
    ("link_datagrams_received", "datagrams_received", "datagrams received from the peer"),
    ("link_bytes_sent", "bytes_sent", "UDP payload bytes sent to the peer"),
    ("link_bytes_received", "bytes_received", "UDP payload bytes received from the peer"),
    ("link_retransmits", "retransmits", "DATA packets sent again"),
    ("link_duplicates", "duplicates", "DATA packets received twice"),
    ("link_bad_crc", "bad_crc", "datagrams dropped for a bad CRC"),
)
#: ... and as gauges, scaled to base units: (metric name, report key, scale, help)
LINK_GAUGES = (
    ("link_srtt_seconds", "srtt_us", 1e-6, "smoothed round-trip time"),
    ("link_min_rtt_seconds", "min_rtt_us", 1e-6, "smallest round-trip time seen"),
    ("link_cwnd_bytes", "cwnd_bytes", 1, "congestion window"),
    ("link_bytes_in_flight", "bytes_in_flight", 1, "bytes sent and not yet acknowledged"),
    ("link_plpmtu_bytes", "plpmtu", 1, "largest datagram the link sends now (path MTU discovery)"),
    ("link_up", None, 1, "1 while the link is established"),
)
#: per-path figures (a link of several paths) exported as counters, and as gauges
PATH_COUNTERS = (
    ("link_path_datagrams_sent", "datagrams_sent", "datagrams sent on the path"),
    ("link_path_datagrams_received", "datagrams_received", "datagrams received on the path"),
    ("link_path_bytes_sent", "bytes_sent", "UDP payload bytes sent on the path"),
    ("link_path_bytes_received", "bytes_received", "UDP payload bytes received on the path"),
    ("link_path_retransmits", "retransmissions", "DATA packets sent again on the path"),
    ("link_path_times_down", "times_down", "times the path was declared down"),
)
PATH_GAUGES = (
    ("link_path_srtt_seconds", "srtt_us", 1e-6, "the path's smoothed round-trip time"),
    ("link_path_min_rtt_seconds", "min_rtt_us", 1e-6, "the path's smallest round-trip time"),
    ("link_path_cwnd_bytes", "cwnd_bytes", 1, "the path's congestion window"),
    ("link_path_pacing_bytes_per_second", "pacing_Bps", 1, "the path's pacing rate"),
    ("link_path_plpmtu_bytes", "plpmtu", 1, "largest datagram the path carries now"),
    ("link_path_up", None, 1, "1 while the path is up"),
)


def snapshot(device: Device) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The device's report and its links' (in the trio thread)."""
    return status.device_report(device), [status.link_report(pl) for _, pl in sorted(device.links.items())]


class DeviceCollector:
    """A ``prometheus_client`` collector over one device's snapshot."""

    def __init__(self, device: Device, token: trio.lowlevel.TrioToken) -> None:
        self.device = device
        self.token = token

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        self.device.loop.wake()  # the loop may sleep in its own epoll, which trio's wake-up does not reach
        try:
            dev, links = trio.from_thread.run_sync(snapshot, self.device, trio_token=self.token)
        except trio.RunFinishedError:
            return  # the daemon is stopping
        name = dev["name"]
        info = InfoMetricFamily("udpverbs", "the daemon", labels=["device"])
        info.add_metric([name], {"version": dev["version"], "addr": dev["addr"], "udp_port": str(dev["udp_port"]),
                                 "cc": dev["cc"], "mtu": str(dev["mtu"])})
        yield info
        for metric, key, help_ in DEVICE_GAUGES:
            g = GaugeMetricFamily("udpverbs_" + metric, help_, labels=["device"])
            g.add_metric([name], dev[key])
            yield g
        for key, value in sorted(dev["counters"].items()):
            if not key.startswith("link_"):
                c = CounterMetricFamily("udpverbs_" + key, f"device counter {key}", labels=["device"])
                c.add_metric([name], value)
                yield c
        for metric, key, help_ in LINK_COUNTERS:
            c = CounterMetricFamily("udpverbs_" + metric, help_, labels=["device", "peer"])
            for link in links:
                c.add_metric([name, link["peer"]], link[key])
            yield c
        for metric, key, scale, help_ in LINK_GAUGES:
            g = GaugeMetricFamily("udpverbs_" + metric, help_, labels=["device", "peer"])
            for link in links:
                value = (link["state"] == "ESTABLISHED") if key is None else link[key]
                if value is not None:
                    g.add_metric([name, link["peer"]], value * scale)
            yield g
        yield from _paths(name, links)


def _paths(name: str, links: list[dict[str, Any]]) -> Iterator[Any]:
    """The per-path families of the links of several paths (none when no link has them)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    paths = [(link["peer"], p) for link in links for p in link.get("paths", ())]
    if not paths:
        return
    labels = ["device", "peer", "path", "local", "remote"]
    for metric, key, help_ in PATH_COUNTERS:
        c = CounterMetricFamily("udpverbs_" + metric, help_, labels=labels)
        for peer, p in paths:
            c.add_metric([name, peer, str(p["path"]), p["local"], p["remote"]], p[key])
        yield c
    for metric, key, scale, help_ in PATH_GAUGES:
        g = GaugeMetricFamily("udpverbs_" + metric, help_, labels=labels)
        for peer, p in paths:
            value = (p["state"] == "up") if key is None else p[key]
            if value is not None:
                g.add_metric([name, peer, str(p["path"]), p["local"], p["remote"]], value * scale)
        yield g


class Endpoint:
    """The HTTP server's thread, serving ``url`` until :meth:`close`."""

    def __init__(self, device: Device, host: str, port: int) -> None:
        """Bind ``host:port`` (port 0: a free one) and serve in a thread; call
        it in the daemon's trio thread (the collector calls back into it).

        Raises:
            OSError: the address cannot be bound.
            ImportError: ``prometheus_client`` is not installed.
        """
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(DeviceCollector(device, trio.lowlevel.current_trio_token()))  # type: ignore[arg-type]
        self.server, self.thread = start_http_server(port, addr=host, registry=registry)
        bound = self.server.server_address[1]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{bound}/metrics"
        device.metrics_url = self.url

    def close(self) -> None:
        """Stop serving (within half a second: serve_forever looks that often)."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(1.0)
