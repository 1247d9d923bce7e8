"""Two private "hosts" for real network runs: network namespaces joined by veth pairs.

Theory of operation
-------------------
A multi-path or path-MTU run needs two hosts joined by several networks
that it may shape and cut.  :class:`NamespacePair` makes them on this
machine: two fresh network namespaces and, per :class:`Wire`, one veth pair
between them on a subnet of its own (wire ``i``: ``10.210.<i+1>.1/24`` in
namespace A, ``.2`` in B), with the wire's MTU and, if asked, a token-bucket
rate on both ends (``tc qdisc … tbf``: netem is not in every kernel).  The
addresses exist only inside the namespaces, so nothing reaches any other
network.  Programs run inside with :meth:`NamespacePair.prefix` (``ip netns
exec``); the control sockets and shared memory of udpverbs are in the file
system, so an application outside talks to a daemon inside.

Everything made is removed on every way out (the veths go with their
namespaces).  Needs root and iproute2; :class:`NamespaceError` says why not.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Sequence

#: the subnet of wire i is 10.210.<i+1>.0/24 (inside the namespaces only)
SUBNET = "10.210.{}"
#: a tbf bucket this deep takes a 64 KiB UDP_SEGMENT send whole
TBF_BURST = "64kb"
TBF_LATENCY = "20ms"

_serial = itertools.count()


class NamespaceError(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip``, or the kernel refused)."""


@dataclass(frozen=True)
class Wire:
    """One veth pair: its MTU and, if not None, the rate of each direction in Mbit/s."""

    mtu: int = 1500
    rate_mbit: float | None = None


def run_ip(*args: str) -> str:
    """Run ``ip ARGS``; return its output.

    Raises: subprocess.CalledProcessError (its ``stderr`` says why).
    """
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10).stdout


class NamespacePair:
    """Namespaces A and B joined by one veth pair per wire (see the module docstring).

    Use as a context manager.  ``ns`` = (A's name, B's); ``addrs[side][i]``
    the address of wire ``i`` in that side (0 = A, 1 = B); ``devs[side][i]``
    its interface name.
    """

    def __init__(self, wires: Sequence[Wire], tag: str = "uvmp") -> None:
        if not 1 <= len(wires) <= 8:
            raise ValueError(f"1 to 8 wires, not {len(wires)}")
        self.wires = tuple(wires)
        unique = f"{tag}{os.getpid() % 100000}x{next(_serial)}"
        self.ns = (f"{unique}a", f"{unique}b")
        self.devs = ([f"uvw{i}a" for i in range(len(wires))], [f"uvw{i}b" for i in range(len(wires))])
        self.addrs = ([f"{SUBNET.format(i + 1)}.1" for i in range(len(wires))],
                      [f"{SUBNET.format(i + 1)}.2" for i in range(len(wires))])
        self._made: list[str] = []

    def __enter__(self) -> "NamespacePair":
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise NamespaceError("network namespaces need root and iproute2's ip")
        try:
            self._make()
        except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as e:
            self.close()
            raise NamespaceError(f"cannot make network namespaces here: {getattr(e, 'stderr', None) or e}") from None
        except BaseException:
            self.close()
            raise
        return self

    def _make(self) -> None:
        for n in self.ns:
            run_ip("netns", "add", n)
            self._made.append(n)
        for n in self.ns:
            run_ip("-n", n, "link", "set", "lo", "up")
        for i, wire in enumerate(self.wires):
            a, b = self.devs[0][i], self.devs[1][i]
            run_ip("link", "add", a, "netns", self.ns[0], "type", "veth", "peer", "name", b, "netns", self.ns[1])
            for side, dev in ((0, a), (1, b)):
                n = self.ns[side]
                run_ip("-n", n, "addr", "add", f"{self.addrs[side][i]}/24", "dev", dev)
                run_ip("-n", n, "link", "set", dev, "mtu", str(wire.mtu), "up")
                if wire.rate_mbit is not None:
                    subprocess.run([*self.prefix(side), "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                                    "rate", f"{wire.rate_mbit}mbit", "burst", TBF_BURST, "latency", TBF_LATENCY],
                                   check=True, capture_output=True, text=True, timeout=10)

    def prefix(self, side: int) -> tuple[str, ...]:
        """The command prefix that runs a program in namespace ``side`` (0 = A, 1 = B)."""
        return ("ip", "netns", "exec", self.ns[side])

    def set_wire(self, i: int, up: bool) -> None:
        """Set both ends of wire ``i`` down (a cut cable) or up again."""
        for side in (0, 1):
            run_ip("-n", self.ns[side], "link", "set", self.devs[side][i], "up" if up else "down")

    def wire_bytes(self, i: int, side: int = 0) -> tuple[int, int]:
        """(bytes sent, bytes received) by ``side``'s end of wire ``i``, as the kernel counts them."""
        info = json.loads(run_ip("-n", self.ns[side], "-s", "-j", "link", "show", "dev", self.devs[side][i]))
        stats = info[0]["stats64"]
        return stats["tx"]["bytes"], stats["rx"]["bytes"]

    def close(self) -> None:
        """Delete the namespaces made (their veths go with them); safe twice."""
        while self._made:
            subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True, timeout=10)

    def __exit__(self, *exc: object) -> None:
        self.close()
