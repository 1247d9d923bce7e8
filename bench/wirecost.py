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
import random
import statistics
import timeit
from collections.abc import Callable
from typing import Any

import construct as c

from udpverbs.wire import crc, envelope, link, rdmap, segment
from udpverbs.wire.envelope import Kind
from udpverbs.wire.link import LinkHeader, PacketType
from udpverbs.wire.rdmap import Opcode

DATAGRAM_LEN = 1472
PAYLOAD_LEN = DATAGRAM_LEN - link.OVERHEAD - segment.TAGGED_PREFIX_LEN  # 1418
TARGET_US = 3.0  # the per-datagram budget for the shipped path, each way

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

    def build(payload: bytes) -> bytes:
        segment.pack_tagged_into(body, 0, DST_QPN, SRC_QPN, Opcode.RDMA_WRITE, True, STAG, TO)
        body[segment.TAGGED_PREFIX_LEN :] = payload
        return link.encode(HEADER, body)

    def parse(datagram: bytes) -> Any:
        h, b = link.decode_untrusted(datagram)
        return h, segment.decode_untrusted(b)

    return build, parse


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
    base = next((r for r in rows if r["config"] == "construct" and "error" not in r), None)
    for r in rows:
        if base and "error" not in r:
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
        print(json.dumps(dict(datagram_bytes=DATAGRAM_LEN, target_us=TARGET_US, rows=rows), indent=2))
        return
    print(f"# {DATAGRAM_LEN} B datagram (link + envelope + DDP tagged + {PAYLOAD_LEN} B + CRC32c); "
          f"median of {args.repeats} x {args.number} calls; ratio = construct / this")
    for r in rows:
        if "error" in r:
            print(f"{r['config']:<20} not measured: {r['error']}")
            continue
        print(
            f"{r['config']:<20} build {r['build_us']:7.2f} us (x{r.get('build_ratio', 1):5.1f})"
            f"   parse+check {r['parse_us']:7.2f} us (x{r.get('parse_ratio', 1):5.1f})"
        )


if __name__ == "__main__":
    main()
