"""bench/wirecost.py: every configuration builds the same datagram and runs."""

from __future__ import annotations

import json

import pytest

from udpverbs.bench import wirecost
from udpverbs.wire import link, segment


def test_datagram_is_full_size_and_parses() -> None:
    build, parse = wirecost.fast_codec()
    payload = bytes(range(256)) * 5 + bytes(wirecost.PAYLOAD_LEN - 1280)
    datagram = build(payload)
    assert len(datagram) == wirecost.DATAGRAM_LEN == 1472
    h, (env, header, view) = parse(datagram)
    assert h == wirecost.HEADER and bytes(view) == payload
    assert (env.dst_qpn, env.src_qpn, header.stag, header.to) == (
        wirecost.DST_QPN, wirecost.SRC_QPN, wirecost.STAG, wirecost.TO)
    # the construct codec reads back what the fast path built
    _, cparse = wirecost.construct_codec(link.LINK_HEADER, wirecost.envelope.ENVELOPE, wirecost.rdmap.RDMAP_SEGMENT)
    assert cparse(datagram)[2].payload == payload
    assert segment.TAGGED_PREFIX_LEN + link.OVERHEAD + wirecost.PAYLOAD_LEN == 1472


def test_every_configuration_is_measured(capsys: pytest.CaptureFixture[str]) -> None:
    wirecost.main(["--number", "3", "--repeats", "1", "--json"])
    rows = {r["config"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    codecs = {"construct", "construct-compiled", "fast"}
    receives = {"receive: parse, check, place", "receive through a Link"}
    assert set(rows) == codecs | receives
    for name in codecs:
        assert "error" not in rows[name], rows[name]
        assert rows[name]["build_us"] > 0 and rows[name]["parse_us"] > 0
    for name in receives:
        assert rows[name]["receive_us"] > 0


def test_the_receive_paths_place_the_payload() -> None:
    payload = bytes(range(256)) * 5 + bytes(wirecost.PAYLOAD_LEN - 1280)
    receive, datagram = wirecost.receive_stateless(payload)
    receive(datagram)  # raises if the STag or the bounds check refused it
    through = wirecost.receive_through_link(payload, 3)
    for _ in range(3):
        through()
    with pytest.raises(StopIteration):  # exactly the packets sent were delivered, one per call
        through()


def test_placement_refuses_what_a_qp_would_refuse() -> None:
    target = wirecost._Target()
    hdr = wirecost.rdmap.TaggedHeader(wirecost.Opcode.RDMA_WRITE, True, target.mr.stag, (1 << 20) - 4)
    with pytest.raises(AssertionError, match="check refused"):
        wirecost.place_write(target, hdr, memoryview(bytes(8)))  # runs past the region's end
