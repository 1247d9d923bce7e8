"""The emulated RNIC: its tables, its links to peer daemons, and one pass of the data path.

Theory of operation
-------------------
A :class:`Device` wires the daemon's parts together; each lives in a
module of its own, in one direction of dependency (``tests/test_layering.py``):

==============  =================================================================
``config``      runtime dir, flags and TOML; ``DeviceConfig``, the links' settings
``tables``      PDs, memory regions by STag, the QP state machine
``opcodes``     opcode and access tables as plain ints
``records``     work-request records (``OutWR``, ORRQ and IRRQ entries, ``Gather``)
``cq``          completion queues, completion channels, SRQs
``ports``       what the engine asks of the device (``QPHost``, ``PeerHost``)
``policy``      when a pass sends: as soon as it can, or in pass order
``paths``       several local addresses: parsing, subnets, pairing, the path map
``udp``         the UDP sockets: batching (GSO/GRO), arrival stamps
``impaired``    ``--impair``: the socket's send side through an impairment model
``peer``        one reliable link to a peer daemon, and what QPs send on it
``qp``          queue pairs, by role: ``requester``, ``responder``, ``completer``
``scheduler``   which QPs a pass visits, and in what order
``rxlane``      the compiled receive lane's glue
``receive``     the receive step: datagrams to links, messages to QPs
``loop``        the data loop: passes, spin, sleep, the hand-over
==============  =================================================================

Above the device: ``control`` (the verbs library's sessions), ``cm`` (the
connection manager) and ``__main__`` (``udpverbsd``).
The engine below the device reaches it only through ``ports.QPHost`` and
``ports.PeerHost``, which this class implements.

A pass (:meth:`Device.poll_once`) does, without awaiting:

1. receive: read what waits on the socket and feed it to the links;
   dispatch what they deliver (``receive.Receiver``); with ``--impair``,
   send the datagrams the impairment held that are now due;
2. fire link timers that are due and react to link events (a failed link
   fails its QPs with IBV_WC_RETRY_EXC_ERR); note the RDMA Writes the links
   acknowledged;
3. complete: retire acknowledged WRs, visiting only the QPs an ACK or a
   message concerned; if anything reached an application (placed data, a
   CQE), ``sched_yield``, since on a shared CPU the application waiting
   for it may be next in line, and it often posts its answer at once;
4. pump: let QPs queue segments, bounded by each link's send space
   (``scheduler.QPScheduler``); a message that would leave alone at the
   end of the pass (a ping-pong's) is sent at once (``PeerLink.send_alone``);
5. flush: send what the links release (paced), runs of equal-size datagrams
   in one UDP_SEGMENT ``sendmsg``;
6. if the pass sent, arm the receive lane for the answer.

Between those steps, an application's answer to what this pass delivered
is taken as soon as it is posted (``QPScheduler.answer_early``).  Time comes
only from the device's ``clock`` (trio's, in the daemon); randomness from
one seeded ``random.Random`` (and STags from the system's, unless seeded).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import random
import secrets
import time
from typing import Any, Iterable

import trio

from ..transport.link import Link, LinkFailed, LinkState, LinkUp, PathChanged, PathMtu
from ..transport.cookie import CookieJar
from ..transport.impair import Impairment
from ..transport.sockbuf import datagrams_that_fit
from ..wire import ctl, envelope
from ..wire import link as wire_link
from ..wire import native as wire_native
from ..wire.errors import WireError
from ..wire.shm import EventType
from . import tables
from .clusterkey import Guard
from .config import DeviceConfig, link_config
from .impaired import ImpairedSocket, ImpairedSockets
from .loop import DataLoop, hand_over
from .paths import PathMap, kernel_networks, pair_addresses, subnet_of
from .peer import PeerLink, SendLane
from .policy import EAGER, LoopPolicy
from .receive import Receiver
from .rxlane import WHOLE_MAX, ReceiveLane
from .scheduler import QPScheduler, QPTable
from .udp import UdpPort

log = logging.getLogger("udpverbs.daemon")

MAX_LINKS = 1024
#: the most paths one link may have (each pair of addresses at most one)
MAX_PATHS = 16
def may_share_a_cpu(pids: Iterable[int]) -> bool:
    """Whether any process in ``pids`` may run on a CPU this one may run on
    (by their affinity masks).  A mask that cannot be read (the process is
    gone, or not ours) counts as shared: that is the safe guess, since it only
    costs a ``sched_yield`` that was not needed."""
    try:
        mine = os.sched_getaffinity(0)
        for pid in pids:
            if mine & os.sched_getaffinity(pid):
                return True
    except OSError:
        return True
    return False


class Device:
    """The RNIC: every table, the UDP socket, links, and the data-path pass.

    ``policy``: when a pass sends what is ready (``policy.py``; the default
    sends as soon as it can).
    """

    def __init__(self, config: DeviceConfig, policy: LoopPolicy = EAGER) -> None:
        self.config = config
        self.policy = policy
        self.rng = random.Random(config.seed)
        self.incarnation = self.rng.getrandbits(63) | 1
        self.node_guid = self.rng.getrandbits(64)
        self.gid = ctl.gid_from_ip(config.addr)
        self.link_config = link_config(config)
        self.rwnd_high = self.link_config.rwnd_packets  # the largest receive window a link may have
        # STags must not be guessable: from the system's random
        # source, or, when the daemon is seeded (twin tests), from the seed
        stag_rng = secrets.SystemRandom() if config.seed is None else random.Random(f"stags {config.seed}")
        self.stags = tables.STagTable(rng=stag_rng)
        # the key of the INIT cookies: the system's, or (seeded) the seed's
        self.cookies = CookieJar(stag_rng.getrandbits(256).to_bytes(32, "big"))
        self.pds = tables.Handles(config.max_pd)
        self.mrs = tables.Handles(config.max_mr)
        self.cqs = tables.Handles(config.max_cq)
        self.channels = tables.Handles(config.max_cq)
        self.srqs = tables.Handles(config.max_qp)
        self.qps = QPTable()
        self._next_qpn = 1
        self.links: dict[tuple[str, int], PeerLink] = {}
        self._told_version: set[tuple[str, int]] = set()  # sources warned of another link version
        #: the counters of links that ended, so that the device's ``link_*``
        #: totals never go backwards when a link is replaced
        self.ended_links: collections.Counter[str] = collections.Counter()
        self.sessions: set[Any] = set()
        self.stats: collections.Counter[str] = collections.Counter()
        #: wall time of the data loop's passes that found work (the rest of
        #: its time it spins or sleeps): what a run keeps the daemon busy
        self.busy_s = 0.0
        #: when the device was made: wall clock (for people) and monotonic (for its uptime)
        self.started = (time.time(), time.monotonic())
        #: where the Prometheus endpoint serves, if it does (metrics.py)
        self.metrics_url: str | None = None
        self.now = 0.0
        #: the clock every pass reads (trio's; the loop binds it without
        #: trio.current_time()'s run-context lookup)
        self.clock = trio.current_time
        self.native = wire_native.load() if config.native else None
        self.udp = UdpPort(self.stats)
        #: one port per local address (``config.addrs``), ``udp`` first
        self.ports = [self.udp] + [UdpPort(self.stats) for _ in config.addrs[1:]]
        #: what the handshake tells peers of our addresses (bind; empty with one address)
        self.local_addresses: tuple[tuple[str, int], ...] = ()
        #: each local address's subnet, for pairing (bind)
        self.subnets: list[Any] = []
        #: the paths beyond each link's path 0, by (socket, peer address) (``paths.py``)
        self.paths = PathMap()
        #: links by their own tag (``Link.tag``), for a datagram of a path not yet known
        self.by_tag: dict[int, PeerLink] = {}
        self.tx_lane = SendLane(self.native) if self.native is not None else None
        self.scheduler = QPScheduler(self.qps, self.native, self.stats)
        self.qp_changed = self.scheduler.qp_changed
        self.rnr_waiting = self.scheduler.rnr_waiting
        self.flow_ack_holding = self.scheduler.flow_ack_holding
        self.lane = None if self.native is None else ReceiveLane(
            self.native, self.qps, self.stags, self.stats, self.scheduler, policy.eager_answers)
        self.receiver = Receiver(self.udp, self.links, self.qps, self.scheduler, self.lane, self.stats,
                                 config.rx_dispatch_budget, self._passive_link)
        if len(self.ports) > 1:
            self.receiver.more_ports(self.ports, self.paths, self._new_path)
        self.loop = DataLoop(self, config.spin_s, config.max_sleep_s)
        #: the most whole requests an armed lane call may take (its dispatch budget)
        self.arm_limit = config.rx_dispatch_budget or WHOLE_MAX
        self.eager_runs = policy.eager_runs
        #: large tagged segments leave from the registered region (peer.ZERO_COPY_MIN)
        self.zero_copy = True
        #: the longest hand-over (none where the daemon is not to spin)
        self.hand_over_s = min(policy.hand_over_s, config.spin_s)
        # Yield after a delivery only if an application may be waiting on one
        # of our CPUs (sessions_changed).
        self.yield_on_delivery = True
        # UDPVERBS_CHECK_PASSES=1 (the test suite sets it): check after every
        # pass that no QP it left out had work (QPScheduler.check)
        self.check_passes = os.environ.get("UDPVERBS_CHECK_PASSES", "") not in ("", "0")
        #: the egress impairment (``--impair``), in place once bound; None: none
        self.impair: ImpairedSocket | ImpairedSockets | None = None

    @property
    def cm(self) -> Any:
        """The connection manager (``cm.py``), which routes CM messages; None until one is made."""
        return self.receiver.cm

    @cm.setter
    def cm(self, cm: Any) -> None:
        self.receiver.cm = cm

    @property
    def groups(self) -> Any:
        """The process groups (``groups.py``), which route LOCK/BARRIER/GROUP messages; None until made."""
        return self.receiver.groups

    @groups.setter
    def groups(self, groups: Any) -> None:
        self.receiver.groups = groups

    # -- setup ----------------------------------------------------------------
    def bind(self) -> tuple[str, int]:
        """Bind the UDP sockets, every address on the first one's port.

        Raises: OSError (EADDRINUSE: another daemon has it), its ``filename``
        the ``ADDR:PORT`` that could not be bound.
        """
        addrs = self.config.addrs
        port = self.config.port
        for udp, a in zip(self.ports, addrs):
            try:
                port = udp.bind(a.ip, port, self.config.gso)[1]
            except OSError as e:
                raise OSError(e.errno, e.strerror, f"{a.ip}:{port}") from None
        addr = self.udp.sock.getsockname()  # type: ignore[union-attr]
        self.config.port = port
        if len(addrs) > 1:
            self.local_addresses = tuple((a.ip, port) for a in addrs)
            networks = kernel_networks()
            self.subnets = [subnet_of(a, networks) for a in addrs]
            log.info("paths: local addresses %s (subnets %s)", " ".join(f"{ip}:{p}" for ip, p in self.local_addresses),
                     " ".join(str(n) for n in self.subnets))
        # Flow control must keep what a peer may have in flight inside our
        # socket buffer, or a blasting sender loses datagrams to overflow:
        # datagrams of --mtu, until a link's path MTU search finds what
        # its path carries (_path_mtu).
        self.link_config.rwnd_packets = datagrams_that_fit(self.udp.receive_buffer_bytes(), self.config.mtu,
                                                           high=self.rwnd_high)
        if self.config.key is not None:
            for udp, a in zip(self.ports, addrs):
                # each address's own pair keys: a datagram checks only on the path it was sent on
                udp.seal_with(Guard(self.config.key, (a.ip, port), self.stats))
            if self.lane is not None:
                self.lane.may_arm = False
            log.info("cluster key set: every datagram authenticated; the compiled armed read is off "
                     "(it would place a datagram before its tag is checked)")
        if self.config.impair is not None:
            self._impair()
        for udp in self.ports:
            self.loop.add_socket(udp.sock.fileno())  # type: ignore[union-attr]
        fd = self.udp.sock.fileno()  # type: ignore[union-attr]
        if self.lane is not None:
            self.lane.recv.fd = fd
        return addr

    def _impair(self) -> None:
        """Put the impairment between the device and its socket, and say so loudly."""
        spec = self.config.impair
        seed = self.config.seed if self.config.seed is not None else secrets.randbits(32)
        # the name too: two daemons given one --seed impair differently
        only = self.config.impair_addr
        impaired = []
        for udp, a in zip(self.ports, self.config.addrs):
            if only is not None and a.ip != only:
                continue
            # the name (and the address) too: two daemons given one --seed impair differently
            tail = "" if a.ip == self.config.addr else f" {a.ip}"
            model = Impairment(spec, random.Random(f"impair {seed} {self.config.name}{tail}"))
            impaired.append(ImpairedSocket(udp.sock, model, lambda: self.clock(), self.stats, udp.gso))
            # in the socket's place: the last step before the wire, after
            # everything the device puts into a datagram
            udp.sock = impaired[-1]  # type: ignore[assignment]
        self.impair = impaired[0] if len(impaired) == 1 else ImpairedSockets(impaired)
        log.warning("IMPAIRED: every datagram this daemon sends%s goes through %s (seed %d%s), each of a "
                    "UDP_SEGMENT run too; counters impair_*. A test setting, not for production.",
                    "" if only is None else f" from {only}", spec.describe(), seed,
                    "" if self.config.seed is not None else ", drawn: give --seed to repeat it")

    def sessions_changed(self) -> None:
        """Recheck, as a session opens or closes, whether the yield after a
        delivery can help: only if some client application may run on a CPU
        of ours.  Pinned apart (``taskset``, or ``udpverbs perf --local``,
        which puts each daemon on a CPU where only the other side's
        application runs) the yield only hands the CPU to a process that is
        not waiting for this delivery, and costs a bandwidth test; unpinned
        it helps a ping-pong.  An application that moves to other CPUs later
        is seen at the next session change."""
        self.yield_on_delivery = may_share_a_cpu(s.pid for s in self.sessions)

    def close(self, report: bool = True) -> None:
        """Tear everything down (links ABORT, sessions closed); ``report``:
        log the counters and each link's state first."""
        if report:
            log.info("stats: %s", self.dump_stats())
        for pl in list(self.links.values()):
            if report:
                log.info("link %s:%d cwnd %.0f srtt %s", pl.addr[0], pl.addr[1], pl.link.cwnd_bytes, pl.link.srtt_s)
            try:
                pl.link.close(self.now)
                pl.flush()
            except Exception:  # closing must not fail on a broken link
                pass
        self.announce_fatal()
        for sess in list(self.sessions):
            sess.teardown()
        if self.impair is not None:
            # what is held (the ABORTs among it) leaves now rather than never
            self.impair.release(float("inf"))
        for udp in self.ports:
            udp.close()
        self.loop.close()

    def announce_fatal(self) -> None:
        """Tell every application the device is going away (IBV_EVENT_DEVICE_FATAL)."""
        for sess in list(self.sessions):
            if not sess.closed and not sess.fatal_sent:
                sess.fatal_sent = True
                sess.device_fatal()
                sess.async_event(EventType.IBV_EVENT_DEVICE_FATAL, 0)

    # -- QPs and links ----------------------------------------------------------
    def alloc_qpn(self) -> int:
        """A free QPN (1 .. 2**24-1; 0 is the connection manager)."""
        if len(self.qps) >= self.config.max_qp:
            raise tables.TableError(errno.ENOMEM, "QP table full")
        while True:
            qpn = self._next_qpn
            self._next_qpn = qpn % envelope.MAX_QPN + 1
            if qpn not in self.qps:
                return qpn

    def _new_link(self, addr: tuple[str, int]) -> PeerLink:
        link = Link(self.link_config, rng=self.rng, incarnation=self.incarnation, framer=self.native)
        if self.local_addresses:
            link.local_addresses = self.local_addresses
        pl = PeerLink(self, addr, link)
        self.links[addr] = pl
        self.by_tag[link.tag] = pl
        return pl

    def get_link(self, addr: tuple[str, int]) -> PeerLink:
        """The link to ``addr``, opened (active) if there is none."""
        pl = self.links.get(addr)
        if pl is None:
            if len(self.links) >= MAX_LINKS:
                raise tables.TableError(errno.ENOMEM, "too many peer links")
            pl = self._new_link(addr)
            self.now = self.clock()
            pl.link.connect(self.now)
            self.loop.wake()
        return pl

    def attach_link(self, qp: Any, addr: tuple[str, int]) -> None:
        """Bind ``qp`` to the link to ``addr`` (at INIT -> RTR)."""
        pl = self.get_link(addr)
        qp.link = pl
        pl.qps.add(qp)

    def detach_link(self, qp: Any) -> None:
        """``qp`` leaves its link (RESET)."""
        if qp.link is not None:
            qp.link.qps.discard(qp)
            qp.link = None

    def _passive_link(self, addr: tuple[str, int], data: bytes) -> PeerLink | None:
        """A link for a datagram from an unknown ``addr``, if it is an INIT
        that echoes our cookie (``transport/cookie.py``); an INIT without one
        is answered with a COOKIE (rate-limited per source IP) and nothing
        kept: garbage, or INITs, from anywhere must not cost state."""
        try:
            h, body = wire_link.decode_untrusted(data)
            init = wire_link.decode_init_untrusted(body) if h.ptype == wire_link.PacketType.INIT else None
        except WireError as e:
            self.stats["rx_garbage"] += 1
            if e.reason == "bad_version":
                self._other_version(addr, str(e))
            return None
        if init is None or h.conn_tag != 0 or init.tag == 0:
            self.stats["rx_unknown_peer"] += 1
            return None
        now = self.clock()
        if not self.cookies.valid(addr, init, now):
            if not self.cookies.may_answer(addr[0], now):
                self.stats["init_cookie_limited"] += 1
                return None
            self.stats["init_cookie_sent"] += 1
            self.udp.sendto(wire_link.encode_fields(
                wire_link.PacketType.COOKIE, 0, h.path_id, init.tag, 0, 0, int(now * 1e6) & 0xFFFFFFFF, h.ts_us,
                0, self.cookies.make(addr, init, now)), addr)
            return None
        if len(self.links) >= MAX_LINKS:
            self.stats["rx_unknown_peer"] += 1
            return None
        log.info("link from %s:%d", *addr)
        return self._new_link(addr)

    def _other_version(self, addr: tuple[str, int], detail: str) -> None:
        """A datagram of another link version: a peer running another udpverbs
        release.  Say so once per source (a bounded set), since the link it
        wants can never come up and its QPs only see retries run out."""
        self.stats["rx_bad_version"] += 1
        if addr not in self._told_version and len(self._told_version) < MAX_LINKS:
            self._told_version.add(addr)
            log.warning("datagram from %s:%d speaks link version %s, this daemon %d: run the same udpverbs "
                        "release on every host", addr[0], addr[1], detail.split()[-1], wire_link.LINK_VERSION)

    def _link_event(self, pl: PeerLink, ev: Any) -> None:
        if isinstance(ev, LinkUp):
            log.info("link to %s:%d up", *pl.addr)
            if self.local_addresses and pl.link.peer_addresses:
                self._pair_paths(pl)
            return
        if isinstance(ev, PathChanged):
            self._path_changed(pl, ev)
            return
        if isinstance(ev, PathMtu):
            self._path_mtu(pl, ev)
            return
        reason = ev.reason if isinstance(ev, LinkFailed) else "closed"
        # The peer closing its end (shutdown) is routine; anything else is worth a warning.
        level = logging.INFO if reason in ("abort_received", "closed") else logging.WARNING
        log.log(level, "link to %s:%d ended: %s", pl.addr[0], pl.addr[1], reason)
        pl.up = False
        pl.failed_reason = reason
        if self.links.get(pl.addr) is pl:
            del self.links[pl.addr]
            self._keep_link_totals(pl)
        if self.by_tag.get(pl.link.tag) is pl:
            del self.by_tag[pl.link.tag]
        if pl.routes is not None:
            self.paths.forget(pl)
        for qp in list(pl.qps):
            self.qp_changed(qp)
            qp.fail_oldest(pl.link.acked)  # the retry budget is gone
            qp.fatal(f"link {reason}")
        if self.cm is not None:
            self.cm.on_link_failed(pl)
        if self.groups is not None:
            self.groups.on_link_failed(pl)

    # -- paths (several local addresses: paths.py) --------------------------------------
    def _pair_paths(self, pl: PeerLink) -> None:
        """Open a path for each pair of our addresses and the peer's that
        the pairing rule makes (``paths.pair_addresses``) and no link uses yet."""
        used = [(0, pl.addr)] + [(self.ports.index(udp), r) for udp, r in (pl.routes or {}).values()]
        for index, addr in pair_addresses(self.subnets, pl.link.peer_addresses, used):
            if self.paths.get(index, addr) is None:
                self._add_path(pl, index, addr, "paired")

    def _new_path(self, index: int, addr: tuple[str, int], datagram: bytes) -> tuple[PeerLink, int] | None:
        """A path for a datagram read on socket ``index`` from ``addr``, a
        pair no path has: opened if the datagram names a link of ours (its
        tag) whose peer told us ``addr`` in its handshake (with a cluster
        key, the socket has checked it was sealed for this very pair), else
        None (counted: garbage, or a stranger)."""
        try:
            h, _ = wire_link.decode_untrusted(datagram)
        except WireError:
            self.stats["rx_garbage"] += 1
            return None
        pl = self.by_tag.get(h.conn_tag)
        if pl is None or addr not in pl.link.peer_addresses or pl.link.state >= LinkState.CLOSED:
            self.stats["rx_unknown_path"] += 1
            return None
        if pl.routes is not None and len(pl.routes) >= MAX_PATHS:
            self.stats["rx_path_limit"] += 1
            return None
        return pl, self._add_path(pl, index, addr, "opened by the peer")

    def _add_path(self, pl: PeerLink, index: int, addr: tuple[str, int], why: str) -> int:
        """A new path of ``pl``'s link between socket ``index`` and ``addr``: its id."""
        path = pl.link.add_path(self.clock())
        pl.add_route(path, self.ports[index], addr)
        self.paths.add(index, addr, pl, path)
        log.info("link to %s:%d: path %d %s:%d -> %s:%d (%s)", pl.addr[0], pl.addr[1], path,
                 *self.local_addresses[index], *addr, why)
        self.loop.wake()
        return path

    def _path_changed(self, pl: PeerLink, ev: PathChanged) -> None:
        """Log a path's new state: down is worth a warning (its traffic moved to the others)."""
        local, remote = pl.route_names(ev.path)
        level = logging.WARNING if ev.state == "down" else logging.INFO
        log.log(level, "link to %s:%d: path %d %s -> %s %s (%s)", pl.addr[0], pl.addr[1], ev.path, local, remote,
                ev.state, ev.reason)

    def _path_mtu(self, pl: PeerLink, ev: PathMtu) -> None:
        """A link's largest message changed (``transport/pmtud.py``): cut to
        it from now on, and say once per link when it is less than --mtu."""
        pl.path_mtu(ev)
        mtu = self.config.mtu
        extra = mtu - self.link_config.max_payload  # link header, CRC and seal: bytes a datagram adds
        size = ev.payload + extra
        # The peer searches the same path up to the same largest body: its
        # datagrams are of this size too, and the window (in datagrams)
        # can hold as many as fit the socket buffer.
        pl.link.receiver.rwnd_packets = datagrams_that_fit(self.udp.receive_buffer_bytes(), size,
                                                           high=self.rwnd_high)
        if size >= mtu:
            log.info("link to %s:%d carries %d-byte datagrams", pl.addr[0], pl.addr[1], size)
        elif not pl.warned and ev.state == "SEARCH_COMPLETE":
            pl.warned = True
            why = "" if ev.path_max + extra >= mtu else f" (the peer takes at most {ev.path_max + extra})"
            log.warning("path to %s:%d carries %d bytes; --mtu asks for %d%s", pl.addr[0], pl.addr[1], size, mtu,
                        why)
        else:
            log.info("link to %s:%d now sends %d-byte datagrams (%s)", pl.addr[0], pl.addr[1], size,
                     ev.state.lower())

    def _keep_link_totals(self, pl: PeerLink) -> None:
        ended = self.ended_links
        ended.update({f"link_{k}": v for k, v in pl.link.stats.as_dict().items()})
        if pl.link.framed_datagrams:
            ended["tx_native_datagrams"] += pl.link.framed_datagrams

    # -- the data path ----------------------------------------------------------
    def poll_once(self) -> bool:
        """One pass over sockets, links and queues; True if anything happened.

        An idle pass is the daemon's spin (and, on a shared CPU, the
        latency every other process on that CPU waits out), so each step
        first asks the cheapest question that proves it has nothing to do.
        """
        now = self.now = self.clock()
        sched = self.scheduler
        if self.qps.version != sched.seen:
            self._qps_changed()
        progress = self.receiver.step(now)
        if self.impair is not None and self.impair.release(now):
            progress = True
        # (the steps' cheapest questions are asked here, inline: these are
        # calls on every pass of a spinning daemon)
        to = sched.delivered_to
        if to is not None and sched.answer_early(to):
            to = sched.delivered_to = None
        if self._link_step(now):
            progress = True
        if to is not None and sched.answer_early(to):
            to = sched.delivered_to = None
        if (sched.delivered or sched.to_complete) and sched.complete():
            progress = True
            if self.yield_on_delivery:
                # Something an application waits for (placed data, a CQE) is
                # now in its memory.  On a shared CPU it may be the task
                # waiting behind us: let it run now, not after this pass's
                # sends.  It often posts its answer at once, which the pump
                # then finds, and whose datagram carries our ACK.
                self.stats["delivery_yields"] += 1
                os.sched_yield()
        answerer, sched.delivered_to = sched.delivered_to, None
        if sched.pump_all(self.links):
            progress = True
        # Stamp what leaves with the time it leaves, not when this pass began
        # (a pass that placed data, yielded and pumped took a while): the
        # peer's RTT sample should hold the path, not our pass.
        self.now = self.clock()
        if self.flush_links():
            progress = True
        if sched.prefetch:
            sched.prefetch_receives()
        if answerer is not None:
            sched.answer_early(answerer)  # posted after the SQ watch looked: sent now, not a pass later
        udp = self.udp
        if udp.sent:
            udp.sent = False
            if self.yield_on_delivery:
                # Our application may share our CPU: it waits for the peer's
                # answer to what we just sent, so the rest of our pass delays
                # nobody.  Arm now (see DataLoop._spin otherwise).
                self.arm_for_answer()
        if self.check_passes:
            sched.check()
        return progress

    def _qps_changed(self) -> None:
        """A QP came or went: the lane's arming and the scheduler's places are stale."""
        if self.lane is not None:
            self.lane.armed = None
        self.scheduler.rebuild(self.links)

    def _link_step(self, now: float) -> bool:
        """Fire due link timers, handle link events, and note the RDMA Writes
        the links acknowledged; True if a link had an event."""
        progress = False
        to_complete = self.scheduler.to_complete
        for pl in list(self.links.values()):
            link = pl.link
            d = link.next_deadline()
            if d is not None and d <= now:
                link.timer_fired(now)
            if link.has_events:
                ev = link.next_event()
                while ev is not None:
                    self._link_event(pl, ev)
                    ev = link.next_event()
                progress = True
            waiters = pl.ack_waiters
            if waiters:
                acked = link.acked
                while waiters and waiters[0][0] < acked:
                    to_complete[waiters.popleft()[1]] = None
        return progress

    def flush_links(self) -> bool:
        """Send what every link lets leave now; True if anything was sent."""
        progress = False
        for pl in list(self.links.values()):
            if pl.flush():
                progress = True
        return progress

    def arm_for_answer(self) -> None:
        """Arm the receive lane for what the link that last received expects next (if not armed)."""
        lane = self.lane
        if lane is not None and lane.armed is None and self.receiver.arm_link is not None:
            lane.arm(self.receiver.arm_link, self.links, self.arm_limit)

    def handed_over(self, pl: PeerLink) -> None:
        """Right after ``pl``'s datagram left alone, before this pass records
        it: arm the lane for the answer, then let the processes that share
        our CPU run for a moment (``loop.hand_over``)."""
        lane = self.lane
        if lane is not None and lane.armed is None:
            lane.arm(pl, self.links, self.arm_limit)
        if self.hand_over_s:
            hand_over(self.policy, self.hand_over_s, self.udp.readable, self.stats)

    def awaiting_peer(self) -> bool:
        """Whether any link has data in flight."""
        for pl in self.links.values():
            if pl.link.bytes_in_flight:
                return True
        return False

    def next_deadline(self) -> float:
        """When the next pass must run at the latest: a link's timer, a QP's
        own deadline, or the periodic rescan."""
        t = self.now + self.config.max_sleep_s
        for pl in self.links.values():
            d = pl.link.next_deadline()
            if d is not None and d < t:
                t = d
        if self.impair is not None:
            d = self.impair.next_deadline()
            if d is not None and d < t:
                t = d
        return self.scheduler.deadline(t)

    def dump_stats(self) -> dict[str, int]:
        """The device's counters, with the data loop's busy time and every
        link's counters summed, those of links that ended included."""
        out = dict(self.stats)
        out["data_busy_us"] = int(self.busy_s * 1e6)
        if self.impair is not None:
            out.update(self.impair.counters())
        for k, v in self.ended_links.items():
            out[k] = out.get(k, 0) + v
        for pl in self.links.values():
            if pl.link.framed_datagrams:
                out["tx_native_datagrams"] = out.get("tx_native_datagrams", 0) + pl.link.framed_datagrams
            for k, v in pl.link.stats.as_dict().items():
                out[f"link_{k}"] = out.get(f"link_{k}", 0) + v
        if self.links:
            # the narrowest path a link has now, as --mtu counts (transport/pmtud.py)
            extra = self.config.mtu - self.link_config.max_payload
            out["link_plpmtu_min"] = extra + min(pl.link.payload_limit for pl in self.links.values())
        return out
