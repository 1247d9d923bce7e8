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
    assert set(rows) == {"construct", "construct-compiled", "fast"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["build_us"] > 0 and r["parse_us"] > 0
