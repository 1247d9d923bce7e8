"""The cluster key: its file, and the guard that seals and opens every datagram.

Theory of operation
-------------------
The key file holds the secret every daemon of a cluster shares, as hex
text: at least 64 hex digits (32 bytes), white space around them ignored.
Text, so that it can be copied between hosts by any means that carries a
line (``udpverbs keygen PATH`` writes one).  Like ssh with a private key,
the daemon refuses a file that its group or others may read or write, and
says how to fix it.

:class:`Guard` is what the UDP socket (``udp.py``) calls on every path:
``seal`` and ``seal_run`` append a trailer (``wire/auth.py``) to each
datagram that leaves, ``open`` checks the trailer of each datagram read and
strips it, so that nothing above the socket ever sees a datagram whose tag
did not check or whose packet number was seen before.  Those are dropped
and counted (``auth_failed``, ``auth_replayed``).  A GRO batch is checked
datagram by datagram and handed on as one buffer of the stripped datagrams,
which keep their equal size, so the compiled receive lane takes it as ever.
The per-peer state (pair keys, replay windows) is made only for peers whose
datagram checked, and bounded.
"""

from __future__ import annotations

import collections
import os
import secrets
import stat
import time

from ..transport.replay import ReplayWindow, first_packet_number
from ..wire.auth import MIN_KEY_LEN, TRAILER_LEN, PairMac, pair_key
from ..wire.errors import WireError

#: peers the guard keeps pair keys and windows for (beyond, the oldest go):
#: more than a daemon's links (device.MAX_LINKS)
MAX_PEERS = 4096


class KeyFileError(ValueError):
    """The key file cannot be used; the message says why and how to fix it."""


def load_key(path: str) -> bytes:
    """The cluster key in the file at ``path`` (hex text, at least 32 bytes).

    Raises: KeyFileError when the file is missing or unreadable, readable
    or writable by group or others, not hex, or too short.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise KeyFileError(f"key file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"key file {path} is not a regular file")
        if st.st_mode & 0o077:
            raise KeyFileError(f"key file {path} is accessible by group or others (mode "
                               f"{stat.S_IMODE(st.st_mode):04o}), so the key may be known beyond this user; "
                               f"fix: chmod 600 {path}, and make a new key if others may have read it")
        text = os.read(fd, 4096)
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise KeyFileError(f"key file {path} is not hex text (make one with: udpverbs keygen PATH)") from None
    if len(key) < MIN_KEY_LEN:
        raise KeyFileError(f"key file {path} holds {len(key)} bytes; a cluster key needs at least {MIN_KEY_LEN} "
                           f"({2 * MIN_KEY_LEN} hex digits; make one with: udpverbs keygen PATH)")
    return key


def write_new_key(path: str) -> None:
    """Write a new random 32-byte key to ``path`` as hex text, mode 0600.

    Raises: FileExistsError if ``path`` exists (a key in use is never
    overwritten), OSError if it cannot be written.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, (secrets.token_hex(MIN_KEY_LEN) + "\n").encode())
    finally:
        os.close(fd)


class _Peer:
    """What the guard keeps for one peer that has sent a valid datagram."""

    __slots__ = ("mac", "window")

    def __init__(self, mac: PairMac) -> None:
        self.mac = mac
        self.window = ReplayWindow()


class Guard:
    """Seals what a daemon at ``me`` sends and opens what it reads (see the module docstring).

    ``stats``: the device's counters; ``salt`` and ``first_pn`` default to
    a random salt and :func:`first_packet_number` of the wall clock.
    """

    def __init__(self, key: bytes, me: tuple[str, int], stats: collections.Counter[str], *,
                 salt: int | None = None, first_pn: int | None = None) -> None:
        self.key = key
        self.me = me
        self.stats = stats
        self.salt = secrets.randbits(32) if salt is None else salt
        self.pn = first_packet_number(time.time_ns()) if first_pn is None else first_pn
        self._tx: dict[tuple[str, int], PairMac] = {}
        self._rx: dict[tuple[str, int], _Peer] = {}

    # -- sending ------------------------------------------------------------------
    def _tx_mac(self, addr: tuple[str, int]) -> PairMac:
        mac = self._tx.get(addr)
        if mac is None:
            if len(self._tx) >= MAX_PEERS:
                del self._tx[next(iter(self._tx))]
            mac = self._tx[addr] = PairMac(pair_key(self.key, self.me, addr))
        return mac

    def seal(self, datagram: bytes | memoryview, addr: tuple[str, int]) -> bytes:
        """``datagram`` with its trailer, for ``addr``."""
        pn = self.pn
        self.pn = pn + 1
        return self._tx_mac(addr).seal(datagram, self.salt, pn)

    def seal_each(self, datagrams: list[bytes | memoryview], addr: tuple[str, int]) -> list[bytes]:
        """Each of ``datagrams`` sealed for ``addr``."""
        mac = self._tx_mac(addr)
        salt, pn = self.salt, self.pn
        self.pn = pn + len(datagrams)
        return [mac.seal(d, salt, pn + i) for i, d in enumerate(datagrams)]

    def seal_run(self, buffers: list[bytes | memoryview], size: int,
                 addr: tuple[str, int]) -> tuple[list[bytes], int]:
        """A run for one UDP_SEGMENT send (datagrams of ``size`` bytes in
        ``buffers``, the last may be shorter), each datagram sealed: the
        sealed buffers and their datagram size, ``size`` + the trailer."""
        sealed, count = self._tx_mac(addr).seal_run(buffers, size, self.salt, self.pn)
        self.pn += count
        return [sealed], size + TRAILER_LEN

    # -- receiving ----------------------------------------------------------------
    def _rx_peer(self, addr: tuple[str, int], datagram: memoryview) -> _Peer | None:
        """The state of the peer at ``addr``, made if ``datagram`` checks under its pair key."""
        peer = self._rx.get(addr)
        if peer is not None:
            return peer
        try:
            mac = PairMac(pair_key(self.key, addr, self.me))
            mac.open_untrusted(datagram)
        except (WireError, ValueError):
            return None
        if len(self._rx) >= MAX_PEERS:
            del self._rx[next(iter(self._rx))]
        peer = self._rx[addr] = _Peer(mac)
        return peer

    def open(self, data: bytes, addr: tuple[str, int], seg: int,
             arrived: float) -> tuple[bytes, tuple[str, int], int, float]:
        """``UdpPort.receive``'s answer for ``data`` read from ``addr``
        (datagrams of ``seg`` bytes, the last may be shorter), each checked
        and stripped of its trailer: the valid ones, as one buffer of
        datagrams of ``seg`` - the trailer, or datagram size -1 if none was."""
        stats = self.stats
        peer = self._rx.get(addr) if data else None
        if peer is None and data:
            peer = self._rx_peer(addr, memoryview(data)[:seg])
        if peer is None:
            stats["auth_failed"] += -(-len(data) // seg) if data else 1
            return data, addr, -1, arrived
        valid, failed = peer.mac.open_run_untrusted(data, seg)
        if failed:
            stats["auth_failed"] += failed
        accept = peer.window.accept
        kept = [(at, end) for at, end, pn in valid if accept(pn)]
        if len(kept) < len(valid):
            stats["auth_replayed"] += len(valid) - len(kept)
        if not kept:
            return data, addr, -1, arrived
        if len(kept) == 1:
            at, end = kept[0]
            return data[at:end], addr, end - at, arrived
        view = memoryview(data)
        return b"".join([view[at:end] for at, end in kept]), addr, seg - TRAILER_LEN, arrived
