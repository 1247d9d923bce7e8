"""The udpverbs side of the benchmarks: perftest's tests over udpverbs.verbs.

Theory of operation
-------------------
Each side opens one set of resources on its daemon (Context, PD, one MR,
one CQ, ``-q`` RC QPs), and the two exchange QPNs, rkey, buffer address and
daemon address (GID + UDP port) over the control connection, as perftest
does out of band, then move their QPs to RTS.  The MR has two halves: the
first is the source of what this side sends, the second is where the peer's
RDMA Writes land, so a side never mistakes its own marker for the peer's.

Per message size:

* ``write_lat``: ping-pong of RDMA Writes.  The client writes iteration
  ``i``'s marker (``i % 255 + 1``) as the last byte of its message into the
  server's landing half; the server spins on that byte, then writes the same
  marker back; the client times the round trip and reports half of it.
  Spinning yields the CPU each turn (``os.sched_yield``): on a 2-vCPU host
  the daemons need it.
* ``read_lat``: the client issues one RDMA Read of the server's buffer and
  busy-polls the CQ for its completion; the whole round trip is reported,
  as perftest does for reads (there is no "half" of a Read).
* ``write_bw`` / ``read_bw``: the client keeps ``tx_depth`` WRs in flight on
  every QP, signals one WR in ``cq_mod`` (a signaled completion retires the
  unsignaled WRs before it on that QP, RFC 5040 §5: completions are in
  order), and notes when each message completed.  The server is passive.

Data-path failures arrive as work completions with a status; the first bad
status stops the run with :class:`VerbsRunError` naming it.  Send and the
atomics need issue 4: until the library and daemon do them, those tests
stop with :class:`VerbsUnavailable` and a clear message, never with a
made-up number.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .stats import BandwidthStats, LatencyStats, bandwidth_stats, latency_stats

#: What the benchmarks need from udpverbs.verbs.
REQUIRED = ("Context", "PD", "MR", "CQ", "QP", "QPInitAttr", "QPCap", "QPAttr", "SendWR", "SGE", "AHAttr", "GlobalRoute")
#: A run that makes no progress for this long has failed.
STALL_S = 30.0
#: How often (in spins) a waiting side looks at the clock and the control connection.
CHECK_EVERY = 256
#: Under -e, the longest single sleep on the CQ before the stall check runs.
EVENT_WAIT_S = 0.05


class VerbsRunError(Exception):
    """The udpverbs side of a run failed (bad completion, stall, daemon refused)."""


class VerbsUnavailable(VerbsRunError):
    """The verbs library (or the daemon) cannot run this test yet."""


def load_verbs() -> Any:
    """Import udpverbs.verbs and check it has what the benchmarks use.

    Returns: the module.
    Raises: VerbsUnavailable naming what is missing.
    """
    from udpverbs import verbs

    missing = [name for name in REQUIRED if not hasattr(verbs, name)]
    if missing:
        raise VerbsUnavailable(
            "the udpverbs verbs library does not provide "
            + ", ".join(missing)
            + " yet; to measure only the raw-UDP baseline, add --baseline raw-udp --baseline-only"
        )
    return verbs


def daemon_command(ip: str, name: str, socket_path: str, udp_payload: int) -> list[str]:
    """Return the command line of a daemon for ``--local``.

    Takes: the IP to bind, the device name, the control socket path, and the
    UDP payload per datagram (the MTU less 28 bytes of IP and UDP headers).
    Returns: argv; ``{ready_fd}`` stands for the readiness pipe.
    """
    import sys

    return [
        sys.executable, "-m", "udpverbs.daemon", "--name", name, "--addr", ip, "--port", "0",
        "--socket", socket_path, "--mtu", str(udp_payload), "--log-level", "ERROR", "--ready-fd", "{ready_fd}",
    ]  # fmt: skip


def open_context(verbs: Any, device: str | None) -> Any:
    """Open the device: a name (looked up in the runtime directory) or a control socket path.

    Raises: VerbsRunError if no daemon answers.
    """
    try:
        if device is not None and "/" in device:
            return verbs.Context(name=os.path.basename(device).removesuffix(".sock"), socket_path=device)
        return verbs.Context(name=device)
    except (verbs.VerbsError, OSError) as e:
        raise VerbsRunError(f"cannot open udpverbs device {device or '(default)'}: {e}") from e


def open_side(params: Any, ctrl: Any, *, is_client: bool, device: str | None) -> "VerbsSide":
    """Open this side's udpverbs resources and connect them to the peer's.

    Takes: the session parameters, the control channel, the role, the device.
    Returns: a connected :class:`VerbsSide`.
    Raises: VerbsUnavailable if the library cannot run ``params.test``;
    VerbsRunError if the daemon refuses; ControlError if the peer fails.
    """
    verbs = load_verbs()
    if params.spec.verb not in ("write", "read"):
        # Checked on both sides before anything is created, so the peer hears it at the exchange.
        raise VerbsUnavailable(
            f"{params.test} needs {'Send/Receive' if params.spec.verb == 'send' else 'atomic operations'}"
            " (issue 4), which udpverbs does not do yet; write_* and read_* work"
        )
    side = VerbsSide(verbs, params, ctrl, is_client=is_client, device=device)
    try:
        side.connect()
    except BaseException:
        side.close()
        raise
    return side


class VerbsSide:
    """One side's resources and the per-size runs (see the module docstring)."""

    def __init__(self, verbs: Any, params: Any, ctrl: Any, *, is_client: bool, device: str | None) -> None:
        from udpverbs.verbs import enums as E

        self.v = verbs
        self.E = E
        self.params = params
        self.ctrl = ctrl
        self.is_client = is_client
        self.depth = params.depth()
        self.half = max(params.sizes())
        self.ctx = open_context(verbs, device)
        try:
            access = E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_READ
            self.pd = verbs.PD(self.ctx)
            self.mr = verbs.MR(self.pd, 2 * self.half, access)
            self.cq = verbs.CQ(self.ctx, max(16, 2 * self.depth * params.qps))
            lat = params.spec.is_latency
            cap = verbs.QPCap(max_send_wr=max(16, self.depth), max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
            init = verbs.QPInitAttr(qp_type=E.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=1 if lat else 0)
            self.qps = [verbs.QP(self.pd, init) for _ in range(params.qps)]
            self.gid = self.ctx.query_gid()
            self.udp_port = self.ctx.query_port().lid
            self.rd_atom = min(self.depth, self.ctx.query_device().max_qp_rd_atom)
        except (verbs.VerbsError, verbs.UserError, TimeoutError) as e:
            self.close()
            raise VerbsRunError(f"setting up udpverbs resources failed: {e}") from e
        self.remote: dict[str, Any] = {}

    # -- set-up -------------------------------------------------------------------
    def connect(self) -> None:
        """Exchange QPN/rkey/address/daemon with the peer and move every QP to RTS.

        Raises: ControlError if the peer fails; VerbsRunError if a transition is refused.
        """
        mine = {
            "op": "verbs",
            "qpns": [qp.qp_num for qp in self.qps],
            "rkey": self.mr.rkey,
            "addr": self.mr.buf,
            "gid": self.gid.gid,
            "port": self.udp_port,
            "rd_atom": self.rd_atom,
        }
        from .perf import STEP_TIMEOUT_S

        peer = self.ctrl.exchange(mine, STEP_TIMEOUT_S)
        try:
            qpns = [int(q) for q in peer["qpns"]]
            self.remote = {"rkey": int(peer["rkey"]), "addr": int(peer["addr"]), "gid": str(peer["gid"]),
                           "port": int(peer["port"]), "qpns": qpns, "rd_atom": int(peer["rd_atom"])}  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            raise VerbsRunError(f"malformed QP attributes from the peer: {e}") from e
        if len(qpns) != len(self.qps):
            raise VerbsRunError(f"peer has {len(qpns)} QPs, we have {len(self.qps)}")
        E, v = self.E, self.v
        try:
            for qp, dest in zip(self.qps, qpns):
                attr = v.QPAttr(
                    qp_access_flags=E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_READ | E.IBV_ACCESS_LOCAL_WRITE,
                    dest_qp_num=dest,
                    ah_attr=v.AHAttr(dlid=self.remote["port"], gr=v.GlobalRoute(dgid=self.remote["gid"])),
                    max_rd_atomic=self.rd_atom,
                    max_dest_rd_atomic=min(self.rd_atom, self.remote["rd_atom"]) or 1,
                )
                qp.to_rts(attr)
        except (v.VerbsError, v.UserError) as e:
            raise VerbsRunError(f"connecting the QPs failed: {e}") from e
        # Both QPs must be in RTS before either side writes (perftest's ctx_hand_shake).
        self.ctrl.exchange({"op": "rts"}, STEP_TIMEOUT_S)

    def addresses(self) -> tuple[str, str]:
        """Return perftest's "local address" / "remote address" texts."""
        r = self.remote

        def text(qpn: int, rkey: int, addr: int, gid: str, port: int) -> str:
            ip = self.v.GID(gid).ip
            return f"QPN {qpn:#06x} RKey {rkey:#010x} VAddr {addr:#018x} Daemon {ip}:{port}"

        return (
            text(self.qps[0].qp_num, self.mr.rkey, self.mr.buf, self.gid.gid, self.udp_port),
            text(r["qpns"][0], r["rkey"], r["addr"], r["gid"], r["port"]),
        )

    # -- runs -------------------------------------------------------------------------
    def run(self, size: int, iters: int, duration_s: float | None) -> LatencyStats | BandwidthStats | None:
        """Run one size on this side.

        Returns: the statistics on the client, None on the server.
        Raises: VerbsRunError on a failed completion or a stall; ControlError.
        """
        from .perf import RUN_TIMEOUT_S, STEP_TIMEOUT_S, warmup_iters

        spec = self.params.spec
        if spec.name == "write_lat":
            # Clear the landing marker before the barrier: after it the peer's
            # first Write may land at any moment.
            self.mr.mv[self.half + size - 1] = 0
        self.ctrl.exchange({"op": "verbs-run", "size": size}, STEP_TIMEOUT_S)
        result: LatencyStats | BandwidthStats | None
        try:
            if spec.name == "write_lat":
                result = self._write_lat(size, iters, duration_s, warmup_iters(iters))
            elif not self.is_client:
                # read_lat and the bandwidth tests are one-sided: the server's
                # daemon answers, its application only waits.
                self.ctrl.expect("done", RUN_TIMEOUT_S + (duration_s or 0.0))
                return None
            elif spec.name == "read_lat":
                result = self._read_lat(size, iters, duration_s, warmup_iters(iters))
            else:
                result = self._bw(size, iters, duration_s)
        except (self.v.VerbsError, self.v.UserError) as e:
            raise VerbsRunError(f"{spec.name} at {size} B: {e}") from e
        if self.is_client:
            self.ctrl.send({"op": "done"})
        return result

    def _check(self, wcs: list[Any]) -> None:
        for wc in wcs:
            if wc.status != self.E.IBV_WC_SUCCESS:
                name = self.E.WcStatus(wc.status).name
                raise VerbsRunError(f"work request {wc.wr_id} completed with {name}")

    def _stalled(self, since: float, what: str) -> None:
        if time.monotonic() - since > STALL_S:
            raise VerbsRunError(f"no progress for {STALL_S:g} s while {what}")

    def _idle(self) -> None:
        """Wait a little for the next completion: sleep on the CQ's event under -e, else yield."""
        if self.params.use_events:
            try:
                self.cq.wait(EVENT_WAIT_S)
            except TimeoutError:
                pass  # the caller's stall check decides
        else:
            os.sched_yield()

    def _drain(self) -> int:
        n, wcs = self.cq.poll(64)
        if n:
            self._check(wcs)
        return n

    def _write_lat(self, size: int, iters: int, duration_s: float | None, warmup: int) -> LatencyStats | None:
        v, E = self.v, self.E
        qp = self.qps[0]
        mv = self.mr.mv
        src_last = size - 1
        land_last = self.half + size - 1
        wr = v.SendWR(
            wr_id=0, opcode=E.IBV_WR_RDMA_WRITE, sg=[v.SGE(self.mr.buf, size, self.mr.lkey)],
            send_flags=E.IBV_SEND_SIGNALED,
        )  # fmt: skip
        wr.set_wr_rdma(self.remote["rkey"], self.remote["addr"] + self.half)
        clock = time.perf_counter_ns
        yield_cpu = os.sched_yield
        outstanding = 0
        limit = qp.cap.max_send_wr - 1
        samples: list[int] = []
        deadline = None if duration_s is None else clock() + int(duration_s * 1e9)
        i = 0
        while True:
            marker = i % 255 + 1
            if self.is_client:
                measured = i - warmup
                if measured >= 0 and (clock() >= deadline if deadline is not None else measured >= iters):
                    break
                t0 = clock()
            else:
                # The server answers until the client says it is done.
                if not self._await_byte(mv, land_last, marker, stop_on_done=True):
                    break
            mv[src_last] = marker
            wr.wr_id = i
            qp.post_send(wr)
            outstanding += 1
            if self.is_client:
                self._await_byte(mv, land_last, marker, stop_on_done=False)
                t1 = clock()
                if i >= warmup:
                    samples.append((t1 - t0) // 2)
            outstanding -= self._drain()
            since = time.monotonic()
            while outstanding >= limit:
                outstanding -= self._drain()
                self._stalled(since, "waiting for Write completions")
                yield_cpu()
            i += 1
        since = time.monotonic()
        while outstanding > 0:  # leave no WR behind for the next size
            outstanding -= self._drain()
            self._stalled(since, "waiting for the last Write completions")
            yield_cpu()
        if self.is_client:
            return latency_stats(samples)
        return None

    def _await_byte(self, mv: Any, index: int, marker: int, *, stop_on_done: bool) -> bool:
        """Spin (yielding) until ``mv[index] == marker``; False if the client said done."""
        spins = 0
        since = time.monotonic()
        yield_cpu = os.sched_yield
        while mv[index] != marker:
            spins += 1
            if spins % CHECK_EVERY == 0:
                if stop_on_done:
                    msg = self.ctrl.poll(0.0)
                    if msg is not None:
                        if msg.get("op") == "done":
                            return False
                        raise VerbsRunError(f"unexpected {msg.get('op')!r} from the client during write_lat")
                self._stalled(since, "waiting for the peer's Write")
            yield_cpu()
        return True

    def _read_lat(self, size: int, iters: int, duration_s: float | None, warmup: int) -> LatencyStats:
        v, E = self.v, self.E
        qp = self.qps[0]
        wr = v.SendWR(
            wr_id=0, opcode=E.IBV_WR_RDMA_READ, sg=[v.SGE(self.mr.buf, size, self.mr.lkey)],
            send_flags=E.IBV_SEND_SIGNALED,
        )  # fmt: skip
        wr.set_wr_rdma(self.remote["rkey"], self.remote["addr"])
        clock = time.perf_counter_ns
        poll = self.cq.poll
        idle = self._idle
        samples: list[int] = []
        deadline = None if duration_s is None else clock() + int(duration_s * 1e9)
        i = 0
        while True:
            measured = i - warmup
            if measured >= 0 and (clock() >= deadline if deadline is not None else measured >= iters):
                break
            t0 = clock()
            wr.wr_id = i
            qp.post_send(wr)
            spins = 0
            since = time.monotonic()
            while True:
                n, wcs = poll(1)
                if n:
                    break
                spins += 1
                if spins % CHECK_EVERY == 0:
                    self._stalled(since, "waiting for a Read completion")
                idle()
            t1 = clock()
            self._check(wcs)
            if i >= warmup:
                samples.append(t1 - t0)  # perftest reports a Read's whole round trip
            i += 1
        return latency_stats(samples)

    def _bw(self, size: int, iters: int, duration_s: float | None) -> BandwidthStats:
        v, E = self.v, self.E
        is_read = self.params.spec.verb == "read"
        opcode = E.IBV_WR_RDMA_READ if is_read else E.IBV_WR_RDMA_WRITE
        depth = self.depth
        cq_mod = self.params.cq_mod()
        nq = len(self.qps)
        wrs = []
        for qp in self.qps:
            wr = v.SendWR(wr_id=0, opcode=opcode, sg=[v.SGE(self.mr.buf, size, self.mr.lkey)])
            wr.set_wr_rdma(self.remote["rkey"], self.remote["addr"] + (0 if is_read else self.half))
            wrs.append(wr)
        # Iterations are shared out among the QPs; under -D every QP stops on
        # a signaled WR (a multiple of cq_mod), so no unsignaled tail is left
        # that no completion would ever retire.
        quota = None if duration_s is not None else [iters // nq + (1 if k < iters % nq else 0) for k in range(nq)]
        posted = [0] * nq
        done = [0] * nq
        finished = [False] * nq
        qpn_index = {qp.qp_num: k for k, qp in enumerate(self.qps)}
        clock = time.perf_counter_ns
        poll = self.cq.poll
        idle = self._idle
        signaled = E.IBV_SEND_SIGNALED
        completions: list[int] = []
        start = clock()
        deadline = None if duration_s is None else start + int(duration_s * 1e9)
        since = time.monotonic()
        while True:
            expired = deadline is not None and clock() >= deadline
            for k in range(nq):
                if finished[k]:
                    continue
                qp, wr = self.qps[k], wrs[k]
                while posted[k] - done[k] < depth:
                    n = posted[k]
                    if (n >= quota[k]) if quota is not None else (expired and n % cq_mod == 0):
                        finished[k] = True
                        break
                    n += 1
                    wr.wr_id = n
                    last = quota is not None and n == quota[k]
                    wr.send_flags = signaled if (n % cq_mod == 0 or last) else 0
                    qp.post_send(wr)
                    posted[k] = n
            if all(finished) and posted == done:
                break
            n, wcs = poll(64)
            if n:
                now = clock()
                self._check(wcs)
                for wc in wcs:
                    k = qpn_index.get(wc.qp_num, 0)
                    newly = wc.wr_id - done[k]
                    if newly > 0:  # a signaled completion retires the WRs before it
                        done[k] = wc.wr_id
                        completions.extend([now] * newly)
                since = time.monotonic()
            else:
                if time.monotonic() - since > STALL_S:
                    raise VerbsRunError(f"no completion for {STALL_S:g} s ({sum(done)} of {sum(posted)} done)")
                idle()
        return bandwidth_stats(size, start, completions, depth)

    def close(self) -> None:
        """Release every resource (the context closes its children first; safe twice)."""
        ctx = getattr(self, "ctx", None)
        if ctx is not None:
            try:
                ctx.close()
            except Exception:  # the daemon may be gone already; nothing to release then
                pass
            self.ctx = None
