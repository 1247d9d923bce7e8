"""Several local addresses per device: their parsing, their subnets, and which pairs make paths.

Theory of operation
-------------------
A device may have several UDP addresses (``udpverbsd --addr A --addr B``),
each a socket of its own on the device's port.  The first is the device's
GID: address vectors name it, links are opened and accepted on it, and
the pair it makes with a peer's first address is path 0 of their link.
The link's handshake tells each side the other's addresses
(``Link.local_addresses`` / ``Link.peer_addresses``); then each side pairs
them (:func:`pair_addresses`) and asks its link for a path per pair.

Pairing follows the networks: a local address takes an unused peer address
of its own subnet first (two NICs on two switches pair NIC to NIC), then
the locals left take the peer addresses left, in order.  An address's
subnet is the one its ``--addr A/PREFIX`` gives, else the longest network
of the kernel's interface table that holds it (:func:`kernel_networks`),
else the address alone.  Both sides pair by the same rule, but each with
its own view of the subnets; a pair the peer made and we did not is
accepted when its first datagram comes (``receive.Receiver``), so two
views that differ still meet.

:class:`PathMap` is the receive side's table: (local socket, peer address)
to (peer link, path), for every path but the links' path 0 (which the
device's ``links`` table, keyed by the peer's first address, already finds).
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import socket
import struct
from typing import Any, Iterable, NamedTuple, Sequence

from ..wire import link as wire_link

#: the most addresses a device may have (the link handshake carries at most
#: this many: ``wire/link.py``)
MAX_ADDRESSES = wire_link.MAX_ADDRESSES
# Linux ioctls on an AF_INET socket (include/uapi/linux/sockios.h)
_SIOCGIFCONF = 0x8912
_SIOCGIFNETMASK = 0x891B
_IFREQ = 40  # struct ifreq on 64-bit Linux: a 16-byte name and a 24-byte union
_IFCONF = struct.Struct("iL")  # struct ifconf: buffer length, buffer pointer
_MAX_INTERFACES = 256


class LocalAddress(NamedTuple):
    """One ``--addr``: the IPv4 address and the subnet it says it is on (None: not said)."""

    ip: str
    network: ipaddress.IPv4Network | None

    def __str__(self) -> str:
        return self.ip if self.network is None else f"{self.ip}/{self.network.prefixlen}"


def parse_address(text: Any) -> LocalAddress:
    """``A`` or ``A/PREFIX`` (CIDR: the subnet the address is on) as a LocalAddress.

    Raises: ValueError for anything but an IPv4 address with an optional
    prefix length 0..32 (the daemon's sockets are IPv4).
    """
    if not isinstance(text, str):
        raise ValueError(f"addr {text!r}: expected an IPv4 address as text, e.g. \"10.0.0.1\" or \"10.0.0.1/24\"")
    ip, slash, prefix = text.strip().partition("/")
    try:
        address = ipaddress.IPv4Address(ip)
        network = ipaddress.IPv4Network(f"{ip}/{prefix}", strict=False) if slash else None
    except ValueError:
        raise ValueError(f"addr {text!r}: expected an IPv4 address, optionally with its prefix length "
                         "(e.g. 10.0.0.1 or 10.0.0.1/24)") from None
    return LocalAddress(str(address), network)


def parse_addresses(value: Any) -> list[LocalAddress]:
    """Every address of ``value``: one string, or a list of them (TOML ``addr = ["A", "B"]``,
    or the repeated ``--addr``), the first the device's GID.

    Raises: ValueError for an empty list, a bad address, one given twice,
    more than MAX_ADDRESSES, or a wildcard (0.0.0.0) among several (each
    path needs the address its peer sends to).
    """
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"addr {value!r}: expected an address or a non-empty list of addresses")
    out = [parse_address(a) for a in items]
    if len(out) > MAX_ADDRESSES:
        raise ValueError(f"addr: {len(out)} addresses; a device takes at most {MAX_ADDRESSES}")
    seen: set[str] = set()
    for a in out:
        if a.ip in seen:
            raise ValueError(f"addr: {a.ip} given twice")
        seen.add(a.ip)
        if len(out) > 1 and ipaddress.IPv4Address(a.ip).is_unspecified:
            raise ValueError("addr: a wildcard address (0.0.0.0) cannot be one of several; "
                             "give each path's own address")
    return out


def kernel_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks of this host's interfaces (SIOCGIFCONF, SIOCGIFNETMASK);
    empty where they cannot be read."""
    out: list[ipaddress.IPv4Network] = []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            buf = array.array("B", bytes(_IFREQ * _MAX_INTERFACES))
            addr, _ = buf.buffer_info()
            n, _ = _IFCONF.unpack(fcntl.ioctl(s.fileno(), _SIOCGIFCONF, _IFCONF.pack(len(buf), addr)))
            raw = buf.tobytes()
            for at in range(0, n, _IFREQ):
                name = raw[at:at + 16]
                ip = socket.inet_ntoa(raw[at + 20:at + 24])
                mask = fcntl.ioctl(s.fileno(), _SIOCGIFNETMASK, name + bytes(_IFREQ - 16))
                out.append(ipaddress.IPv4Network(f"{ip}/{socket.inet_ntoa(mask[20:24])}", strict=False))
    except (OSError, ValueError):
        return []
    return out


def subnet_of(address: LocalAddress, networks: Sequence[ipaddress.IPv4Network]) -> ipaddress.IPv4Network:
    """``address``'s subnet: as given, else the longest of ``networks``
    holding it, else the address alone (a /32)."""
    if address.network is not None:
        return address.network
    ip = ipaddress.IPv4Address(address.ip)
    best = ipaddress.IPv4Network(f"{ip}/32")
    found = None
    for net in networks:
        if ip in net and (found is None or net.prefixlen > found.prefixlen):
            found = net
    return found if found is not None else best


def pair_addresses(subnets: Sequence[ipaddress.IPv4Network], peer: Sequence[tuple[str, int]],
                   used: Iterable[tuple[int, tuple[str, int]]] = ()) -> list[tuple[int, tuple[str, int]]]:
    """Which (local index, peer address) pairs make paths (the module
    docstring's rule), besides the pairs ``used`` already (path 0's among them).

    Takes: each local address's subnet, by index; the peer's addresses.
    Returns: the new pairs, each local and each peer address in at most
    one pair (``used`` included).
    """
    taken_local = {i for i, _ in used}
    taken_peer = {r for _, r in used}
    free_peer = [r for r in peer if r not in taken_peer]
    pairs: list[tuple[int, tuple[str, int]]] = []
    left: list[int] = []
    for i, net in enumerate(subnets):
        if i in taken_local:
            continue
        match = next((r for r in free_peer if _holds(net, r[0])), None)
        if match is None:
            left.append(i)
            continue
        free_peer.remove(match)
        pairs.append((i, match))
    for i, r in zip(left, free_peer):
        pairs.append((i, r))
    return pairs


def _holds(net: ipaddress.IPv4Network, ip: str) -> bool:
    try:
        return ipaddress.IPv4Address(ip) in net
    except ValueError:  # a peer's IPv6 address: on none of our (IPv4) subnets
        return False


class PathMap:
    """(local socket index, peer address) -> (peer link, path id), for paths beyond each link's path 0."""

    def __init__(self) -> None:
        self.paths: dict[tuple[int, tuple[str, int]], tuple[Any, int]] = {}

    def __len__(self) -> int:
        return len(self.paths)

    def get(self, index: int, addr: tuple[str, int]) -> tuple[Any, int] | None:
        """The link and path of a datagram read on socket ``index`` from ``addr`` (None: none)."""
        return self.paths.get((index, addr))

    def add(self, index: int, addr: tuple[str, int], pl: Any, path: int) -> None:
        """Remember that ``pl``'s path ``path`` runs between socket ``index`` and ``addr``."""
        self.paths[index, addr] = (pl, path)

    def forget(self, pl: Any) -> None:
        """Drop every path of ``pl`` (its link ended)."""
        for key in [k for k, (owner, _) in self.paths.items() if owner is pl]:
            del self.paths[key]
