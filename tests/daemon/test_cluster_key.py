"""The cluster key in the daemon: its file, the MTU, and the UDP port's sealing and opening.

The port tests use real ``UdpPort`` objects on loopback: what one sends,
sealed, another opens, or a plain socket reads as it is on the wire.
"""

from __future__ import annotations

import collections
import os
import socket
import stat
import subprocess
import sys

import pytest

from udpverbs.daemon import clusterkey, config, udp
from udpverbs.daemon.clusterkey import Guard, KeyFileError, load_key, write_new_key
from udpverbs.transport.link import Burst
from udpverbs.wire import auth
from udpverbs.wire import link as wire_link

KEY = bytes(range(32))
MTU = 1472


# -- the key file -----------------------------------------------------------------
def test_keygen_writes_a_private_key_the_daemon_loads(tmp_path) -> None:
    path = str(tmp_path / "cluster.key")
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-m", "udpverbs.cli", "keygen", path], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    key = load_key(path)
    assert len(key) == 32 and key != load_key_of_new(tmp_path / "other.key")
    r = subprocess.run([sys.executable, "-m", "udpverbs.cli", "keygen", path], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "never overwritten" in r.stderr
    assert load_key(path) == key


def load_key_of_new(path) -> bytes:
    write_new_key(str(path))
    return load_key(str(path))


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o644])
def test_a_key_others_may_read_or_write_is_refused_with_the_fix(tmp_path, mode: int) -> None:
    path = tmp_path / "k"
    write_new_key(str(path))
    os.chmod(path, mode)
    with pytest.raises(KeyFileError, match=f"chmod 600 {path}"):
        load_key(str(path))


@pytest.mark.parametrize("text, why", [("ab" * 31, "at least 32"), ("zz" * 32, "not hex"), ("", "at least 32")])
def test_a_short_or_garbled_key_is_refused(tmp_path, text: str, why: str) -> None:
    path = tmp_path / "k"
    path.write_text(text + "\n")
    os.chmod(path, 0o600)
    with pytest.raises(KeyFileError, match=why):
        load_key(str(path))


def test_the_daemon_refuses_a_bad_key_before_it_binds(tmp_path) -> None:
    path = tmp_path / "k"
    write_new_key(str(path))
    os.chmod(path, 0o644)
    r = subprocess.run([sys.executable, "-m", "udpverbs.daemon", "--key-file", str(path), "--port", "0",
                        "--socket", str(tmp_path / "d.sock")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"chmod 600 {path}" in r.stderr
    os.chmod(path, 0o600)
    with pytest.raises(ValueError, match="wildcard"):
        config.configure(["--key-file", str(path), "--addr", "0.0.0.0"])
    with pytest.raises(KeyFileError, match="No such file"):
        config.configure(["--key-file", str(tmp_path / "missing")])
    toml = tmp_path / "d.toml"
    toml.write_text(f'key_file = "{path}"\n')
    assert config.configure(["--config", str(toml)])["key"] == load_key(str(path))


def test_a_full_datagram_with_its_trailer_fits_the_mtu() -> None:
    plain = config.link_config(config.DeviceConfig(mtu=MTU))
    keyed = config.link_config(config.DeviceConfig(mtu=MTU, key=KEY))
    assert plain.max_payload + wire_link.OVERHEAD == MTU
    assert keyed.max_payload + wire_link.OVERHEAD + auth.TRAILER_LEN == MTU


# -- sealing and opening on real sockets --------------------------------------------
class Ports:
    """A sealing port at 127.0.0.2, and at 127.0.0.3 a sealing port and a plain socket."""

    def __init__(self, gro: bool = True) -> None:
        self.stats_a: collections.Counter[str] = collections.Counter()
        self.stats_b: collections.Counter[str] = collections.Counter()
        self.a, self.b = udp.UdpPort(self.stats_a), udp.UdpPort(self.stats_b)
        self.addr_a = self.a.bind("127.0.0.2", 0, True)
        self.addr_b = self.b.bind("127.0.0.3", 0, gro)
        self.a.seal_with(Guard(KEY, self.addr_a, self.stats_a))
        self.b.seal_with(Guard(KEY, self.addr_b, self.stats_b))
        self.plain = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.plain.bind(("127.0.0.3", 0))
        self.plain.settimeout(5)
        self.addr_plain = self.plain.getsockname()

    def close(self) -> None:
        self.a.close()
        self.b.close()
        self.plain.close()

    def read_b(self) -> tuple[bytes, int]:
        """What ``b.receive`` answers once a datagram is there: (data, datagram size)."""
        for _ in range(1000):
            got = self.b.receive(0.0, 0.0)
            if got is not None:
                return got[0], got[2]
            select_wait(self.b)
        raise AssertionError("nothing arrived")


def select_wait(port: udp.UdpPort) -> None:
    assert port.rx_epoll is not None
    port.rx_epoll.poll(1.0)


def datagrams(n: int, size: int, last: int | None = None) -> list[bytes]:
    out = [bytes([i]) * size for i in range(n)]
    if last is not None:
        out[-1] = out[-1][:last]
    return out


def test_every_segment_of_a_gso_run_carries_its_own_trailer_within_the_mtu() -> None:
    p = Ports()
    try:
        if not p.a.gso:
            pytest.skip("no UDP_SEGMENT here")
        size = MTU - auth.TRAILER_LEN
        plain = datagrams(45, size)  # 45 × 1444 B fit one send; sealed, 45 × 1472 B would not
        p.a.send_segmented([Burst(memoryview(b"".join(plain)), size)], p.addr_plain)
        mac = auth.PairMac(auth.pair_key(KEY, p.addr_a, p.addr_plain))
        pns = []
        for want in plain:
            d = p.plain.recv(65536)
            assert len(d) == len(want) + auth.TRAILER_LEN <= MTU
            body, pn = mac.open_untrusted(memoryview(d))
            assert bytes(body) == want
            pns.append(pn)
        assert pns == list(range(pns[0], pns[0] + len(plain)))
        assert p.stats_a["tx_gso_sends"] >= 2  # cut in two so the trailers fit
        assert p.stats_a["tx_oserror"] == 0 and p.stats_a["tx_gso_refused"] == 0
    finally:
        p.close()


def test_a_gro_batch_is_opened_datagram_by_datagram_and_stays_one_buffer() -> None:
    p = Ports()
    try:
        if not (p.a.gso and p.b.gro):
            pytest.skip("no UDP_SEGMENT / UDP_GRO here")
        plain = datagrams(10, 1000, last=300)
        p.a.send_segmented([Burst(memoryview(b"".join(plain)), 1000)], p.addr_b)
        got, seg = b"", 0
        while len(got) < 9300:
            data, seg = p.read_b()
            assert seg == 1000 or len(data) == seg  # stripped: the sender's own size
            got += data
        assert got == b"".join(plain)
        assert p.stats_b["rx_gro_batches"] >= 1 and p.stats_b["auth_failed"] == 0
    finally:
        p.close()


def test_a_forged_or_replayed_datagram_is_dropped_and_counted() -> None:
    p = Ports(gro=False)
    try:
        sealed = p.a.guard.seal(b"hello", p.addr_b)
        sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            # p.a's own socket, so that the source is p.a's address
            assert p.a.sock is not None
            p.a.sock.sendto(sealed, p.addr_b)
            assert p.read_b() == (b"hello", 5)
            p.a.sock.sendto(sealed, p.addr_b)  # the same again: a replay
            assert p.read_b() == (sealed, -1)
            assert p.stats_b["auth_replayed"] == 1
            forged = bytearray(sealed)
            forged[0] ^= 1
            p.a.sock.sendto(bytes(forged), p.addr_b)
            sender.sendto(sealed, p.addr_b)  # valid, but from the wrong address
            p.a.sock.sendto(b"hello", p.addr_b)  # no trailer at all
            p.a.sock.sendto(b"", p.addr_b)
            for _ in range(4):
                assert p.read_b()[1] == -1
            assert p.stats_b["auth_failed"] == 4 and p.stats_b["auth_replayed"] == 1
            p.a.sendto(b"again", p.addr_b)  # the port's own path still goes through
            assert p.read_b() == (b"again", 5)
        finally:
            sender.close()
    finally:
        p.close()


def test_peer_state_is_kept_only_for_valid_peers_and_bounded(monkeypatch) -> None:
    monkeypatch.setattr(clusterkey, "MAX_PEERS", 4)
    me = ("127.0.0.3", 9)
    g = Guard(KEY, me, collections.Counter())
    for i in range(10):
        src = ("127.0.0.2", 1000 + i)
        g.open(b"x" * 50, src, 50, 0.0)
        assert not g._rx
    for i in range(10):
        src = ("127.0.0.2", 1000 + i)
        d = Guard(KEY, src, collections.Counter()).seal(b"x" * 50, me)
        assert g.open(d, src, len(d), 0.0)[2] == 50
    assert len(g._rx) == 4 and g.stats["auth_failed"] == 10
