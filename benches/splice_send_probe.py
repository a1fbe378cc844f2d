"""Is a sender that does not copy cheaper on this kernel? Issue 26's integrity row at 512 KiB
needs our TCP path plus a tag on every byte to cost no more CPU than a plain socket stream
(the stream fills both cores here). One way under the stream's CPU would be a sender that
hands its pages to the socket instead of copying them: ``vmsplice`` into a pipe, then
``splice`` into the socket. This probe times both senders over loopback, 512 KiB a call
walking a 256 MiB buffer, against a receiver that ``recv_into``s a 512 KiB buffer, and
reports GB/s and CPU-seconds per GB of each end (``os.times`` of each process).

    python benches/splice_send_probe.py [--seconds 3] [--pairs 2]

Not a transfer path: a spliced page is read by the kernel after ``splice`` returns, so a
sender could not reuse its buffer at once (Linux only; ``vmsplice`` through ctypes).
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import os
import socket
import time

import numpy as np

CHUNK = 512 << 10
WALK = 256 << 20
F_SETPIPE_SZ = 1031


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _receive(srv: socket.socket, report: int) -> None:
    conn, _ = srv.accept()
    view = memoryview(bytearray(CHUNK))
    got = 0
    t0 = os.times()
    while n := conn.recv_into(view):
        got += n
    t1 = os.times()
    os.write(report, f"{(t1.user + t1.system - t0.user - t0.system) / (got / 1e9):.3f}\n".encode())


def one(mode: str, seconds: float) -> tuple[float, float, float]:
    """(GB/s, sender CPU-s/GB, receiver CPU-s/GB) of one run of ``mode`` (send / splice)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _receive(srv, report_w)
        finally:
            os._exit(0)
    sock = socket.create_connection(srv.getsockname())
    data = np.random.default_rng(1).integers(0, 256, WALK, dtype=np.uint8)
    pipe_r, pipe_w = os.pipe()
    fcntl.fcntl(pipe_w, F_SETPIPE_SZ, 1 << 20)
    sent = off = 0
    t0, c0 = time.perf_counter(), os.times()
    while time.perf_counter() - t0 < seconds:
        if mode == "send":
            sock.sendall(memoryview(data)[off:off + CHUNK])
        else:
            done = 0
            while done < CHUNK:
                iov = _IoVec(data.ctypes.data + off + done, CHUNK - done)
                k = libc.vmsplice(pipe_w, ctypes.byref(iov), 1, 0)
                if k < 0:
                    raise OSError(ctypes.get_errno(), "vmsplice")
                left = k
                while left:
                    left -= os.splice(pipe_r, sock.fileno(), left, flags=os.SPLICE_F_MOVE | os.SPLICE_F_MORE)
                done += k
        sent += CHUNK
        off = (off + CHUNK) % WALK
    elapsed, c1 = time.perf_counter() - t0, os.times()
    sock.shutdown(socket.SHUT_WR)
    os.waitpid(pid, 0)
    recv_cpu = float(os.read(report_r, 64).decode())
    for fd in (pipe_r, pipe_w, report_r, report_w):
        os.close(fd)
    sock.close()
    srv.close()
    return sent / elapsed / 1e9, (c1.user + c1.system - c0.user - c0.system) / (sent / 1e9), recv_cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--pairs", type=int, default=2)
    a = ap.parse_args()
    print("| pair | sender | GB/s | sender CPU-s/GB | receiver CPU-s/GB |")
    print("|---|---|---|---|---|")
    for p in range(a.pairs):
        for mode in ("send", "splice"):
            gbps, send_cpu, recv_cpu = one(mode, a.seconds)
            print(f"| {p + 1} | {mode} | {gbps:.2f} | {send_cpu:.3f} | {recv_cpu:.3f} |", flush=True)


if __name__ == "__main__":
    main()
