"""Process groups: offloaded queue locks and barriers (skeleton: the launcher's environment contract).

The full Group class lands in this module; the environment contract below is
what ``udpverbs run`` sets for every rank and what ``Group.from_env`` reads.
"""

from __future__ import annotations

import ipaddress
from typing import Sequence

#: the environment ``udpverbs run`` gives every rank
ENV_DEVICE = "UDPVERBS_DEVICE"  # the device (daemon) this rank opens
ENV_RUNTIME_DIR = "UDPVERBS_RUNTIME_DIR"  # where the launcher's daemons' sockets are
ENV_RANK = "UDPVERBS_RANK"
ENV_SIZE = "UDPVERBS_SIZE"
ENV_MEMBERS = "UDPVERBS_MEMBERS"  # member list, rank order: "ip:port,ip:port,..." ("[v6]:port" for IPv6)
ENV_GROUP = "UDPVERBS_GROUP"  # the job's group name


def format_members(members: Sequence[tuple[str, int]]) -> str:
    """``[("127.0.0.2", 4791), ("::1", 5000)]`` -> ``"127.0.0.2:4791,[::1]:5000"``."""
    out = []
    for ip, port in members:
        addr = ipaddress.ip_address(ip)
        out.append(f"[{addr}]:{port}" if addr.version == 6 else f"{addr}:{port}")
    return ",".join(out)


def parse_members(text: str) -> list[tuple[str, int]]:
    """The inverse of :func:`format_members`.

    Raises:
        ValueError: an entry is not ``ip:port`` / ``[ip6]:port`` with a port in 1..65535.
    """
    members: list[tuple[str, int]] = []
    for item in text.split(","):
        item = item.strip()
        if item.startswith("["):
            host, sep, port = item[1:].partition("]:")
        else:
            host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) <= 0xFFFF:
            raise ValueError(f"member {item!r} is not ip:port")
        members.append((str(ipaddress.ip_address(host)), int(port)))
    return members
