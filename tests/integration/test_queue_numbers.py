"""Queue numbers, MSNs and MOs on the wire, from a live run, against RFC 5040, 5041 and 7306.

Two real daemons talk through a relay that keeps every datagram; the
project's own codecs decode the capture and ``opcode_tour.check_tour``
holds each opcode's segments to the RFCs: Atomic Requests on queue 1 in
the Read Requests' MSN sequence, Atomic Responses on queue 3 with their
own, Sends and Immediate Data on 0, the Terminate on 2.
"""

from __future__ import annotations

import tempfile

from udpverbs import verbs
from udpverbs.wire import link, rdmap, segment
from udpverbs.wire.envelope import Kind

from .conftest import ACCESS_ALL, Side
from .daemons import DaemonProc
from .opcode_tour import ACCESS_ATOMIC, Segment, check_tour, run_tour
from .relay import Relay


def connect_through(a: Side, b: Side, b_seen_by_a: tuple[str, int], a_seen_by_b: tuple[str, int]) -> None:
    """Both QPs to RTS, each addressing its peer where ``relay`` stands in for it."""
    for me, peer, (ip, port) in ((a, b, b_seen_by_a), (b, a, a_seen_by_b)):
        attr = verbs.QPAttr(qp_access_flags=ACCESS_ALL, dest_qp_num=peer.qp.qp_num, max_rd_atomic=4,
                            max_dest_rd_atomic=4)
        attr.ah_attr = verbs.AHAttr(dlid=port, gr=verbs.GlobalRoute(dgid=verbs.GID("::ffff:" + ip)))
        me.qp.to_rts(attr)


def decode(datagrams: list[tuple[str, bytes]]) -> list[Segment]:
    """The DDP segments of the captured datagrams, with the project's codecs."""
    out = []
    for sender, data in datagrams:
        h, body = link.decode_untrusted(data)
        if h.ptype != link.PacketType.DATA:
            continue
        env, hdr, payload = segment.decode_untrusted(body)
        if env.kind != Kind.DDP:
            continue
        s = Segment(sender, h.seq, hdr.opcode, hdr.last, len(payload))
        if isinstance(hdr, rdmap.TaggedHeader):
            s.stag, s.to = hdr.stag, hdr.to
        else:
            s.qn, s.msn, s.mo, s.inv_stag = hdr.qn, hdr.msn, hdr.mo, hdr.inv_stag
            s.body = body_fields(hdr.opcode, payload)
        out.append(s)
    return out


def body_fields(op: int, payload: memoryview) -> dict[str, int]:
    if op == rdmap.Opcode.RDMA_READ_REQUEST:
        return rdmap.decode_read_request_untrusted(payload)._asdict()
    if op == rdmap.Opcode.ATOMIC_REQUEST:
        return rdmap.decode_atomic_request_untrusted(payload)._asdict()
    if op == rdmap.Opcode.ATOMIC_RESPONSE:
        return rdmap.decode_atomic_response_untrusted(payload)._asdict()
    if op in (rdmap.Opcode.IMMEDIATE_DATA, rdmap.Opcode.IMMEDIATE_DATA_SE):
        return {"imm_data": rdmap.decode_immediate_data_untrusted(payload)}
    if op == rdmap.Opcode.TERMINATE:
        t = rdmap.decode_terminate_untrusted(payload)
        _, _, stag, to = rdmap.ddp.TAGGED.unpack(t.ddp_header)
        return {"layer": t.layer, "etype": t.etype, "ecode": t.ecode, "ddp_stag": stag, "ddp_to": to}
    return {}


def test_every_opcode_travels_on_its_rfc_queue_with_its_msn_and_mo() -> None:
    with tempfile.TemporaryDirectory(prefix="udpverbs-qn-") as d:
        da = DaemonProc("uvQa", "127.0.0.2", d, seed=31).start()
        try:
            db = DaemonProc("uvQb", "127.0.0.3", d, seed=32).start()
            try:
                relay = Relay((da.addr, da.port), (db.addr, db.port)).start()
                a, b = Side(da), Side(db, access=ACCESS_ATOMIC)
                try:
                    connect_through(a, b, relay.b_seen_by_a, relay.a_seen_by_b)
                    tour = run_tour(a, b)
                finally:
                    a.close()
                    b.close()
                    relay.stop()
            finally:
                assert db.stop() == 0, db.log_text()
        finally:
            assert da.stop() == 0, da.log_text()
    check_tour(tour, decode(relay.datagrams))
