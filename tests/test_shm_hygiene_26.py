"""Issue 26, item 7 (/dev/shm): segments ``mooncake_rs.<pid>.*`` do not outlive their
process. A worker stopped with SIGTERM removes its own; the segments of a process that
was SIGKILLed are removed by the next cluster, worker or service that starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

from serving_helpers import shm_segments  # noqa: E402

pytestmark = pytest.mark.timeout(300)

# A process that creates shared segments the way a worker does and then blocks; it
# registers the exit cleanup as our entry points do, and ends on SIGTERM like them.
_HOLDER = r"""
import signal, sys, threading
from mooncake_rs import _core
from mooncake_rs.serving.shm import clean_at_exit, stop_on_sigterm
clean_at_exit()
stop = threading.Event()
stop_on_sigterm(stop.set)
store = _core.Store(4096, 1 << 20, shared_memory=True)
# a cycle kept alive by a daemon thread: nothing drops it at exit, as in a real worker
keep = [store]
keep.append(keep)
threading.Thread(target=lambda: (keep, threading.Event().wait()), daemon=True).start()
print("up", flush=True)
while not stop.wait(0.05):
    pass
"""


def _start_holder():
    p = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up", p.stderr.read()
    mine = {n for n in shm_segments() if n.startswith(f"mooncake_rs.{p.pid}.")}
    assert mine, "the holder created no shared segment"
    return p, mine


def test_sigterm_removes_the_process_own_segments():
    p, mine = _start_holder()
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 0
    assert not mine & shm_segments()


def test_a_sigkilled_process_segments_are_removed_by_the_next_start():
    from mooncake_rs.serving.shm import sweep_dead

    p, mine = _start_holder()
    p.kill()
    p.wait(30)
    assert mine <= shm_segments(), "SIGKILL leaves them (nothing ran in that process)"
    sweep_dead()
    assert not mine & shm_segments()


def test_a_cluster_of_worker_processes_sweeps_dead_segments_at_start():
    from mooncake_rs import Cluster
    from mooncake_rs.engine import ModelConfig

    fake = f"/dev/shm/mooncake_rs.{2 ** 31 - 2}.0"  # a pid above any pid_max: surely dead
    with open(fake, "wb") as f:
        f.write(b"x")
    c = Cluster(ModelConfig.tiny(), prefill=1, decode=1, processes=True)
    try:
        assert not os.path.exists(fake)
        workers = {m.proc.pid for m in c._core.members.values()}
        # SIGTERM a worker: it stops through its loop and unlinks its arena
        victim = next(iter(workers))
        os.kill(victim, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while any(n.startswith(f"mooncake_rs.{victim}.") for n in shm_segments()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(n.startswith(f"mooncake_rs.{victim}.") for n in shm_segments())
    finally:
        c.close()
        if os.path.exists(fake):
            os.unlink(fake)


def test_the_sweep_can_be_turned_off(monkeypatch):
    from mooncake_rs.serving.shm import sweep_dead

    fake = f"/dev/shm/mooncake_rs.{2 ** 31 - 3}.0"
    with open(fake, "wb") as f:
        f.write(b"x")
    try:
        monkeypatch.setenv("MOONCAKE_SHM_SWEEP", "0")
        assert sweep_dead() == 0 and os.path.exists(fake)
        monkeypatch.delenv("MOONCAKE_SHM_SWEEP")
        assert sweep_dead() >= 1 and not os.path.exists(fake)
    finally:
        if os.path.exists(fake):
            os.unlink(fake)
