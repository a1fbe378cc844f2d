"""A remote decode worker's batch limit reaches the conductor's admission (issue 26):
``Ready`` carries the engine's ``max_num_seqs``, so ``serve --etcd --rejection early``
holds a decode worker started with ``--max-num-seqs 2`` to two requests (before, every
remote decode worker was registered with the default batch of 256, and admission let
through what the worker could only queue). Processes on loopback, as a user starts them."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from deploy_helpers import Deployment, LoopbackHosts, wait_until  # noqa: E402
from etcd_helpers import etcd  # noqa: E402,F401,F811  (the fixture)

import mooncake_rs as mc  # noqa: E402
from mooncake_rs.engine import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

LONG = SamplingParams(max_tokens=400, ignore_eos=True)


def test_admission_holds_a_remote_decode_worker_to_its_max_num_seqs(etcd, tmp_path: Path) -> None:  # noqa: F811
    with LoopbackHosts(3) as hosts:
        dep = Deployment(hosts, etcd, tmp_path)
        client = None
        try:
            # generous SLOs: only the decode capacity can refuse here
            dep.serve("serve", 0, extra=["--rejection", "early", "--ttft-slo", "60", "--tbt-slo", "60"])
            assert dep.wait_log("serve", "leading"), dep.log_tail()
            dep.worker("p0", 1, "prefill")
            dep.worker("d0", 2, "decode", extra=["--max-num-seqs", "2"])
            client = dep.client()
            assert wait_until(lambda: len(client.instances()) == 2, 90), dep.log_tail()
            held = [client.submit([3, 1, 4, 1, 5, i], LONG) for i in range(2)]
            with pytest.raises(mc.Overloaded) as info:
                client.submit([2, 7, 1, 8], LONG)
            assert info.value.reason == "decode_capacity", info.value
            assert "2 of 2 requests" in str(info.value), info.value
            for h in held:
                h.cancel()
            # the places free again once the two leave
            assert wait_until(lambda: _admits(client), 60), dep.log_tail()
        finally:
            if client is not None:
                client.close()
            dep.close()


def _admits(client) -> bool:
    try:
        client.submit([2, 7, 1, 8], SamplingParams(max_tokens=2)).result(60)
        return True
    except mc.Overloaded:
        return False
