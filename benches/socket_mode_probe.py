#!/usr/bin/env python3
"""What decides the plain socket stream's speed at 64 KiB on a 2-core host (issue 26).

  python benches/socket_mode_probe.py [--sizes 64] [--batches 32,64] [--trials 6] [--seconds 0.4]
  python benches/socket_mode_probe.py --sizes 512 --engine write --engine-auth integrity

The reference of ``transfer_bench.py`` (``SocketRef``: a Python sender, a Python
receiver child, ``size``-byte sends of ``size x batch`` bytes a call walking a 256 MiB
buffer, one ack a call) measured 1.5 GB/s in some rounds and 4.3 GB/s in others at 64 KiB.
This probe runs the same stream under fixed placements, interleaved trial by trial:

* ``free``: no affinity (what the bench does);
* ``same``: sender and receiver pinned to one core (the other core idle for them);
* ``split``: sender on one core, receiver on the other;

and prints per placement: GB/s, CPU-s/GB of both ends, context switches per MB (voluntary
= the thread slept: a wake-up each; involuntary = preempted), NET_RX softirqs per MB on
each CPU, and for ``free`` the CPU each end ran on at the end of each call (how often
they shared one). Nothing is asserted: it is a measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mooncake_rs as mc
from transfer_bench import AUTH_VARIANTS, WS, SocketRef, call_base, cpu_s, start_peer, stop

MB = 1e6


def ctx_switches(pid):
    """(voluntary, involuntary) context switches of every thread of ``pid``."""
    vol = inv = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        vol += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        inv += int(line.split()[1])
        except OSError:
            pass
    return vol, inv


def per_thread(pid):
    """thread name -> [CPU s, voluntary, involuntary] summed over ``pid``'s threads."""
    out: dict[str, list[float]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            base = f"/proc/{pid}/task/{tid}"
            name = open(f"{base}/comm").read().strip()
            cpu = int(open(f"{base}/schedstat").read().split()[0]) / 1e9
            vol = inv = 0
            for line in open(f"{base}/status"):
                if line.startswith("voluntary_ctxt_switches"):
                    vol = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    inv = int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
        acc = out.setdefault(name, [0.0, 0, 0])
        acc[0] += cpu
        acc[1] += vol
        acc[2] += inv
    return out


def net_rx():
    with open("/proc/softirqs") as f:
        for line in f:
            if line.strip().startswith("NET_RX:"):
                return [int(x) for x in line.split()[1:]]
    return []


def last_cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


PLACEMENTS = {"free": None, "same": (0, 0), "split": (0, 1), "same1": (1, 1), "split10": (1, 0)}


def place(ref, which):
    me, child = os.getpid(), ref.p.pid
    cpus = set(range(os.cpu_count() or 1))
    pin = PLACEMENTS[which]
    os.sched_setaffinity(me, {pin[0]} if pin else cpus)
    os.sched_setaffinity(child, {pin[1]} if pin else cpus)


def trial(ref, size, nb, seconds, k0):
    total = size * nb
    me, child = os.getpid(), ref.p.pid
    c0, v0, x0, n0 = cpu_s(me, child), ctx_switches(me), ctx_switches(child), net_rx()
    lat, shared, k = [], 0, k0
    t_end = time.perf_counter() + seconds
    while len(lat) < 3 or time.perf_counter() < t_end:
        t = time.perf_counter()
        ref.stream(size, total, call_base("walk", k, total))
        lat.append(time.perf_counter() - t)
        k += 1
        shared += last_cpu(me) == last_cpu(child)
    moved = total * len(lat)
    c1, v1, x1, n1 = cpu_s(me, child), ctx_switches(me), ctx_switches(child), net_rx()
    return k, {
        "GBps": total / statistics.median(lat) / 1e9,
        "cpu_s_per_GB": (c1 - c0) / (moved / 1e9),
        "send_vol_per_MB": (v1[0] - v0[0]) / (moved / MB),
        "send_inv_per_MB": (v1[1] - v0[1]) / (moved / MB),
        "recv_vol_per_MB": (x1[0] - x0[0]) / (moved / MB),
        "recv_inv_per_MB": (x1[1] - x0[1]) / (moved / MB),
        "netrx_per_MB": [round((b - a) / (moved / MB), 2) for a, b in zip(n0, n1)],
        "same_cpu_share": shared / len(lat),
    }


class EngineSide:
    """Our engine writing to / reading from a peer process, the bench's case: no token, or
    with a token and the given ``wire_protection`` (``encrypted`` or ``integrity``)."""

    def __init__(self, conns=None, protection=None):
        tok = {} if protection is None else {"auth_token": "probe-token", "wire_protection": protection}
        self.peer, info = start_peer(name="probe-peer", regions=[{"name": "r", "length": WS, "fill": False}],
                                     transports=["tcp"], **tok)
        extra = {} if conns is None else {"connections_per_endpoint": conns}
        self.e = mc.TransferEngine("probe-init", transports=["tcp"], registry=mc.TransferRegistry(), **tok, **extra)
        self.p = self.e.connect("probe-peer", info["address"])
        self.mine = self.e.allocate(WS)
        self.rid = info["regions"]["r"]

    def place(self, which):
        """Pins every thread of this process and of the peer (``same``: both on CPU 0;
        ``split``: this one on CPU 0, the peer on CPU 1; ``free``: no pinning)."""
        cpus = set(range(os.cpu_count() or 1))
        pin = PLACEMENTS[which]
        for pid, cpu in ((os.getpid(), pin and pin[0]), (self.peer.pid, pin and pin[1])):
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    os.sched_setaffinity(int(tid), cpus if pin is None else {cpu})
                except OSError:
                    pass

    def run(self, op, size, nb, seconds, k0):
        total = size * nb
        pids = {"init": os.getpid(), "peer": self.peer.pid}
        before = {side: per_thread(pid) for side, pid in pids.items()}
        n0 = net_rx()
        lat, k = [], k0
        t_end = time.perf_counter() + seconds
        while len(lat) < 3 or time.perf_counter() < t_end:
            base = call_base("walk", k, total)
            reqs = [mc.TransferRequest(op, self.mine, base + i * size, self.p, self.rid, base + i * size, size)
                    for i in range(nb)]
            t = time.perf_counter()
            st = self.e.submit(reqs, timeout_s=60).wait()
            lat.append(time.perf_counter() - t)
            assert all(s.ok for s in st), st[0]
            k += 1
        mb = total * len(lat) / MB
        threads = {}
        for side, pid in pids.items():
            after = per_thread(pid)
            for name, (cpu, vol, inv) in after.items():
                b = before[side].get(name, [0.0, 0, 0])
                if cpu - b[0] > 1e-4:
                    threads[f"{side}:{name}"] = ((cpu - b[0]) / (mb / 1e3), (vol - b[1]) / mb, (inv - b[2]) / mb)
        n1 = net_rx()
        return k, {"GBps": total / statistics.median(lat) / 1e9,
                   "cpu_s_per_GB": sum(t[0] for t in threads.values()),
                   "threads": threads,
                   "netrx_per_MB": [round((b - a) / mb, 2) for a, b in zip(n0, n1)]}

    def close(self):
        self.e.close()
        stop(self.peer)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64", help="send sizes in KiB")
    ap.add_argument("--batches", default="32,64")
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=0.4)
    ap.add_argument("--placements", default="free,same,split")
    ap.add_argument("--engine", default="", help="also our engine's ops (write,read)")
    ap.add_argument("--engine-auth", default=None, choices=sorted(AUTH_VARIANTS),
                    help="our engine with a token and this wire protection (default: no token)")
    ap.add_argument("--engine-placements", default="free", help="placements of our engine's two processes")
    ap.add_argument("--engine-conns", type=int, default=None, help="connections_per_endpoint (default: the engine's)")
    a = ap.parse_args()
    ref = SocketRef()
    eng = EngineSide(a.engine_conns, a.engine_auth) if a.engine else None
    erows: dict[tuple, list[dict]] = {}
    rows: dict[tuple, list[dict]] = {}
    k = 0
    try:
        ref.stream(64 << 10, WS // 2)  # touch both buffers once
        for _ in range(a.trials):
            for size in (int(s) << 10 for s in a.sizes.split(",")):
                for nb in (int(b) for b in a.batches.split(",")):
                    for which in a.placements.split(","):
                        place(ref, which)
                        k, row = trial(ref, size, nb, a.seconds, k)
                        rows.setdefault((size >> 10, nb, which), []).append(row)
                    place(ref, "free")
                    for which in a.engine_placements.split(",") if eng else ():
                        eng.place(which)
                        for op in filter(None, a.engine.split(",")):
                            k, row = eng.run(op, size, nb, a.seconds, k)
                            erows.setdefault((size >> 10, nb, f"{op}/{which}"), []).append(row)
                    if eng:
                        eng.place("free")
        place(ref, "free")
    finally:
        ref.close()
        if eng:
            eng.close()
    print(f"load {os.getloadavg()[0]:.1f}")
    for (size, nb, which), rs in rows.items():
        gb = [r["GBps"] for r in rs]
        def m(key):
            return statistics.median(r[key] for r in rs)
        netrx = [statistics.median(r["netrx_per_MB"][i] for r in rs) for i in range(len(rs[0]["netrx_per_MB"]))]
        print(f"{size:5d} KiB x{nb:<3d} {which:6s} GB/s med {statistics.median(gb):5.2f} "
              f"[{min(gb):4.2f}-{max(gb):4.2f}]  cpu {m('cpu_s_per_GB'):.3f} s/GB  "
              f"ctx/MB send v{m('send_vol_per_MB'):.1f} i{m('send_inv_per_MB'):.1f} "
              f"recv v{m('recv_vol_per_MB'):.1f} i{m('recv_inv_per_MB'):.1f}  "
              f"netrx/MB {netrx}  same-cpu {m('same_cpu_share'):.2f}  "
              f"per trial {' '.join(f'{g:.2f}' for g in gb)}")
    for (size, nb, op), rs in erows.items():
        gb = [r["GBps"] for r in rs]
        names = sorted({n for r in rs for n in r["threads"]})
        med3 = {n: [statistics.median(r["threads"].get(n, (0, 0, 0))[i] for r in rs) for i in range(3)] for n in names}
        netrx = [statistics.median(r["netrx_per_MB"][i] for r in rs) for i in range(len(rs[0]["netrx_per_MB"]))]
        print(f"{size:5d} KiB x{nb:<3d} engine {op:11s} GB/s med {statistics.median(gb):5.2f} "
              f"[{min(gb):4.2f}-{max(gb):4.2f}]  cpu {statistics.median(r['cpu_s_per_GB'] for r in rs):.3f} s/GB  "
              f"netrx/MB {netrx}  per trial {' '.join(f'{g:.2f}' for g in gb)}")
        for n, (cpu, vol, inv) in med3.items():
            print(f"      {n:24s} cpu {cpu:.3f} s/GB  ctx/MB v{vol:.1f} i{inv:.1f}")


if __name__ == "__main__":
    main()
