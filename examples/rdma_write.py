"""Move a buffer by RDMA Write, read it back by RDMA Read, check it (perftest style).

Two processes, each talking to its own udpverbs daemon:

  host B:  udpverbsd --name uvB --addr <B's IP>
           python examples/rdma_write.py server --device uvB --oob-port 18600
  host A:  udpverbsd --name uvA --addr <A's IP>
           python examples/rdma_write.py client --device uvA --server <B's IP>:18600

Like perftest, the two sides first swap what RDMA needs over a plain TCP
connection ("out of band"): QP number, the daemon's GID (its IP address) and
UDP port (reported as the port's LID), and the server's buffer address and
rkey.  Each side then moves its QP RESET -> INIT -> RTR -> RTS by hand.  The
client writes a random buffer into the server's memory with one RDMA Write,
reads it back into a second local buffer with one RDMA Read, and both sides
compare.

  python examples/rdma_write.py --local

starts two daemons on loopback (127.0.0.2 and 127.0.0.3) in a temporary
runtime directory, runs both roles as separate processes, stops the daemons
and exits 0 only if the data matched.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import BinaryIO

from udpverbs import verbs
from udpverbs.verbs.enums import (
    IBV_ACCESS_LOCAL_WRITE,
    IBV_ACCESS_REMOTE_READ,
    IBV_ACCESS_REMOTE_WRITE,
    IBV_QPT_RC,
    IBV_SEND_SIGNALED,
    IBV_WC_SUCCESS,
    IBV_WR_RDMA_READ,
    IBV_WR_RDMA_WRITE,
)

ACCESS = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ


def setup(device: str, size: int) -> tuple[verbs.Context, verbs.MR, verbs.CQ, verbs.QP]:
    ctx = verbs.Context(name=device)
    pd = verbs.PD(ctx)
    mr = verbs.MR(pd, 2 * size, ACCESS)  # first half: data; second half: where the Read lands
    cq = verbs.CQ(ctx, 16)
    qp = verbs.QP(pd, verbs.QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq, cap=verbs.QPCap(4, 4, 1, 1)))
    return ctx, mr, cq, qp


def my_info(ctx: verbs.Context, mr: verbs.MR, qp: verbs.QP) -> dict:
    return {"qpn": qp.qp_num, "gid": ctx.query_gid().gid, "lid": ctx.query_port().lid,
            "rkey": mr.rkey, "addr": mr.buf}


def to_rts(qp: verbs.QP, peer: dict) -> None:
    attr = verbs.QPAttr(qp_access_flags=ACCESS, dest_qp_num=peer["qpn"], max_rd_atomic=1, max_dest_rd_atomic=1)
    # The address vector names the peer's daemon: dgid = its IP, dlid = its UDP port.
    attr.ah_attr = verbs.AHAttr(dlid=peer["lid"], gr=verbs.GlobalRoute(dgid=peer["gid"]))
    qp.to_rts(attr)  # RESET -> INIT -> RTR -> RTS


def exchange(conn: socket.socket, lines: BinaryIO, mine: dict) -> dict:
    """Send our line, read the peer's.  ``lines`` is the one buffered reader of
    ``conn``: a second reader would miss whatever the first read ahead."""
    conn.sendall(json.dumps(mine).encode() + b"\n")
    return json.loads(lines.readline())


def run_server(args: argparse.Namespace) -> int:
    ctx, mr, cq, qp = setup(args.device, args.size)
    with ctx, socket.create_server((args.oob_bind, args.oob_port)) as srv:
        if args.ready_fd is not None:
            os.write(args.ready_fd, b"ready\n")
            os.close(args.ready_fd)
        srv.settimeout(args.timeout)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(args.timeout)
            lines = conn.makefile("rb")
            peer = exchange(conn, lines, my_info(ctx, mr, qp))
            to_rts(qp, peer)
            conn.sendall(b"rts\n")
            done = json.loads(lines.readline())  # the client finished its Write and Read
            got = hashlib.sha256(mr.read(args.size, 0)).hexdigest()
            ok = got == done["sha256"]
            conn.sendall(json.dumps({"ok": ok}).encode() + b"\n")
    print(f"server: {args.size} bytes arrived by RDMA Write, {'match' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def run_client(args: argparse.Namespace) -> int:
    host, port = args.server.rsplit(":", 1)
    ctx, mr, cq, qp = setup(args.device, args.size)
    data = os.urandom(args.size)
    mr.write(data, args.size, 0)
    with ctx, socket.create_connection((host, int(port)), timeout=args.timeout) as conn:
        lines = conn.makefile("rb")
        peer = exchange(conn, lines, my_info(ctx, mr, qp))
        to_rts(qp, peer)
        assert lines.readline() == b"rts\n"  # the server's QP is ready to receive
        t0 = time.perf_counter()
        wr = verbs.SendWR(wr_id=1, opcode=IBV_WR_RDMA_WRITE, sg=[verbs.SGE(mr.buf, args.size, mr.lkey)],
                          send_flags=IBV_SEND_SIGNALED)
        wr.set_wr_rdma(peer["rkey"], peer["addr"])
        qp.post_send(wr)
        (wc,) = cq.poll_blocking(1, timeout=args.timeout)
        t1 = time.perf_counter()
        if wc.status != IBV_WC_SUCCESS:
            print(f"client: RDMA Write failed: {wc}")
            return 1
        wr = verbs.SendWR(wr_id=2, opcode=IBV_WR_RDMA_READ, sg=[verbs.SGE(mr.buf + args.size, args.size, mr.lkey)],
                          send_flags=IBV_SEND_SIGNALED)
        wr.set_wr_rdma(peer["rkey"], peer["addr"])
        qp.post_send(wr)
        (wc,) = cq.poll_blocking(1, timeout=args.timeout)
        t2 = time.perf_counter()
        if wc.status != IBV_WC_SUCCESS:
            print(f"client: RDMA Read failed: {wc}")
            return 1
        back = mr.read(args.size, args.size)
        conn.sendall(json.dumps({"sha256": hashlib.sha256(data).hexdigest()}).encode() + b"\n")
        server_ok = json.loads(lines.readline())["ok"]
    ok = back == data and server_ok
    mb = args.size / 1e6
    print(f"client: wrote {args.size} bytes in {1e3 * (t1 - t0):.2f} ms ({mb / (t1 - t0):.1f} MB/s), "
          f"read back in {1e3 * (t2 - t1):.2f} ms ({mb / (t2 - t1):.1f} MB/s): {'match' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def _wait_line(fd: int, timeout: float, what: str) -> str:
    buf = b""
    deadline = time.monotonic() + timeout
    while not buf.endswith(b"\n"):
        r, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not r:
            raise TimeoutError(f"{what} not ready after {timeout} s")
        chunk = os.read(fd, 256)
        if not chunk:
            raise RuntimeError(f"{what} exited before it was ready")
        buf += chunk
    return buf.decode()


def _spawn(argv: list[str], env: dict, what: str, timeout: float) -> subprocess.Popen:
    """Start a process that writes one line to --ready-fd when it is ready; wait for it."""
    r, w = os.pipe()
    try:
        p = subprocess.Popen([*argv, "--ready-fd", str(w)], pass_fds=(w,), env=env)
    finally:
        os.close(w)
    try:
        _wait_line(r, timeout, what)
    except BaseException:
        p.kill()
        p.wait()
        raise
    finally:
        os.close(r)
    return p


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_local(args: argparse.Namespace) -> int:
    py = sys.executable
    me = os.path.abspath(__file__)
    with tempfile.TemporaryDirectory(prefix="udpverbs-example-") as rundir:
        env = dict(os.environ, UDPVERBS_RUNTIME_DIR=rundir)
        procs: list[subprocess.Popen] = []
        try:
            for name, addr in (("uvA", "127.0.0.2"), ("uvB", "127.0.0.3")):
                procs.append(_spawn([py, "-m", "udpverbs.daemon", "--name", name, "--addr", addr, "--port", "0",
                                     "--log-level", "WARNING"],
                                    env, f"daemon {name}", args.timeout))
            with socket.socket() as s:  # a free TCP port for the out-of-band exchange
                s.bind(("127.0.0.1", 0))
                oob = s.getsockname()[1]
            server = _spawn([py, me, "server", "--device", "uvB", "--oob-bind", "127.0.0.1", "--oob-port", str(oob),
                             "--size", str(args.size)], env, "server", args.timeout)
            procs.append(server)
            client = subprocess.run([py, me, "client", "--device", "uvA", "--server", f"127.0.0.1:{oob}",
                                     "--size", str(args.size)], env=env, timeout=args.timeout * 3)
            server_rc = server.wait(args.timeout)
            ok = client.returncode == 0 and server_rc == 0
        finally:
            for p in reversed(procs):
                _stop(p)
    print("rdma_write example:", "OK" if ok else "FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("role", nargs="?", choices=("server", "client"))
    p.add_argument("--local", action="store_true", help="start two daemons on loopback and run both roles")
    p.add_argument("--device", default="uv0", help="udpverbs device (daemon) name")
    p.add_argument("--server", default="127.0.0.1:18600", help="client: the server's out-of-band host:port")
    p.add_argument("--oob-port", type=int, default=18600, help="server: TCP port for the out-of-band exchange")
    p.add_argument("--oob-bind", default="0.0.0.0", help="server: address for the out-of-band TCP port")
    p.add_argument("--size", type=int, default=1 << 20, help="bytes to move (default 1 MiB)")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.local:
        return run_local(args)
    if args.role == "server":
        return run_server(args)
    if args.role == "client":
        return run_client(args)
    p.error("give a role (server/client) or --local")
    return 2


if __name__ == "__main__":
    sys.exit(main())
