"""A bad network on purpose: loss, duplication, reordering, corruption, delay and a bottleneck (sans-IO).

Theory of operation
-------------------
Users test an application, or a congestion controller, on a bad network
with Linux's ``tc netem``; where the kernel has none (or the user no root)
the daemon impairs its own egress with this model instead.  The spec reads
like netem's options, ``loss=0.05,dup=0.02,reorder=0.05,corrupt=0.001,
delay=200us,jitter=50us,rate=1gbit`` (:func:`parse_spec`), and each key
does what netem's does, with one difference: a reordered datagram here is
*held back* (``reorder_delay`` longer) so that later ones pass it, where
netem sends it at once and delays the rest, which needs a ``delay``.

:meth:`Impairment.offer` decides a datagram's fate at ``now`` and keeps
what survives in a heap keyed by release time; :meth:`Impairment.due`
hands out, in release order, what may leave at ``now``;
:meth:`Impairment.next_deadline` says when the next one may.  The effects,
in netem's order:

1. loss: the datagram is dropped;
2. duplication: a copy follows the original, through the steps below on
   draws of its own;
3. corruption: one random bit of the copy is flipped;
4. the bottleneck (``rate``): datagrams are serialized one after the
   other, each leaving ``8 * len / rate`` seconds after the one before (or
   at once, when the bottleneck is idle);
5. delay: ``delay`` plus uniform(-``jitter``, +``jitter``), never before
   ``now`` (jitter alone reorders, as netem's does);
6. reorder: held ``reorder_delay`` more.

At most ``limit`` datagrams are held at once (netem's ``limit``, default
1000); one more is dropped at the tail and counted, so the memory held is
bounded by ``limit`` datagrams whatever the rate and the delay.

Every draw comes from the ``random.Random`` given, and ties in release
time leave in the order offered: the same seed and the same offers give
the same output, byte for byte.
"""

from __future__ import annotations

import bisect
import heapq
import operator
import random
from dataclasses import dataclass, fields
from typing import Any, Mapping

#: netem's default queue limit, in datagrams
DEFAULT_LIMIT = 1000
#: how long a reordered datagram is held when no ``delay`` is given: long
#: enough for a daemon's next passes (tens to hundreds of microseconds each)
#: to send datagrams that overtake it
DEFAULT_REORDER_DELAY_S = 1e-3

#: a time unit: how many of it make a second (a division keeps 200us exactly 200e-6)
_TIME_UNITS = {
    "s": 1.0, "sec": 1.0, "secs": 1.0, "ms": 1e3, "msec": 1e3, "msecs": 1e3,
    "us": 1e6, "usec": 1e6, "usecs": 1e6, "ns": 1e9, "nsec": 1e9, "nsecs": 1e9,
}  # fmt: skip
# tc's rate units (tc(8), "RATES"): bit forms are bits per second, bps forms
# bytes per second; k/m/g/t are powers of 1000, ki/mi/gi/ti of 1024.
_RATE_SCALES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
                "ki": 1024.0, "mi": 1024.0 ** 2, "gi": 1024.0 ** 3, "ti": 1024.0 ** 4}  # fmt: skip
_RATE_UNITS = {**{f"{p}bit": s for p, s in _RATE_SCALES.items()},
               **{f"{p}bps": 8 * s for p, s in _RATE_SCALES.items()}}  # fmt: skip
#: the spec's keys, as netem names them, and the field each sets
_RELEASE = operator.itemgetter(0)
_KEYS = {"loss": "loss", "dup": "dup", "duplicate": "dup", "reorder": "reorder", "corrupt": "corrupt",
         "delay": "delay_s", "jitter": "jitter_s", "reorder_delay": "reorder_delay_s", "rate": "rate_bps",
         "limit": "limit", "start": "start_s", "stop": "stop_s"}  # fmt: skip


def _number(text: str, key: str) -> tuple[float, str]:
    """``text`` split into its number and its unit (lower case)."""
    t = text.strip().lower()
    i = len(t)
    while i and t[i - 1].isalpha():
        i -= 1
    try:
        value = float(t[:i])
    except ValueError:
        raise ValueError(f"impair {key}={text!r}: not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"impair {key}={text!r}: not a finite number")
    return value, t[i:]


def parse_probability(text: str, key: str = "loss") -> float:
    """A probability, ``0.05`` or ``5%``.  Raises ValueError outside 0..1."""
    t = text.strip()
    percent = t.endswith("%")
    value, unit = _number(t[:-1] if percent else t, key)
    if unit:
        raise ValueError(f"impair {key}={text!r}: a probability is a number from 0 to 1, or a percentage")
    if percent:
        value /= 100
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"impair {key}={text!r}: a probability is from 0 to 1 (0% to 100%)")
    return value


def parse_time(text: str, key: str = "delay") -> float:
    """A duration with its unit (``s``, ``ms``, ``us``, ``ns``), in seconds.

    Raises ValueError for a negative one, or one without a unit (``0`` may go without).
    """
    value, unit = _number(text, key)
    if not unit and value == 0:
        return 0.0
    if unit not in _TIME_UNITS:
        raise ValueError(f"impair {key}={text!r}: give a time with its unit: s, ms, us or ns (e.g. 200us)")
    if value < 0:
        raise ValueError(f"impair {key}={text!r}: a time is not negative")
    return value / _TIME_UNITS[unit]


def parse_rate(text: str, key: str = "rate") -> float:
    """A rate with tc's units, in bits per second: ``bit``, ``kbit``,
    ``mbit``, ``gbit``, ``tbit`` (and ``kibit`` ... for powers of 1024),
    or ``bps``, ``kbps``, ``mbps``, ``gbps`` for *bytes* per second, as tc
    reads them.

    Raises ValueError for a rate that is not positive or has no unit.
    """
    value, unit = _number(text, key)
    if unit not in _RATE_UNITS:
        raise ValueError(f"impair {key}={text!r}: give a rate with tc's units: bit, kbit, mbit, gbit "
                         "(bits per second) or bps, kbps, mbps, gbps (bytes per second), e.g. 1gbit")
    bps = value * _RATE_UNITS[unit]
    if bps <= 0:
        raise ValueError(f"impair {key}={text!r}: a rate is more than 0")
    return bps


@dataclass(frozen=True)
class ImpairSpec:
    """What to do to each datagram (the module docstring has the order).

    Probabilities are from 0 to 1; ``rate_bps`` 0 means no bottleneck;
    ``reorder_delay_s`` None means ``delay_s`` if that is set, else
    DEFAULT_REORDER_DELAY_S.
    """

    loss: float = 0.0
    dup: float = 0.0
    reorder: float = 0.0
    corrupt: float = 0.0
    delay_s: float = 0.0
    jitter_s: float = 0.0
    reorder_delay_s: float | None = None
    rate_bps: float = 0.0
    limit: int = DEFAULT_LIMIT
    #: the daemon impairs only from ``start_s`` after it started until
    #: ``stop_s`` (a path that fails for a while); the model itself ignores them
    start_s: float = 0.0
    stop_s: float = float("inf")

    @classmethod
    def from_items(cls, items: Mapping[str, Any]) -> "ImpairSpec":
        """A spec from ``key: value`` pairs (a TOML ``[impair]`` table, or a parsed string).

        Values may be strings as in the spec string or, for probabilities
        and ``limit``, numbers.
        Raises ValueError naming the key for an unknown key or a bad value.
        """
        out: dict[str, Any] = {}
        for raw_key, raw in items.items():
            key = str(raw_key).strip().lower().replace("-", "_")
            name = _KEYS.get(key)
            if name is None:
                raise ValueError(f"impair: unknown key {raw_key!r}; have {', '.join(sorted(_KEYS))}")
            if name in out:
                raise ValueError(f"impair: {raw_key!r} given twice")
            if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
                raise ValueError(f"impair {key}={raw!r}: not a number or a string")
            text = str(raw)
            if name in ("delay_s", "jitter_s", "reorder_delay_s", "start_s", "stop_s"):
                out[name] = parse_time(text, key)
            elif name == "rate_bps":
                out[name] = parse_rate(text, key)
            elif name == "limit":
                value, unit = _number(text, key)
                if unit or value != int(value) or value < 1:
                    raise ValueError(f"impair limit={text!r}: a whole number of datagrams, 1 or more")
                out[name] = int(value)
            else:
                out[name] = parse_probability(text, key)
        if out.get("start_s", 0.0) >= out.get("stop_s", float("inf")):
            raise ValueError("impair: start must come before stop")
        return cls(**out)

    @property
    def hold_back_s(self) -> float:
        """How much longer a reordered datagram is held."""
        if self.reorder_delay_s is not None:
            return self.reorder_delay_s
        return self.delay_s if self.delay_s > 0 else DEFAULT_REORDER_DELAY_S

    def describe(self) -> str:
        """The spec as :func:`parse_spec` reads it, the keys that differ from the defaults only."""
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            key = f.name.removesuffix("_s").removesuffix("_bps")
            if f.name.endswith("_s"):
                parts.append(f"{key}={value * 1e6:g}us")
            elif f.name == "rate_bps":
                parts.append(f"{key}={value:g}bit")
            else:
                parts.append(f"{key}={value:g}")
        return ",".join(parts) or "none"


def parse_spec(text: str) -> ImpairSpec:
    """Read ``key=value,key=value`` (keys: loss, dup, reorder, corrupt,
    delay, jitter, reorder_delay, rate, limit, start, stop).

    Raises ValueError, naming the part, for an empty spec, a part without
    ``=``, an unknown key or a bad value.
    """
    items: dict[str, str] = {}
    parts = [p for p in text.replace(" ", ",").split(",") if p.strip()]
    if not parts:
        raise ValueError("impair: empty spec; e.g. loss=0.05,dup=0.02,reorder=0.05,corrupt=0.001")
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"impair: {part!r} is not KEY=VALUE")
        if key.strip().lower() in items:
            raise ValueError(f"impair: {key.strip()!r} given twice")
        items[key.strip().lower()] = value
    return ImpairSpec.from_items(items)


#: a datagram that may leave: ``(release_s, datagram, to)``, when, its
#: bytes, and where to (as offered); a plain tuple, made once per datagram
Released = tuple[float, "bytes | bytearray", Any]


class Impairment:
    """The model: datagrams offered, datagrams released (see the module docstring).

    ``stats`` counts ``offered``, ``lost``, ``duplicated``, ``corrupted``,
    ``reordered``, ``tail_dropped`` (over ``limit``) and ``released``.
    """

    def __init__(self, spec: ImpairSpec, rng: random.Random) -> None:
        self.spec = spec
        self.rng = rng
        self._counts = dict.fromkeys(("offered", "lost", "duplicated", "corrupted", "reordered", "tail_dropped",
                                      "released"), 0)
        #: what waits for a later time than it was offered at: (release, order, bytes, to)
        self._held: list[tuple[float, int, bytes | bytearray, Any]] = []
        #: what may leave at the time it was offered (most datagrams, unless
        #: the spec delays them all): in order, no heap
        self._ready: list[Released] = []
        self._seq = 0
        #: when the bottleneck has sent all it took (rate_bps > 0)
        self._busy_until = float("-inf")
        #: whether every datagram is held (then nothing takes the heap's by-pass)
        self._timed = bool(spec.delay_s or spec.jitter_s or spec.rate_bps)

    @property
    def stats(self) -> dict[str, int]:
        """The counters (a copy)."""
        return dict(self._counts)

    @property
    def held(self) -> int:
        """Datagrams waiting for their release time."""
        return len(self._held) + len(self._ready)

    def offer(self, datagram: bytes | bytearray | memoryview, now: float, to: Any = None) -> None:
        """A datagram to send at ``now`` to ``to``: dropped, or held (with a
        duplicate, perhaps) until :meth:`due` releases it.  The model keeps
        its own copy: the caller may reuse its buffer."""
        spec = self.spec
        counts = self._counts
        counts["offered"] += 1
        if spec.loss and self.rng.random() < spec.loss:
            counts["lost"] += 1
            return
        data = bytes(datagram)
        self._hold(data, now, to)
        if spec.dup and self.rng.random() < spec.dup:
            counts["duplicated"] += 1
            self._hold(data, now, to)

    def _hold(self, data: bytes, now: float, to: Any) -> None:
        """One copy through corruption, the bottleneck, delay and reordering."""
        spec = self.spec
        counts = self._counts
        rng = self.rng
        held = self._held
        if len(held) + len(self._ready) >= spec.limit:
            counts["tail_dropped"] += 1
            return
        out: bytes | bytearray = data
        if spec.corrupt and data and rng.random() < spec.corrupt:
            out = bytearray(data)
            bit = rng.randrange(len(out) * 8)
            out[bit >> 3] ^= 1 << (bit & 7)
            counts["corrupted"] += 1
        at = now
        if self._timed:
            at = self._delayed(len(data), now)
        if spec.reorder and rng.random() < spec.reorder:
            counts["reordered"] += 1
            at += spec.hold_back_s
        elif at <= now:
            self._ready.append((now, out, to))
            return
        self._seq += 1
        heapq.heappush(held, (at, self._seq, out, to))

    def _delayed(self, size: int, now: float) -> float:
        """When a datagram of ``size`` bytes offered at ``now`` leaves the bottleneck and the delay."""
        spec = self.spec
        at = now
        if spec.rate_bps:
            start = self._busy_until if self._busy_until > now else now
            at = self._busy_until = start + 8 * size / spec.rate_bps
        d = spec.delay_s
        if spec.jitter_s:
            d += (2 * self.rng.random() - 1) * spec.jitter_s
        return at + d if d > 0 else at

    def due(self, now: float) -> list[Released]:
        """Take the datagrams whose release time is ``now`` or earlier, in
        release order (``now`` never goes back: a monotonic clock)."""
        held = self._held
        out = self._ready
        self._ready = []
        # Held datagrams that are due join those that left at once, in order
        # of release; a handful at a time, so by insertion, not a merge.
        while held and held[0][0] <= now:
            at, _, data, to = heapq.heappop(held)
            bisect.insort_right(out, (at, data, to), key=_RELEASE)
        self._counts["released"] += len(out)
        return out

    def next_deadline(self) -> float | None:
        """When the next held datagram may leave; None if none is held."""
        held = self._held
        if self._ready:
            first = self._ready[0][0]
            return first if not held or held[0][0] > first else held[0][0]
        return held[0][0] if held else None
