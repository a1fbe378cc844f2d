"""Soak (issue 26, "Must show"): mixed traffic against a deployment for a while, with a
worker SIGKILLed and restarted every few minutes and etcd restarted once; resources must
stay flat and every request must either complete or fail with a typed error.

    python benches/soak_bench.py                 # 5 minutes (the issue's long run: --minutes 30)
    python benches/soak_bench.py --minutes 1

Not in CI. What runs, on 127.0.0.1: an etcd (``$MOONCAKE_ETCD`` or ``etcd`` on PATH);
2 prefill and 1 decode ``mooncake-rs worker`` processes and one ``mooncake-rs serve
--etcd`` with the HTTP front, over a small random model with a real tokenizer (the test
suite's ``text_helpers.write_model_dir``). Traffic, all at once:

- HTTP streams (``/v1/completions``, ``stream: true``), a third of them abandoned
  mid-stream by the client;
- ``RemoteCluster`` clients submitting token prompts, some cancelled;
- every ``--kill-every`` seconds a worker (in turn) is SIGKILLed and started again;
  halfway through, etcd is stopped for 5 s and started again.

Every 10 s it samples the serve process and the workers: RSS, threads, open descriptors,
and the ``mooncake_rs.*`` entries in /dev/shm (the live processes' own and any left by
dead ones). At the end: the counts of requests completed and failed (by error type),
the first and last samples and their ratio. Flat: no steady growth after the warm-up.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from ports import free_port  # noqa: E402

TOKEN = "soak-token-0123456789abcdef0123456789"


def proc_stats(pid: int) -> tuple[float, int, int]:
    """(RSS MiB, threads, open fds) of ``pid``; zeros when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss = next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS:")) / 1024
        threads = next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("Threads:"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        return rss, threads, fds
    except (OSError, StopIteration):
        return 0.0, 0, 0


def error_type(body: bytes) -> str:
    """The OpenAI error ``type`` of an error body, or UNTYPED when it has none (an internal
    error is counted as untyped too: it is a bug, not a refusal)."""
    import json

    try:
        kind = json.loads(body)["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return "UNTYPED (no error type)"
    return f"UNTYPED {kind}" if kind == "internal_error" else f"typed {kind}"


def shm_entries(pids: set[int] | None = None) -> int:
    """``mooncake_rs.<pid>.*`` entries in /dev/shm: of ``pids`` (this soak's processes, live
    or dead: other users of the machine make their own), or all of them."""
    names = [n for n in os.listdir("/dev/shm") if n.startswith("mooncake_rs.")]
    if pids is None:
        return len(names)
    return sum(1 for n in names if n.split(".")[1].isdigit() and int(n.split(".")[1]) in pids)


class Soak:
    def __init__(self, tmp: Path, minutes: float, kill_every: float) -> None:
        import text_helpers as th

        self.tmp, self.seconds, self.kill_every = tmp, minutes * 60, kill_every
        self.model = th.write_model_dir(tmp / "soak-model", max_position_embeddings=512)
        (tmp / "token").write_text(TOKEN)
        self.etcd_port, self.peer_port = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{self.etcd_port}"
        self.etcd: subprocess.Popen | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.pids = {os.getpid()}  # every process this soak started, for its /dev/shm entries
        self.http_port, self.listen_port = free_port(), free_port()
        self.counts: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        self.stop = threading.Event()

    # ---- processes
    def start_etcd(self) -> None:
        binary = os.environ.get("MOONCAKE_ETCD") or shutil.which("etcd")
        if binary is None:
            raise SystemExit("needs etcd (set MOONCAKE_ETCD or put etcd on PATH)")
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = open(self.tmp / "etcd.log", "ab")
        self.etcd = subprocess.Popen([binary, "--name", "s", "--data-dir", str(self.tmp / "etcd"),
                                      "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
                                      "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                                      "--initial-cluster", f"s={peer}"], stdout=log, stderr=log)
        time.sleep(2.0)

    def start(self, name: str, args: list[str]) -> None:
        log = open(self.tmp / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "mooncake_rs", *args], stdout=log, stderr=log,
                                            stdin=subprocess.DEVNULL)
        self.pids.add(self.procs[name].pid)

    def start_worker(self, name: str, role: str, port: int) -> None:
        self.start(name, ["worker", "--role", role, "--model", str(self.model), "--etcd", self.etcd_url,
                          "--listen", f"127.0.0.1:{port}", "--name", name, "--cluster", "soak",
                          "--auth-token-file", str(self.tmp / "token"), "--ttl", "2", "--heartbeat", "0.5"])

    def up(self) -> None:
        self.start_etcd()
        self.ports = {"p0": free_port(), "p1": free_port(), "d0": free_port()}
        for name, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
            self.start_worker(name, role, self.ports[name])
        self.start("serve", ["serve", "--etcd", self.etcd_url, "--listen", f"127.0.0.1:{self.listen_port}",
                             "--cluster", "soak", "--auth-token-file", str(self.tmp / "token"),
                             "--model", str(self.model), "--port", str(self.http_port), "--lease-ttl", "2",
                             "--heartbeat-timeout", "3"])
        import httpx

        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.http_port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise SystemExit("the deployment did not come up; see the logs in " + str(self.tmp))

    def down(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.etcd is not None:
            self.etcd.terminate()
            self.etcd.wait(10)

    # ---- traffic
    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1

    def http_client(self, seed: int) -> None:
        import httpx

        rng = random.Random(seed)
        url = f"http://127.0.0.1:{self.http_port}/v1/completions"
        while not self.stop.is_set():
            abandon = rng.random() < 0.33
            body = {"model": "soak-model", "prompt": "soak " * rng.randint(1, 40), "max_tokens": rng.randint(4, 48),
                    "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", url, json=body, timeout=60) as r:
                    if r.status_code != 200:
                        self.count(f"http {r.status_code} {error_type(r.read())}")
                        time.sleep(0.2)
                        continue
                    lines = []
                    for line in r.iter_lines():
                        if not line:  # the blank line between events
                            continue
                        lines.append(line)
                        if abandon and len(lines) > 2:
                            break
                    errors = [ln for ln in lines if '"error"' in ln]
                    if abandon and not errors:
                        self.count("http abandoned mid-stream")
                    elif errors:
                        self.count(f"http error event {error_type(errors[0].removeprefix('data: ').encode())}")
                    elif lines and lines[-1] == "data: [DONE]":
                        self.count("http completed")
                    else:
                        self.count("http UNTYPED stream ended without [DONE]")
            except httpx.HTTPError as e:
                # the front is never down in this soak: a broken connection is a failure without a type
                self.count(f"http UNTYPED {type(e).__name__}")
                time.sleep(0.5)

    def remote_client(self, seed: int) -> None:
        from mooncake_rs import Cluster
        from mooncake_rs.engine import SamplingParams
        from mooncake_rs.errors import MooncakeError

        rng = random.Random(seed)
        client = None
        while not self.stop.is_set():
            try:
                if client is None:
                    client = Cluster.connect(etcd=self.etcd_url, auth_token=TOKEN, cluster="soak",
                                             connect_timeout_s=30)
                h = client.submit([rng.randrange(1, 200) for _ in range(rng.randint(8, 120))],
                                  SamplingParams(max_tokens=rng.randint(2, 32), ignore_eos=True), timeout_s=60)
                if rng.random() < 0.2:
                    time.sleep(rng.random() * 0.05)
                    h.cancel()
                    try:  # a cancelled request either finished first or fails with a typed error
                        h.result(90)
                        self.count("remote cancelled (finished first)")
                    except MooncakeError as e:
                        self.count(f"remote cancelled ({type(e).__name__})")
                else:
                    h.result(90)
                    self.count("remote completed")
            except MooncakeError as e:
                self.count(f"remote {type(e).__name__}")
                time.sleep(0.2)
            except Exception as e:  # noqa: BLE001 - an untyped failure is what the soak looks for
                self.count(f"remote UNTYPED {type(e).__name__}")
                time.sleep(0.5)

    def chaos(self) -> None:
        names = ["p0", "d0", "p1"]
        t0 = time.monotonic()
        k = 0
        etcd_done = False
        while not self.stop.wait(1.0):
            el = time.monotonic() - t0
            if el > (k + 1) * self.kill_every:
                name = names[k % len(names)]
                self.procs[name].kill()
                self.procs[name].wait(10)
                self.count(f"chaos: SIGKILL {name}")
                time.sleep(2)
                self.start_worker(name, "decode" if name == "d0" else "prefill", self.ports[name])
                k += 1
            if not etcd_done and el > self.seconds / 2 and self.etcd is not None:
                self.etcd.terminate()
                self.etcd.wait(10)
                self.count("chaos: etcd stopped")
                time.sleep(5)
                self.start_etcd()
                etcd_done = True

    def sample(self) -> dict[str, float]:
        for p in list(self.procs.values()):  # instance processes a worker may start count as ours
            try:
                self.pids.update(int(c) for c in Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split())
            except OSError:
                pass
        out: dict[str, float] = {"shm": shm_entries(self.pids), "load1": os.getloadavg()[0]}
        for name, p in self.procs.items():
            rss, th, fds = proc_stats(p.pid)
            out[f"{name}.rss"], out[f"{name}.threads"], out[f"{name}.fds"] = rss, th, fds
        return out

    def run(self) -> int:
        self.up()
        threads = [threading.Thread(target=self.http_client, args=(i,), daemon=True) for i in range(6)]
        threads += [threading.Thread(target=self.remote_client, args=(100 + i,), daemon=True) for i in range(3)]
        threads.append(threading.Thread(target=self.chaos, daemon=True))
        for t in threads:
            t.start()
        samples: list[tuple[float, dict[str, float]]] = []
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < self.seconds:
                samples.append((time.monotonic() - t0, self.sample()))
                with self.lock:
                    done = sum(v for k, v in self.counts.items() if not k.startswith("chaos"))
                print(f"t={samples[-1][0]:.0f}s requests={done} {samples[-1][1]}", flush=True)
                time.sleep(10)
        finally:
            self.stop.set()
            for t in threads:
                t.join(120)
            samples.append((time.monotonic() - t0, self.sample()))
            self.down()
        print(f"soak of {self.seconds / 60:g} min; logs in {self.tmp}")
        print("| outcome | count |\n| --- | --- |")
        for k, v in sorted(self.counts.items()):
            print(f"| {k} | {v} |")
        with open(self.tmp / "samples.jsonl", "w") as f:  # the whole series, to plot or re-read
            for t, smp in samples:
                f.write(json.dumps({"t": round(t, 1), **smp}) + "\n")
        live = samples[:-1] if len(samples) > 1 else samples  # the last one is taken after traffic stopped
        warm = next((smp for t, smp in live if t >= 60), live[0][1])
        print("| resource | start | after warm-up (60 s) | end | max |\n| --- | --- | --- | --- | --- |")
        for key in sorted(warm):
            series = [smp.get(key, 0) for _, smp in live]
            print(f"| {key} | {series[0]:.0f} | {warm[key]:.0f} | {series[-1]:.0f} | {max(series):.0f} |")
        print(f"(workers are SIGKILLed and restarted, so their series restart; every sample: {self.tmp}/samples.jsonl)")
        # This process is still alive here and its own arena goes at its exit, so count the
        # entries of the processes it started (all stopped or killed by now) apart from its own.
        others = shm_entries(self.pids - {os.getpid()})
        print(f"/dev/shm mooncake_rs.* after shutdown: {others} of the stopped processes, "
              f"{shm_entries({os.getpid()})} of this live process (removed at its exit)")
        untyped = sum(v for k, v in self.counts.items() if "UNTYPED" in k)
        return 1 if untyped else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--kill-every", type=float, default=90.0, help="seconds between worker SIGKILLs")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="mooncake-soak-"))
    return Soak(tmp, args.minutes, args.kill_every).run()


if __name__ == "__main__":
    sys.exit(main())
