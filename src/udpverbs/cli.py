"""The ``udpverbs`` command: perftest-style benchmarks, a demo and a job launcher.

Theory of operation
-------------------
``udpverbs perf TEST`` is perftest's ``ib_TEST`` with the same flags and
meanings (``-s -a -n -D -q -t -m -I -p --device``) and the same roles: without
a peer it is the server, opens its device (so that a missing daemon fails at
once) and waits for a client; ``--peer HOST[:PORT]`` makes it the client;
``--local`` runs both sides on this host (two daemons on 127.0.0.2 and
127.0.0.3, the server as a child process) so nothing needs setting up.
When one side is interrupted, the other is told so and fails saying so.
``--baseline raw-udp`` measures bare UDP sockets between the same two
processes in the same run and prints it beside every row.
``--rnr-delay-us D`` (send_lat only) exercises the receiver-not-ready path:
the server posts each receive D µs after its reply, so the client's next
Send is NACKed and resumed; the latencies include the wait.

``udpverbs perf all --local`` runs every row of the README's results
tables, each with its baseline, in rounds, and prints them as the README
does (see :mod:`udpverbs.bench.table`).

``udpverbs demo`` is the first command to try after installing: a local
write latency sweep and write bandwidth sweep with the baseline, the tables,
and a plot.

``udpverbs soak --bytes 1G`` moves that many bytes between two local
daemons with a mix of Writes, Reads and Sends, checks every byte, and does
it again under ``--impair`` (see :mod:`udpverbs.bench.soak`).

``udpverbs run -n N -- COMMAND ...`` starts N ranks of COMMAND with local
daemons (or daemons a ``--hosts`` file names), as mpirun does; see
:mod:`udpverbs.launch`.  Its exit status is the job's.

``udpverbs keygen PATH`` writes a new cluster key for ``udpverbsd
--key-file`` (32 random bytes as hex text, mode 0600; never over an
existing file).

Exit status: 0 on success, 2 for a usage error, 1 when the run failed.
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
from typing import Callable, Sequence, TextIO

from udpverbs import launch, tools
from udpverbs.bench import group_perf, local, soak, table
from udpverbs.bench.control import DEFAULT_PORT, ControlError, accept, connect, listen
from udpverbs.bench.perf import TESTS, OutputOptions, PerfParams, PerfUsageError, Session, hello, tty_progress, welcome
from udpverbs.bench.plot import PlotUnavailable, plot_rows, require_matplotlib
from udpverbs.bench.rawudp import BaselineError
from udpverbs.bench.report import OUTPUT_UNITS, Row
from udpverbs.bench.verbs_perf import VerbsRunError, load_verbs, open_context
from udpverbs.daemon.config import version_line

CONNECT_TIMEOUT_S = 10.0
#: The demo moves at most this much per message size, to finish in about a minute.
DEMO_VOLUME_BYTES = 16 << 20
#: Errors that end a run with a message instead of a traceback.
RUN_ERRORS = (ControlError, BaselineError, VerbsRunError, group_perf.GroupRunError, local.LocalRunError, OSError,
              soak.SoakError)


class UsageError(Exception):
    """The command line is wrong (exit status 2)."""


def _size(text: str) -> int:
    # perftest accepts plain numbers; K/M suffixes save typing 8388608.
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower()
    mult = units.get(t[-1:], 1)
    if mult != 1:
        t = t[:-1]
    try:
        return int(t, 0) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}") from None


def parse_peer(text: str, default_port: int) -> tuple[str, int]:
    """Split ``HOST[:PORT]``.

    Returns: (host, port).
    Raises: UsageError on an empty host or a bad port.
    """
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, ""
    if not host:
        raise UsageError(f"--peer {text!r}: no host")
    if not port:
        return host, default_port
    try:
        value = int(port)
    except ValueError:
        raise UsageError(f"--peer {text!r}: port must be a number") from None
    if not 1 <= value <= 65535:
        raise UsageError(f"--peer {text!r}: port must be 1..65535")
    return host, value


def _add_daemon_arg(p: argparse.ArgumentParser, whom: str = "both daemons a local run starts") -> None:
    p.add_argument("--daemon-arg", dest="daemon_args", action="append", default=[], metavar="=FLAG",
                   help=f"pass FLAG to {whom}, e.g. --daemon-arg=--cc=aimd "
                   "(repeatable; write it with '=': its value starts with '--')")


def _add_no_pin(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="leave the CPUs of a local run's processes to the scheduler (by default each daemon has "
                   "a CPU of its own, shared with the other side's application; see docs/REFERENCE.md)")


def placement_from(args: argparse.Namespace) -> local.Placement | None:
    """Where a local run's processes go (``--no-pin``: None).

    Raises: UsageError for ``--no-pin`` without ``--local``.
    """
    if args.command == "perf" and not args.local:
        if not args.pin:
            raise UsageError("--no-pin goes with --local: it places the processes a local run starts")
        return None
    return local.default_placement(args.pin)


def daemon_args_from(args: argparse.Namespace) -> list[str]:
    """The ``--daemon-arg`` flags, checked as the daemons would check them.

    Raises: UsageError if one is bad, or if no local daemon would take it.
    """
    if not args.daemon_args:
        return []
    if args.command == "perf" and not args.local:
        raise UsageError("--daemon-arg goes with --local: a daemon you started keeps the flags you gave it")
    if args.command == "perf" and args.baseline_only:
        raise UsageError("--daemon-arg: --baseline-only starts no daemon")
    if args.command == "soak" and any(a.startswith("--impair") for a in args.daemon_args):
        raise UsageError("--daemon-arg: give the impairment with soak's own --impair")
    if args.command == "run" and args.hosts:
        raise UsageError("--daemon-arg goes without --hosts: a daemon you started keeps the flags you gave it")
    try:
        return local.check_daemon_args(args.daemon_args, "udpverbs run" if args.command == "run" else "--local")
    except ValueError as e:
        raise UsageError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``udpverbs`` command (sub-commands ``perf``, ``demo``, ``run``,
    ``keygen``, ``soak``, and the tools ``devices``, ``devinfo`` and ``stat``)."""
    parser = argparse.ArgumentParser(prog="udpverbs",
                                     description="RDMA verbs over plain UDP: benchmarks, demo, job launcher")
    parser.add_argument("--version", action="version", version=version_line("udpverbs"))
    sub = parser.add_subparsers(dest="command", required=True)
    _add_perf_parser(sub)
    _add_demo_parser(sub)
    _add_run_parser(sub)
    keygen = sub.add_parser("keygen", help="write a new cluster key for udpverbsd --key-file (mode 0600)")
    keygen.add_argument("path", metavar="PATH", help="the key file to create (an existing file is not overwritten)")
    _add_soak_parser(sub)
    tools.add_parsers(sub)
    for sub_parser in sub.choices.values():
        sub_parser.set_defaults(sub_parser=sub_parser)  # whose usage a stray argument gets (parse_command)
    return parser


def parse_command(argv: list[str]) -> argparse.Namespace:
    """Parse the ``udpverbs`` command line (not ``perf lock_lat|barrier_lat|all``, see :func:`main`).

    An argument no parser takes is reported with the usage of the
    sub-command it follows (argparse would print the top-level usage).
    Raises: SystemExit (status 2) for a bad command line, as argparse does.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        message = f"unrecognized arguments: {' '.join(extra)}"
        if extra[0] in argv[:argv.index(args.command)]:
            parser.error(message)  # a stray argument before the sub-command
        args.sub_parser.error(message)
    return args


def _add_perf_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add ``udpverbs perf`` and its flags to ``sub``."""
    perf = sub.add_parser(
        "perf",
        help="perftest-style latency and bandwidth tests",
        description="Without --peer this is the server; with --peer HOST[:PORT] the client; "
        "--local runs both sides on this host. The client's parameters rule the session: "
        "a server needs only the test name (and -d/-p/--bind).",
    )
    _add_perf_workload(perf)
    _add_perf_test_options(perf)
    _add_perf_roles(perf)


def _add_perf_workload(perf: argparse.ArgumentParser) -> None:
    """Add what every test takes: the test, sizes, iterations or duration, QPs, depth, MTU, polling."""
    perf.add_argument("test", choices=[*TESTS, *group_perf.TESTS, "all"],
                      help="the test, as perftest's ib_<test>; lock_lat and barrier_lat measure the process group "
                      "(udpverbs perf lock_lat -h); all runs the README's results tables (udpverbs perf all -h)")
    perf.add_argument("-s", "--size", type=_size, help="message size in bytes (default 2 for latency, 65536 for bandwidth)")
    perf.add_argument("-a", "--all", dest="all_sizes", action="store_true", help="run every size 2 … 2^23")
    perf.add_argument("--max-size", type=_size, default=1 << 23, help="largest size of an -a sweep (default 8M)")
    perf.add_argument("-n", "--iters", type=int, help="iterations per size (default 1000 latency, 5000 bandwidth, fewer for large messages)")
    perf.add_argument("-D", "--duration", dest="duration_s", type=float, help="run each size for this many seconds instead")
    perf.add_argument("-q", "--qps", type=int, default=1, help="number of QPs (bandwidth tests)")
    perf.add_argument("-t", "--tx-depth", dest="tx_depth", type=int, help="messages in flight per QP (bandwidth tests; default 128)")
    perf.add_argument("-m", "--mtu", type=int, default=1500, help="IP path MTU in bytes (default 1500): the baseline's datagrams and the --local daemons' (a daemon you started keeps its own)")
    perf.add_argument("-e", "--events", dest="use_events", action="store_true", help="sleep on CQ events instead of busy-polling")


def _add_perf_test_options(perf: argparse.ArgumentParser) -> None:
    """Add the options that apply to some tests only (perftest's -I -o -A -b -r -Q -l -R and its reports)."""
    perf.add_argument("--rnr-delay-us", type=int, default=0, metavar="D",
                      help="send_lat only: the server posts each receive D usec after its reply, so the next Send "
                      "takes the receiver-not-ready path (RNR NACK, then resume); the latency includes the wait "
                      "(default 0: receives stay pre-posted)")
    perf.add_argument("-I", "--inline-size", dest="inline_size", type=int, metavar="SIZE",
                      help="post messages up to SIZE bytes inline (IBV_SEND_INLINE: the data rides in the work "
                      "request); default as perftest's: 220 for write_lat, 236 for send_lat, 0 otherwise")
    perf.add_argument("-o", "--outs", type=int, metavar="N",
                      help="Reads or atomics in flight per QP (read and atomic tests: the QP's ORD and the "
                      "server's IRD; default: what the device offers, at most the TX depth)")
    perf.add_argument("-A", "--atomic_type", "--atomic-type", dest="atomic_type", metavar="TYPE",
                      help="atomic tests: CMP_AND_SWAP or FETCH_AND_ADD (default; as perftest's -A). Each "
                      "Compare-and-Swap expects the word's last value, so every one must succeed")
    perf.add_argument("-b", "--bidirectional", action="store_true",
                      help="bandwidth tests: both sides stream at once, and each row reports the two directions' "
                      "sum (as perftest's -b; the baseline streams both ways too)")
    perf.add_argument("--report_gbits", "--report-gbits", dest="report_gbits", action="store_true",
                      help="print bandwidth in Gb/s (10^9 bits) instead of MB/s (tables only: --json keeps MB/s)")
    perf.add_argument("--output", metavar="UNITS", choices=sorted(OUTPUT_UNITS),
                      help="print one figure per size and nothing else, as perftest's --output: bandwidth "
                      "(average), message_rate, latency (average) or latency_typical")
    perf.add_argument("--use_srq", "--use-srq", dest="use_srq", action="store_true",
                      help="Send tests: the receiving QPs take their receives from one shared receive queue "
                      "(as perftest's --use_srq)")
    perf.add_argument("-r", "--rx-depth", dest="rx_depth", type=int, metavar="N",
                      help="send_bw: receives kept posted, all QPs together (or the SRQ's size under --use_srq; "
                      "default 512, at least twice the TX depth per QP)")
    perf.add_argument("-Q", "--cq-mod", dest="cq_moderation", type=int, metavar="N",
                      help="bandwidth tests: signal one WR in N (as perftest's -Q; default 16, or the post list)")
    perf.add_argument("-l", "--post_list", "--post-list", dest="post_list", type=int, default=1, metavar="N",
                      help="bandwidth tests: post WRs in chains of N, one post_send each (as perftest's -l)")
    perf.add_argument("-R", "--rdma_cm", "--rdma-cm", dest="rdma_cm", action="store_true",
                      help="connect the QPs through the daemons' connection managers, as rdma_cm does (perftest's "
                      "-R; iWARP's way): the server listens on service port -p")
    perf.add_argument("--cpu_util", "--cpu-util", dest="cpu_util", action="store_true",
                      help="report each daemon's CPU time over every run, as a share of one CPU (perftest's "
                      "--cpu_util reports the host's)")
    samples = perf.add_mutually_exclusive_group()
    samples.add_argument("-H", "--report-histogram", dest="samples", action="store_const", const="sorted",
                         help="latency tests: after each row, print every sample in µs, sorted (as perftest's -H; "
                         "--json adds them as samples_us)")
    samples.add_argument("-U", "--report-unsorted", dest="samples", action="store_const", const="unsorted",
                         help="latency tests: as -H, in the order measured (as perftest's -U)")


def _add_perf_roles(perf: argparse.ArgumentParser) -> None:
    """Add where a run happens and what it prints: device, control connection, role, baseline, output."""
    perf.add_argument("-d", "--device", help="the udpverbs device: a name, or the path of its daemon's control socket")
    perf.add_argument("-p", "--port", type=int, default=DEFAULT_PORT, help=f"TCP port of the control connection (default {DEFAULT_PORT})")
    role = perf.add_mutually_exclusive_group()
    role.add_argument("--peer", help="run as the client of the server at HOST[:PORT]")
    role.add_argument("--local", action="store_true", help="start two local daemons and run both sides here")
    perf.add_argument("--bind", help="local IP address to listen on (server) or connect from (client)")
    perf.add_argument("--baseline", choices=["raw-udp"], help="also measure bare UDP sockets in the same run")
    perf.add_argument("--baseline-only", action="store_true", help="measure only the baseline (needs no daemon)")
    perf.add_argument("--json", action="store_true", help="print one JSON object per row instead of the table")
    perf.add_argument("--plot", metavar="FILE.png", help="write latency/bandwidth against message size (needs matplotlib)")
    perf.add_argument("--progress", action="store_true", help="show progress on stderr even when it is not a terminal")
    perf.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)  # internal: --local's readiness pipe
    # internal: --local starts its server while the daemons start, and
    # connects the client only once they serve
    perf.add_argument("--device-on-request", action="store_true", help=argparse.SUPPRESS)
    _add_daemon_arg(perf)
    _add_no_pin(perf)
    perf.add_argument("--local-paths", type=int, default=1, metavar="N",
                      help="with --local: give each daemon N addresses (127.0.0.x, 127.1.0.x, ...), one link over "
                      "N paths (default 1)")


def _add_demo_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add ``udpverbs demo`` and its flags to ``sub``."""
    demo = sub.add_parser("demo", help="two local daemons, write latency and bandwidth sweeps against raw UDP, a plot")
    demo.add_argument("--plot", metavar="FILE.png", default="udpverbs-demo.png", help="where the plot goes (default %(default)s)")
    demo.add_argument("--max-size", type=_size, default=1 << 20, help="largest message of the sweeps (default 1M)")
    demo.add_argument("-n", "--iters", type=int, help="iterations per size (default: as perf, at most 16 MB per size)")
    demo.add_argument("--json", action="store_true", help="print JSON rows instead of tables")
    _add_daemon_arg(demo)
    _add_no_pin(demo)


def _add_run_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add ``udpverbs run`` and its flags to ``sub``."""
    run = sub.add_parser(
        "run", help="start N ranks of a command with their daemons, as mpirun does",
        usage="udpverbs run -n N [options] -- COMMAND [ARGS...]",
        description="Start daemons uv0..uvM-1 on 127.0.0.2, 127.0.0.3, ... (or use those a --hosts file names) "
        "and N copies (ranks) of COMMAND, each told by UDPVERBS_DEVICE, UDPVERBS_RUNTIME_DIR, UDPVERBS_RANK, "
        "UDPVERBS_SIZE, UDPVERBS_MEMBERS and UDPVERBS_GROUP where it is; each output line is prefixed '[rank] '. "
        "Exit status: the first failing rank's (128+S if killed by signal S), 124 on --timeout, 130 on Ctrl-C, "
        "2 for a usage error.",
    )
    run.add_argument("-n", "--np", dest="ranks", type=int, metavar="N",
                     help="ranks to start (with --hosts: the ranks from --rank-base on; default: all the rest)")
    run.add_argument("--daemons", type=int, metavar="M",
                     help="local daemons to start (default 1); rank r uses daemon r*M//N")
    _add_daemon_arg(run, "every daemon it starts")
    run.add_argument("--hosts", metavar="FILE",
                     help="use the running daemons FILE names, one a line: ADDRESS PORT [slots=K] [device=NAME]")
    run.add_argument("--rank-base", type=int, metavar="B", help="with --hosts: the first rank started here (default 0)")
    run.add_argument("--device", metavar="NAME", help="with --hosts: the device of ranks whose line names none "
                     "(default $UDPVERBS_DEVICE or uv0)")
    run.add_argument("--name", help="the job's group name (default run-PID-TIME; with --hosts and ranks elsewhere, "
                     "required: every launcher gives the same)")
    run.add_argument("--timeout", dest="timeout_s", type=float, metavar="S",
                     help="stop every rank after S seconds and exit 124")
    run.add_argument("--grace", dest="grace_s", type=float, default=local.STOP_GRACE_S, metavar="S",
                     help="seconds a rank has to exit after SIGTERM before SIGKILL (default %(default)g)")
    run.add_argument("-v", "--verbose", action="store_true",
                     help="say on stderr which daemons and ranks started, with their pids")
    run.add_argument("command_argv", metavar="COMMAND", nargs=argparse.REMAINDER,
                     help="the command each rank runs, after '--'")


def _add_soak_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add ``udpverbs soak`` and its flags to ``sub``."""
    s = sub.add_parser(
        "soak", help="move many bytes between two local daemons, clean and impaired, and check every one",
        description="Start two local daemons, move --bytes with a seeded mix of RDMA Writes, Reads and Sends "
        "(sizes log-uniform from --min-size to --max-size), check that every work request completes and that "
        "the digests of what arrived equal those of what was sent, per op type; then again with both daemons "
        "started with --impair SPEC. Prints each run's goodput and their ratio. Exit status: 0 if both runs "
        "passed, 1 on any failure, 2 for a usage error.")
    s.add_argument("--bytes", dest="total_bytes", type=_size, default=256 << 20, metavar="SIZE",
                   help="bytes each run moves (K/M/G suffixes; default 256M)")
    s.add_argument("--impair", default=soak.DEFAULT_IMPAIR, metavar="SPEC",
                   help="the impairment of the second run, as udpverbsd --impair (default %(default)s)")
    s.add_argument("-q", "--qps", type=int, default=4, help="QP pairs (default 4)")
    s.add_argument("-t", "--depth", type=int, default=4, help="work requests in flight per QP (default 4)")
    s.add_argument("--min-size", type=_size, default=1, metavar="SIZE", help="smallest message (default 1)")
    s.add_argument("--max-size", type=_size, default=1 << 20, metavar="SIZE", help="largest message (default 1M)")
    s.add_argument("--ops", default=",".join(soak.OPS), help="the op types to mix (default %(default)s)")
    s.add_argument("--seed", type=int, default=1, help="seed of the workload and of the impairment (default 1)")
    s.add_argument("--stall", dest="stall_s", type=float, default=30.0, metavar="S",
                   help="fail after S seconds without a completion (default 30)")
    s.add_argument("--timeout", dest="timeout_s", type=float, default=1800.0, metavar="S",
                   help="fail a run that takes more than S seconds (default 1800)")
    s.add_argument("-m", "--mtu", type=int, default=1500, help="IP path MTU of the daemons (default 1500)")
    s.add_argument("--json", action="store_true", help="print one JSON object per run, then the ratio")
    _add_daemon_arg(s, "both daemons of each run")
    _add_no_pin(s)


def params_from_args(args: argparse.Namespace) -> PerfParams:
    """Return the validated parameters of ``udpverbs perf``.

    Raises: UsageError with perftest-like wording.
    """
    try:
        return PerfParams(
            test=args.test,
            size=args.size,
            all_sizes=args.all_sizes,
            iters=args.iters,
            duration_s=args.duration_s,
            qps=args.qps,
            tx_depth=args.tx_depth,
            mtu=args.mtu,
            baseline=args.baseline,
            baseline_only=args.baseline_only,
            max_size=args.max_size,
            use_events=args.use_events,
            rnr_delay_us=args.rnr_delay_us,
            inline_size=args.inline_size,
            outs=args.outs,
            bidirectional=args.bidirectional,
            use_srq=args.use_srq,
            rx_depth=args.rx_depth,
            cq_moderation=args.cq_moderation,
            post_list=args.post_list,
            cpu_util=args.cpu_util,
            atomic_type=args.atomic_type,
            rdma_cm=args.rdma_cm,
        ).validate()
    except (PerfUsageError, ValueError) as e:
        raise UsageError(str(e)) from None


def output_from(args: argparse.Namespace, params: PerfParams) -> OutputOptions:
    """How this side prints (``--report_gbits``, ``-H``/``-U``, ``--output``).

    Raises: UsageError for -H/-U on a bandwidth test, or on a server (the
    client measures the samples); for an --output of the other kind of
    test, or beside --json.
    """
    if args.output is not None:
        if args.json:
            raise UsageError("--output and --json are exclusive: each chooses what a row prints")
        if OUTPUT_UNITS[args.output] != params.spec.is_latency:
            kind = "latency" if params.spec.is_latency else "bandwidth"
            raise UsageError(f"--output={args.output} does not apply to {params.test}, a {kind} test")
    if args.samples is not None:
        flag = "-H" if args.samples == "sorted" else "-U"
        if not params.spec.is_latency:
            raise UsageError(f"{flag} applies to latency tests: a bandwidth test keeps no samples")
        if not (args.peer or args.local):
            raise UsageError(f"{flag} prints the client's samples: give it to the client (or with --local)")
    return OutputOptions(gbits=args.report_gbits, samples=args.samples, only=args.output)


def _progress(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    if args.progress or sys.stderr.isatty():
        return tty_progress(sys.stderr)
    return None


def run_server(args: argparse.Namespace, out: TextIO | None = None) -> list[Row]:
    """Serve one client, as a perftest server does, and print its rows.

    Raises: the run errors (ControlError, …).
    """
    out = out or sys.stdout
    context = open_server_device(args)
    try:
        listener = listen(args.bind or "0.0.0.0", args.port)
        try:
            port = listener.getsockname()[1]
            if args.ready_fd is not None:
                os.write(args.ready_fd, f"{port}\n".encode())
                os.close(args.ready_fd)
            if not args.json and args.output is None:
                print(f"{'*' * 36}\n* Waiting for client to connect... *\n{'*' * 36}", file=out, flush=True)
            ctrl = accept(listener, None)
        finally:
            listener.close()
        with ctrl:
            params = welcome(ctrl, args.test)
            session = Session(params, ctrl, is_client=False, out=out, json_out=args.json, device=args.device,
                              context=context, output=OutputOptions(gbits=args.report_gbits, only=args.output))
            context = None  # the session closes it
            return session.run()
    finally:
        if context is not None:
            context.close()


def open_server_device(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """Open the server's device before it waits for a client, as perftest
    does, so that a missing daemon fails now and not once a client came.

    Returns: the open context; None under ``--baseline-only`` (the
    device is then opened only if the client asks for udpverbs after all)
    or for the server of a ``--local`` run, whose daemon is still starting.
    Raises: VerbsRunError naming the device and what to do.
    """
    if args.baseline_only or args.device_on_request:
        return None
    try:
        return open_context(load_verbs(), args.device)
    except VerbsRunError as e:
        raise VerbsRunError(f"{e}; to measure only the raw-UDP baseline, without a daemon, add --baseline raw-udp "
                            "--baseline-only") from None


def run_client(
    params: PerfParams,
    host: str,
    port: int,
    *,
    bind: str | None,
    device: str | None,
    json_out: bool,
    progress,  # type: ignore[no-untyped-def]
    out: TextIO | None = None,
    daemon_args: Sequence[str] = (),
    cpus: str | None = None,
    output: OutputOptions = OutputOptions(),
) -> list[Row]:
    """Connect to a server, run the session, print the rows.

    ``daemon_args``: the flags the local daemons were started with, and
    ``cpus``, where a local run's processes are (both for the banner);
    ``output``: how the rows are printed.
    Returns: the rows.
    Raises: the run errors.
    """
    out = out or sys.stdout
    with connect(host, port, CONNECT_TIMEOUT_S, source_ip=bind) as ctrl:
        hello(ctrl, params)
        session = Session(params, ctrl, is_client=True, out=out, json_out=json_out, device=device, progress=progress,
                          daemon_args=daemon_args, cpus=cpus, output=output)
        return session.run()


def run_local(params: PerfParams, *, json_out: bool, progress, out: TextIO | None = None,  # type: ignore[no-untyped-def]
              daemon_args: Sequence[str] = (), placement: local.Placement | None = None,
              output: OutputOptions = OutputOptions(), paths: int = 1) -> list[Row]:
    """Run both sides on this host: daemons (unless baseline-only), a server child, this client.

    ``daemon_args``: more flags for both daemons (checked by ``daemon_args_from``);
    ``placement``: the CPUs of the four processes (None: the scheduler's
    choice), this one's given back at the end; ``output``: as :func:`run_client`;
    ``paths``: the addresses of each daemon (``local.path_addresses``).
    Returns: the rows.
    Raises: the run errors; every child is stopped by pid first.
    """
    daemons = local.LocalDaemons(mtu=params.mtu, daemon_args=daemon_args, placement=placement, paths=paths)
    server = None
    try:
        # Start the daemons and the server at once: the server opens its
        # daemon only when the client asks, after both are ready.
        if not params.baseline_only:
            daemons.start()
        server = local.spawn_server(params.test, device=daemons.server_device,
                                    cpus=placement.server_app if placement else None)
        daemons.wait_ready()
        port = local.server_port(server)
        with local.pinned(placement.client_app if placement else None):
            rows = run_client(
                params,
                local.SERVER_IP,
                port,
                bind=local.CLIENT_IP,
                device=daemons.client_device,
                json_out=json_out,
                progress=progress,
                out=out,
                daemon_args=daemon_args,
                cpus=placement.describe(daemons=not params.baseline_only) if placement else "not pinned",
                output=output,
            )
        status = local.wait_process(server.proc, local.SERVER_EXIT_S)
        server = None
        if status != 0:
            raise local.LocalRunError(f"the server side exited with status {status}" + (
                f": it had not finished {local.SERVER_EXIT_S:g} s after the client" if status == -signal.SIGTERM else ""))
        return rows
    finally:
        if server is not None:
            # The client failed: often because the server saw the bad data
            # first and tore its QP down.  Let it print why before stopping it.
            local.wait_process(server.proc, local.REPORT_GRACE_S)
            server.stop()
        daemons.close()


def cmd_perf(args: argparse.Namespace) -> int:
    """Run ``udpverbs perf``; returns the exit status."""
    params = params_from_args(args)
    output = output_from(args, params)
    daemon_args = daemon_args_from(args)
    placement = placement_from(args)
    if args.plot:
        require_matplotlib()  # fail before a long sweep, not after it
    if args.local_paths != 1 and not args.local:
        raise UsageError("--local-paths goes with --local: it gives the daemons a local run starts their addresses")
    if args.local:
        try:
            local.path_addresses(0, args.local_paths)
        except ValueError as e:
            raise UsageError(f"--local-paths: {e}") from None
        rows = run_local(params, json_out=args.json, progress=_progress(args), daemon_args=daemon_args,
                         placement=placement, output=output, paths=args.local_paths)
    elif args.peer:
        host, port = parse_peer(args.peer, args.port)
        rows = run_client(
            params, host, port, bind=args.bind, device=args.device, json_out=args.json, progress=_progress(args),
            output=output,
        )
    else:
        rows = run_server(args)
    if args.plot:
        both = " -b (the two directions' sum)" if params.bidirectional else ""
        plot_rows(rows, args.plot, title=f"udpverbs {params.test}{both}")
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def prepare_table_run(argv: Sequence[str]) -> Callable[[], list[Row]]:
    """One run of ``udpverbs perf all``: ``argv``, the words after ``udpverbs perf``, checked now.

    Returns: the run, which returns its rows (the per-test output is dropped: the table prints them).
    Raises: UsageError as ``udpverbs perf`` would.
    """
    args = parse_command(["perf", *argv])
    params, daemon_args, placement = params_from_args(args), daemon_args_from(args), placement_from(args)
    return lambda: run_local(params, json_out=True, progress=None, out=io.StringIO(), daemon_args=daemon_args,
                             placement=placement)


def cmd_demo(args: argparse.Namespace) -> int:
    """Run ``udpverbs demo``; returns the exit status."""
    rows: list[Row] = []
    daemon_args = daemon_args_from(args)
    placement = placement_from(args)
    for test in ("write_lat", "write_bw"):
        try:
            params = PerfParams(
                test=test, all_sizes=True, iters=args.iters, baseline="raw-udp", max_size=args.max_size,
                max_volume=DEMO_VOLUME_BYTES,
            ).validate()
        except PerfUsageError as e:
            raise UsageError(str(e)) from None
        if not args.json:
            print(f"\n== udpverbs perf {test} --local -a --baseline raw-udp", flush=True)
        rows += run_local(params, json_out=args.json, progress=tty_progress(sys.stderr) if sys.stderr.isatty() else None,
                          daemon_args=daemon_args, placement=placement)
    try:
        plot_rows(rows, args.plot, title="udpverbs demo: RDMA Write over udpverbs vs raw UDP")
        print(f"\nplot written to {args.plot}")
    except PlotUnavailable as e:
        print(f"\nno plot: {e}", file=sys.stderr)
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    """Run ``udpverbs keygen PATH``; returns the exit status."""
    from udpverbs.daemon.clusterkey import write_new_key

    try:
        write_new_key(args.path)
    except FileExistsError:
        raise UsageError(f"{args.path} exists; a key in use is never overwritten (remove it first)") from None
    print(f"wrote a new cluster key to {args.path}; copy it to every host of the cluster (mode 0600) and "
          f"start each udpverbsd with --key-file {args.path}", file=sys.stderr)
    return 0


def cmd_soak(args: argparse.Namespace) -> int:
    """Run ``udpverbs soak``; returns the exit status."""
    try:
        params = soak.SoakParams(
            total_bytes=args.total_bytes, impair=args.impair, qps=args.qps, depth=args.depth,
            min_size=args.min_size, max_size=args.max_size, ops=tuple(o.strip() for o in args.ops.split(",")),
            seed=args.seed, stall_s=args.stall_s, timeout_s=args.timeout_s, mtu=args.mtu,
            daemon_args=tuple(daemon_args_from(args)),
        ).validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    soak.soak(params, sys.stdout, json_out=args.json, placement=placement_from(args))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Run ``udpverbs run``; returns the job's exit status."""
    command = args.command_argv[1:] if args.command_argv[:1] == ["--"] else args.command_argv
    opts = launch.RunOptions(
        command=tuple(command), ranks=args.ranks, daemons=args.daemons, daemon_args=tuple(daemon_args_from(args)),
        hosts=args.hosts, rank_base=args.rank_base, device=args.device, name=args.name, timeout_s=args.timeout_s,
        grace_s=args.grace_s, verbose=args.verbose,
    )
    try:
        return launch.run(opts)
    except launch.RunUsageError as e:
        raise UsageError(str(e)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``udpverbs`` console script.

    Takes: the arguments (default: sys.argv[1:]).
    Returns: the exit status.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # lock_lat, barrier_lat and all have flags of their own (bench/group_perf.py, bench/table.py);
    # the test is the first word after perf that is not a flag (a flag's value could be "all")
    test = next((a for a in argv[1:] if not a.startswith("-")), None) if argv[:1] == ["perf"] else None
    group_test = test in group_perf.TESTS
    table_run = test == "all"
    args = None if group_test or table_run else parse_command(argv)
    command = "perf" if args is None else args.command
    try:
        if table_run:
            return table.main(argv[1:], prepare_table_run, RUN_ERRORS)
        if args is None:
            return group_perf.main(argv[1:])
        if command == "perf":
            return cmd_perf(args)
        if command == "run":
            return cmd_run(args)
        if command == "keygen":
            return cmd_keygen(args)
        if command == "soak":
            return cmd_soak(args)
        if command in tools.COMMANDS:
            return tools.main(args)
        return cmd_demo(args)
    except (UsageError, group_perf.GroupUsageError, PlotUnavailable, tools.ToolUsageError, table.TableUsageError) as e:
        print(f"udpverbs {command}: error: {e}", file=sys.stderr)
        return 2
    except (*RUN_ERRORS, table.TableRunError) as e:
        print(f"udpverbs {command}: failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
