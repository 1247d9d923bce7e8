"""The cluster key's trailer (``wire/auth.py``): layout, seal and open."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from udpverbs.wire import auth
from udpverbs.wire.errors import WireError

from .strategies import SETTINGS, u32, u64

KEY = bytes(range(32))
A, B, C = ("127.0.0.2", 18515), ("127.0.0.3", 18515), ("127.0.0.4", 18515)


@SETTINGS
@given(salt=u32, pn=u64, tag=st.binary(min_size=16, max_size=16))
def test_fast_codec_agrees_with_the_declaration(salt: int, pn: int, tag: bytes) -> None:
    built = auth.TRAILER.build({"salt": salt, "pn": pn, "tag": tag})
    assert built == auth.NONCE.pack(salt, pn) + tag
    parsed = auth.TRAILER.parse(built)
    assert (parsed.salt, parsed.pn, parsed.tag) == (*auth.NONCE.unpack_from(built), built[auth.NONCE_LEN:])
    assert auth.TRAILER_LEN == len(built) == 28


def test_known_layout() -> None:
    mac = auth.PairMac(auth.pair_key(KEY, A, B))
    sealed = mac.seal(b"link packet", 0x01020304, 0x1122334455667788)
    assert sealed[:11] == b"link packet"
    assert sealed[11:23] == bytes.fromhex("01020304" "1122334455667788")
    body, pn = mac.open_untrusted(memoryview(sealed))
    assert (bytes(body), pn) == (b"link packet", 0x1122334455667788)


@SETTINGS
@given(body=st.binary(min_size=1, max_size=200), salt=u32, pn=u64, data=st.data())
def test_any_changed_byte_fails(body: bytes, salt: int, pn: int, data: st.DataObject) -> None:
    mac = auth.PairMac(auth.pair_key(KEY, A, B))
    sealed = bytearray(mac.seal(body, salt, pn))
    i = data.draw(st.integers(0, len(sealed) - 1))
    sealed[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(WireError) as e:
        mac.open_untrusted(memoryview(sealed))
    assert e.value.reason == "bad_mac"


def test_a_datagram_is_valid_only_between_the_two_daemons_it_names() -> None:
    sealed = memoryview(auth.PairMac(auth.pair_key(KEY, A, B)).seal(b"x" * 40, 1, 2))
    for key, src, dst in ((KEY, B, A), (KEY, A, C), (KEY, C, B), (KEY, A, ("127.0.0.3", 18516)),
                          (bytes(32), A, B)):
        with pytest.raises(WireError):
            auth.PairMac(auth.pair_key(key, src, dst)).open_untrusted(sealed)


@pytest.mark.parametrize("n", [0, 1, auth.TRAILER_LEN])
def test_too_short_to_carry_a_trailer(n: int) -> None:
    with pytest.raises(WireError) as e:
        auth.PairMac(auth.pair_key(KEY, A, B)).open_untrusted(memoryview(bytes(n)))
    assert e.value.reason == "truncated"
