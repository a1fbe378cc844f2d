"""Minor items of issue 17 (engine and serving side): token ids that are not ints are
refused instead of truncated; a prompt no instance could serve (a token outside the
vocabulary, longer than the model's context, more KV than a pool or a store holds) is
refused at submit with InvalidArgument, before it reaches the conductor or an instance;
a huge finite wait timeout is "practically forever", not an error."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

import mooncake_rs as mc  # noqa: E402
from mooncake_rs import InvalidArgument  # noqa: E402
from mooncake_rs.engine import Engine, ModelConfig, SamplingParams  # noqa: E402

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(max_tokens=4)
NOT_INTS = [[1, 1.5], [1.0], [True, 2], [1, False], [np.float32(3)], ["7"], [None], [1, 2j]]


@pytest.fixture(scope="module")
def engine():
    return Engine(ModelConfig.tiny(), block_size=16, seed=0, num_pages=16)


@pytest.fixture(scope="module")
def cluster():
    # 16 pages of 16 tokens (256 tokens of KV) per engine; 8 KiB blocks, 16 store slots
    with mc.Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=16, dram_bytes_per_instance=128 << 10,
                    engine_kwargs={"num_pages": 16}, seed=0) as c:
        yield c


@pytest.mark.parametrize("prompt", NOT_INTS)
def test_engine_refuses_non_int_token_ids(engine, prompt):
    with pytest.raises(InvalidArgument, match="token ids must be ints|list of int"):
        engine.add_request(prompt, GREEDY)
    with pytest.raises(InvalidArgument):
        engine.generate([prompt], GREEDY)
    assert not engine.has_unfinished()


def test_engine_accepts_integer_kinds_and_checks_first_token(engine):
    ref = engine.generate([[1, 2, 3]], GREEDY)[0].token_ids
    assert engine.generate([[np.int64(1), np.uint8(2), 3]], GREEDY)[0].token_ids == ref
    assert engine.generate([np.array([1, 2, 3])], GREEDY)[0].token_ids == ref
    with pytest.raises(InvalidArgument, match="ints"):
        engine.add_decode_request([1, 2, 3], 1.5, GREEDY, [np.zeros(engine.layout.block_nbytes, np.uint8)])
    with pytest.raises(InvalidArgument):
        engine.generate(["abc"], GREEDY)  # a string is not a token list


@pytest.mark.parametrize("prompt", NOT_INTS)
def test_cluster_refuses_non_int_token_ids(cluster, prompt):
    before = cluster.metrics.requests
    with pytest.raises(InvalidArgument):
        cluster.submit(prompt, GREEDY)
    with pytest.raises(InvalidArgument):
        cluster.generate([prompt], GREEDY)
    assert cluster.metrics.requests == before  # never reached the conductor


@pytest.mark.parametrize("prompt,params,match", [
    ([1, 256], GREEDY, "vocabulary"),                           # tiny: vocab_size 256
    ([-1, 2], GREEDY, "vocabulary"),
    (list(range(256)) * 16, GREEDY, "context"),                 # 4096 tokens: max_position_embeddings
    ([5] * 200, SamplingParams(max_tokens=100), "KV pool"),     # 300 tokens > 256 of KV
    ([5] * 17 * 16, SamplingParams(max_tokens=1), "KV pool"),
])
def test_cluster_refuses_at_submit_what_an_instance_would_refuse(cluster, prompt, params, match):
    before = cluster.metrics.requests
    with pytest.raises(InvalidArgument, match=match):
        cluster.submit(prompt, params)
    assert cluster.metrics.requests == before
    assert cluster.conductor.snapshot().requests == 0
    # and the engine of an instance refuses the same prompt (the limits agree)
    eng = Engine(ModelConfig.tiny(), block_size=16, seed=0, num_pages=16)
    with pytest.raises(InvalidArgument):
        eng.add_request(prompt, params)


def test_cluster_refuses_a_prompt_its_stores_cannot_hold():
    # 32 pages of KV but only 4 store slots of 8 KiB: a 5-block prompt never fits
    with mc.Cluster(ModelConfig.tiny(), prefill=1, decode=1, block_size=16, dram_bytes_per_instance=32 << 10,
                    engine_kwargs={"num_pages": 32}, seed=0) as c:
        with pytest.raises(InvalidArgument, match="store"):
            c.submit([3] * (4 * 16 + 1), GREEDY)
        assert len(c.generate([[3] * (4 * 16 - 1)], GREEDY)[0].token_ids) == 4  # what fits is served


def test_cluster_serves_the_limits_themselves(cluster):
    ref = Engine(ModelConfig.tiny(), block_size=16, seed=0).generate([[255, 0, 7]], GREEDY)[0].token_ids
    assert cluster.generate([[255, 0, 7]], GREEDY)[0].token_ids == ref
    assert len(cluster.generate([[5] * 252], GREEDY)[0].token_ids) == 4  # 252 + 4 == the pool


def test_huge_finite_and_infinite_timeouts_are_accepted(cluster):
    p = [1, 2, 3, 4]
    ref = cluster.generate([p], GREEDY)[0].token_ids
    assert cluster.generate([p], GREEDY, timeout_s=1e300)[0].token_ids == ref
    assert cluster.generate([p], GREEDY, timeout_s=float("inf"))[0].token_ids == ref
    assert cluster.submit(p, GREEDY, timeout_s=1e300).result(timeout=1e300).token_ids == ref
    assert cluster.submit(p, GREEDY).result(timeout=float("inf")).token_ids == ref
    for bad in (0, -1.0, float("nan"), True, "1"):
        with pytest.raises(InvalidArgument, match="timeout_s"):
            cluster.generate([p], GREEDY, timeout_s=bad)
        with pytest.raises(InvalidArgument, match="timeout_s"):
            cluster.submit(p, GREEDY, timeout_s=bad)
    h = cluster.submit(p, GREEDY)
    with pytest.raises(InvalidArgument, match="timeout"):
        h.result(timeout=float("nan"))
    assert h.result(timeout=60).token_ids == ref


def test_transfer_batch_wait_accepts_a_huge_timeout():
    reg = mc.TransferRegistry()
    with mc.TransferEngine("a", registry=reg) as a, mc.TransferEngine("b", registry=reg) as b:
        ra, rb = a.allocate(4096), b.allocate(4096)
        out = a.submit([mc.TransferRequest("write", ra, 0, a.connect("b"), rb.id, 0, 4096)]).wait(timeout_s=1e300)
        assert out[0].ok
