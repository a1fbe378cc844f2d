"""The pool against the real Mooncake Store, side by side in one run, through the same
Mooncake API calls (ours: mooncake_rs.compat's facade):

- local: one process holds the pool (ours: the embedded pool; Mooncake: a client that owns
  the only segment, which takes its memcpy shortcut, with a master beside it);
- remote (needs root: network namespaces, tests/netns_helpers.py): the client on host 0,
  the pool on host 1, every byte over TCP (ours: a ``mooncake-rs store --tcp-only`` node
  found through etcd on the bridge; Mooncake: master + segment owner on host 1); plus our
  transfer engine's own TCP batches of the same bytes between the same hosts. Ours and
  our engine run twice: plaintext (``--plaintext`` nodes, an engine without a token: like
  for like with Mooncake, whose TCP is plaintext) and with the cluster token (AES-GCM).
  The pool's bulk rows are set against our engine twice: its batch of the same bytes
  timed beside each of the pool's batches (before or after it, alternately) in the same
  client process (the "same rounds" table, median of per-pair ratios: the like-for-like
  figure), and the engine in its own process after the pool's rows (another minute;
  kept, labelled "own process").

Rows: batch_put_from / batch_get_into of 32 x 512 KiB and 32 x 4 MiB (GB/s, median over
rounds; fresh keys per round), and 128 B keys put / get / batch_is_exist (ops/s). Remote
small keys also stand beside the floor of one synchronous 128 B round trip on the same
link: a native echo (benches/pool_echo.rs) whose reads sleep and the same echo polling
before it reads (the fair floor of our polling reads), a bare Python socket echo, and one
128 B request of our transfer engine.

    python benches/pool_bench.py [--runs 3] [--peer-venv /tmp/peer-mc] [--no-remote] [--no-local]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
ROLES = str(HERE / "pool_bench_roles.py")
MiB = 1 << 20
TOKEN = "pool-bench-token-0123456789abcdef"


def run_role(argv_prefix: list[str], python: str, role: str, args: dict, env: dict | None = None,
             timeout: float = 600) -> dict:
    r = subprocess.run([*argv_prefix, python, ROLES, role, json.dumps(args)], capture_output=True, text=True,
                       timeout=timeout, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{role} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def our_env(extra: dict | None = None) -> dict:
    e = dict(os.environ, MOONCAKE_LOG="warn")
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), e.get("PYTHONPATH", "")])
    e.update(extra or {})
    return e


def local_run(peer_py: str, tmp: str) -> dict:
    seg = 640 * MiB
    ours = run_role([], sys.executable, "store", {"impl": "ours", "host": "127.0.0.1", "meta": "P2PHANDSHAKE",
                                                  "master": "127.0.0.1:50051", "segment": seg,
                                                  "parts": ["bulk", "small"]}, our_env())
    penv = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
    theirs = run_role([], peer_py, "store", {"impl": "mooncake", "host": "127.0.0.1", "start_master": True,
                                             "segment": seg, "log": f"{tmp}/mc-master-local.log",
                                             "parts": ["bulk", "small"]}, penv)
    return {"ours": ours, "mooncake": theirs}


def build_echo(tmp: str) -> str | None:
    """benches/pool_echo.rs built with ``rustc -O`` (std only); None without rustc."""
    exe = str(Path(tmp) / "pool_echo")
    try:
        r = subprocess.run(["rustc", "-O", "--edition", "2021", str(HERE / "pool_echo.rs"), "-o", exe],
                           capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
        print("rustc not found: the native echo row is left out", file=sys.stderr)
        return None
    if r.returncode != 0:
        raise RuntimeError(f"building pool_echo.rs failed:\n{r.stderr[-3000:]}")
    return exe


def remote_run(peer_py: str, tmp: str, echo_exe: str | None) -> dict:
    from etcd_helpers import EtcdServer, etcd_binary
    from netns_helpers import TestHosts
    from pool_helpers import start_node

    out: dict = {}
    with TestHosts(2) as hosts:
        cli, srv = 0, 1
        ns = ["ip", "netns", "exec", hosts.names[cli]]
        # ours: a store node on host 1, the client on host 0
        etcd = EtcdServer(etcd_binary(), Path(tmp) / "etcd", host=hosts.gateway)
        etcd.start()
        try:
            etcd_addr = "etcd://" + etcd.url[len("http://"):]
            # plaintext first (like for like with Mooncake's TCP), then with the cluster token
            for key, plain, port in (("ours", True, 7600), ("ours+token", False, 7601)):
                node, _ = start_node(lambda argv, **kw: hosts.popen(srv, argv, **kw), etcd.url, hosts.ip(srv), port,
                                     key, f"bench-{port}", dram="1GB", extra=("--plaintext",) if plain else ())
                env = our_env({"MOONCAKE_CLUSTER": f"bench-{port}", "MOONCAKE_RS_TRANSPORTS": "tcp",
                               **({"MOONCAKE_RS_PLAINTEXT": "1"} if plain else
                                  {"MOONCAKE_AUTH_TOKEN": "pool-test-token-0123456789abcdef"})})
                # our engine's batch of the same bytes in the same rounds (pool_bench_roles.py
                # SameRoundEngine), to a plain engine beside the node, in the same mode
                token = None if plain else TOKEN
                ts = hosts.popen(srv, [sys.executable, ROLES, "te-server", json.dumps({"host": hosts.ip(srv),
                                                                                       "token": token})],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=our_env())
                te_info = {"token": token, **json.loads(ts.stdout.readline())}
                out[key] = run_role(ns, sys.executable, "store", {"impl": "ours", "host": hosts.ip(cli),
                                                                  "meta": etcd_addr, "master": etcd_addr, "segment": 0,
                                                                  "parts": ["bulk", "small"], "te": te_info}, env)
                out[f"{key} same rounds"] = out[key].pop("same rounds")
                ts.stdin.close()
                ts.wait(10)
                node.terminate()
                node.wait(10)
        finally:
            etcd.stop()
        # our transfer engine, same bytes, same hosts: plaintext and with the token
        for key, token in (("te", None), ("te+token", TOKEN)):
            ts = hosts.popen(srv, [sys.executable, ROLES, "te-server", json.dumps({"host": hosts.ip(srv),
                                                                                   "token": token})],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=our_env())
            info = json.loads(ts.stdout.readline())
            out[key] = run_role(ns, sys.executable, "te-client", {"token": token, **info}, our_env())
            ts.stdin.close()
            ts.wait(10)
        # the link's own ceiling for bulk bytes: a plain socket stream, one and two connections
        for conns in (1, 2):
            ss = hosts.popen(srv, [sys.executable, ROLES, "stream-server",
                                   json.dumps({"host": hosts.ip(srv), "connections": conns})],
                             stdout=subprocess.PIPE, text=True, env=our_env())
            got = run_role(ns, sys.executable, "stream-client", {"connections": conns,
                                                                 **json.loads(ss.stdout.readline())}, our_env())
            ss.wait(10)
            out.setdefault("stream", {}).update(got)
        # the floor of a 128 B request/response in Python on both ends: a bare socket echo
        es = hosts.popen(srv, [sys.executable, ROLES, "echo-server", json.dumps({"host": hosts.ip(srv)})],
                         stdout=subprocess.PIPE, text=True, env=our_env())
        out["echo"] = run_role(ns, sys.executable, "echo-client", json.loads(es.stdout.readline()), our_env())
        es.wait(10)
        # ... and native on both ends (benches/pool_echo.rs): the floor of the link itself
        # (twice: reads that sleep in the kernel, and reads that poll first as ours do)
        for mode, row in (([], "native echo 128 B"), (["poll"], "native polling echo 128 B")):
            if echo_exe is None:
                break
            nat = hosts.popen(srv, [echo_exe, "server", hosts.ip(srv), *mode], stdout=subprocess.PIPE, text=True)
            addr = json.loads(nat.stdout.readline())["address"]
            r = subprocess.run([*ns, echo_exe, "client", addr, "2000", *mode], capture_output=True, text=True,
                               timeout=120)
            nat.wait(10)
            if r.returncode != 0:
                raise RuntimeError(f"pool_echo client failed: {r.stderr[-2000:]}")
            out["echo"][row] = json.loads(r.stdout)["ops"]
        # Mooncake: master + segment owner on host 1, the client (no segment) on host 0
        owner = hosts.popen(srv, [peer_py, ROLES, "mc-owner", json.dumps({"host": hosts.ip(srv), "segment": 1536 * MiB,
                                                                          "log": f"{tmp}/mc-master-remote.log"})],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, MC_TCP_BIND_ADDRESS=hosts.ip(srv)))
        info = json.loads(owner.stdout.readline())
        out["mooncake"] = run_role(ns, peer_py, "store", {"impl": "mooncake", "host": hosts.ip(cli), "segment": 0,
                                                          "parts": ["bulk", "small"], **info},
                                   dict(os.environ, MC_TCP_BIND_ADDRESS=hosts.ip(cli)))
        owner.stdin.close()
        owner.wait(20)
    return out


def median_of(runs: list[dict], path: tuple[str, str]) -> float:
    return statistics.median(r[path[0]][path[1]] for r in runs)


def ratio(runs: list[dict], a: str, b: str, name: str, name_b: str | None = None) -> float:
    """The median over runs of each run's own ratio (robust to a load that drifts between
    runs on a shared machine)."""
    return statistics.median(r[a][name] / r[b][name_b or name] for r in runs)


def table(runs: list[dict], title: str) -> str:
    rows = [f"### {title} (median of {len(runs)} runs)", "",
            "| operation | ours | Mooncake Store | ours / Mooncake (median of per-run ratios) |",
            "|---|---|---|---|"]
    for name in runs[0]["ours"]:
        o, m = median_of(runs, ("ours", name)), median_of(runs, ("mooncake", name))
        unit = "GB/s" if name.startswith(("batch_put_from", "batch_get_into", "memcpy")) else "ops/s"
        fmt = (lambda x: f"{x:.2f} {unit}") if unit == "GB/s" else (lambda x: f"{x:,.0f} {unit}")
        rows.append(f"| {name} | {fmt(o)} | {fmt(m)} | {ratio(runs, 'ours', 'mooncake', name):.2f}x |")
    return "\n".join(rows) + "\n"


def remote_table(runs: list[dict]) -> str:
    """Ours plaintext (``--plaintext`` nodes: like for like with Mooncake's TCP, which is
    plaintext) and ours with the cluster token (AES-256-GCM on control and data), each
    against Mooncake and against our transfer engine in the same mode: the engine's
    figure of its own process, after the pool's rows (``te-client``, another minute), and
    then the same-rounds table (same_rounds_table)."""
    rows = [f"### remote: client and pool on two namespace hosts, TCP (median of {len(runs)} runs)", "",
            "| operation | ours plaintext | ours + token | Mooncake Store (plaintext TCP) | plaintext / Mooncake "
            "| token / Mooncake | TE plaintext (own process, later) | plaintext / TE (own process) | TE + token "
            "(own process) | token / TE + token (own process) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name in runs[0]["ours"]:
        unit = "GB/s" if name.startswith(("batch_put_from", "batch_get_into", "memcpy")) else "ops/s"
        fmt = (lambda x: f"{x:.2f} {unit}") if unit == "GB/s" else (lambda x: f"{x:,.0f} {unit}")
        cells = [name] + [fmt(median_of(runs, (k, name))) for k in ("ours", "ours+token", "mooncake")]
        cells += [f"{ratio(runs, k, 'mooncake', name):.2f}x" for k in ("ours", "ours+token")]
        te_name = name.replace("batch_put_from", "te write").replace("batch_get_into", "te read")
        for k, te in (("ours", "te"), ("ours+token", "te+token")):
            if te_name in runs[0].get(te, {}):
                cells += [f"{median_of(runs, (te, te_name)):.2f} GB/s", f"{ratio(runs, k, te, name, te_name):.2f}x"]
            else:
                cells += ["", ""]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def same_rounds_table(runs: list[dict]) -> str:
    """The pool against our engine's batch of the same bytes timed beside each of the
    pool's batches (before or after it, alternately), in the same client process, same
    hosts and minute (pool_bench_roles.py ``SameRoundEngine``): per run the median of the
    per-pair ratios (engine time / pool time), then the median over runs."""
    if "ours same rounds" not in runs[0]:
        return ""
    rows = [f"### remote bulk rows against our engine in the same rounds (median of {len(runs)} runs)", "",
            "| operation | TE plaintext, same rounds | **plaintext / TE, same rounds** | per run "
            "| TE + token, same rounds | **token / TE + token, same rounds** | per run |", "|---|---|---|---|---|---|---|"]
    for name in runs[0]["ours same rounds"]:
        cells = [name]
        for k in ("ours same rounds", "ours+token same rounds"):
            per = [r[k][name]["pool / te"] for r in runs]
            cells += [f"{statistics.median(r[k][name]['te GB/s'] for r in runs):.2f} GB/s",
                      f"**{statistics.median(per):.2f}x**", ", ".join(f"{x:.2f}" for x in per)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def ceiling_table(runs: list[dict]) -> str:
    """Bulk rows as shares of the link's own ceiling measured in the same run: a plain
    socket stream of the same pieces between the same hosts (benches/pool_bench_roles.py
    ``stream-*``: no protocol, one connection, and the pieces split over two)."""
    if "stream" not in runs[0]:
        return ""
    link = runs[0]["stream"].get("link facts", {})
    rows = [f"### remote bulk rows as shares of a plain socket stream (median of {len(runs)} runs)", "",
            "link: " + ", ".join(f"{k} {v}" for k, v in link.items()), "",
            "| row | stream | stream x2 | ours plaintext / stream | TE / stream | Mooncake / stream "
            "| stream x2 / stream |", "|---|---|---|---|---|---|---|"]
    for name in runs[0]["ours"]:
        if not name.startswith(("batch_put_from", "batch_get_into")):
            continue
        st = name.replace("batch_put_from", "stream write").replace("batch_get_into", "stream read")
        st2 = st.replace("stream", "stream x2")
        te = name.replace("batch_put_from", "te write").replace("batch_get_into", "te read")
        rows.append("| " + " | ".join([
            name, f"{median_of(runs, ('stream', st)):.2f} GB/s", f"{median_of(runs, ('stream', st2)):.2f} GB/s",
            f"{ratio(runs, 'ours', 'stream', name, st):.2f}x", f"{ratio(runs, 'te', 'stream', te, st):.2f}x",
            f"{ratio(runs, 'mooncake', 'stream', name, st):.2f}x", f"{ratio(runs, 'stream', 'stream', st2, st):.2f}x"])
            + " |")
    return "\n".join(rows) + "\n"


def floor_table(runs: list[dict]) -> str:
    """Small keys beside the floor of one synchronous 128 B round trip on the same link: a
    native echo (benches/pool_echo.rs: Rust on both ends, one thread a side, nothing
    decoded) whose reads sleep in the kernel, the same echo polling before it reads (as
    our pool's reads do: the fair floor of a polling design), a bare Python socket echo
    (Python on both ends, nothing decoded), and one 128 B request of our transfer engine
    (each the median of 5 passes of 2000 calls). A call that is one round trip cannot beat
    the polling native echo, so ``polling echo / Mooncake`` bounds the ratio any such
    design reaches here."""
    rows = [f"### remote small keys beside the floor of one 128 B round trip (median of {len(runs)} runs)", "",
            "| call | ours plaintext | ours + token | Mooncake Store | plaintext / Mooncake | native echo 128 B "
            "| native polling echo 128 B | polling echo / Mooncake | ours / polling echo | Python socket echo 128 B "
            "| TE 128 B (one request) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, te_name in (("put 128 B", "te write 128 B"), ("get 128 B", "te read 128 B")):
        if te_name not in runs[0].get("te", {}):
            continue
        ops = lambda k, n: f"{median_of(runs, (k, n)):,.0f} ops/s"  # noqa: E731
        polling = "native polling echo 128 B"
        native = polling in runs[0]["echo"]  # (no rustc: no native rows)
        rows.append("| " + " | ".join([
            name, ops("ours", name), ops("ours+token", name), ops("mooncake", name),
            f"{ratio(runs, 'ours', 'mooncake', name):.2f}x",
            ops("echo", "native echo 128 B") if native else "(no rustc)",
            ops("echo", polling) if native else "",
            f"{ratio(runs, 'echo', 'mooncake', polling, name):.2f}x" if native else "",
            f"{ratio(runs, 'ours', 'echo', name, polling):.2f}x" if native else "",
            ops("echo", "python socket echo 128 B"), f"{te_name}: " + ops("te", te_name)]) + " |")
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--peer-venv", default=os.environ.get("MC_PEER_VENV", "/tmp/peer-mc"))
    ap.add_argument("--no-remote", action="store_true")
    ap.add_argument("--no-local", action="store_true")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    a = ap.parse_args()
    peer_py = str(Path(a.peer_venv) / "bin" / "python")
    tmp = tempfile.mkdtemp(prefix="pool-bench-")
    local, remote = [], []
    echo_exe = None if a.no_remote else build_echo(tmp)
    for i in range(a.runs):
        t = time.time()
        if not a.no_local:
            local.append(local_run(peer_py, tmp))
        if not a.no_remote:
            remote.append(remote_run(peer_py, tmp, echo_exe))
        print(f"run {i + 1}/{a.runs} done in {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    if local:
        print(table(local, "local: one process holds the pool"))
    if remote:
        print(remote_table(remote))
        print(same_rounds_table(remote))
        print(ceiling_table(remote))
        print(floor_table(remote))
    if a.json:
        Path(a.json).write_text(json.dumps({"local": local, "remote": remote}, indent=1))


if __name__ == "__main__":
    main()
