"""Where a daemon lives and how it is configured: runtime dir, flags, TOML.

Theory of operation
-------------------
Applications find their daemon through the file system: the control socket
of device ``NAME`` is ``<runtime dir>/NAME.sock``, where the runtime dir is
``$UDPVERBS_RUNTIME_DIR`` if set (tests point it at a temporary directory),
else ``$XDG_RUNTIME_DIR/udpverbs``, else ``/tmp/udpverbs-<uid>``; it is
created mode 0700 and the socket is 0600, so only the user reaches it.
The naming rule lives in ``wire/ctl.py`` so the daemon and the verbs
library share one definition.

Precedence: built-in defaults < TOML file (``--config``) < command-line flags.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import tomllib
from typing import Any

import udpverbs

from ..transport.congestion.base import create as create_cc
from ..transport.impair import ImpairSpec, parse_spec
from ..transport.link import LinkConfig
from ..wire import ctl
from ..wire import link as wire_link
from ..wire.auth import TRAILER_LEN
from . import heap
from .clusterkey import load_key
from .paths import LocalAddress, parse_address, parse_addresses
from .quota import Quota

DEFAULT_PORT = 18515  #: our UDP port (perftest's TCP port number; not RoCEv2's 4791)
DEFAULT_MTU = 1472  #: UDP payload of a 1500-byte Ethernet MTU
DEFAULT_NAME = "uv0"
#: UDP payload bytes a datagram may carry: IPv4's minimum MTU (576) and its
#: largest datagram (65,535) less the IP and UDP headers.
MIN_MTU, MAX_MTU = 576 - 28, 65535 - 28
#: the datagram every path is assumed to carry (a 1500-byte Ethernet MTU's):
#: links start there and search up to --mtu (transport/pmtud.py)
BASE_DATAGRAM = DEFAULT_MTU
#: the datagram a link falls to when its path does not carry even that
#: (QUIC's smallest, RFC 9000 §14)
MIN_DATAGRAM = 1200


def check_mtu(mtu: int) -> int:
    """Return ``mtu`` if a datagram can carry it.

    Raises: ValueError otherwise (above 65,507 B the kernel refuses every
    full datagram, and the link would die retransmitting them).
    """
    if not MIN_MTU <= int(mtu) <= MAX_MTU:
        raise ValueError(f"mtu {mtu} out of range {MIN_MTU}..{MAX_MTU}")
    return int(mtu)


runtime_dir = ctl.runtime_dir
socket_path = ctl.socket_path


def make_runtime_dir(path: str) -> None:
    """Create the runtime dir 0700, or check that an existing one is ours and private.

    Raises:
        PermissionError: the directory belongs to someone else or others may
            use it (``ctl.private_dir_problem``); the message says how to fix it.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    problem = ctl.private_dir_problem(path)
    if problem is not None:
        raise PermissionError(f"{problem}; another user could replace the control socket. "
                              f"Fix: chmod 700 {path} if it is yours, else remove it "
                              "(or point UDPVERBS_RUNTIME_DIR or XDG_RUNTIME_DIR at a private directory)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="udpverbsd", description="udpverbs daemon: an emulated iWARP RNIC over UDP")
    p.add_argument("--config", help="TOML file with the same keys as the long flags (e.g. port = 18515)")
    p.add_argument("--name", help=f"device name (default {DEFAULT_NAME})")
    p.add_argument("--addr", action="append", metavar="ADDR[/PREFIX]",
                   help="IPv4 address to bind a UDP socket to (default 127.0.0.1); repeat it for several networks, "
                   "each a path of every link (the first is the device's GID; /PREFIX says its subnet, for pairing "
                   "paths with a peer's addresses)")
    p.add_argument("--port", type=int, help=f"UDP port (default {DEFAULT_PORT}; 0 picks a free one)")
    p.add_argument("--socket", help="control socket path (default <runtime dir>/<name>.sock)")
    p.add_argument("--mtu", type=int, help=f"UDP payload bytes per datagram (default {DEFAULT_MTU})")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR (default INFO)")
    p.add_argument("--spin-us", type=float, help="idle spin before sleeping, microseconds (default 200); "
                   "also bounds the yield after a message sent alone (0: neither)")
    p.add_argument("--cc", help="link congestion control: efe-host, efe, aimd or fixed (default efe-host: EFE tuned for host scheduling noise)")
    p.add_argument("--link", action="append", default=[], metavar="KEY=VALUE",
                   help="a transport.LinkConfig field, e.g. --link dead_peer_s=1.0 (repeatable)")
    p.add_argument("--quota", action="append", default=[], metavar="KEY=VALUE",
                   help="what one client (process) may hold at once, refused with ENOMEM beyond: qp (default 1024), "
                   "cq (1024), mr (4096), mr_bytes (256 GiB), fd_share (0.25 of the daemon's file descriptors); "
                   "repeatable")
    p.add_argument("--seed", type=int, help="seed of the daemon's random numbers (tags, ISNs)")
    p.add_argument("--no-gso", dest="gso", action="store_const", const=False,
                   help="send and receive every datagram with its own system call (no UDP_SEGMENT / UDP_GRO batching)")
    p.add_argument("--no-native", dest="native", action="store_const", const=False,
                   help="build and place tagged segments in Python only (no compiled lanes; see wire/native.py)")
    p.add_argument("--rx-dispatch-budget", type=int, metavar="N",
                   help="datagrams of one GRO batch that go through the Python path per pass, the rest in the next "
                   "passes, so that answers to the first leave sooner (default 8; 0: no limit)")
    p.add_argument("--heap-keep-mb", type=int, metavar="MB",
                   help="freed heap memory the daemon keeps mapped for its next buffers instead of returning it to "
                   f"the kernel, which would make each reuse page-fault (default {heap.DEFAULT_KEEP_MB}; 0: the C "
                   "library's default)")
    p.add_argument("--key-file", metavar="PATH",
                   help="the cluster key (hex text, at least 32 bytes, mode 0600; make one with udpverbs keygen "
                   "PATH): every datagram is then authenticated and replays are dropped; every daemon of the "
                   "cluster needs the same key")
    p.add_argument("--impair", metavar="SPEC",
                   help="impair every datagram this daemon sends, as tc netem would, to test on a bad network: "
                   "e.g. loss=0.05,dup=0.02,reorder=0.05,corrupt=0.001,delay=200us,jitter=50us,rate=1gbit "
                   "(seeded by --seed; TOML table [impair])")
    p.add_argument("--impair-addr", metavar="ADDR",
                   help="impair only what leaves from this one of the --addr addresses (default: all of them)")
    p.add_argument("--ready-fd", type=int, metavar="FD",
                   help="once serving, write the line 'ready IP PORT SOCKET' to this inherited pipe and close it "
                   "(PORT: the UDP port, the one --port 0 picked); nothing is written if the start fails "
                   "(for launchers; see docs/REFERENCE.md)")
    p.add_argument("--metrics", metavar="ADDR:PORT",
                   help="serve Prometheus metrics on this address only, e.g. 127.0.0.1:9464 (default: off)")
    p.add_argument("--version", action="version", version=version_line("udpverbsd"))
    return p


def version_line(program: str) -> str:
    """What ``--version`` prints: the program, the package's version and the control protocol's."""
    return f"{program} {udpverbs.__version__} (control protocol {ctl.CTL_VERSION})"


def check_metrics_addr(text: str) -> tuple[str, int]:
    """``ADDR:PORT`` (``[ADDR]:PORT`` for IPv6) of the metrics endpoint as ``(addr, port)``.

    Raises: ValueError unless ADDR is an IP address (a name could resolve
    to more than the address meant) and PORT is 0..65535.
    """
    host, sep, port = str(text).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(host)
        n = int(port)
    except ValueError:
        n = -1
    if not sep or not 0 <= n <= 65535:
        raise ValueError(f"metrics {text!r}: expected ADDR:PORT with an IP address, e.g. 127.0.0.1:9464")
    return host, n


_KEYS = ("name", "addr", "port", "socket", "mtu", "log_level", "spin_us", "seed", "cc", "gso", "native",
         "rx_dispatch_budget", "heap_keep_mb", "key_file", "metrics", "impair_addr")


def parse_flags(argv: list[str] | None) -> argparse.Namespace:
    """The flags alone, for a program that passes them on
    (``udpverbs perf --local --daemon-arg``).

    Raises: ValueError (not argparse's exit) for an unknown flag or a bad value.
    """
    p = parser()
    p.exit_on_error = False
    try:
        args, extra = p.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ValueError(str(e)) from None
    if extra:
        raise ValueError(f"unrecognized arguments: {' '.join(extra)}")
    return args


def load(argv: list[str] | None = None, *, exit_on_error: bool = True) -> dict[str, Any]:
    """Merge defaults, the TOML file and flags into one dict.

    ``exit_on_error=False`` is for flags another program passes on
    (``udpverbs perf --local --daemon-arg``): a bad flag is then a
    ValueError it can report, not argparse's exit.

    Raises:
        SystemExit: bad flags (argparse, unless ``exit_on_error`` is false);
        ValueError: bad TOML keys or values, or bad flags.
    """
    args = parser().parse_args(argv) if exit_on_error else parse_flags(argv)
    cfg: dict[str, Any] = {"name": DEFAULT_NAME, "addr": "127.0.0.1", "port": DEFAULT_PORT, "socket": None,
                           "mtu": DEFAULT_MTU, "log_level": "INFO", "spin_us": 200.0, "seed": None,
                           "cc": "efe-host", "gso": True, "native": True, "rx_dispatch_budget": 8,
                           "heap_keep_mb": heap.DEFAULT_KEEP_MB, "key_file": None, "metrics": None,
                           "impair_addr": None}
    if args.config:
        with open(args.config, "rb") as f:
            data = tomllib.load(f)
        for k, v in data.items():
            key = k.replace("-", "_")
            if key not in _KEYS and key not in ("link", "quota", "impair"):
                raise ValueError(f"{args.config}: unknown key {k!r}")
            cfg[key] = v
    for k in _KEYS:
        v = getattr(args, k)
        if v is not None:
            cfg[k] = v
    for key in ("gso", "native"):
        if not isinstance(cfg[key], bool):
            raise ValueError(f"{key} must be true or false, not {cfg[key]!r}")
    budget = cfg["rx_dispatch_budget"]
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(f"rx_dispatch_budget must be a whole number, not {budget!r}")
    heap.check_keep_mb(cfg["heap_keep_mb"])
    _addresses(cfg)
    check_mtu(cfg["mtu"])
    if cfg["metrics"] is not None:
        cfg["metrics"] = check_metrics_addr(cfg["metrics"])
    cfg["link"] = _settings("link", cfg, args.link)
    cfg["quota"] = Quota.from_settings(_settings("quota", cfg, args.quota))
    cfg["impair"] = impair_spec(cfg.pop("impair", None), args.impair)
    cfg["ready_fd"] = args.ready_fd
    if cfg["socket"] is None:
        cfg["socket"] = socket_path(cfg["name"])
    return cfg


def _addresses(cfg: dict[str, Any]) -> None:
    """``addr`` (one address or several) as ``addrs``, the LocalAddress list
    (``paths.py``), and ``addr``, the first's IP (the device's GID).

    Raises: ValueError for a bad address list, or an ``impair_addr`` that is none of them.
    """
    addrs = parse_addresses(cfg["addr"])
    cfg["addrs"] = addrs
    cfg["addr"] = addrs[0].ip
    if cfg["impair_addr"] is not None:
        ip = parse_address(cfg["impair_addr"]).ip
        if ip not in [a.ip for a in addrs]:
            raise ValueError(f"impair_addr {cfg['impair_addr']!r} is not one of the addresses "
                             f"({', '.join(a.ip for a in addrs)})")
        cfg["impair_addr"] = ip


def _settings(table: str, cfg: dict[str, Any], flags: list[str]) -> dict[str, Any]:
    """A TOML table (``[link]``, ``[quota]``) overridden by its ``--TABLE KEY=VALUE`` flags.

    Raises: ValueError for a flag without ``=``.
    """
    out = dict(cfg.pop(table, {}) or {})
    for item in flags:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--{table} {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def impair_spec(table: Any, flag: str | None) -> ImpairSpec | None:
    """The impairment of ``--impair SPEC``, else of the TOML ``[impair]``
    table (the flag replaces the whole table); None when neither is given.

    Raises: ValueError for a table that is not one, or a bad key or value.
    """
    if flag is not None:
        return parse_spec(flag)
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ValueError(f"[impair] must be a table of KEY = VALUE, not {table!r}")
    return ImpairSpec.from_items(table)


def configure(argv: list[str] | None = None, *, exit_on_error: bool = True) -> dict[str, Any]:
    """:func:`load`, then every value checked as the daemon would use it,
    before anything is bound (the log level; the MTU, congestion control
    and ``--link`` settings through the link's configuration).

    Raises: ValueError on a bad value, OSError on an unreadable TOML file,
    SystemExit on bad flags unless ``exit_on_error`` is false.
    """
    cfg = load(argv, exit_on_error=exit_on_error)
    cfg["key"] = None
    if cfg["key_file"] is not None:
        if cfg["addr"] in ("0.0.0.0", ""):
            # Each datagram's tag binds the address it was sent to (wire/auth.py).
            raise ValueError("a cluster key needs --addr to be the address peers send to, not a wildcard")
        cfg["key"] = load_key(str(cfg["key_file"]))
    if not isinstance(logging.getLevelName(str(cfg["log_level"]).upper()), int):
        raise ValueError(f"unknown log level {cfg['log_level']!r}; have DEBUG, INFO, WARNING, ERROR")
    link_config(DeviceConfig(mtu=int(cfg["mtu"]), cc=str(cfg["cc"]), link=cfg["link"],
                             rx_dispatch_budget=cfg["rx_dispatch_budget"]))
    return cfg


#: the daemon's defaults for LinkConfig.pacing_burst_packets and
#: pacing_burst_s (see link_config)
DAEMON_PACING_BURST_PACKETS = 32.0
DAEMON_PACING_BURST_S = 1e-3
#: the daemon's default for LinkConfig.min_rto_s.  The RTO estimator cannot
#: see how long the peer's daemon left our datagrams in its socket (its echo
#: leaves that out, for the delay signal), and on a loaded host a daemon
#: may not run for several milliseconds: a few milliseconds gave spurious
#: RTOs in bulk transfers, 20 ms none (Linux TCP uses 200 ms).
DAEMON_MIN_RTO_S = 0.02


class DeviceConfig:
    """What a device is: name, UDP address, limits (filled from flags/TOML)."""

    def __init__(self, *, name: str = "uv0", addr: str = "127.0.0.1", port: int = 18515,
                 mtu: int = 1472, spin_us: float = 200.0, max_sleep_s: float = 0.25,
                 max_qp: int = 4096, max_cq: int = 4096, max_mr: int = 65536, max_pd: int = 4096,
                 max_qp_wr: int = 16384, max_cqe: int = 65536, max_qp_rd_atom: int = 128,
                 seed: int | None = None, cc: str = "efe-host", link: dict[str, Any] | None = None,
                 gso: bool = True, native: bool = True, rx_dispatch_budget: int = 8,
                 quota: Quota | None = None, key: bytes | None = None,
                 impair: ImpairSpec | None = None, addrs: list[LocalAddress] | None = None,
                 impair_addr: str | None = None) -> None:
        self.name = name
        #: every local address, one UDP socket each (``paths.py``); the first is ``addr``, the GID
        self.addrs = list(addrs) if addrs else [LocalAddress(addr, None)]
        self.addr = self.addrs[0].ip
        self.port = port
        self.mtu = check_mtu(mtu)
        self.spin_s = spin_us * 1e-6
        self.max_sleep_s = max_sleep_s
        self.max_qp = max_qp
        self.max_cq = max_cq
        self.max_mr = max_mr
        self.max_pd = max_pd
        self.max_qp_wr = max_qp_wr
        self.max_cqe = max_cqe
        self.max_qp_rd_atom = max_qp_rd_atom
        self.seed = seed
        self.cc = cc
        self.link = dict(link or {})
        #: what one client may hold (quota.py)
        self.quota = quota or Quota()
        self.gso = gso
        #: the compiled lanes for tagged segments, receive and send (wire/native.py)
        self.native = native
        if rx_dispatch_budget < 0:
            raise ValueError("rx_dispatch_budget must be 0 (no limit) or more")
        #: the most datagrams of one GRO buffer that go through the Python
        #: path in one pass (0: no limit); the rest wait for the next pass,
        #: so that the answers to the first leave before the rest are worked
        #: through (see receive.py)
        self.rx_dispatch_budget = rx_dispatch_budget
        #: the cluster key (clusterkey.py), or None: datagrams go unauthenticated
        self.key = key
        #: what to do to every datagram sent (``--impair``; None: nothing)
        self.impair = impair
        #: the one local address ``impair`` applies to (None: every one)
        self.impair_addr = impair_addr


def link_config(config: DeviceConfig) -> LinkConfig:
    """The LinkConfig of a device: MTU and congestion control, plus ``--link`` overrides.

    Raises:
        ValueError: an unknown LinkConfig field or a value of the wrong type.
    """
    # The pacer's burst must cover the time between two passes of the data
    # loop, in which the pacer's rate would release many packets: a 2-packet
    # burst (LinkConfig's default, right for a sender that can act every
    # microsecond) capped a 1472-byte Write stream at a few packets per
    # pass, and a fixed 32 packets capped it with long passes.  So the burst
    # is also a time: 1 ms at the pacing rate.
    # A full datagram, with the cluster key's trailer, must still fit the MTU.
    trailer = TRAILER_LEN if config.key is not None else 0
    # Path MTU discovery (transport/pmtud.py): a link starts at what a
    # 1500-byte Ethernet path carries (or --mtu, if less) and finds the rest.
    extra = wire_link.OVERHEAD + trailer
    lc = LinkConfig(max_payload=config.mtu - extra, cc=config.cc,
                    base_payload=min(BASE_DATAGRAM, config.mtu) - extra,
                    min_payload=min(MIN_DATAGRAM, config.mtu) - extra,
                    pacing_burst_packets=DAEMON_PACING_BURST_PACKETS, pacing_burst_s=DAEMON_PACING_BURST_S,
                    min_rto_s=DAEMON_MIN_RTO_S)
    create_cc(config.cc, config.mtu)  # raises ValueError for an unknown name, now rather than per link
    for key, value in config.link.items():
        if key not in LinkConfig.__dataclass_fields__ or key in ("cc_params",):
            raise ValueError(f"unknown link setting {key!r}")
        current = getattr(lc, key)
        setattr(lc, key, type(current)(value) if not isinstance(current, bool) else str(value) == "true")
    return lc
