"""Shared setup of the HTTP front tests: a tiny chat model directory, a cluster over it,
the front on 127.0.0.1 in a thread, and reference outputs from a single Engine."""

from __future__ import annotations

import re
import time

import text_helpers as th

API_KEY = "test-key-123"
MODEL = "tiny-chat"


def start_front(tmp_path_factory, *, api_key=API_KEY, **cluster_kw):
    """(cluster, front, server, model_dir); the caller stops the server and closes the cluster."""
    from mooncake_rs import Cluster
    from mooncake_rs.http import Frontend, ServerThread

    d = th.write_model_dir(tmp_path_factory.mktemp("models") / MODEL)
    cluster = Cluster(str(d), **{"prefill": 2, "decode": 1, "seed": 0, **cluster_kw})
    try:
        front = Frontend.from_model_dir(cluster, d, api_key=api_key)
        server = ServerThread(front).start()
    except BaseException:
        cluster.close()
        raise
    return cluster, front, server, d


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, flags=re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def wait_for(pred, timeout_s: float = 30.0, what: str = "condition"):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
