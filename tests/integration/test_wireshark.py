"""contrib/wireshark/udpverbs.lua, tried on a live capture with tshark.

Two fresh daemons run every opcode (``opcode_tour``) while dumpcap captures
their ports on ``lo``; tshark then decodes the file with the Lua dissector
and the segments it shows are held to the RFCs and to what was posted, as
``test_queue_numbers`` holds the project's own decoding: once as
Wireshark's iwarp_ddp_rdmap dissector shows them (with the Lua's RFC 7306
trees), once as the Lua decodes them alone, found by port instead of
heuristically.  Every link packet's CRC32c must check, including those of
the GSO runs the daemons send (several link packets in one captured
datagram), and nothing may be marked malformed.

Needs tshark (Debian package ``tshark``) and the right to capture on
``lo``; skipped, with the reason, without them.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET

import pytest

from udpverbs.daemon.clusterkey import write_new_key
from udpverbs.daemon.config import DEFAULT_PORT
from udpverbs.wire import auth, envelope, link
from udpverbs.wire.barrier import BarrierType
from udpverbs.wire.cm import CmType
from udpverbs.wire.flow import FlowType
from udpverbs.wire.group import GroupType
from udpverbs.wire.lock import LockType
from udpverbs.wire.rdmap import AtomicOp, Opcode

from .conftest import Side, connect_manual
from .daemons import DaemonProc
from .opcode_tour import ACCESS_ATOMIC, TAGGED, Segment, Tour, check_tour, run_tour

LUA = pathlib.Path(__file__).resolve().parents[2] / "contrib" / "wireshark" / "udpverbs.lua"
END_MARK = b"udpverbs wireshark test: end of capture"
START_MARK = b"udpverbs wireshark test: capturing"


def _tools() -> tuple[str, str]:
    tshark, dumpcap = shutil.which("tshark"), shutil.which("dumpcap")
    if not tshark or not dumpcap:
        pytest.skip("tshark is not installed (Debian package tshark: apt-get install tshark)")
    return tshark, dumpcap


class Capture:
    """dumpcap on ``lo`` for the given UDP ports, bounded to a minute."""

    def __init__(self, dumpcap: str, ports: list[int], path: str) -> None:
        self.path = path
        expr = " or ".join(f"udp port {p}" for p in ports)
        self.proc = subprocess.Popen([dumpcap, "-q", "-i", "lo", "-f", expr, "-a", "duration:60", "-w", path],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline().decode(errors="replace")
        if "Capturing on" not in line:
            try:
                rest = self.proc.communicate(timeout=10)[1].decode(errors="replace")
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rest = ""
            pytest.skip(f"dumpcap cannot capture on lo here: {(line + rest).strip()}")

    def mark(self, mark: bytes, mark_to: tuple[str, int]) -> None:
        """Send a datagram the filter takes until the file holds it (dumpcap says
        "Capturing on" before its filter is in place: a busy machine lost a link's INIT)."""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                s.sendto(mark, mark_to)
                time.sleep(0.1)
                if os.path.exists(self.path) and mark in pathlib.Path(self.path).read_bytes():
                    return

    def finish(self, mark_to: tuple[str, int]) -> None:
        """Send a last datagram the filter takes, wait until the file holds it, stop dumpcap."""
        self.mark(END_MARK, mark_to)
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _tshark_pdml(tshark: str, path: str, *prefs: str) -> ET.Element:
    # The payloads are test bytes, not RPC-over-RDMA or SMB Direct, whose
    # heuristics would take some of them (and call them malformed).
    cmd = [tshark, "-n", "-r", path, "-X", f"lua_script:{LUA}", "-o", "udpverbs.check_crc:TRUE", "-T", "pdml",
           "--disable-heuristic", "rpcrdma_iwarp", "--disable-heuristic", "smb_direct_iwarp"]
    for p in prefs:
        cmd += ["-o", p]
    out = subprocess.run(cmd, capture_output=True, timeout=60, env=dict(os.environ, LANG="C"))
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    assert b"Lua" not in out.stderr and b"rror" not in out.stderr, out.stderr.decode(errors="replace")
    return ET.fromstring(out.stdout)


def _num(field: ET.Element) -> int:
    return int(field.get("show", ""), 0)


def _children(elem: ET.Element) -> dict[str, ET.Element]:
    """Fields directly under ``elem`` (a copied header nested deeper is not the segment's own)."""
    return {f.get("name", ""): f for f in elem.findall("field")}


def _all(elem: ET.Element) -> dict[str, ET.Element]:
    return {f.get("name", ""): f for f in elem.iter("field")}


# names of udpverbs_rdmap's body fields -> Segment.body keys (opcode_tour's names)
BODY = {"rr.sink_stag": "sink_stag", "rr.sink_to": "sink_to", "rr.size": "size", "rr.src_stag": "src_stag",
        "rr.src_to": "src_to", "atomic.opcode": "aop", "atomic.req_id": "req_id", "atomic.stag": "stag",
        "atomic.to": "to", "atomic.add_swap_data": "add_swap_data", "atomic.compare_data": "compare_data",
        "atomic.orig_req_id": "req_id", "atomic.orig_value": "orig_value", "imm_data": "imm_data",
        "term.layer": "layer", "term.etype": "etype", "term.ecode": "ecode"}


def _body(proto: ET.Element) -> dict[str, int]:
    own = _children(proto)
    body = {key: _num(own["udpverbs_rdmap." + name]) for name, key in BODY.items() if "udpverbs_rdmap." + name in own}
    copied = own.get("udpverbs_rdmap.term.ddp_header")
    if copied is not None:
        inner = _children(copied)
        body["ddp_stag"], body["ddp_to"] = _num(inner["udpverbs_rdmap.stag"]), _num(inner["udpverbs_rdmap.to"])
    return body


# where each decoder shows a segment's header fields
IWARP = {"opcode": "iwarp_rdma.opcode", "last": "iwarp_ddp.last_flag", "stag": "iwarp_ddp.stag",
         "to": "iwarp_ddp.tagged_offset", "qn": "iwarp_ddp.qn", "msn": "iwarp_ddp.msn", "mo": "iwarp_ddp.mo",
         "inv_stag": "iwarp_rdma.inval_stag"}
LUA_FIELDS = {key: "udpverbs_rdmap." + key for key in ("opcode", "last", "stag", "to", "qn", "msn", "mo", "inv_stag")}
#: Wireshark's own names of the Read Request fields
IWARP_READ_REQUEST = {"sinkstag": "sink_stag", "sinkto": "sink_to", "rdmardsz": "size", "srcstag": "src_stag",
                      "srcto": "src_to"}


def _segment(f: dict[str, ET.Element], names: dict[str, str], sender: str, seq: int, length: int) -> Segment:
    def get(key: str) -> int:
        return _num(f[names[key]])

    s = Segment(sender, seq, get("opcode"), bool(get("last")), length)
    if s.opcode in TAGGED:
        s.stag, s.to = get("stag"), get("to")
    else:
        s.qn, s.msn, s.mo = get("qn"), get("msn"), get("mo")
        if names["inv_stag"] in f:
            s.inv_stag = get("inv_stag")
    return s


def _segment_from_iwarp(proto: ET.Element, sender: str, seq: int, length: int) -> Segment:
    f = _all(proto)
    s = _segment(f, IWARP, sender, seq, length)
    if "iwarp_rdma.rr" in f:  # Wireshark decodes the Read Request header itself
        s.body = {key: _num(f["iwarp_rdma." + name]) for name, key in IWARP_READ_REQUEST.items()}
    return s


def _segment_from_lua(proto: ET.Element, sender: str, seq: int, length: int) -> Segment:
    s = _segment(_children(proto), LUA_FIELDS, sender, seq, length)
    s.body = _body(proto)
    return s


class Decoded:
    """What tshark showed: the DDP segments in capture order, and per link packet its type and CRC status."""

    def __init__(self, pdml: ET.Element, a_ip: str) -> None:
        self.segments: list[Segment] = []
        self.link_packets: list[tuple[int, int]] = []  # (packet type, CRC status)
        self.gso_frames = 0
        self.frames = 0
        self.names: set[str] = set()
        self.experts: list[str] = []
        for packet in pdml.iter("packet"):
            self._packet(packet, a_ip)

    def _packet(self, packet: ET.Element, a_ip: str) -> None:
        sender = "A" if _all(packet)["ip.src"].get("show") == a_ip else "B"
        self.names |= {f.get("name", "") for f in packet.iter("field")} | {p.get("name", "") for p in packet}
        self.experts += [f.get("show", "") for f in packet.iter("field") if f.get("name") == "_ws.expert.message"]
        current: Segment | None = None
        seq, length, links = 0, 0, 0
        for proto in packet.findall("proto"):
            name = proto.get("name")
            if name == "udpverbs":
                f = _all(proto)
                seq = _num(f["udpverbs.seq"])
                length = _num(f["udpverbs.ddp_payload_len"]) if "udpverbs.ddp_payload_len" in f else -1
                self.link_packets.append((_num(f["udpverbs.ptype"]), _num(f["udpverbs.crc.status"])))
                links += 1
                current = None
            elif name == "iwarp_ddp_rdmap":
                current = _segment_from_iwarp(proto, sender, seq, length)
                self.segments.append(current)
            elif name == "udpverbs_rdmap":
                if current is None:  # the Lua decodes DDP/RDMAP alone
                    self.segments.append(_segment_from_lua(proto, sender, seq, length))
                else:  # the RFC 7306 (and Terminate) part beside Wireshark's tree
                    current.body.update(_body(proto))
        if links:
            self.frames += 1
            self.gso_frames += links > 1


def _check(decoded: Decoded, tour: Tour) -> None:
    check_tour(tour, decoded.segments)
    assert decoded.link_packets and all(status == 1 for _, status in decoded.link_packets)  # every CRC32c good
    types = {t for t, _ in decoded.link_packets}
    assert {1, 2, 3, 4} <= types  # DATA, ACK, INIT, INIT_ACK
    assert decoded.gso_frames  # GSO runs were cut into their link packets
    assert not decoded.names & {"_ws.malformed", "udpverbs.malformed", "udpverbs.crc.bad"}, decoded.experts


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "cluster key"])
def test_the_lua_dissector_decodes_a_live_capture_of_every_opcode(keyed: bool) -> None:
    # With a cluster key every link packet, each piece of a GSO run too, is
    # followed by the 28-byte trailer the dissector must step over.
    tshark, dumpcap = _tools()
    with tempfile.TemporaryDirectory(prefix="udpverbs-ws-") as d:
        extra: tuple[str, ...] = ()
        if keyed:
            key = os.path.join(d, "cluster.key")
            write_new_key(key)
            extra = (f"--key-file={key}",)
        da = DaemonProc("uvWa", "127.0.0.2", d, seed=41, extra=extra).start()
        db = None
        cap = None
        try:
            db = DaemonProc("uvWb", "127.0.0.3", d, seed=42, extra=extra).start()
            cap = Capture(dumpcap, [da.port, db.port], os.path.join(d, "tour.pcapng"))
            cap.mark(START_MARK, (da.addr, da.port))
            a, b = Side(da), Side(db, access=ACCESS_ATOMIC)
            try:
                connect_manual(a, a.qp, b, b.qp)
                tour = run_tour(a, b)
            finally:
                a.close()
                b.close()
        finally:
            if db is not None:
                assert db.stop() == 0, db.log_text()
            assert da.stop() == 0, da.log_text()
            if cap is not None:
                cap.finish((da.addr, da.port))
        with_iwarp = Decoded(_tshark_pdml(tshark, cap.path), da.addr)
        assert "iwarp_ddp_rdmap" in with_iwarp.names
        _check(with_iwarp, tour)
        assert ("udpverbs.auth.pn" in with_iwarp.names) == keyed
        ports = f"{da.port},{db.port}"
        alone = Decoded(_tshark_pdml(tshark, cap.path, "udpverbs.use_iwarp:FALSE", "udpverbs.heuristic:FALSE",
                                     f"udpverbs.ports:{ports}"), da.addr)
        assert "iwarp_ddp_rdmap" not in alone.names
        _check(alone, tour)
        assert alone.segments == with_iwarp.segments


def _lua_table(text: str, name: str) -> dict[int, str]:
    body = re.search(r"^local " + name + r" = \{(.*?)\}", text, re.S | re.M)
    assert body is not None, name
    return {int(k): v for k, v in re.findall(r'\[(\d+)\] = "([^"]+)"', body.group(1))}


def test_the_lua_dissector_has_the_constants_of_wire() -> None:
    # Runs without tshark: the Lua file keeps its own copy of wire/'s
    # numbers, and this says when one of them moves.
    text = LUA.read_text()
    consts = dict(re.findall(r"^local ([A-Z_]+) = (\d+)\b", text, re.M))
    assert int(consts["DEFAULT_PORT"]) == DEFAULT_PORT
    assert int(consts["LINK_VERSION"]) == link.LINK_VERSION and int(consts["HEADER_LEN"]) == link.HEADER_LEN
    assert int(consts["MAX_SACK"]) == link.MAX_SACK_BLOCKS and int(consts["COOKIE_LEN"]) == link.COOKIE_LEN
    assert int(consts["INIT_LEN"]) == len(link.encode_init(link.LinkInit(0, 0, 0, 0, 0)))
    assert int(consts["ENVELOPE_LEN"]) == envelope.ENVELOPE_LEN
    assert int(consts["FLOW_ACK_LEN"]) == envelope.FLOW_ACK_LEN
    assert int(consts["AUTH_TRAILER_LEN"]) == auth.TRAILER_LEN
    assert _lua_table(text, "PTYPES") == {int(t): t.name for t in link.PacketType}
    assert _lua_table(text, "KINDS") == {int(k): k.name for k in envelope.Kind}
    assert _lua_table(text, "FLOW_TYPES") == {int(t): t.name for t in FlowType}
    assert _lua_table(text, "LOCK_TYPES") == {int(t): t.name for t in LockType}
    assert _lua_table(text, "BARRIER_TYPES") == {int(t): t.name for t in BarrierType}
    assert _lua_table(text, "GROUP_TYPES") == {int(t): t.name for t in GroupType}
    assert _lua_table(text, "CM_TYPES") == {int(t): t.name for t in CmType}
    assert _lua_table(text, "ATOMIC_OPS").keys() == {int(op) for op in AtomicOp}
    assert _lua_table(text, "OPCODES").keys() == {int(op) for op in Opcode}
