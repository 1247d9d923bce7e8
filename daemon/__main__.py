"""``udpverbsd`` / ``python -m udpverbs.daemon``: run one emulated RNIC in the foreground.

Theory of operation
-------------------
Parse flags and TOML (``config.py``), check that the control socket's
directory is the user's and mode 0700 (exit 2 otherwise), set the
process's allocator to keep freed memory for reuse (``heap.py``), bind the UDP socket and the control
socket (refusing clearly if another daemon holds either), then run one trio
nursery holding the control server, the data-path loop and a signal
watcher; SIGINT/SIGTERM cancel the nursery and every resource is released
(links send ABORT, client sessions are torn down, the socket file removed).
One log line says what was bound; ``--ready-fd`` lets a supervisor or a test
wait for readiness without sleeping.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

import trio

import udpverbs

from . import config as dconfig
from . import heap, quota
from .cm import ConnectionManager
from .groups import GroupService
from .server import check_socket_free, serve_control
from .device import Device, DeviceConfig

log = logging.getLogger("udpverbs.daemon")


async def run(cfg: dict[str, Any]) -> None:
    """Serve until SIGINT/SIGTERM.  Raises OSError when the port or socket is taken."""
    path = cfg["socket"]
    check_socket_free(path)
    device = Device(DeviceConfig(name=cfg["name"], addr=cfg["addr"], port=int(cfg["port"]), mtu=int(cfg["mtu"]),
                                 spin_us=float(cfg["spin_us"]), seed=cfg["seed"], cc=str(cfg["cc"]),
                                 link=cfg["link"], gso=cfg["gso"], native=cfg["native"],
                                 rx_dispatch_budget=cfg["rx_dispatch_budget"], quota=cfg["quota"], key=cfg["key"],
                                 impair=cfg["impair"], addrs=cfg["addrs"], impair_addr=cfg["impair_addr"]))
    served = False
    endpoint = None
    try:
        try:
            ip, port = device.bind()
        except OSError as e:
            where = e.filename or f"{cfg['addr']}:{cfg['port']}"
            raise OSError(e.errno, f"cannot bind UDP {where}: {e.strerror}"
                          " (another udpverbs daemon on this port?)") from None
        ConnectionManager(device)
        groups = GroupService(device)
        if cfg.get("metrics") is not None:
            endpoint = _metrics(device, *cfg["metrics"])
        async with trio.open_nursery() as nursery:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                await nursery.start(serve_control, device, path)
                await nursery.start(device.loop.run)
                await nursery.start(groups.run)
                more = "".join(f" +{a.ip}" for a in cfg["addrs"][1:])
                log.info("udpverbsd %s: udp %s:%d%s, control %s, mtu %d, cc %s, pid %d, version %s", cfg["name"],
                         ip, port, more, path, cfg["mtu"], cfg["cc"], os.getpid(), udpverbs.__version__)
                served = True
                if cfg.get("ready_fd") is not None:
                    os.write(cfg["ready_fd"], f"ready {ip} {port} {path}\n".encode())
                    os.close(cfg["ready_fd"])
                async for signum in signals:
                    log.info("signal %s: shutting down", signal.Signals(signum).name)
                    device.announce_fatal()
                    nursery.cancel_scope.cancel()
                    break
    finally:
        if endpoint is not None:
            endpoint.close()
        device.close(report=served)  # a start that failed has nothing to report


def _metrics(device: Device, host: str, port: int) -> Any:
    """The Prometheus endpoint (``metrics.py``), serving.  Raises OSError when it cannot serve."""
    try:
        from . import metrics
        endpoint = metrics.Endpoint(device, host, port)
    except ImportError as e:
        raise OSError(f"--metrics needs prometheus_client ({e}); pip install prometheus_client") from None
    except OSError as e:
        raise OSError(e.errno, f"cannot serve metrics on {host}:{port}: {e.strerror}") from None
    log.info("metrics on %s", endpoint.url)
    return endpoint


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    try:
        cfg = dconfig.configure(argv)
        # Refused before anything is bound: the socket's directory must be
        # ours and private (the uid is the trust boundary; README "Trust").
        dconfig.make_runtime_dir(os.path.dirname(cfg["socket"]) or ".")
    except (ValueError, OSError) as e:
        print(f"udpverbsd: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=str(cfg["log_level"]).upper(), stream=sys.stderr,
                        format="%(asctime)s udpverbsd[%(process)d] %(levelname)s %(message)s")
    heap.keep_freed_heap(cfg["heap_keep_mb"])
    soft, hard = quota.raise_fd_limit()  # every context and region holds fds (quota.FD_COST)
    log.debug("file descriptors: %d (hard limit %d)", soft, hard)
    try:
        trio.run(run, cfg)
    except OSError as e:
        log.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
