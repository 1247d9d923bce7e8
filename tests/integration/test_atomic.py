"""RFC 7306 atomics between real daemons: values, protection, and atomicity across processes and daemons."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import tempfile
import time
from typing import Iterator

import pytest

from udpverbs import verbs
from udpverbs.verbs.enums import (
    IBV_ACCESS_LOCAL_WRITE,
    IBV_ACCESS_REMOTE_ATOMIC,
    IBV_ACCESS_REMOTE_READ,
    IBV_ACCESS_REMOTE_WRITE,
    IBV_SEND_SIGNALED,
    IBV_WC_COMP_SWAP,
    IBV_WC_FETCH_ADD,
    IBV_WC_REM_ACCESS_ERR,
    IBV_WC_SUCCESS,
    IBV_WR_ATOMIC_CMP_AND_SWP,
    IBV_WR_ATOMIC_FETCH_AND_ADD,
)

from .conftest import Side, connect_manual
from .daemons import DaemonProc

ATOMIC_ALL = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _atomic(qp: verbs.QP, mr: verbs.MR, opcode: int, rkey: int, addr: int, compare_add: int, swap: int = 0) -> None:
    wr = verbs.SendWR(wr_id=opcode, opcode=opcode, sg=[verbs.SGE(mr.buf, 8, mr.lkey)], send_flags=IBV_SEND_SIGNALED)
    wr.set_wr_atomic(rkey, addr, compare_add, swap)
    qp.post_send(wr)


def _word(mr: verbs.MR, off: int = 0) -> int:
    return int(struct.unpack("=Q", mr.read(8, off))[0])


def test_fetch_add_and_compare_swap(daemons) -> None:
    a, b = Side(daemons[0], access=ATOMIC_ALL), Side(daemons[1], access=ATOMIC_ALL)
    try:
        connect_manual(a, a.qp, b, b.qp)
        b.mr.write(struct.pack("=Q", 0xFFFFFFFFFFFFFFFE), 8, 64)
        _atomic(a.qp, a.mr, IBV_WR_ATOMIC_FETCH_AND_ADD, b.mr.rkey, b.mr.buf + 64, 5)
        (wc,) = a.cq.poll_blocking(1, timeout=10)
        assert (wc.status, wc.opcode, wc.byte_len) == (IBV_WC_SUCCESS, IBV_WC_FETCH_ADD, 8)
        assert _word(a.mr) == 0xFFFFFFFFFFFFFFFE and _word(b.mr, 64) == 3  # wraps modulo 2**64
        _atomic(a.qp, a.mr, IBV_WR_ATOMIC_CMP_AND_SWP, b.mr.rkey, b.mr.buf + 64, 4, 99)  # compare fails
        _atomic(a.qp, a.mr, IBV_WR_ATOMIC_CMP_AND_SWP, b.mr.rkey, b.mr.buf + 64, 3, 42)  # compare holds
        wcs = a.cq.poll_blocking(2, timeout=10)
        assert [(w.status, w.opcode) for w in wcs] == [(IBV_WC_SUCCESS, IBV_WC_COMP_SWAP)] * 2
        assert _word(a.mr) == 3 and _word(b.mr, 64) == 42
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("case", ["no_atomic_access", "unaligned", "out_of_bounds"])
def test_atomic_protection(daemons, case: str) -> None:
    access = ATOMIC_ALL & ~IBV_ACCESS_REMOTE_ATOMIC if case == "no_atomic_access" else ATOMIC_ALL
    a, b = Side(daemons[0], access=ATOMIC_ALL), Side(daemons[1], access=access)
    try:
        connect_manual(a, a.qp, b, b.qp)
        b.mr.write(b"\x5a" * 64, 64, 0)
        off = {"no_atomic_access": 8, "unaligned": 12, "out_of_bounds": b.mr.length - 4}[case]
        _atomic(a.qp, a.mr, IBV_WR_ATOMIC_FETCH_AND_ADD, b.mr.rkey, b.mr.buf + off, 1)
        (wc,) = a.cq.poll_blocking(1, timeout=10)
        assert wc.status == IBV_WC_REM_ACCESS_ERR
        assert b.mr.read(64, 0) == b"\x5a" * 64
    finally:
        a.close()
        b.close()


@pytest.fixture(scope="module")
def five_daemons() -> Iterator[list[DaemonProc]]:
    """A daemon that holds the words, and four daemons for the workers."""
    with tempfile.TemporaryDirectory(prefix="udpverbs-atomic-") as d:
        procs: list[DaemonProc] = []
        try:
            for i in range(5):
                procs.append(DaemonProc(f"uvT{i}", f"127.0.1.{i + 1}", d, seed=30 + i).start())
            yield procs
        finally:
            for p in procs:
                assert p.stop() == 0, p.log_text()


def _run_workers(daemons: list[DaemonProc], n: int, mode: str, count: int) -> tuple[Side, verbs.MR]:
    owner = Side(daemons[0], mr_size=4096, access=ATOMIC_ALL, cap=verbs.QPCap(1, 1))
    word = owner.mr
    procs = []
    try:
        for i in range(n):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.integration.atomic_worker", daemons[1 + i % 4].socket_path, mode,
                 str(count)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        for p in procs:
            assert p.stdout is not None and p.stdin is not None
            qpn, gid, lid = p.stdout.readline().split()
            qp = owner.new_qp(verbs.QPCap(1, 1))
            attr = verbs.QPAttr(qp_access_flags=ATOMIC_ALL, dest_qp_num=int(qpn), max_rd_atomic=1,
                                max_dest_rd_atomic=1)
            attr.ah_attr = verbs.AHAttr(dlid=int(lid), gr=verbs.GlobalRoute(dgid=bytes.fromhex(gid.decode())))
            qp.to_rts(attr)
            p.stdin.write(f"{qp.qp_num} {owner.ctx.query_gid().raw.hex()} {owner.ctx.query_port().lid} "
                          f"{word.rkey} {word.buf}\n".encode())
            p.stdin.flush()
        deadline = time.monotonic() + 240
        for p in procs:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert p.returncode == 0, err.decode()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return owner, word


def test_sixteen_processes_on_four_daemons_fetch_add_one_counter(five_daemons) -> None:
    owner, word = _run_workers(five_daemons, 16, "fadd", 1000)
    try:
        assert _word(word, 0) == 16_000
    finally:
        owner.close()


def test_cas_spinlock_protects_a_counter(five_daemons) -> None:
    # The increment itself is a Read then a Write: without the lock, concurrent
    # workers would lose updates.
    owner, word = _run_workers(five_daemons, 4, "lock", 40)
    try:
        assert _word(word, 0) == 0  # the lock is free at the end
        assert _word(word, 8) == 4 * 40
    finally:
        owner.close()
