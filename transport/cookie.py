"""Stateless cookies for the passive open, and the per-source rate limit of their answers (sans-IO).

Theory of operation
-------------------
A daemon that receives an INIT from an address it keeps no link for must not
spend state on it: anyone can send INITs, from any address (a flood of
them would fill the link table).  So it answers with one COOKIE packet
and forgets (SCTP's State Cookie, RFC 9260 §5.1.3; QUIC's Retry token,
RFC 9000 §8.1.3).  The cookie is the daemon's clock in seconds and a keyed
MAC (BLAKE2b with a per-daemon secret) over that stamp, the peer's address
and the INIT's tag and incarnation.  The initiator sends its INIT again
with the cookie; only an INIT carrying a valid cookie younger than
``lifetime_s`` makes a link.  A spoofer who cannot see the answers to the
address it forges never has the cookie, so a blind INIT costs nothing.

The answers themselves are bounded per source IP (``CookieJar.may_answer``):
a token bucket per address, in a table that is itself bounded (when full it
starts again empty: a flood of many sources then gets at most ``burst``
answers each per clearing, and never more state).

Time is ``now`` (seconds, the daemon's clock) and the secret is given: the
tests fix both.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from ..wire import link as wl

_STAMP = struct.Struct("!I")
_MACED = struct.Struct("!IIQH")  # stamp, tag, incarnation, port
_MAC_LEN = wl.COOKIE_LEN - _STAMP.size


class CookieJar:
    """Makes and checks INIT cookies, and rate-limits the COOKIE answers per source IP.

    Args:
        secret: the daemon's key (16..64 bytes; the daemon draws it at start).
        lifetime_s: how long a cookie stays valid.
        rate_per_s, burst: the token bucket of answers per source IP.
        max_sources: the most source addresses the rate limit tracks.
    """

    def __init__(self, secret: bytes, *, lifetime_s: float = 10.0, rate_per_s: float = 20.0, burst: int = 8,
                 max_sources: int = 4096) -> None:
        if not 16 <= len(secret) <= 64:
            raise ValueError("the cookie secret is 16 to 64 bytes")
        self._secret = secret
        self.lifetime_s = lifetime_s
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_sources = max_sources
        self._buckets: dict[str, tuple[float, float]] = {}  # ip -> (tokens, when)

    def _mac(self, stamp: int, addr: tuple[str, int], init: wl.LinkInit) -> bytes:
        h = hashlib.blake2b(key=self._secret, digest_size=_MAC_LEN)
        h.update(_MACED.pack(stamp, init.tag, init.incarnation, addr[1]))
        h.update(addr[0].encode())
        return h.digest()

    def make(self, addr: tuple[str, int], init: wl.LinkInit, now: float) -> bytes:
        """The cookie that answers ``init`` from ``addr`` at ``now``."""
        stamp = int(now) & 0xFFFFFFFF
        return _STAMP.pack(stamp) + self._mac(stamp, addr, init)

    def valid(self, addr: tuple[str, int], init: wl.LinkInit, now: float) -> bool:
        """Whether ``init`` (from ``addr``) echoes a cookie we made for it, less than ``lifetime_s`` ago."""
        cookie = init.cookie
        if len(cookie) != wl.COOKIE_LEN:
            return False
        (stamp,) = _STAMP.unpack_from(cookie)
        age = (int(now) - stamp) & 0xFFFFFFFF
        if age > self.lifetime_s:
            return False
        return hmac.compare_digest(cookie[_STAMP.size:], self._mac(stamp, addr, init))

    def may_answer(self, ip: str, now: float) -> bool:
        """Take a token of ``ip``'s bucket: False when it has none (answer nothing)."""
        buckets = self._buckets
        got = buckets.get(ip)
        if got is None:
            if len(buckets) >= self.max_sources:
                buckets.clear()
            tokens = float(self.burst)
        else:
            tokens, when = got
            tokens = min(float(self.burst), tokens + (now - when) * self.rate_per_s)
        if tokens < 1.0:
            buckets[ip] = (tokens, now)
            return False
        buckets[ip] = (tokens - 1.0, now)
        return True
