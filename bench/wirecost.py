"""What one 1472-byte RDMA Write datagram costs to build and to parse+check.

Theory of operation
-------------------
A full-size data datagram is a link header (28 B), the envelope (8 B), a DDP
tagged header carrying RDMAP (14 B), 1418 B of payload and the CRC32c (4 B):
1472 B, the UDP payload of a 1500-byte MTU.  The daemon builds one per
segment it sends and parses and checks one per segment it receives, so these
two costs bound the segment rate of the Python data path.

Three configurations do the same work:

* ``construct``: the reference declarations (``LINK_HEADER``, ``ENVELOPE``,
  ``RDMAP_SEGMENT``), parsed and built as declared;
* ``construct-compiled``: the same after ``.compile()`` (a row says so if
  construct cannot compile a declaration);
* ``fast``: what the daemon and transport ship, ``segment.pack_tagged_into``
  + ``link.encode`` to build, ``link.decode_untrusted`` +
  ``segment.decode_untrusted`` to parse and check.

Each cost is the median over ``--repeats`` ``timeit`` runs of ``--number``
calls, in µs per datagram, with the ratio to plain construct beside it.
Payload bytes come from a seeded ``random.Random``.  Run as
``python -m udpverbs.bench.wirecost [--json]``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import random
import statistics
import timeit
from collections.abc import Callable
from typing import Any

import construct as c

from udpverbs.daemon import tables
from udpverbs.transport.link import Link, LinkConfig
from udpverbs.wire import crc, envelope, link, rdmap, segment
from udpverbs.wire.shm import AccessFlags
from udpverbs.wire.envelope import Kind
from udpverbs.wire.link import LinkHeader, PacketType
from udpverbs.wire.rdmap import Opcode

DATAGRAM_LEN = 1472
PAYLOAD_LEN = DATAGRAM_LEN - link.OVERHEAD - segment.TAGGED_PREFIX_LEN  # 1418
TARGET_US = 3.0  # the per-datagram budget for the shipped path, each way
RECEIVE_TARGET_US = 5.0  # the budget to parse, check and place one datagram in Python
_REMOTE_WRITE = int(AccessFlags.IBV_ACCESS_REMOTE_WRITE)

HEADER = LinkHeader(PacketType.DATA, 0, 0, 0x5EED5EED, 1000, 990, 123456, 123000, 256)
DST_QPN, SRC_QPN, STAG, TO = 0x000102, 0x000304, 0x00ABCD01, 0x10000


def _link_fields(h: LinkHeader) -> dict[str, Any]:
    return dict(
        ptype=h.ptype, flags=h.flags, path_id=h.path_id, conn_tag=h.conn_tag, seq=h.seq, ack=h.ack,
        ts_us=h.ts_us, ts_echo_us=h.ts_echo_us, rwnd=h.rwnd, sack_count=0, sack=[],
    )


def construct_codec(link_c: c.Construct, env_c: c.Construct, seg_c: c.Construct) -> tuple[Callable[[bytes], bytes], Callable[[bytes], Any]]:
    """Build and parse+check functions over the given (maybe compiled) declarations."""
    link_fields = _link_fields(HEADER)
    env_fields = dict(kind=Kind.DDP, dst_qpn=DST_QPN, flags=0, src_qpn=SRC_QPN)

    def build(payload: bytes) -> bytes:
        seg = seg_c.build(
            dict(ddp=dict(T=True, L=True), rdmap=dict(opcode=int(Opcode.RDMA_WRITE)), buffer=dict(stag=STAG, to=TO),
                 payload=payload)
        )
        out = link_c.build(link_fields) + env_c.build(env_fields) + seg
        return out + crc.crc32c(out).to_bytes(4, "big")

    def parse(datagram: bytes) -> Any:
        view = memoryview(datagram)
        if crc.crc32c(view[:-4]) != int.from_bytes(view[-4:], "big"):
            raise ValueError("bad crc")
        h = link_c.parse(datagram)
        env = env_c.parse(datagram[link.HEADER_LEN:])
        return h, env, seg_c.parse(datagram[link.HEADER_LEN + envelope.ENVELOPE_LEN : -4])

    return build, parse


def fast_codec() -> tuple[Callable[[bytes], bytes], Callable[[bytes], Any]]:
    """The shipped path: what the daemon's send and receive loops call."""
    body = bytearray(segment.TAGGED_PREFIX_LEN + PAYLOAD_LEN)
    pack_header = segment.tagged_packer(DST_QPN, SRC_QPN, Opcode.RDMA_WRITE)
    h = HEADER

    def build(payload: bytes) -> bytes:
        pack_header(body, True, STAG, TO)
        body[segment.TAGGED_PREFIX_LEN :] = payload
        return link.encode_fields(h.ptype, h.flags, h.path_id, h.conn_tag, h.seq, h.ack, h.ts_us, h.ts_echo_us,
                                  h.rwnd, body)

    def parse(datagram: bytes) -> Any:
        h, b = link.decode_untrusted(datagram)
        return h, segment.decode_untrusted(b)

    return build, parse


class _Target:
    """A registered region on the receiving side, as the daemon holds it."""

    def __init__(self) -> None:
        self.pd = tables.ProtectionDomain(1, None)
        self.mr = tables.MemoryRegion(1, self.pd, int(AccessFlags.IBV_ACCESS_REMOTE_WRITE), 0, 1 << 20,
                                      mmap.mmap(-1, 1 << 20))
        self.stags = tables.STagTable()
        self.stags.register(self.mr)


def place_write(target: _Target, hdr: Any, payload: memoryview) -> None:
    """What ``QueuePair.on_segment`` does with a tagged RDMA Write: ``STagTable.place``."""
    code = target.stags.place(target.pd, _REMOTE_WRITE, hdr.stag, hdr.to, payload)
    if code:
        raise AssertionError(f"check refused the write ({code})")


def receive_stateless(payload: bytes) -> tuple[Callable[[bytes], Any], bytes]:
    """parse + check + place of one datagram, no link state (what RECEIVE_TARGET_US budgets)."""
    target = _Target()
    pack_header = segment.tagged_packer(DST_QPN, SRC_QPN, Opcode.RDMA_WRITE)
    body = bytearray(segment.TAGGED_PREFIX_LEN) + payload
    pack_header(body, True, target.mr.stag, TO)
    datagram = link.encode(HEADER, body)

    def receive(d: bytes) -> None:
        _, b = link.decode_untrusted(d)
        _, hdr, data = segment.decode_untrusted(b)
        place_write(target, hdr, data)

    return receive, datagram


def receive_through_link(payload: bytes, count: int) -> Callable[[], None]:
    """The same, through a receiving ``transport.Link`` (reliability, ACK state, in-order delivery).

    A sending link (fixed window, unpaced) produces ``count`` in-order data
    packets up front; each call of the returned function hands the next one
    to the receiving link, drains it and places the segment, and every 64th
    call has the receiver build its ACK, as the daemon does once per pass.
    """
    target = _Target()
    cfg = LinkConfig(max_payload=DATAGRAM_LEN - link.OVERHEAD, cc="fixed", cc_params={"window_packets": count + 8},
                     send_buffer_packets=count + 8, rwnd_packets=1 << 15)
    tx = Link(cfg, rng=random.Random(1), incarnation=1)
    rx = Link(cfg, rng=random.Random(2), incarnation=2)
    now = 1.0
    tx.connect(now)
    for _ in range(4):  # the handshake, in memory
        for d in tx.datagrams_to_send(now):
            rx.datagram_received(d, now)
        for d in rx.datagrams_to_send(now):
            tx.datagram_received(d, now)
    pack_header = segment.tagged_packer(DST_QPN, SRC_QPN, Opcode.RDMA_WRITE)
    for _ in range(count):
        body = bytearray(segment.TAGGED_PREFIX_LEN) + payload
        pack_header(body, True, target.mr.stag, TO)
        tx.send(body, now)
    datagrams = enumerate(tx.datagrams_to_send(now), 1)

    def receive() -> None:
        n, datagram = next(datagrams)
        rx.datagram_received(datagram, now)
        for msg in rx.drain_received():
            _, hdr, data = segment.decode_untrusted(msg)
            place_write(target, hdr, data)
        if n % 64 == 0:
            rx.datagrams_to_send(now)

    return receive


def _median_us(fn: Callable[[], Any], number: int, repeats: int) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeats)) / number * 1e6


def measure(number: int, repeats: int, seed: int) -> list[dict[str, Any]]:
    """Time every configuration; return one row per configuration."""
    payload = random.Random(seed).randbytes(PAYLOAD_LEN)
    configs: list[tuple[str, Any]] = [
        ("construct", lambda: construct_codec(link.LINK_HEADER, envelope.ENVELOPE, rdmap.RDMAP_SEGMENT)),
        ("construct-compiled", lambda: construct_codec(
            link.LINK_HEADER.compile(), envelope.ENVELOPE.compile(), rdmap.RDMAP_SEGMENT.compile())),
        ("fast", fast_codec),
    ]
    reference = fast_codec()[0](payload)
    rows: list[dict[str, Any]] = []
    for name, make in configs:
        try:
            build, parse = make()
            datagram = build(payload)
            if datagram != reference:
                raise AssertionError(f"{name} built different bytes than the shipped path")
            parse(datagram)
        except Exception as e:  # a declaration construct cannot compile: say so, go on
            rows.append(dict(config=name, error=f"{type(e).__name__}: {e}"))
            continue
        rows.append(
            dict(
                config=name,
                build_us=_median_us(lambda: build(payload), number, repeats),
                parse_us=_median_us(lambda: parse(datagram), number, repeats),
            )
        )
    receive, datagram = receive_stateless(payload)
    rows.append(dict(config="receive: parse, check, place", receive_us=_median_us(lambda: receive(datagram), number,
                                                                                repeats)))
    through = receive_through_link(payload, number * repeats)
    rows.append(dict(config="receive through a Link", receive_us=_median_us(through, number, repeats)))
    base = next((r for r in rows if r["config"] == "construct" and "error" not in r), None)
    for r in rows:
        if base and "error" not in r and "build_us" in r:
            r["build_ratio"] = base["build_us"] / r["build_us"]
            r["parse_ratio"] = base["parse_us"] / r["parse_us"]
    return rows


def main(argv: list[str] | None = None) -> None:
    """Command line: print one line per configuration (or JSON with --json)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--number", type=int, default=2000, help="calls per timing run")
    ap.add_argument("--repeats", type=int, default=7, help="timing runs; the median is reported")
    ap.add_argument("--seed", type=int, default=1, help="seed of the payload bytes")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    rows = measure(args.number, args.repeats, args.seed)
    if args.json:
        print(json.dumps(dict(datagram_bytes=DATAGRAM_LEN, target_us=TARGET_US, receive_target_us=RECEIVE_TARGET_US,
                              rows=rows), indent=2))
        return
    print(f"# {DATAGRAM_LEN} B datagram (link + envelope + DDP tagged + {PAYLOAD_LEN} B + CRC32c); "
          f"median of {args.repeats} x {args.number} calls; ratio = construct / this")
    for r in rows:
        if "error" in r:
            print(f"{r['config']:<20} not measured: {r['error']}")
            continue
        if "receive_us" in r:
            print(f"{r['config']:<30} {r['receive_us']:7.2f} us per datagram (target {RECEIVE_TARGET_US:g})")
            continue
        print(
            f"{r['config']:<20} build {r['build_us']:7.2f} us (x{r.get('build_ratio', 1):5.1f})"
            f"   parse+check {r['parse_us']:7.2f} us (x{r.get('parse_ratio', 1):5.1f})"
        )


if __name__ == "__main__":
    main()
