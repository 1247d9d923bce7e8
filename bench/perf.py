"""perftest-style benchmarks: parameters, the two roles, and one session.

Theory of operation
-------------------
As with perftest's ``ib_write_lat`` and friends, one program plays either
role: started without a peer it is the *server* and waits on a TCP port;
started with ``--peer`` it is the *client*, connects, and sends the test
parameters.  The client's parameters rule the session (sizes, iterations,
depth, MTU); the server only checks that it was started for the same test.

A :class:`Session` then walks the message sizes in lock-step on both sides,
each step bracketed by :meth:`ControlChannel.exchange` (the barrier):

1. set-up: each side opens its udpverbs resources (QP, MR, CQ) and the two
   exchange QPN, rkey, buffer address and daemon address, as perftest does
   out of band (under ``-R`` the QPs are then connected through the
   daemons' connection managers, the server listening on its own control
   port's number as the service port); with a baseline, each side opens a UDP socket on the address
   the control connection uses and the two exchange ports;
2. for every size: the udpverbs run (:mod:`udpverbs.bench.verbs_perf`; it
   ends with the server checking the client's count of completed operations
   against what arrived; under ``--cpu_util`` the server then sends its
   daemon's load, ``cpu``), then the baseline run
   (:mod:`udpverbs.bench.rawudp`) between the same two processes; under
   ``-b`` the server then sends its own figures (``bw-report``); the client
   computes the statistics, prints the row, and sends it to the server,
   which prints it too (a perftest server also reports);
3. ``bye``.

A side that fails tells the other (``{"op": "error"}``) before raising, so
neither waits for a peer that has given up; every wait has a timeout.
"""

from __future__ import annotations

import dataclasses
import json
import math
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TextIO

from . import rawudp
from .control import ControlChannel, ControlError
from .report import (RESULT_LINE, DaemonLoad, Row, Stats, banner, columns, figure_text, format_row, row_from_json,
                     row_json, stats_from_json, stats_json)
from .stats import BandwidthStats, both_directions, bandwidth_stats, latency_stats

#: Version of the control conversation; both sides must speak the same.
#: 2: a udpverbs run ends with ``done`` both ways, the client's carrying its
#: count of completed operations for the server to check.
PROTOCOL_VERSION = 2
#: The longest a side waits for its peer at a barrier outside a run.
STEP_TIMEOUT_S = 60.0
#: The longest a side waits for its peer to finish one size's run (beyond ``-D``).
RUN_TIMEOUT_S = 900.0

MAX_SIZE = 1 << 30
#: ``-a`` sweeps 2 … 2**23 bytes, as perftest does.
ALL_SIZES = [1 << k for k in range(1, 24)]
#: Without ``-n``, large messages get fewer iterations so that one size
#: moves at most this many bytes (perftest's fixed counts would take minutes
#: per size in Python at 8 MB).
LAT_VOLUME_BYTES = 32 << 20
BW_VOLUME_BYTES = 128 << 20
MIN_DEFAULT_ITERS = 5
#: Bandwidth tests signal one WR in this many (perftest's cq_mod).
CQ_MOD = 16
#: The longest ``--rnr-delay-us`` (1 s): a run must stay far from the stall timeout.
MAX_RNR_DELAY_US = 1_000_000
#: perftest's default inline sizes for latency tests (its DEF_INLINE_WRITE and
#: DEF_INLINE_SEND_RC_UC); bandwidth tests default to none, as there.
DEFAULT_INLINE = {"write_lat": 220, "send_lat": 236}
#: The largest ``-I`` accepted before asking the device (which says what it takes).
MAX_INLINE_ARG = 4096
#: The largest ``-o`` accepted before asking the device (likewise).
MAX_OUTS_ARG = 65536
#: The largest ``-r`` accepted before asking the device (likewise).
MAX_RX_DEPTH_ARG = 1 << 20
#: send_bw: receives the receiving side keeps posted, shared out among its
#: QPs (perftest's 512), and at least twice the TX depth on every QP.
RX_DEPTH = 512


class PerfUsageError(Exception):
    """The parameters are inconsistent or out of range (a caller mistake)."""


@dataclass(frozen=True)
class TestSpec:
    """What one perftest test is: the verb, latency or bandwidth, defaults."""

    name: str
    verb: str  # "write", "read", "send", "atomic"
    is_latency: bool
    title: str

    @property
    def default_size(self) -> int:
        if self.verb == "atomic":
            return 8  # an atomic operand is 64 bits (RFC 7306 §4)
        return 2 if self.is_latency else 65536

    @property
    def default_iters(self) -> int:
        return 1000 if self.is_latency else 5000

    @property
    def default_tx_depth(self) -> int:
        return 1 if self.is_latency else 128


def _spec(verb: str, kind: str, title: str) -> TestSpec:
    return TestSpec(f"{verb}_{kind}", verb, kind == "lat", title)


TESTS: dict[str, TestSpec] = {
    t.name: t
    for t in (
        _spec("write", "lat", "RDMA_Write Latency Test"),
        _spec("read", "lat", "RDMA_Read Latency Test"),
        _spec("send", "lat", "Send Latency Test"),
        _spec("atomic", "lat", "Atomic FETCH_AND_ADD Latency Test"),
        _spec("write", "bw", "RDMA_Write BW Test"),
        _spec("read", "bw", "RDMA_Read BW Test"),
        _spec("send", "bw", "Send BW Test"),
        _spec("atomic", "bw", "Atomic FETCH_AND_ADD BW Test"),
    )
}
BASELINES = ("raw-udp",)
#: perftest's -A choices, in its order
ATOMIC_TYPES = ("CMP_AND_SWAP", "FETCH_AND_ADD")


@dataclass(frozen=True)
class PerfParams:
    """A benchmark's parameters, perftest's flags by their meaning.

    ``size``/``iters``/``tx_depth`` of None mean "the test's default".
    """

    test: str
    size: int | None = None
    all_sizes: bool = False
    iters: int | None = None
    duration_s: float | None = None
    qps: int = 1
    tx_depth: int | None = None
    mtu: int = 1500
    baseline: str | None = None
    baseline_only: bool = False
    #: perftest's -e: sleep on completion events instead of busy-polling the CQ
    use_events: bool = False
    #: largest size of a ``-a`` sweep
    max_size: int = ALL_SIZES[-1]
    #: without ``-n``: the most bytes one size moves (None: the test's default)
    max_volume: int | None = None
    #: send_lat's receiver-not-ready path: the server posts each receive this
    #: many microseconds after its reply (0: receives stay pre-posted)
    rnr_delay_us: int = 0
    #: perftest's -I: messages up to this many bytes are posted with
    #: IBV_SEND_INLINE (None: perftest's default for the test)
    inline_size: int | None = None
    #: perftest's -o: Reads or atomics each QP keeps on the wire (its ORD,
    #: and the server's IRD); None: as many as the device offers
    outs: int | None = None
    #: perftest's -b: both sides stream at once (bandwidth tests); the rows
    #: report the two directions' sum
    bidirectional: bool = False
    #: perftest's --use_srq: the receiving side's QPs take their receives
    #: from one shared receive queue (Send tests)
    use_srq: bool = False
    #: perftest's -r: receives send_bw keeps posted, shared out among the
    #: QPs (None: RX_DEPTH, at least twice the TX depth on every QP)
    rx_depth: int | None = None
    #: perftest's -Q: bandwidth tests signal one WR in this many (None:
    #: CQ_MOD, or the post list's length under -l)
    cq_moderation: int | None = None
    #: perftest's -l: bandwidth tests post their WRs in chains of this many,
    #: one post_send (one doorbell) per chain
    post_list: int = 1
    #: perftest's --cpu_util, for what udpverbs adds: each side's daemon's
    #: CPU and busy time over every run (report.DaemonLoad)
    cpu_util: bool = False
    #: perftest's -A: the atomic tests' operation, one of ATOMIC_TYPES (None:
    #: FETCH_AND_ADD, perftest's default)
    atomic_type: str | None = None
    #: perftest's -R: the QPs are connected through the daemons' connection
    #: managers (udpverbs.verbs.cm, as rdma_cm) instead of by QPN exchange
    rdma_cm: bool = False

    @property
    def spec(self) -> TestSpec:
        return TESTS[self.test]

    def validate(self) -> "PerfParams":
        """Check the parameters together.

        Returns: self.
        Raises: PerfUsageError with a message naming the flag.
        """
        if self.test not in TESTS:
            raise PerfUsageError(f"unknown test {self.test!r}; choose one of {', '.join(TESTS)}")
        spec = self.spec
        self._check_sizes(spec)
        self._check_run_shape(spec)
        self._check_modes(spec)
        self._check_verb_options(spec)
        self._check_posting(spec)
        self._check_extras(spec)
        return self

    def _check_sizes(self, spec: TestSpec) -> None:
        """-s, -a, --max-size and the volume per size.  Raises: PerfUsageError."""
        if self.size is not None and self.all_sizes:
            raise PerfUsageError("-s and -a are exclusive: -a already runs every size 2 … 2^23")
        if not 2 <= self.max_size <= MAX_SIZE:
            raise PerfUsageError(f"--max-size must be between 2 and {MAX_SIZE} bytes")
        if self.max_volume is not None and self.max_volume < 1:
            raise PerfUsageError("the volume per size must be positive")
        if self.size is not None and not 1 <= self.size <= MAX_SIZE:
            raise PerfUsageError(f"-s must be between 1 and {MAX_SIZE} bytes")
        if spec.verb == "atomic" and (self.all_sizes or self.size not in (None, 8)):
            raise PerfUsageError("atomic tests move 8 bytes: -s and -a do not apply")

    def _check_run_shape(self, spec: TestSpec) -> None:
        """-n or -D, -q, -t and -m.  Raises: PerfUsageError."""
        if self.iters is not None and self.duration_s is not None:
            raise PerfUsageError("-n and -D are exclusive: run a number of iterations or a duration")
        if self.iters is not None and self.iters < 1:
            raise PerfUsageError("-n must be at least 1")
        if self.duration_s is not None and not 0 < self.duration_s <= 3600:
            raise PerfUsageError("-D must be more than 0 and at most 3600 seconds")
        if self.qps < 1 or self.qps > 1024:
            raise PerfUsageError("-q must be between 1 and 1024")
        if spec.is_latency and self.qps != 1:
            raise PerfUsageError("latency tests use one QP (as perftest's): -q applies to bandwidth tests")
        if self.tx_depth is not None:
            if not 1 <= self.tx_depth <= 16384:
                raise PerfUsageError("-t must be between 1 and 16384")
            if spec.is_latency and self.tx_depth != 1:
                raise PerfUsageError("latency tests keep one message in flight: -t applies to bandwidth tests")
        if not 576 <= self.mtu <= 65535:
            # 576: the smallest datagram every IPv4 host must accept (RFC 791)
            raise PerfUsageError("-m (the IP path MTU) must be between 576 and 65535 bytes")

    def _check_modes(self, spec: TestSpec) -> None:
        """The baseline, -e and --rnr-delay-us.  Raises: PerfUsageError."""
        if self.baseline is not None and self.baseline not in BASELINES:
            raise PerfUsageError(f"unknown baseline {self.baseline!r}; choose one of {', '.join(BASELINES)}")
        if self.use_events and self.test == "write_lat":
            raise PerfUsageError("write_lat polls the landing buffer, not a CQ: -e does not apply (as in perftest)")
        if self.baseline_only and self.baseline is None:
            raise PerfUsageError("--baseline-only needs --baseline")
        if not 0 <= self.rnr_delay_us <= MAX_RNR_DELAY_US:
            raise PerfUsageError(f"--rnr-delay-us must be between 0 (off) and {MAX_RNR_DELAY_US} microseconds")
        if self.rnr_delay_us and self.test != "send_lat":
            why = f"{self.test} has no receives" if spec.is_latency else "bandwidth tests keep their receives posted"
            raise PerfUsageError(f"--rnr-delay-us drives send_lat's receiver-not-ready path: it does not apply to "
                                 f"{self.test} ({why})")

    def _check_verb_options(self, spec: TestSpec) -> None:
        """The options of some verbs only: -I, -o, --use_srq, -r.  Raises: PerfUsageError."""
        if self.inline_size is not None:
            if not 0 <= self.inline_size <= MAX_INLINE_ARG:
                raise PerfUsageError(f"-I must be between 0 and {MAX_INLINE_ARG} bytes")
            if self.inline_size and spec.verb in ("read", "atomic"):
                # what they send is a request; their data comes back into an SGE
                raise PerfUsageError(f"-I does not apply to {self.test}: a Read or atomic sends no data inline")
        if self.outs is not None:
            if spec.verb not in ("read", "atomic"):
                raise PerfUsageError(f"-o does not apply to {self.test}: it bounds the Reads and atomics in flight")
            if not 1 <= self.outs <= MAX_OUTS_ARG:
                raise PerfUsageError(f"-o must be between 1 and {MAX_OUTS_ARG}")
        if self.use_srq and spec.verb != "send":
            raise PerfUsageError(f"--use_srq does not apply to {self.test}: only Sends consume receives")
        if self.rx_depth is not None:
            if self.test != "send_bw":
                raise PerfUsageError(f"-r does not apply to {self.test}: it sizes send_bw's posted receives")
            if not 1 <= self.rx_depth <= MAX_RX_DEPTH_ARG:
                raise PerfUsageError(f"-r must be between 1 and {MAX_RX_DEPTH_ARG}")

    def _check_posting(self, spec: TestSpec) -> None:
        """-Q and -l, alone and together.  Raises: PerfUsageError."""
        if self.cq_moderation is not None or self.post_list != 1:
            flag = "-Q" if self.cq_moderation is not None else "-l"
            if spec.is_latency:
                raise PerfUsageError(f"{flag} applies to bandwidth tests: a latency test signals every WR")
            if self.cq_moderation is not None and not 1 <= self.cq_moderation <= self.depth():
                raise PerfUsageError(f"-Q must be between 1 and the TX depth ({self.depth()})")
            if not 1 <= self.post_list <= self.depth():
                raise PerfUsageError(f"-l must be between 1 and the TX depth ({self.depth()}): "
                                     "a whole list must fit in flight")  # fmt: skip
            # Lists start at multiples of -l and the last signaled WR completes
            # last, so up to cq_mod - gcd WRs can wait unsignaled: a list more
            # must still fit, or nothing would ever complete them.
            cq, lst = self.cq_mod(), self.post_list
            waiting = cq - math.gcd(cq, lst)
            if waiting + lst > self.depth():
                raise PerfUsageError(f"-Q {cq} and -l {lst}: up to {waiting} WRs could wait unsignaled with no room "
                                     f"for another list; make -t at least {waiting + lst} or -Q a multiple of -l")

    def _check_extras(self, spec: TestSpec) -> None:
        """-R, --cpu_util, -b and -A against the test and the baseline.  Raises: PerfUsageError."""
        if self.rdma_cm and self.baseline_only:
            raise PerfUsageError("-R connects QPs through the connection manager: --baseline-only makes none")
        if self.cpu_util and self.baseline_only:
            raise PerfUsageError("--cpu_util measures the daemons: --baseline-only starts none")
        if self.bidirectional and spec.is_latency:
            raise PerfUsageError(f"-b applies to bandwidth tests: {self.test} is a ping-pong, both ways already")
        if self.atomic_type is not None:
            if spec.verb != "atomic":
                raise PerfUsageError(f"-A does not apply to {self.test}: it chooses the atomic tests' operation")
            if self.atomic_type not in ATOMIC_TYPES:
                choices = ", ".join(ATOMIC_TYPES)
                raise PerfUsageError(f"unknown atomic type {self.atomic_type!r}; choose one of {choices}")

    def atomic(self) -> str:
        """Return the atomic tests' operation (perftest's -A): CMP_AND_SWAP or FETCH_AND_ADD."""
        return self.atomic_type or "FETCH_AND_ADD"

    def inline(self) -> int:
        """Return the largest message posted inline (0: none)."""
        if self.inline_size is not None:
            return self.inline_size
        return DEFAULT_INLINE.get(self.test, 0)

    def title(self) -> str:
        """Return the banner's title line (perftest's under -b; an RNR run says its latencies include the delay)."""
        title = self.spec.title.replace("FETCH_AND_ADD", self.atomic())  # perftest names the operation
        if self.bidirectional:
            title = title.replace(" BW Test", " Bidirectional BW Test")  # perftest's title under -b
        if self.rnr_delay_us:
            title += f" (RNR path: includes the server's {self.rnr_delay_us} usec receive delay)"
        return title

    def sizes(self) -> list[int]:
        """Return the message sizes to run, in order."""
        if self.all_sizes:
            return [1 << k for k in range(1, MAX_SIZE.bit_length()) if 1 << k <= self.max_size]
        return [self.size if self.size is not None else self.spec.default_size]

    def iterations_for(self, size: int) -> int:
        """Return the iteration count for one size (ignored under ``-D``).

        ``-n`` wins; otherwise perftest's default, lowered for large messages
        so that one size moves at most LAT_VOLUME_BYTES / BW_VOLUME_BYTES.
        """
        if self.iters is not None:
            return self.iters
        volume = self.max_volume or (LAT_VOLUME_BYTES if self.spec.is_latency else BW_VOLUME_BYTES)
        return max(MIN_DEFAULT_ITERS, min(self.spec.default_iters, volume // size))

    def depth(self) -> int:
        """Return the number of messages kept in flight per QP."""
        return self.tx_depth if self.tx_depth is not None else self.spec.default_tx_depth

    def rx_total(self) -> int:
        """send_bw: the receives a receiving side keeps posted, all its QPs together (perftest's -r).

        Default: RX_DEPTH, and at least twice the TX depth on every QP, so
        that a window in flight always finds receives.
        """
        if self.rx_depth is not None:
            return self.rx_depth
        return self.qps * max(2 * self.depth(), -(-RX_DEPTH // self.qps))

    def cq_mod(self) -> int:
        """Return how many WRs share one signaled completion (perftest's cq_mod).

        Latency tests signal every WR; bandwidth tests one in ``-Q``, else,
        as perftest, one per post list under ``-l``, else one in CQ_MOD, at
        most the depth.
        """
        if self.spec.is_latency:
            return 1
        if self.cq_moderation is not None:
            return self.cq_moderation
        return self.post_list if self.post_list > 1 else max(1, min(CQ_MOD, self.depth()))

    def to_wire(self) -> dict[str, Any]:
        """Return the parameters as a JSON-able object."""
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, obj: Any) -> "PerfParams":
        """Rebuild and validate parameters sent by a client.

        Raises: PerfUsageError if the object is not a valid parameter set.
        """
        if not isinstance(obj, dict):
            raise PerfUsageError("parameters are not an object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(obj) - names
        if unknown or "test" not in obj:
            raise PerfUsageError(f"bad parameter names: {sorted(unknown) or 'test missing'}")
        try:
            params = cls(**obj)
        except TypeError as e:
            raise PerfUsageError(f"bad parameters: {e}") from e
        for f, kinds in _WIRE_TYPES.items():
            v = getattr(params, f)
            if v is None and f in _OPTIONAL:
                continue
            # bool is an int in Python: only the flags may be booleans
            if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
                raise PerfUsageError(f"parameter {f} has the wrong type")
        return params.validate()


_WIRE_TYPES: dict[str, tuple[type, ...]] = {
    "test": (str,), "size": (int,), "all_sizes": (bool,), "iters": (int,), "duration_s": (int, float),
    "qps": (int,), "tx_depth": (int,), "mtu": (int,), "baseline": (str,), "baseline_only": (bool,),
    "use_events": (bool,), "max_size": (int,), "max_volume": (int,), "rnr_delay_us": (int,),
    "inline_size": (int,), "outs": (int,), "bidirectional": (bool,), "use_srq": (bool,), "rx_depth": (int,),
    "cq_moderation": (int,), "post_list": (int,), "cpu_util": (bool,), "atomic_type": (str,),
    "rdma_cm": (bool,),
}  # fmt: skip
_OPTIONAL = {"size", "iters", "duration_s", "tx_depth", "baseline", "max_volume", "inline_size", "outs", "rx_depth",
             "cq_moderation", "atomic_type"}


@dataclass(frozen=True)
class OutputOptions:
    """How one side prints its rows: its own flags, which do not travel to the peer."""

    #: perftest's --report_gbits: the table's bandwidth in Gb/s (JSON keeps MB/s)
    gbits: bool = False
    #: a latency client's every sample after its row: "sorted" (perftest's
    #: -H), "unsorted" (-U, in the order measured), or None
    samples: str | None = None
    #: perftest's --output: each row is one figure (report.OUTPUT_UNITS) with
    #: no banner or table around it; None: the table
    only: str | None = None


def warmup_iters(iters: int) -> int:
    """Return the round trips run before measuring (caches, page faults, daemons' spin)."""
    return min(100, max(1, iters // 10))


class Session:
    """One benchmark conversation, on either side.

    Takes: the validated parameters, the control channel, the role
    (``is_client``), where to print (``out``, None for nothing), JSON output,
    the daemon to use (``device``, or ``context``, that device already open,
    which the session then closes), a progress callback for the client, and
    the flags local daemons were started with (``daemon_args``) and where a
    local run's processes are (``cpus``), both shown in the banner so a
    saved table says what it measured, and how this side prints (``output``).
    """

    def __init__(
        self,
        params: PerfParams,
        ctrl: ControlChannel,
        *,
        is_client: bool,
        out: TextIO | None = None,
        json_out: bool = False,
        device: str | None = None,
        context: Any = None,
        progress: Callable[[int, int, int], None] | None = None,
        daemon_args: Sequence[str] = (),
        cpus: str | None = None,
        output: OutputOptions = OutputOptions(),
    ) -> None:
        self.params = params
        self.output = output
        self.daemon_args = list(daemon_args)
        self.cpus = cpus
        self.ctrl = ctrl
        self.is_client = is_client
        self.out = out
        self.json_out = json_out
        self.device = device
        self.context = context
        self.progress = progress
        self.rows: list[Row] = []
        self._udp: socket.socket | None = None
        #: -b: the socket of the server-to-client stream (``_udp`` carries the other)
        self._udp_rev: socket.socket | None = None
        self._ours: Any = None

    # -- output -------------------------------------------------------------
    def _print(self, line: str) -> None:
        if self.out is not None:
            print(line, file=self.out, flush=True)

    def _emit(self, row: Row) -> None:
        self.rows.append(row)
        samples = self._samples_us()
        if self.json_out:
            obj = row_json(row)
            if samples is not None:
                obj["samples_us"] = samples
            self._print(json.dumps(obj))
            return
        if self.output.only is not None:
            self._print(figure_text(row, self.output.only, gbits=self.output.gbits))
        else:
            for line in format_row(row, gbits=self.output.gbits):
                self._print(line)
        if samples is not None:
            # perftest's -H/-U list: a header, then "index, value" per sample
            self._print("#, usec")
            for i, us in enumerate(samples, 1):
                self._print(f"{i}, {us:g}")

    def _samples_us(self) -> list[float] | None:
        """-H/-U: this run's latency samples in µs, as the row reports them; None without the flag."""
        order = self.output.samples
        if order is None or self._ours is None or not self.is_client:
            return None
        us = [ns / 1000 for ns in self._ours.samples_ns]
        return sorted(us) if order == "sorted" else us

    @property
    def _table(self) -> bool:
        """True when the rows print as perftest's table (not --json, not --output)."""
        return not self.json_out and self.output.only is None

    def _banner(self) -> None:
        if not self._table:
            return
        p = self.params
        # perftest prints the inline size, or for Reads and atomics (which
        # send nothing inline) how many may be outstanding
        if p.spec.verb not in ("read", "atomic"):
            verb_line = [("Max inline data", f"{p.inline()}[B]")]
        elif self._ours is not None:
            verb_line = [("Outstand reads", str(self._ours.rd_atom))]
        else:
            verb_line = []  # the baseline alone: no QP, no ORD
        settings = [
            ("Number of qps", f"{p.qps}\t\tTransport type : iWARP over UDP (udpverbs)"),
            ("Connection type", f"RC\t\tUsing SRQ      : {'ON' if p.use_srq else 'OFF'}"),
            ("TX depth", str(p.depth())),
            ("Mtu", f"{p.mtu}[B]"),
            ("Link type", "UDP/IPv4"),
            *verb_line,
            *([("RX depth", str(self._ours.rx_total if self._ours else p.rx_total()))] if p.test == "send_bw" else []),
            *([("Post list", str(p.post_list))] if p.post_list > 1 else []),
            ("Data ex. method", "rdma_cm (parameters over the TCP control connection)" if p.rdma_cm
             else "Ethernet (TCP control connection)"),
            ("CQ Moderation", f"{p.cq_mod()}\t\tPolling method : {'events' if p.use_events else 'busy poll'}"),
        ]
        if p.baseline:
            settings.append(("Baseline", f"{p.baseline}{' only' if p.baseline_only else ''}"))
        if self.daemon_args:
            settings.append(("Daemon flags", " ".join(self.daemon_args)))
        if self.cpus:
            settings.append(("CPU placement", self.cpus))
        local = remote = None
        if self._ours is not None:
            local, remote = self._ours.addresses()
        elif self._udp is not None:
            local = "UDP {}:{}".format(*self._udp.getsockname())
            remote = "UDP {}:{}".format(*self._udp.getpeername())
        for line in banner(p.title(), settings, local, remote):
            self._print(line)
        self._print(columns(p.spec.is_latency, p.baseline is not None and not p.baseline_only, gbits=self.output.gbits))

    # -- the conversation -----------------------------------------------------
    def run(self) -> list[Row]:
        """Run every size on this side.

        Returns: the rows (the client computes them; the server receives them).
        Raises: ControlError if the peer fails or goes away; the udpverbs
        side's and the baseline's errors; in every case the peer is told.
        """
        try:
            return self._run()
        except BaseException as e:
            try:
                self.ctrl.send(error_message(e))
            except ControlError:
                pass
            raise
        finally:
            self.close()

    def _run(self) -> list[Row]:
        p = self.params
        if not p.baseline_only:
            from . import verbs_perf  # imported only when udpverbs itself is measured

            self._ours = verbs_perf.open_side(p, self.ctrl, is_client=self.is_client, device=self.device,
                                              context=self.context)
        if p.baseline:
            self._open_udp()
        self._banner()
        sizes = p.sizes()
        for k, size in enumerate(sizes):
            if self.progress is not None:
                self.progress(k, len(sizes), size)
            iters = p.iterations_for(size)
            ours: Stats | None = None
            base: Stats | None = None
            daemons: DaemonLoad | None = None
            if self._ours is not None:
                before, start = self._ours.daemon_times() if p.cpu_util else (0.0, 0.0), time.monotonic()
                ours = self._ours.run(size, iters, p.duration_s)
                if p.cpu_util:
                    after, wall = self._ours.daemon_times(), max(1e-6, time.monotonic() - start)
                    daemons = self._both_daemons([100.0 * (a - b) / wall for a, b in zip(after, before)])
            if self._udp is not None:
                base = self._run_raw(size, iters, run=k + 1)
            if p.bidirectional:
                ours, base = self._both_ways(ours, base)
            if self.is_client:
                atomic = p.atomic() if p.spec.verb == "atomic" and not p.baseline_only else None
                row = Row(p.test, size, ours, base, p.baseline or "raw-udp", p.rnr_delay_us, p.bidirectional, daemons,
                          atomic)
                self.ctrl.send({"op": "row", "row": row_json(row)})
            else:
                msg = self.ctrl.expect("row", STEP_TIMEOUT_S)
                try:
                    row = row_from_json(msg["row"])
                except (KeyError, TypeError, ValueError) as e:
                    raise ControlError(f"malformed row from the client: {e}") from e
            self._emit(row)
        if self.progress is not None:
            self.progress(len(sizes), len(sizes), 0)
        self.ctrl.exchange({"op": "bye"}, STEP_TIMEOUT_S)
        if self._table:
            self._print(RESULT_LINE)
        return self.rows

    def _both_daemons(self, mine: list[float]) -> DaemonLoad | None:
        """--cpu_util: the server tells the client its daemon's CPU and busy shares over the run.

        Takes: this side's daemon's [CPU %, busy %].
        Returns: on the client, both daemons' figures; None on the server.
        Raises: ControlError if the server's figures are malformed.
        """
        if not self.is_client:
            self.ctrl.send({"op": "cpu", "pct": mine})
            return None
        theirs = self.ctrl.expect("cpu", STEP_TIMEOUT_S).get("pct")
        if not (isinstance(theirs, list) and len(theirs) == 2
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < math.inf
                        for x in theirs)):  # fmt: skip
            raise ControlError(f"malformed CPU figures from the server: {theirs!r}")
        return DaemonLoad(cpu_pct=(mine[0], float(theirs[0])), busy_pct=(mine[1], float(theirs[1])))

    def _both_ways(self, ours: Stats | None, base: Stats | None) -> tuple[Stats | None, Stats | None]:
        """-b: the client adds the server's figures (its own stream) to its own, as perftest reports.

        Returns: the server its own figures, the client the sums.
        Raises: ControlError if the server's report is malformed.
        """
        if not self.is_client:
            figures = {key: None if s is None else stats_json(s) for key, s in (("ours", ours), ("baseline", base))}
            self.ctrl.send({"op": "bw-report", **figures})
            return ours, base
        msg = self.ctrl.expect("bw-report", STEP_TIMEOUT_S)
        sums: list[Stats | None] = []
        for key, mine in (("ours", ours), ("baseline", base)):
            theirs = msg.get(key)
            if mine is None or theirs is None:
                if (mine is None) != (theirs is None):
                    raise ControlError(f"the server's report and ours disagree on whether {key} ran")
                sums.append(None)
                continue
            try:
                peer = stats_from_json(theirs)
                if not isinstance(peer, BandwidthStats):
                    raise TypeError("latency figures")
            except (KeyError, TypeError, ValueError) as e:
                raise ControlError(f"malformed bandwidth report from the server: {e!r}") from e
            sums.append(both_directions(mine, peer))  # type: ignore[arg-type]
        return sums[0], sums[1]

    def _open_udp(self) -> None:
        # The data sockets live on the addresses the control connection uses,
        # so the baseline crosses the same path as the daemons' traffic. -b
        # takes a second pair for the stream the other way.
        socks = [rawudp.open_socket(self.ctrl.local_ip()) for _ in range(2 if self.params.bidirectional else 1)]
        try:
            mine = {"op": "udp", "addr": list(socks[0].getsockname())}
            if len(socks) == 2:
                mine["rev_addr"] = list(socks[1].getsockname())
            peer = self.ctrl.exchange(mine, STEP_TIMEOUT_S)
            for sock, key in zip(socks, ("addr", "rev_addr")):
                addr = peer.get(key)
                if not (isinstance(addr, list) and len(addr) == 2 and isinstance(addr[0], str)
                        and isinstance(addr[1], int)):  # fmt: skip
                    raise ControlError(f"malformed UDP address from the peer: {addr!r}")
                sock.connect((addr[0], addr[1]))
        except BaseException:
            for sock in socks:
                sock.close()
            raise
        self._udp = socks[0]
        self._udp_rev = socks[1] if len(socks) == 2 else None

    def _stop_when_done(self) -> bool:
        return self.ctrl.poll_step("done") is not None

    def _request_size(self) -> int | None:
        # A Read is a small request answered by the message: the baseline's
        # request is one byte (its header carries the rest), and the whole
        # round trip is reported, as perftest does for read_lat.
        return 1 if self.params.spec.verb == "read" else None

    def _run_raw(self, size: int, iters: int, run: int) -> Stats | None:
        p = self.params
        sock = self._udp
        assert sock is not None
        self.ctrl.exchange({"op": "raw", "size": size, "run": run}, STEP_TIMEOUT_S)
        if p.bidirectional:
            return self._raw_both_ways(size, iters, run)
        if not self.is_client:
            if p.spec.is_latency:
                rawudp.latency_server(
                    sock, size, p.mtu, stop=self._stop_when_done, run=run, request_size=self._request_size(),
                    pause_s=p.rnr_delay_us / 1e6,
                )
            else:
                rawudp.bandwidth_server(
                    sock, size, p.mtu, stop=self._stop_when_done, run=run, answer=p.spec.verb == "atomic"
                )
            return None
        if p.spec.is_latency:
            samples = rawudp.latency_client(
                sock, size, p.mtu, iters=iters, duration_s=p.duration_s, warmup=warmup_iters(iters), run=run,
                request_size=self._request_size(), rtt_factor=1 if p.spec.verb in ("read", "atomic") else 2,
            )
            self.ctrl.send({"op": "done"})
            return latency_stats(samples)
        start, completions = self._raw_stream(sock, size, iters, run)
        self.ctrl.send({"op": "done"})
        return bandwidth_stats(size, start, completions, p.depth())

    def _raw_stream(self, sock: socket.socket, size: int, iters: int, run: int) -> tuple[int, list[int]]:
        p = self.params
        # An atomic is a small request answered by the word's old value, tx_depth of them in flight.
        answer = p.spec.verb == "atomic"
        return rawudp.bandwidth_client(
            sock, size, p.mtu, iters=iters, duration_s=p.duration_s, run=run, answer=answer,
            window=min(p.depth(), rawudp.default_window(sock, p.mtu)) if answer else None,
        )  # fmt: skip

    def _raw_both_ways(self, size: int, iters: int, run: int) -> Stats:
        """-b's baseline: this side's stream from a second thread while this one receives the peer's.

        Each side's ``done`` says its own stream has ended; receiving stops
        once the peer's has come and the peer's stream has gone quiet.
        Returns: this side's stream's figures.
        Raises: the stream's BaselineError, ControlError.
        """
        p = self.params
        assert self._udp is not None and self._udp_rev is not None
        out, into = (self._udp, self._udp_rev) if self.is_client else (self._udp_rev, self._udp)
        result: dict[str, Any] = {}

        def stream() -> None:
            try:
                result["stream"] = self._raw_stream(out, size, iters, run)
            except BaseException as e:  # re-raised below, in this thread
                result["error"] = e

        sender = threading.Thread(target=stream, name="raw-udp stream", daemon=True)
        sender.start()
        told = False

        def stop() -> bool:
            nonlocal told
            if sender.is_alive():
                return False
            if "error" in result:
                return True
            if not told:
                self.ctrl.send({"op": "done"})
                told = True
            return self._stop_when_done()

        try:
            rawudp.bandwidth_server(into, size, p.mtu, stop=stop, run=run, answer=p.spec.verb == "atomic")
        finally:
            # the stream gives up by itself within rawudp.GIVE_UP_S of silence
            sender.join()
        if "error" in result:
            raise result["error"]
        start, completions = result["stream"]
        return bandwidth_stats(size, start, completions, p.depth())

    def close(self) -> None:
        """Release the udpverbs resources and the data socket (safe twice)."""
        if self._ours is not None:
            self._ours.close()
            self._ours = None
        if self.context is not None:  # given, and unused if the client asked for the baseline only
            self.context.close()
            self.context = None
        for sock in (self._udp, self._udp_rev):
            if sock is not None:
                sock.close()
        self._udp = self._udp_rev = None


def error_message(e: BaseException) -> dict[str, Any]:
    """The control message telling the peer why this side stops: Ctrl-C
    (KeyboardInterrupt) is an interruption, not a failure to name by its type."""
    if isinstance(e, KeyboardInterrupt):
        return {"op": "error", "message": "interrupted", "interrupted": True}
    return {"op": "error", "message": f"{type(e).__name__}: {e}"}


def hello(ctrl: ControlChannel, params: PerfParams) -> None:
    """Client: send the parameters and wait for the server's agreement.

    Raises: ControlError if the server refuses them or does not answer.
    """
    ctrl.send({"op": "params", "version": PROTOCOL_VERSION, "params": params.to_wire()})
    ctrl.expect("params", STEP_TIMEOUT_S)


def welcome(ctrl: ControlChannel, test: str, timeout_s: float = STEP_TIMEOUT_S) -> PerfParams:
    """Server: receive and check the client's parameters, and agree.

    Takes: the test this server was started for.
    Returns: the client's parameters (they rule the session).
    Raises: ControlError after telling the client why its parameters were refused.
    """
    msg = ctrl.expect("params", timeout_s)
    try:
        if msg.get("version") != PROTOCOL_VERSION:
            raise PerfUsageError(f"client speaks control version {msg.get('version')}, we speak {PROTOCOL_VERSION}")
        params = PerfParams.from_wire(msg.get("params"))
        if params.test != test:
            raise PerfUsageError(f"client runs {params.test}, this server was started for {test}")
    except PerfUsageError as e:
        ctrl.send({"op": "error", "message": str(e)})
        raise ControlError(f"refused the client's parameters: {e}") from e
    ctrl.send({"op": "params", "ok": True})
    return params


def tty_progress(stream: TextIO = sys.stderr) -> Callable[[int, int, int], None]:
    """Return a progress callback that redraws one status line on ``stream``."""

    def show(done: int, total: int, size: int) -> None:
        if done >= total:
            stream.write("\r" + " " * 60 + "\r")
        else:
            width = 30
            filled = math.floor(width * done / total)
            stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}  {size} B ")
        stream.flush()

    return show
