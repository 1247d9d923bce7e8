"""``udpverbs soak``: move many bytes between two real daemons, clean and on a bad network, and check every one.

Theory of operation
-------------------
Two local daemons are started as ``udpverbs perf --local`` starts them
(:class:`local.LocalDaemons`, 127.0.0.2 and 127.0.0.3); this process opens
both, as two applications would, and connects ``qps`` RC QP pairs between
them.  Side A posts a seeded random mix of RDMA Writes (A's memory into
B's), RDMA Reads (B's memory into A's) and Sends (into receives B posted),
of sizes drawn log-uniformly from ``min_size`` to ``max_size`` (so there
are many small messages and many large ones), keeping ``depth`` of them
in flight per QP, until ``total_bytes`` have moved.  Every work request is
signaled and must complete with IBV_WC_SUCCESS, a Send's receive with the
Send's length.

Each work request's data lands in a slot of its own, read once its
completion is in: for each op type the run keeps the BLAKE2b digest of
what was sent (the source bytes, when posted) and of what arrived, work
request by work request in posting order, and the two must be equal.
The sources are seeded random bytes, each request taking them from a
random offset, so a misplaced or stale segment cannot pass.

:func:`soak` does this twice with the same seed, first with clean daemons
and then with daemons started with ``--impair SPEC``, and reports the
goodput of each (bytes moved over the time from the first post to the
last completion) and their ratio.  Any failure (an error completion, a
digest that differs, no completion for ``stall_s``, the whole run over
``timeout_s``) ends it with :class:`SoakError`.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..transport.impair import parse_spec
from . import local

#: the impairment of ``udpverbs soak`` unless told otherwise
DEFAULT_IMPAIR = "loss=0.05,dup=0.02,reorder=0.05,corrupt=0.001"
OPS = ("write", "read", "send")
#: the seeded random bytes each side's requests take their data from
SOURCE_BYTES = 4 << 20
#: most Reads one QP may have outstanding (within the device's max_qp_rd_atom)
MAX_RD_ATOMIC = 16
#: how long one wait for a completion lasts before the run looks at its clocks again
POLL_WAIT_S = 0.2


class SoakError(Exception):
    """The soak failed: an error completion, data that differs, a stall, or its time ran out."""


@dataclass(frozen=True)
class SoakParams:
    """What one soak moves, and how (see the module docstring)."""

    total_bytes: int
    impair: str = DEFAULT_IMPAIR
    qps: int = 4
    depth: int = 4
    min_size: int = 1
    max_size: int = 1 << 20
    ops: tuple[str, ...] = OPS
    seed: int = 1
    stall_s: float = 30.0
    timeout_s: float = 1800.0
    mtu: int = 1500
    daemon_args: tuple[str, ...] = ()

    def validate(self) -> "SoakParams":
        """Return the parameters if they make sense.  Raises ValueError naming the bad one."""
        parse_spec(self.impair)
        if self.total_bytes < 1:
            raise ValueError("--bytes must be at least 1")
        if not 1 <= self.qps <= 64:
            raise ValueError("--qps must be from 1 to 64")
        if not 1 <= self.depth <= 64:
            raise ValueError("--depth must be from 1 to 64")
        if not 1 <= self.min_size <= self.max_size <= 16 << 20:
            raise ValueError("sizes must be 1 <= --min-size <= --max-size <= 16M")
        if not self.ops or any(op not in OPS for op in self.ops):
            raise ValueError(f"--ops takes some of {','.join(OPS)}, not {','.join(self.ops) or 'none'}")
        if self.stall_s <= 0 or self.timeout_s <= 0:
            raise ValueError("--stall and --timeout are more than 0 seconds")
        return self


@dataclass
class OpTally:
    """One op type's work requests in a run: how many, their bytes, and the two digests."""

    wrs: int = 0
    bytes: int = 0
    sent: Any = field(default_factory=lambda: hashlib.blake2b(digest_size=16))
    arrived: Any = field(default_factory=lambda: hashlib.blake2b(digest_size=16))
    differing: int = 0  # work requests whose data differs


@dataclass
class SoakResult:
    """One run: what moved, how fast, and the daemons' counters."""

    label: str
    seconds: float
    tallies: dict[str, OpTally]
    stats: dict[str, int]

    @property
    def bytes(self) -> int:
        """Bytes moved, all op types."""
        return sum(t.bytes for t in self.tallies.values())

    @property
    def goodput_MBps(self) -> float:
        """Bytes moved per second, in MB (10^6 bytes)."""
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The run as one JSON-able object."""
        return {"run": self.label, "bytes": self.bytes, "seconds": round(self.seconds, 3),
                "goodput_MBps": round(self.goodput_MBps, 2),
                "ops": {op: {"wrs": t.wrs, "bytes": t.bytes, "digest": t.arrived.hexdigest(), "ok": not t.differing}
                        for op, t in self.tallies.items()},
                "stats": self.stats}  # fmt: skip


def _size(rng: random.Random, lo: int, hi: int) -> int:
    """A size from ``lo`` to ``hi``, log-uniform: each power of two is as likely."""
    return min(hi, max(lo, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))))


@dataclass
class _WR:
    """A work request in flight."""

    op: str
    qp: int
    slot: int
    size: int
    src: int  # offset in the source area it was taken from
    digest: bytes  # of what was sent
    done_a: bool = False  # its completion on A
    done_b: bool = False  # a Send's receive completion on B (others: True)


class _Side:
    """One application's resources on one daemon: a region (sources, then
    a slot per work request in flight), a CQ and the QPs."""

    def __init__(self, verbs: Any, device: str, p: SoakParams, seed: str) -> None:
        from ..verbs import enums as E
        from .verbs_perf import open_context

        self.ctx = open_context(verbs, device)
        pd = verbs.PD(self.ctx)
        access = E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_READ
        self.mr = verbs.MR(pd, SOURCE_BYTES + p.qps * p.depth * p.max_size, access)
        self.mr.write(random.Random(seed).randbytes(SOURCE_BYTES))
        self.cq = verbs.CQ(self.ctx, 2 * p.qps * p.depth + 16)
        cap = verbs.QPCap(max_send_wr=p.depth, max_recv_wr=p.depth, max_send_sge=1, max_recv_sge=1)
        self.qps = [verbs.QP(pd, verbs.QPInitAttr(qp_type=E.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
                    for _ in range(p.qps)]
        self.slot_bytes = p.max_size
        self.depth = p.depth

    def slot(self, qp: int, slot: int) -> int:
        """The offset in the region of QP ``qp``'s slot ``slot``."""
        return SOURCE_BYTES + (qp * self.depth + slot) * self.slot_bytes

    def stats(self) -> dict[str, int]:
        """The daemon's counters (``query_stats``)."""
        return self.ctx.query_stats()

    def close(self) -> None:
        self.ctx.close()


def _connect(verbs: Any, a: _Side, b: _Side, rd: int) -> None:
    """Connect A's QP k to B's QP k, perftest style (QP numbers, GIDs and ports swapped by hand)."""
    from ..verbs import enums as E

    access = E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_READ
    for me, peer in ((a, b), (b, a)):
        port, gid = peer.ctx.query_port().lid, peer.ctx.query_gid()
        for qp, pqp in zip(me.qps, peer.qps):
            attr = verbs.QPAttr(qp_access_flags=access, dest_qp_num=pqp.qp_num, max_rd_atomic=rd,
                                max_dest_rd_atomic=rd)
            attr.ah_attr = verbs.AHAttr(dlid=port, gr=verbs.GlobalRoute(dgid=gid))
            qp.to_rts(attr)


def _status_name(status: int) -> str:
    from ..wire.shm import WcStatus

    try:
        return WcStatus(status).name
    except ValueError:
        return f"status {status}"


class _Run:
    """One pass of the workload over two connected sides (see the module docstring)."""

    def __init__(self, verbs: Any, a: _Side, b: _Side, p: SoakParams) -> None:
        from ..verbs import enums as E

        self.v, self.E, self.a, self.b, self.p = verbs, E, a, b, p
        self.rng = random.Random(f"soak {p.seed}")
        self.free = [list(range(p.depth)) for _ in range(p.qps)]
        self.inflight: dict[int, _WR] = {}
        self.finished: dict[int, tuple[str, int, bytes, bytes]] = {}  # id: op, size, sent, arrived
        self.folded = 0  # work requests folded into the tallies, in posting order
        self.tallies = {op: OpTally() for op in p.ops}
        self.posted_bytes = 0
        self.next_id = 0

    # -- posting --------------------------------------------------------------------
    def post_all(self) -> None:
        """Post on every QP while it has a free slot and bytes remain."""
        p = self.p
        for q in range(p.qps):
            while self.free[q] and self.posted_bytes < p.total_bytes:
                self._post(q, self.free[q].pop())

    def _post(self, q: int, slot: int) -> None:
        p, rng, a, b, v, E = self.p, self.rng, self.a, self.b, self.v, self.E
        op = rng.choice(p.ops)
        size = min(_size(rng, p.min_size, p.max_size), p.total_bytes - self.posted_bytes)
        src = rng.randrange(SOURCE_BYTES - size + 1)
        source = b if op == "read" else a
        wr = _WR(op, q, slot, size, src, hashlib.blake2b(source.mr.mv[src:src + size], digest_size=16).digest(),
                 done_b=op != "send")
        wid = self.next_id
        self.next_id += 1
        self.inflight[wid] = wr
        self.posted_bytes += size
        flags = E.IBV_SEND_SIGNALED
        if op == "send":
            b.qps[q].post_recv(v.RecvWR(wr_id=wid, sg=[v.SGE(self._target(q, slot), p.max_size, b.mr.lkey)]))
            a.qps[q].post_send(v.SendWR(wr_id=wid, opcode=E.IBV_WR_SEND, send_flags=flags,
                                        sg=[v.SGE(a.mr.buf + src, size, a.mr.lkey)]))
            return
        if op == "write":
            s = v.SendWR(wr_id=wid, opcode=E.IBV_WR_RDMA_WRITE, send_flags=flags,
                         sg=[v.SGE(a.mr.buf + src, size, a.mr.lkey)])
            s.set_wr_rdma(b.mr.rkey, self._target(q, slot))
        else:
            s = v.SendWR(wr_id=wid, opcode=E.IBV_WR_RDMA_READ, send_flags=flags,
                         sg=[v.SGE(a.mr.buf + a.slot(q, slot), size, a.mr.lkey)])
            s.set_wr_rdma(b.mr.rkey, b.mr.buf + src)
        a.qps[q].post_send(s)

    def _target(self, q: int, slot: int) -> int:
        """The address in B's memory where a Write or Send of QP ``q`` into ``slot`` lands."""
        return self.b.mr.buf + self.b.slot(q, slot)

    # -- completing ---------------------------------------------------------------------
    def reap(self, wait_s: float) -> bool:
        """Wait up to ``wait_s`` for completions and take them; True if any came.

        Raises SoakError for an error completion or a receive of the wrong length.
        """
        waiting_on_a = any(not w.done_a for w in self.inflight.values())
        try:
            (self.a.cq if waiting_on_a else self.b.cq).wait(wait_s)
        except TimeoutError:
            pass
        got = False
        for side, cq in ((self.a, self.a.cq), (self.b, self.b.cq)):
            _, wcs = cq.poll(4 * self.p.qps * self.p.depth)
            for wc in wcs:
                got = True
                self._completed(wc, on_b=side is self.b)
        return got

    def _completed(self, wc: Any, on_b: bool) -> None:
        w = self.inflight.get(wc.wr_id)
        where = "receive on B" if on_b else "on A"
        if w is None:
            raise SoakError(f"a completion {where} for work request {wc.wr_id}, which is not in flight")
        if wc.status != self.E.IBV_WC_SUCCESS:
            raise SoakError(f"{w.op} #{wc.wr_id} ({w.size} B, QP {w.qp}) completed {where} with "
                            f"{_status_name(wc.status)}")
        if on_b:
            if wc.byte_len != w.size:
                raise SoakError(f"send #{wc.wr_id} of {w.size} B arrived as {wc.byte_len} B")
            w.done_b = True
        else:
            w.done_a = True
        if w.done_a and w.done_b:
            self._finish(wc.wr_id, w)

    def _finish(self, wid: int, w: _WR) -> None:
        """Digest what arrived, free the slot, fold finished work requests in posting order."""
        side = self.a if w.op == "read" else self.b
        at = side.slot(w.qp, w.slot)
        arrived = hashlib.blake2b(side.mr.mv[at:at + w.size], digest_size=16).digest()
        del self.inflight[wid]
        self.free[w.qp].append(w.slot)
        self.finished[wid] = (w.op, w.size, w.digest, arrived)
        while self.folded in self.finished:
            op, size, sent, got = self.finished.pop(self.folded)
            t = self.tallies[op]
            t.wrs += 1
            t.bytes += size
            t.sent.update(sent)
            t.arrived.update(got)
            t.differing += sent != got
            self.folded += 1

    def run(self) -> float:
        """Move ``total_bytes``; return the seconds from the first post to the last completion.

        Raises SoakError (see :meth:`reap`), or after ``stall_s`` without a
        completion, or ``timeout_s`` in all.
        """
        p = self.p
        start = last = time.monotonic()
        self.post_all()
        while self.inflight:
            if self.reap(POLL_WAIT_S):
                last = time.monotonic()
                self.post_all()
            now = time.monotonic()
            if now - last > p.stall_s or now - start > p.timeout_s:
                why = f"no completion for {p.stall_s:g} s" if now - last > p.stall_s else f"over {p.timeout_s:g} s"
                ops = sorted(f"{w.op} #{i} {w.size} B QP {w.qp}" for i, w in self.inflight.items())
                raise SoakError(f"{why}; in flight: {', '.join(ops[:8])}{' ...' if len(ops) > 8 else ''}")
        return last - start


#: the daemons' counters a soak reports, summed over both
REPORTED_STATS = ("impair_offered", "impair_lost", "impair_duplicated", "impair_reordered", "impair_corrupted",
                  "link_retransmits", "link_bad_crc", "link_duplicate", "link_rto_count")


def soak_once(p: SoakParams, label: str, impair: str | None, *, placement: local.Placement | None = None) -> SoakResult:
    """One run between two fresh local daemons (with ``--impair impair`` unless None).

    Raises SoakError if the run fails, LocalRunError if a daemon does not
    start, and the verbs errors of a setup that fails.
    """
    from .. import verbs

    args = list(p.daemon_args)
    if impair is not None:
        args += [f"--impair={impair}", f"--seed={p.seed}"]
    with local.LocalDaemons(mtu=p.mtu, daemon_args=args, placement=placement) as daemons:
        assert daemons.server_device is not None and daemons.client_device is not None
        a = _Side(verbs, daemons.server_device, p, f"soak A {p.seed}")
        try:
            b = _Side(verbs, daemons.client_device, p, f"soak B {p.seed}")
            try:
                _connect(verbs, a, b, min(p.depth, MAX_RD_ATOMIC))
                run = _Run(verbs, a, b, p)
                seconds = run.run()
                both = [a.stats(), b.stats()]
            finally:
                b.close()
        finally:
            a.close()
    stats = {k: sum(s.get(k, 0) for s in both) for k in REPORTED_STATS}
    result = SoakResult(label, seconds, run.tallies, stats)
    bad = [f"{op}: {t.differing} of {t.wrs} work requests differ" for op, t in result.tallies.items()
           if t.differing or t.sent.digest() != t.arrived.digest()]
    if bad:
        raise SoakError(f"{label}: what arrived is not what was sent ({'; '.join(bad)})")
    if result.bytes != p.total_bytes:
        raise SoakError(f"{label}: {result.bytes} B moved, not {p.total_bytes}")
    return result


def describe(r: SoakResult) -> str:
    """One line for a run: bytes, work requests per op, time, goodput, the digests' verdict."""
    ops = ", ".join(f"{op} {t.wrs}" for op, t in r.tallies.items())
    line = (f"{r.label:9s} {r.bytes} B in {sum(t.wrs for t in r.tallies.values())} WRs ({ops}), "
            f"{r.seconds:.2f} s, goodput {r.goodput_MBps:.1f} MB/s, digests equal")
    if r.stats.get("impair_offered"):
        s = r.stats
        line += (f"; impaired datagrams: {s['impair_lost']} lost, {s['impair_duplicated']} duplicated, "
                 f"{s['impair_reordered']} reordered, {s['impair_corrupted']} corrupted of {s['impair_offered']}; "
                 f"link: {s['link_retransmits']} retransmits, {s['link_bad_crc']} bad CRC")
    return line


def soak(p: SoakParams, out: Any, *, json_out: bool = False, placement: local.Placement | None = None,
         runs: Sequence[str] = ("clean", "impaired")) -> list[SoakResult]:
    """The clean run and the impaired one, each printed as it ends, then their goodput ratio.

    Raises SoakError on the first failure.
    """
    import json

    results = []
    for label in runs:
        r = soak_once(p, label, p.impair if label == "impaired" else None, placement=placement)
        results.append(r)
        print(json.dumps(r.as_dict()) if json_out else describe(r), file=out, flush=True)
    if len(results) == 2 and results[0].goodput_MBps > 0:
        ratio = results[1].goodput_MBps / results[0].goodput_MBps
        print(json.dumps({"ratio": round(ratio, 4), "impair": p.impair}) if json_out else
              f"goodput impaired / clean: {ratio:.2f} (--impair {p.impair})", file=out, flush=True)
    return results
