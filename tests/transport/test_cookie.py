"""The INIT cookie (``transport/cookie.py``): valid only for the INIT and address it answered, while fresh."""

from __future__ import annotations

import random

from udpverbs.transport.cookie import CookieJar
from udpverbs.transport.link import Link, LinkState
from udpverbs.transport.records import LinkConfig
from udpverbs.wire import link as wl

SECRET = bytes(range(32))
ADDR = ("127.0.0.3", 4791)


def test_cookie_is_bound_to_address_init_and_time() -> None:
    jar = CookieJar(SECRET, lifetime_s=10.0)
    init = wl.LinkInit(5, 6, 1400, 64, 77)
    echoed = init._replace(cookie=jar.make(ADDR, init, 100.0))
    assert jar.valid(ADDR, echoed, 100.5) and jar.valid(ADDR, echoed, 110.0)
    assert not jar.valid(ADDR, echoed, 111.5)  # stale
    assert not jar.valid(ADDR, echoed, 99.0)  # from the future
    assert not jar.valid(("127.0.0.3", 4792), echoed, 100.5)  # another port
    assert not jar.valid(("127.0.0.4", 4791), echoed, 100.5)  # another host
    assert not jar.valid(ADDR, echoed._replace(tag=6), 100.5)  # another INIT
    assert not jar.valid(ADDR, echoed._replace(incarnation=78), 100.5)
    assert not jar.valid(ADDR, init, 100.5)  # none
    assert not CookieJar(bytes(32)).valid(ADDR, echoed, 100.5)  # another daemon's key
    forged = bytearray(echoed.cookie)
    forged[-1] ^= 1
    assert not jar.valid(ADDR, echoed._replace(cookie=bytes(forged)), 100.5)


def test_answers_are_rate_limited_per_source_ip_in_bounded_state() -> None:
    jar = CookieJar(SECRET, rate_per_s=10.0, burst=4, max_sources=100)
    assert [jar.may_answer("10.0.0.1", 0.0) for _ in range(6)] == [True] * 4 + [False] * 2
    assert jar.may_answer("10.0.0.2", 0.0)  # another source has its own bucket
    assert not jar.may_answer("10.0.0.1", 0.05) and jar.may_answer("10.0.0.1", 0.2)  # refilled
    for i in range(1000):
        jar.may_answer(f"10.1.{i // 256}.{i % 256}", 1.0)
    assert len(jar._buckets) <= 100


def test_initiator_sends_its_init_again_with_the_cookie() -> None:
    a = Link(LinkConfig(), rng=random.Random(1), incarnation=1)
    a.connect(0.0)
    (init,) = a.datagrams_to_send(0.0)
    h, body = wl.decode_untrusted(init)
    assert wl.decode_init_untrusted(body).cookie == b""
    cookie = bytes(range(wl.COOKIE_LEN))
    other = wl.encode_fields(wl.PacketType.COOKIE, 0, 0, a.tag ^ 1, 0, 0, 0, 0, 0, cookie)
    a.datagram_received(other, 0.001)  # not addressed to us: ignored
    assert a.datagrams_to_send(0.001) == [] and a.stats.bad_tag == 1
    a.datagram_received(wl.encode_fields(wl.PacketType.COOKIE, 0, 0, a.tag, 0, 0, 0, 0, 0, cookie), 0.002)
    (again,) = a.datagrams_to_send(0.002)
    h2, body2 = wl.decode_untrusted(again)
    assert h2.ptype == wl.PacketType.INIT and wl.decode_init_untrusted(body2).cookie == cookie
    assert a.state == LinkState.INIT_SENT
