"""The udpverbs side of the benchmarks: perftest's tests over udpverbs.verbs.

Theory of operation
-------------------
Each side opens one set of resources on its daemon (Context, PD, one MR,
one CQ, ``-q`` RC QPs), and the two exchange QPNs, rkey, buffer address and
daemon address (GID + UDP port) over the control connection, as perftest
does out of band, then move their QPs to RTS.  Under ``-R`` the connection
managers move them instead (rdma_cm's way, and iWARP's): the server listens,
and the client connects its QP ``k`` with ``k`` as the private data, so the
server accepts it on its own QP ``k``.  The MR has two halves: the
first is the source of what this side sends, the second is where the peer's
RDMA Writes and Sends land, so a side never mistakes its own marker for the
peer's (atomics: the words the peer's atomics advance start the second
half, the old value an atomic fetches lands at the start of the first).

Per message size:

* ``write_lat``: ping-pong of RDMA Writes.  The client writes iteration
  ``i``'s marker (``i % 255 + 1``) as the last byte of its message into the
  server's landing half; the server spins on that byte, then writes the same
  marker back; the client times the round trip and reports half of it.
  Spinning yields the CPU each turn (``os.sched_yield``): on a 2-vCPU host
  the daemons need it.
* ``send_lat``: ping-pong of Sends, as perftest's ``ib_send_lat``.  Each
  side posts the receive (on its landing half) for the peer's next message
  just before sending its own, and the server starts with one posted, so
  no Send ever finds the QP without a receive.  The marker travels
  in the last byte and is checked on both sides; half the round trip is
  reported.  With ``--rnr-delay-us D`` the server posts the receive for the
  next ping only D µs *after* its reply, so the client's next Send meets a
  QP with no receive (RNR NACK), and completes once the receive appears
  (the daemon's active resume); the latency includes the wait.
* ``read_lat`` / ``atomic_lat``: the client issues one RDMA Read of the
  server's buffer, or one Fetch-and-Add of 1 on the 8-byte word at the
  start of the server's landing half, and busy-polls the CQ for its
  completion; the whole round trip is reported, as perftest does for reads
  and atomics.  Each Fetch-and-Add's old value (host byte order, at the
  start of this side's first half) must be the server's starting value
  plus the number of adds before it.  Under ``-A CMP_AND_SWAP`` each
  Compare-and-Swap expects that same value and swaps in one more, so the
  same check holds and every swap must succeed; in atomic_bw each QP swaps
  a word of its own (the responder executes a QP's atomics in the order
  they arrive, so the QP's stream knows the value its word will hold).
* ``write_bw`` / ``read_bw`` / ``send_bw`` / ``atomic_bw``: the client
  keeps ``tx_depth`` WRs in flight on every QP, signals one WR in
  ``cq_mod`` (a signaled completion retires the unsignaled WRs before it on
  that QP, RFC 5040 §5: completions are in order), and notes when each
  message completed.  The server is passive, except in ``send_bw``, where
  it keeps ``-r`` receives posted (perftest's 512 by default, shared out
  among the QPs, at least twice ``tx_depth`` each), re-posting each as it
  completes, as perftest's ``ib_send_bw``.  Under ``--use_srq`` the QPs of
  a receiving side take their receives from one shared receive queue that
  holds all of them.  Reads and atomics share the
  QP's ORD/IRD budget (RFC 7306): at most ``min(tx_depth, -o or max_qp_rd_atom)``
  are on the wire, the daemon holds the rest in the send queue.
* ``-b`` (bidirectional, as perftest's): both sides run the client's loop
  at once, each into the other's landing half, and under send_bw both keep
  receives posted and re-post them from the same CQ.  The server reports
  its own stream's figures and the client adds them to its own.

Every run ends with a check of what reached the server: the client says how
many operations completed, and the server compares it with the receives it
counted (send tests) or with how far its target words advanced (atomics);
a mismatch fails the run on both sides.  Under ``-b`` each side tells the
other its count and checks the stream it received.  Data-path failures
arrive as work completions with a status; the first bad status stops the
run with :class:`VerbsRunError` naming it.
"""

from __future__ import annotations

import collections
import os
import struct
import sys
import time
from typing import Any, Sequence

from .control import ControlError
from .stats import BandwidthStats, LatencyStats, bandwidth_stats, latency_stats

#: What the benchmarks need from udpverbs.verbs.
REQUIRED = ("Context", "PD", "MR", "CQ", "QP", "QPInitAttr", "QPCap", "QPAttr", "SendWR", "RecvWR", "SGE", "AHAttr",
            "GlobalRoute", "SRQ", "SrqInitAttr", "SrqAttr", "CMListener", "connect")
#: A run that makes no progress for this long has failed.
STALL_S = 30.0
#: How often (in spins) a waiting side looks at the clock and the control connection.
CHECK_EVERY = 256
#: Under -e, the longest single sleep on the CQ before the stall check runs.
EVENT_WAIT_S = 0.05
#: send_bw: once the client has said how many Sends completed, the longest the
#: server waits, without a new receive completion, for the ones still missing.
DRAIN_S = 2.0
#: rnr_retry 7: retry for ever on receiver-not-ready (IB's "infinite").
INFINITE_RNR_RETRY = 7
#: -R: the private data of a connection request, the index of the client's QP
_CM_INDEX = struct.Struct("!H")
_U64 = (1 << 64) - 1


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


def daemon_command(ip: str, name: str, socket_path: str, udp_payload: int, extra: Sequence[str] = ()) -> list[str]:
    """Return the command line of a daemon for ``--local``.

    Takes: the IP to bind, the device name, the control socket path, the
    UDP payload per datagram (the MTU less 28 bytes of IP and UDP headers),
    and the user's ``--daemon-arg`` flags (after ours: ``--log-level`` may
    be overridden; ``local.check_daemon_args`` refuses the rest of ours).
    Returns: argv; ``{ready_fd}`` stands for the readiness pipe.
    """
    return [
        sys.executable, "-m", "udpverbs.daemon", "--name", name, "--addr", ip, "--port", "0",
        "--socket", socket_path, "--mtu", str(udp_payload), "--log-level", "ERROR", "--ready-fd", "{ready_fd}",
        *extra,
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


def open_side(params: Any, ctrl: Any, *, is_client: bool, device: str | None, context: Any = None) -> "VerbsSide":
    """Open this side's udpverbs resources and connect them to the peer's.

    Takes: the session parameters, the control channel, the role, the
    device, or ``context``, the device already open (the side then owns it).
    Returns: a connected :class:`VerbsSide`.
    Raises: VerbsUnavailable if the library cannot run ``params.test``;
    VerbsRunError if the daemon refuses; ControlError if the peer fails.
    """
    verbs = load_verbs()
    side = VerbsSide(verbs, params, ctrl, is_client=is_client, device=device, context=context)
    try:
        side.connect()
    except BaseException:
        side.close()
        raise
    return side


def _deadline(duration_s: float | None) -> int | None:
    return None if duration_s is None else time.perf_counter_ns() + int(duration_s * 1e9)


def _finished(i: int, warmup: int, iters: int, deadline: int | None) -> bool:
    """True once iteration ``i`` is past the warm-up and ``iters`` measured ones, or the deadline (ns)."""
    measured = i - warmup
    if measured < 0:
        return False
    return time.perf_counter_ns() >= deadline if deadline is not None else measured >= iters


def _cas_operands(wr: Any, start: int, i: int) -> None:
    """Make ``wr`` the ``i``-th (from 0) Compare-and-Swap on a word that held
    ``start``: it expects ``start + i`` and swaps in one more."""
    wr.compare_add = (start + i) & _U64
    wr.swap = (start + i + 1) & _U64


def _is_uint(v: Any) -> bool:
    """True for a count or a memory word as the peer's JSON must carry it: an int, not a bool, not negative."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _peer_words(msg: dict[str, Any], n: int) -> list[int]:
    """The peer's ``n`` target words before a run (``counters``), checked.

    Raises: ControlError if they are missing or not ``n`` words (:func:`_is_uint`).
    """
    words = msg.get("counters")
    if not isinstance(words, list) or len(words) != n or not all(map(_is_uint, words)):
        raise ControlError(f"the peer sent {words!r} as its {n} atomic target word(s)")
    return words


def _peer_int(msg: dict[str, Any], key: str) -> int:
    v = msg.get(key)
    if not _is_uint(v):
        raise ControlError(f"malformed {msg.get('op')!r} from the peer: {key}={v!r}")
    return v


class VerbsSide:
    """One side's resources and the per-size runs (see the module docstring)."""

    def __init__(self, verbs: Any, params: Any, ctrl: Any, *, is_client: bool, device: str | None,
                 context: Any = None) -> None:
        from udpverbs.verbs import enums as E

        self.v = verbs
        self.E = E
        self.params = params
        self.ctrl = ctrl
        self.is_client = is_client
        self.depth = params.depth()
        spec = params.spec
        # Atomics: each QP's Compare-and-Swaps go to a word of their own (see _targets)
        self.half = max(*params.sizes(), 8 * params.qps if spec.verb == "atomic" else 0)
        self.access = E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE | E.IBV_ACCESS_REMOTE_READ
        if spec.verb == "atomic":
            self.access |= E.IBV_ACCESS_REMOTE_ATOMIC
        self.remote: dict[str, Any] = {}
        self._sends_out = 0  # send WRs posted and not yet completed (latency tests)
        self._recvs: collections.deque[Any] = collections.deque()  # receive completions not yet consumed
        self._done: dict[str, Any] | None = None  # the peer's "done", once it has come
        self._count = 0  # operations this run: completed (client) or received (server)
        self._received = 0  # send_bw: the peer's Sends received this run
        self.cas = spec.verb == "atomic" and params.atomic() == "CMP_AND_SWAP"
        self._starts: list[int] = []  # atomics: the peer's target words before this run (_targets)
        self.srq: Any = None  # --use_srq's shared receive queue
        self.samples_ns: list[int] = []  # the client's last latency run, in the order measured (-H/-U)
        # How often (in turns) a waiting side looks at the clock and the control
        # connection: every turn under -e, where each turn may sleep EVENT_WAIT_S.
        self.check_every = 1 if params.use_events else CHECK_EVERY
        self.ctx = context if context is not None else open_context(verbs, device)
        try:
            dev = self.ctx.query_device()
            self._size_receives(params, dev)
            self.pd = verbs.PD(self.ctx)
            self.mr = verbs.MR(self.pd, 2 * self.half, self.access)
            self._recv_wr = verbs.RecvWR(sg=[verbs.SGE(self.mr.buf + self.half, self.half, self.mr.lkey)])
            cqe = max(16, (2 * self.depth + self.rx_depth) * params.qps)
            self.cq = verbs.CQ(self.ctx, min(cqe, dev.max_cqe))
            lat = spec.is_latency
            self.inline = params.inline()
            if self.inline > dev.max_inline_data:
                self.close()
                raise VerbsRunError(f"-I {self.inline}: the device takes at most {dev.max_inline_data} inline bytes")
            if params.outs is not None and params.outs > dev.max_qp_rd_atom:
                self.close()
                raise VerbsRunError(f"-o {params.outs}: the device takes at most {dev.max_qp_rd_atom} "
                                    "outstanding Reads and atomics per QP")
            cap = verbs.QPCap(max_send_wr=max(16, self.depth), max_recv_wr=max(1, self.rx_depth), max_send_sge=1,
                              max_recv_sge=1, max_inline_data=self.inline)  # fmt: skip
            if params.use_srq:
                self.srq = verbs.SRQ(self.pd, verbs.SrqInitAttr(verbs.SrqAttr(max_wr=self.srq_size, max_sge=1)))
            init = verbs.QPInitAttr(qp_type=E.IBV_QPT_RC, scq=self.cq, rcq=self.cq, srq=self.srq, cap=cap,
                                    sq_sig_all=1 if lat else 0)  # fmt: skip
            # -R: the connection manager keeps the access flags of a QP in INIT
            # (a QP it moves out of RESET gets rdma_cm's, without atomics)
            at_init = verbs.QPAttr(qp_access_flags=self.access) if params.rdma_cm else None
            self.qps = [verbs.QP(self.pd, init, at_init) for _ in range(params.qps)]
            self._qp_index = {qp.qp_num: k for k, qp in enumerate(self.qps)}
            self.gid = self.ctx.query_gid()
            self.udp_port = self.ctx.query_port().lid
            self.rd_atom = min(self.depth, params.outs or dev.max_qp_rd_atom)
        except (verbs.VerbsError, verbs.UserError, TimeoutError) as e:
            self.close()
            raise VerbsRunError(f"setting up udpverbs resources failed: {e}") from e

    def _size_receives(self, params: Any, dev: Any) -> None:
        """Set the receives this side keeps posted: ``rx_depth`` per QP,
        ``srq_size`` under --use_srq, and ``rx_total`` (send_bw's banner).

        send_lat's server starts with one posted and its client posts its
        own as it goes; send_bw's receiving side (both under -b) keeps -r
        posted, shared out among its QPs.  The default follows -t and -q
        and the device's ``max_qp_wr`` bounds it; an -r beyond it is refused.
        Raises: VerbsRunError (after closing) for such an -r.
        """
        spec = params.spec
        total = params.rx_total()
        cap = dev.max_qp_wr  # a QP's receive queue, or an SRQ
        self.rx_total = min(total, cap * (1 if params.use_srq else params.qps))
        if spec.verb != "send" or (self.is_client and not params.bidirectional):
            self.rx_depth = 0
        elif spec.is_latency:
            self.rx_depth = 1
        else:
            self.rx_depth = -(-total // params.qps)
        self.srq_size = total if spec.name == "send_bw" and self.rx_depth else max(1, self.rx_depth)
        where, posted = ("SRQ", self.srq_size) if params.use_srq else ("QP", self.rx_depth)
        if params.rx_depth is not None and posted > cap:
            self.close()
            raise VerbsRunError(f"-r {params.rx_depth}: the device takes at most {cap} receives per {where}")
        self.rx_depth = min(self.rx_depth, cap)
        self.srq_size = min(self.srq_size, cap)

    # -- set-up -------------------------------------------------------------------
    def connect(self) -> None:
        """Exchange QPN/rkey/address/daemon with the peer, move every QP to RTS, post the receives.

        Under -R the QPs reach RTS through the connection managers instead
        (:meth:`_connect_with_cm`); the exchange still carries the rkey and
        address, which rdma_cm leaves to the application.
        Raises: ControlError if the peer fails; VerbsRunError if a transition
        or a connection is refused.
        """
        from .perf import STEP_TIMEOUT_S

        v = self.v
        listener = None
        cm_port = 0  # the service port this side listens on (-R's server)
        if self.params.rdma_cm and not self.is_client:
            cm_port = self.ctrl.local_port()
            # listening before the exchange: the client connects as soon as it has our address
            try:
                listener = v.CMListener(self.ctx, cm_port)
            except (v.VerbsError, v.UserError) as e:
                raise VerbsRunError(f"-R: cannot listen on service port {cm_port}: {e}") from e
        try:
            mine = {
                "op": "verbs",
                "qpns": [qp.qp_num for qp in self.qps],
                "rkey": self.mr.rkey,
                "addr": self.mr.buf,
                "gid": self.gid.gid,
                "port": self.udp_port,
                "rd_atom": self.rd_atom,
                "cm_port": cm_port,
            }
            peer = self.ctrl.exchange(mine, STEP_TIMEOUT_S)
            try:
                qpns = [int(q) for q in peer["qpns"]]
                self.remote = {"rkey": int(peer["rkey"]), "addr": int(peer["addr"]), "gid": str(peer["gid"]),
                               "port": int(peer["port"]), "qpns": qpns, "rd_atom": int(peer["rd_atom"]),
                               "cm_port": int(peer["cm_port"])}  # fmt: skip
            except (KeyError, TypeError, ValueError) as e:
                raise VerbsRunError(f"malformed QP attributes from the peer: {e}") from e
            if len(qpns) != len(self.qps):
                raise VerbsRunError(f"peer has {len(qpns)} QPs, we have {len(self.qps)}")
            try:
                if self.srq is not None and self.rx_depth:
                    self._post_recvs(self.qps[0], self.srq_size)
                if not self.params.rdma_cm:
                    self._connect_by_hand()
                elif listener is not None:
                    self._accept_with_cm(listener, STEP_TIMEOUT_S)
                else:
                    self._connect_with_cm(STEP_TIMEOUT_S)
                if self.srq is None:
                    for qp in self.qps:
                        self._post_recvs(qp, self.rx_depth)
            except (v.VerbsError, v.UserError) as e:
                raise VerbsRunError(f"connecting the QPs failed: {e}") from e
        finally:
            if listener is not None:
                listener.close()
        # Both QPs must be in RTS (and their receives posted) before either
        # side sends (perftest's ctx_hand_shake).
        self.ctrl.exchange({"op": "rts"}, STEP_TIMEOUT_S)

    def _connect_by_hand(self) -> None:
        """Move every QP to RTS towards the peer's QP of the same index (perftest without -R)."""
        v = self.v
        for qp, dest in zip(self.qps, self.remote["qpns"]):
            attr = v.QPAttr(
                qp_access_flags=self.access,
                dest_qp_num=dest,
                ah_attr=v.AHAttr(dlid=self.remote["port"], gr=v.GlobalRoute(dgid=self.remote["gid"])),
                max_rd_atomic=self.rd_atom,
                max_dest_rd_atomic=min(self.rd_atom, self.remote["rd_atom"]) or 1,
                rnr_retry=INFINITE_RNR_RETRY,
            )
            qp.to_rts(attr)

    def _connect_with_cm(self, timeout_s: float) -> None:
        """-R, client: connect QP ``k`` to the server's listener, naming ``k`` in the private data.

        The ORD and IRD asked for are this side's; the connection managers
        settle each at most the other side's IRD (RFC 6581), and rnr_retry
        is rdma_cm's infinite one, as perftest's -R asks for.
        Raises: VerbsRunError if the server's QP is not the one it announced.
        """
        v, r = self.v, self.remote
        host = v.GID(r["gid"]).ip
        for k, qp in enumerate(self.qps):
            conn = v.connect(qp, host, r["cm_port"], udp_port=r["port"], private_data=_CM_INDEX.pack(k),
                             ord=self.rd_atom, ird=self.rd_atom, timeout=timeout_s)
            if conn.remote_qpn != r["qpns"][k]:
                raise VerbsRunError(f"-R: QP {k} was accepted by QPN {conn.remote_qpn:#x}, "
                                    f"the server announced {r['qpns'][k]:#x}")

    def _accept_with_cm(self, listener: Any, timeout_s: float) -> None:
        """-R, server: accept each of the client's QPs on ours of the same index.

        A request is the client's if it names an index we have not connected
        and comes from the QP the client announced for it; any other is
        rejected, and the wait goes on until the deadline.
        Raises: VerbsRunError once ``timeout_s`` has passed without all of them.
        """
        deadline = time.monotonic() + timeout_s
        waiting = dict(enumerate(self.remote["qpns"]))  # our QP index -> the client's QPN
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise VerbsRunError(f"-R: {len(waiting)} of the client's {len(self.qps)} QPs did not connect")
            try:
                req = listener.get_request(timeout=left)
            except self.v.VerbsError as e:
                raise VerbsRunError(f"-R: waiting for the client's connections: {e}") from e
            k = _CM_INDEX.unpack(req.private_data)[0] if len(req.private_data) == _CM_INDEX.size else -1
            if waiting.get(k) != req.remote_qpn:
                listener.reject(req)
                continue
            listener.accept(req, self.qps[k], ord=self.rd_atom, ird=self.rd_atom)
            del waiting[k]

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

    def _work_request(self, size: int, k: int = 0) -> Any:
        """Return a signaled WR of this test's verb for one message of ``size`` bytes on QP ``k``.

        Writes go from this side's first half into the peer's landing half,
        Reads from the peer's first half into this side's, Sends from the
        first half.  An atomic's target is its QP's word in the peer's
        landing half (:meth:`_targets`) and its old value lands at the start
        of our first half, so that under -b it never lands on a word the
        peer advances.  A Fetch-and-Add adds 1; a Compare-and-Swap's
        operands are set for each post (:func:`_cas_operands`).
        """
        v, E, r = self.v, self.E, self.remote
        verb = self.params.spec.verb
        if verb == "atomic":
            opcode = E.IBV_WR_ATOMIC_CMP_AND_SWP if self.cas else E.IBV_WR_ATOMIC_FETCH_AND_ADD
            wr = v.SendWR(opcode=opcode, sg=[v.SGE(self.mr.buf, 8, self.mr.lkey)], send_flags=E.IBV_SEND_SIGNALED)
            wr.set_wr_atomic(r["rkey"], r["addr"] + self.half + 8 * (k if self.cas else 0), compare_add=1, swap=0)
            return wr
        opcode = {"write": E.IBV_WR_RDMA_WRITE, "read": E.IBV_WR_RDMA_READ, "send": E.IBV_WR_SEND}[verb]
        wr = v.SendWR(opcode=opcode, sg=[v.SGE(self.mr.buf, size, self.mr.lkey)],
                      send_flags=E.IBV_SEND_SIGNALED | self._inline_flag(size))
        if verb != "send":
            wr.set_wr_rdma(r["rkey"], r["addr"] + (self.half if verb == "write" else 0))
        return wr

    def _inline_flag(self, size: int) -> int:
        """IBV_SEND_INLINE for a message of ``size`` bytes up to -I (as perftest), else 0."""
        return self.E.IBV_SEND_INLINE if size <= self.inline else 0

    def _post_recvs(self, qp: Any, count: int) -> None:
        """Post ``count`` receives for ``qp`` (to the SRQ under --use_srq), all into the landing half
        (one buffer, as perftest's)."""
        if self.srq is not None:
            qp = self.srq
        if count == 1:
            qp.post_recv(self._recv_wr)
        elif count > 1:
            head = None
            for _ in range(count):
                head = self.v.RecvWR(sg=self._recv_wr.sg, next_wr=head)
            qp.post_recv(head)

    def _word(self, at: int) -> int:
        """The 64-bit word at offset ``at`` of the MR, in host byte order (atomics)."""
        return int.from_bytes(self.mr.mv[at : at + 8], sys.byteorder)

    def daemon_times(self) -> tuple[float, float]:
        """This side's daemon's CPU time and busy time so far, in seconds (its counters).

        Busy time is the wall time of its data loop's passes that found work.
        """
        stats = self.ctx.query_stats()
        cpu_ms = stats.get("process_cpu_user_ms", 0) + stats.get("process_cpu_system_ms", 0)
        return cpu_ms / 1e3, stats.get("data_busy_us", 0) / 1e6

    def _targets(self) -> list[int]:
        """The words the peer's atomics advance, in the landing half: one
        counter that every QP's Fetch-and-Adds add to, or one word per QP
        for Compare-and-Swaps, each swapping in one more than the value it
        expects, which only a QP's own stream (executed in order) can know."""
        return [self._word(self.half + 8 * k) for k in range(len(self.qps) if self.cas else 1)]

    # -- runs -------------------------------------------------------------------------
    def run(self, size: int, iters: int, duration_s: float | None) -> LatencyStats | BandwidthStats | None:
        """Run one size on this side, then check what reached the server.

        Returns: the statistics on the client, None on the server.
        Raises: VerbsRunError on a failed completion, a stall, or a count
        that does not match; ControlError.
        """
        from .perf import RUN_TIMEOUT_S, STEP_TIMEOUT_S, warmup_iters

        spec = self.params.spec
        if spec.name in ("write_lat", "send_lat"):
            # Clear the landing marker before the barrier: after it the peer's
            # first message may land at any moment.
            self.mr.mv[self.half + size - 1] = 0
        both = self.params.bidirectional
        mine: dict[str, Any] = {"op": "verbs-run", "size": size}
        if spec.verb == "atomic" and (both or not self.is_client):
            mine["counters"] = self._targets()
        peer = self.ctrl.exchange(mine, STEP_TIMEOUT_S)
        if spec.verb == "atomic" and (both or self.is_client):
            self._starts = _peer_words(peer, len(self.qps) if self.cas else 1)
        self._done = None
        self._count = self._received = 0
        warmup = warmup_iters(iters)
        result: LatencyStats | BandwidthStats | None = None
        try:
            if spec.name in ("write_lat", "send_lat"):
                result = self._ping_pong(size, iters, duration_s, warmup)
            elif both:
                result = self._bw(size, iters, duration_s)  # -b: each side streams to the other
            elif not self.is_client:
                # The other tests are one-sided but for send_bw's receives:
                # the server's daemon answers, its application only waits.
                if spec.name == "send_bw":
                    self._receive_sends(size)
                    self._count = self._received
            elif spec.is_latency:
                result = self._round_trip_lat(size, iters, duration_s, warmup)
            else:
                result = self._bw(size, iters, duration_s)
        except (self.v.VerbsError, self.v.UserError) as e:
            raise VerbsRunError(f"{spec.name} at {size} B: {e}") from e
        if both:
            self._finish_both_ways(size, mine.get("counters"), RUN_TIMEOUT_S + (duration_s or 0.0))
            return result
        if self.is_client:
            self.ctrl.exchange({"op": "done", "count": self._count}, STEP_TIMEOUT_S)
            return result
        done = self._done or self.ctrl.expect("done", RUN_TIMEOUT_S + (duration_s or 0.0))
        self._verify(size, _peer_int(done, "count"), mine.get("counters"), self._count)
        self.ctrl.send({"op": "done"})
        return None

    def _finish_both_ways(self, size: int, counters: list[int] | None, timeout_s: float) -> None:
        """-b: tell the peer how many operations completed here, and check its count against what came.

        Each side checks the stream it received, as the server alone does
        without -b.  send_bw keeps re-posting receives until the peer's
        Sends are all in: the peer's last ones may still need them.
        """
        self.ctrl.send({"op": "done", "count": self._count})
        if self.params.spec.verb == "send":
            self._receive_sends(size)
            done = self._done
            assert done is not None
        else:
            done = self.ctrl.expect("done", timeout_s)
        self._verify(size, _peer_int(done, "count"), counters, self._received)

    def _verify(self, size: int, count: int, counters: list[int] | None, received: int) -> None:
        """Compare the peer's count of completed operations with what arrived here.

        Takes: the peer's count, this side's target words before the run
        (atomics, else None; :meth:`_targets`), and the Sends this side received.
        A Compare-and-Swap that found another value than it expected still
        completes, but leaves its word behind: the words' advance tells.
        """
        name = self.params.test
        me = "the server" if not self.is_client else "the client"
        peer = "the client" if not self.is_client else "the server"
        if self.params.spec.verb == "send" and received != count:
            raise VerbsRunError(f"{name} at {size} B: {me} received {received} Sends, "
                                f"{peer} completed {count}")  # fmt: skip
        if counters is not None:
            advanced = sum((now - before) & _U64 for now, before in zip(self._targets(), counters))
            if advanced != count:
                what, ops = ("words", "Compare-and-Swaps") if self.cas else ("counter", "Fetch-and-Adds")
                raise VerbsRunError(f"{name}: {me}'s {what} advanced by {advanced}, "
                                    f"{peer} completed {count} {ops}")  # fmt: skip

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

    def _peer_done(self) -> bool:
        """Server: True once the client's ``done`` has arrived (kept in ``self._done``)."""
        if self._done is None:
            self._done = self.ctrl.poll_step("done")
        return self._done is not None

    # -- latency tests: one message in flight ------------------------------------------
    def _post(self, qp: Any, wr: Any, i: int) -> None:
        wr.wr_id = i
        qp.post_send(wr)
        self._sends_out += 1

    def _reap(self) -> int:
        """Poll the CQ once: count send completions off, keep receive ones; return how many came."""
        n, wcs = self.cq.poll(64)
        if n:
            self._check(wcs)
            recv = self.E.IBV_WC_RECV
            for wc in wcs:
                if wc.opcode & recv:
                    self._recvs.append(wc)
                else:
                    self._sends_out -= 1
        return n

    def _retire_sends(self, limit: int) -> None:
        """Reap completions until at most ``limit`` send WRs are outstanding."""
        since = time.monotonic()
        while True:
            n = self._reap()
            if self._sends_out <= limit:
                return
            if n:
                since = time.monotonic()
            else:
                self._stalled(since, f"waiting for {self.params.spec.verb} completions")
                os.sched_yield()

    def _await_recv(self, *, stop_on_done: bool) -> Any:
        """Wait for the next receive completion; None if the client said done (``stop_on_done``)."""
        spins = 0
        since = time.monotonic()
        while not self._recvs:
            if self._reap():
                continue
            spins += 1
            if spins % self.check_every == 0:
                if stop_on_done and self._peer_done():
                    return None
                self._stalled(since, "waiting for the peer's Send")
            self._idle()
        return self._recvs.popleft()

    def _await_message(self, size: int, marker: int, *, stop_on_done: bool) -> bool:
        """Wait for the peer's ping-pong message ending in ``marker``; False if the client said done.

        A Write is seen landing (its last byte); a Send by its receive
        completion, then its length and last byte are checked.
        """
        land_last = self.half + size - 1
        if self.params.spec.verb != "send":
            return self._await_byte(self.mr.mv, land_last, marker, stop_on_done=stop_on_done)
        wc = self._await_recv(stop_on_done=stop_on_done)
        if wc is None:
            return False
        got = self.mr.mv[land_last]
        if wc.byte_len != size or got != marker:
            raise VerbsRunError(f"Send {self._count}: received {wc.byte_len} B ending in {got}, "
                                f"expected {size} B ending in {marker}")  # fmt: skip
        return True

    def _ping_pong(self, size: int, iters: int, duration_s: float | None, warmup: int) -> LatencyStats | None:
        """write_lat / send_lat: one message each way per iteration; the client reports half round trips.

        Send: each side posts the receive for the peer's next message just
        before its own message (the server has one posted from the start),
        except that under --rnr-delay-us the server posts it only that long
        after its reply.
        """
        qp = self.qps[0]
        mv = self.mr.mv
        src_last = size - 1
        wr = self._work_request(size)
        is_send = self.params.spec.verb == "send"
        rnr_s = 0.0 if self.is_client else self.params.rnr_delay_us / 1e6
        clock = time.perf_counter_ns
        limit = qp.cap.max_send_wr - 1
        samples: list[int] = []
        deadline = _deadline(duration_s)
        i = 0
        while True:
            marker = i % 255 + 1
            self._count = i
            if self.is_client:
                if _finished(i, warmup, iters, deadline):
                    break
                t0 = clock()
            elif not self._await_message(size, marker, stop_on_done=True):
                break  # the server answers until the client says it is done
            if is_send and not rnr_s:
                self._post_recvs(qp, 1)
            mv[src_last] = marker
            self._post(qp, wr, i)
            if self.is_client:
                self._await_message(size, marker, stop_on_done=False)
                t1 = clock()
                if i >= warmup:
                    samples.append((t1 - t0) // 2)
            elif rnr_s:
                # The RNR path: the client's next Send may come while no receive is posted.
                time.sleep(rnr_s)
                self._post_recvs(qp, 1)
            self._retire_sends(limit)
            i += 1
        self._retire_sends(0)  # leave no WR behind for the next size
        if not self.is_client:
            return None
        self.samples_ns = samples
        return latency_stats(samples)

    def _await_byte(self, mv: Any, index: int, marker: int, *, stop_on_done: bool) -> bool:
        """Spin (yielding) until ``mv[index] == marker``; False if the client said done."""
        spins = 0
        since = time.monotonic()
        yield_cpu = os.sched_yield
        while mv[index] != marker:
            spins += 1
            if spins % CHECK_EVERY == 0:
                if stop_on_done and self._peer_done():
                    return False
                self._stalled(since, "waiting for the peer's Write")
            yield_cpu()
        return True

    def _round_trip_lat(self, size: int, iters: int, duration_s: float | None, warmup: int) -> LatencyStats:
        """read_lat / atomic_lat: one WR at a time, the whole round trip measured."""
        qp = self.qps[0]
        wr = self._work_request(size)
        is_atomic = self.params.spec.verb == "atomic"
        start = self._starts[0] if is_atomic else 0
        op = "Compare-and-Swap" if self.cas else "Fetch-and-Add"
        what = f"a {op}" if is_atomic else "a Read"
        cas = self.cas
        clock = time.perf_counter_ns
        poll = self.cq.poll
        idle = self._idle
        samples: list[int] = []
        deadline = _deadline(duration_s)
        i = 0
        while not _finished(i, warmup, iters, deadline):
            t0 = clock()
            wr.wr_id = i
            if cas:
                _cas_operands(wr, start, i)
            qp.post_send(wr)
            spins = 0
            since = time.monotonic()
            while True:
                n, wcs = poll(1)
                if n:
                    break
                spins += 1
                if spins % self.check_every == 0:
                    self._stalled(since, f"waiting for {what} completion")
                idle()
            t1 = clock()
            self._check(wcs)
            if is_atomic and self._word(0) != (start + i) & _U64:
                raise VerbsRunError(f"{op} {i} returned {self._word(0)}, expected {(start + i) & _U64} "
                                    "(the server's word before it)")  # fmt: skip
            if i >= warmup:
                samples.append(t1 - t0)  # perftest reports a Read's (an atomic's) whole round trip
            i += 1
        self._count = i
        self.samples_ns = samples
        return latency_stats(samples)

    # -- bandwidth tests: tx_depth in flight ----------------------------------------------
    def _take_receives(self, wcs: list[Any], size: int) -> list[Any]:
        """Count the receive completions among ``wcs`` and re-post their receives; return the others."""
        recv = self.E.IBV_WC_RECV
        others = []
        repost: dict[int, int] = {}
        for wc in wcs:
            if not wc.opcode & recv:
                others.append(wc)
                continue
            if wc.byte_len != size:
                raise VerbsRunError(f"Send {self._received}: received {wc.byte_len} B, expected {size} B")
            k = self._qp_index.get(wc.qp_num, 0)
            repost[k] = repost.get(k, 0) + 1
            self._received += 1
        for k, count in repost.items():
            self._post_recvs(self.qps[k], count)
        return others

    def _receive_sends(self, size: int) -> None:
        """Count the peer's Sends, re-posting each receive, until the peer's count of them has arrived."""
        poll = self.cq.poll
        idle = self._idle
        target: int | None = None
        spins = 0
        since = time.monotonic()
        while target is None or self._received < target:
            n, wcs = poll(64)
            if n:
                self._check(wcs)
                self._take_receives(wcs, size)
                since = time.monotonic()
            spins += 1
            if spins % self.check_every == 0:
                if target is None:
                    if self._peer_done():
                        assert self._done is not None
                        target = _peer_int(self._done, "count")
                        since = time.monotonic()
                    self._stalled(since, f"receiving Sends ({self._received} so far)")
                elif time.monotonic() - since > DRAIN_S:
                    break  # what has not arrived by now never will: _verify says so
            if not n:
                idle()

    def _bw(self, size: int, iters: int, duration_s: float | None) -> BandwidthStats:
        E = self.E
        depth = self.depth
        cq_mod = self.params.cq_mod()
        nq = len(self.qps)
        # Each QP posts chains of plist WRs (next_wr, perftest's -l), one
        # post_send each; without -l a chain is one WR.
        plist = self.params.post_list
        chains = [self._chain(size, plist, k) for k in range(len(self.qps))]
        starts = self._starts if self.cas else None
        # Iterations are shared out among the QPs; under -D every QP stops on
        # a signaled WR (a multiple of cq_mod), so no unsignaled tail is left
        # that no completion would ever retire.
        quota = None if duration_s is not None else [iters // nq + (1 if k < iters % nq else 0) for k in range(nq)]
        posted = [0] * nq
        done = [0] * nq
        finished = [False] * nq
        qpn_index = self._qp_index
        # -b send_bw: the peer's Sends complete receives on the same CQ
        receiving = self.params.bidirectional and self.params.spec.verb == "send"
        clock = time.perf_counter_ns
        poll = self.cq.poll
        idle = self._idle
        signaled = E.IBV_SEND_SIGNALED
        inline = self._inline_flag(size)
        completions: list[int] = []
        start = clock()
        deadline = None if duration_s is None else start + int(duration_s * 1e9)
        since = time.monotonic()
        while True:
            expired = deadline is not None and clock() >= deadline
            for k in range(nq):
                if finished[k]:
                    continue
                qp, chain = self.qps[k], chains[k]
                while True:
                    n = posted[k]
                    if (n >= quota[k]) if quota is not None else (expired and n % cq_mod == 0):
                        finished[k] = True
                        break
                    m = plist if quota is None else min(plist, quota[k] - n)  # the quota's tail: shorter
                    if n - done[k] + m > depth:
                        break
                    for j in range(m):
                        n += 1
                        w = chain[j]
                        w.wr_id = n
                        if starts is not None:
                            _cas_operands(w, starts[k], n - 1)
                        last = quota is not None and n == quota[k]
                        w.send_flags = (signaled if (n % cq_mod == 0 or last) else 0) | inline
                    if m < plist:
                        chain[m - 1].next_wr = None
                    qp.post_send(chain[0])
                    if m < plist:
                        chain[m - 1].next_wr = chain[m]
                    posted[k] = n
            if all(finished) and posted == done:
                break
            n, wcs = poll(64)
            if n:
                now = clock()
                self._check(wcs)
                if receiving:
                    wcs = self._take_receives(wcs, size)
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
        self._count = sum(done)
        return bandwidth_stats(size, start, completions, depth)

    def _chain(self, size: int, length: int, k: int) -> list[Any]:
        """Return ``length`` WRs of this test for QP ``k``, each linked to the next (``next_wr``): one post list."""
        chain = [self._work_request(size, k) for _ in range(length)]
        for a, b in zip(chain, chain[1:]):
            a.next_wr = b
        return chain

    def close(self) -> None:
        """Release every resource (the context closes its children first; safe twice)."""
        ctx = getattr(self, "ctx", None)
        if ctx is not None:
            try:
                ctx.close()
            except Exception:  # the daemon may be gone already; nothing to release then
                pass
            self.ctx = None
