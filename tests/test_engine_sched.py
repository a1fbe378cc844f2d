"""Scheduling and KV hand-off paths give the tokens of a plain run (tiny model, CPU)."""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mooncake_rs import InvalidArgument  # noqa: E402
from mooncake_rs.engine import Engine, ModelConfig, SamplingParams  # noqa: E402
from engine_helpers import saved_blocks  # noqa: E402

CFG = ModelConfig.tiny()
B = 8  # store block size used here (pages of 4)
RNG = random.Random(7)
PROMPTS = [[RNG.randrange(CFG.vocab_size) for _ in range(n)] for n in (29, 5, 16, 41, 1, 24)]
GREEDY = SamplingParams(max_tokens=12)


def engine(**kw):
    args = dict(block_size=B, page_size=4, num_pages=256, seed=11)
    args.update(kw)
    return Engine(CFG, **args)


@pytest.fixture(scope="module")
def reference():
    e = engine(max_num_seqs=1, max_num_batched_tokens=4096)
    return {tuple(p): e.generate([p], GREEDY)[0].token_ids for p in PROMPTS}


def test_batch_chunked_and_alone_agree(reference):
    for kw in (dict(), dict(max_num_batched_tokens=7), dict(max_num_seqs=3, max_num_batched_tokens=13)):
        outs = engine(**kw).generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == [reference[tuple(p)] for p in PROMPTS], kw
        assert all(o.finish_reason == "length" and len(o.token_ids) == 12 for o in outs)


def test_preemption_keeps_greedy_tokens(reference):
    e = engine(num_pages=24, max_num_batched_tokens=32)  # 96 token slots for ~170 tokens of demand
    outs = e.generate(PROMPTS, GREEDY)
    assert sum(o.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == [reference[tuple(p)] for p in PROMPTS]
    assert e.num_free_pages == 24


def test_restored_prefix_gives_same_tokens(reference):
    src = engine()
    prompt = PROMPTS[3]  # 41 tokens: 5 full blocks
    rid = src.add_request(prompt, SamplingParams(max_tokens=1), hold_kv=True)
    while src.has_unfinished():
        src.step()
    blocks = saved_blocks(src, rid, len(prompt))
    src.release(rid)
    assert src.num_free_pages == 256
    dst = engine(max_num_batched_tokens=5)
    for k in (1, 3, 5, 6):  # 6 given: only (41 - 1) // 8 = 5 are usable
        rid2 = dst.add_request(prompt, GREEDY, restored_kv=blocks[:k])
        out = None
        while dst.has_unfinished():
            for o in dst.step():
                out = o if o.request_id == rid2 and o.finished else out
        assert out.token_ids == reference[tuple(prompt)]
        assert out.num_cached_tokens == min(k, 5) * B
    # a different prompt sharing the first two blocks reuses them
    other = prompt[:16] + [3, 1, 4, 1, 5]
    plain = engine().generate([other], GREEDY)[0].token_ids
    rid3 = dst.add_request(other, GREEDY, restored_kv=blocks[:2])
    outs = {}
    while dst.has_unfinished():
        outs.update({o.request_id: o for o in dst.step()})
    assert outs[rid3].token_ids == plain and outs[rid3].num_cached_tokens == 16


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_tokens=12, temperature=0.8, top_k=40, seed=5)])
def test_split_prefill_then_decode(params):
    single = engine().generate(PROMPTS, params)
    pre = engine(max_num_batched_tokens=10)  # chunked prefill: blocks complete over several steps
    dec = engine()
    layers_seen: dict[str, dict[int, set]] = {}
    slots: dict[str, dict[int, np.ndarray]] = {}

    def on_layer(ev):
        buf_of = slots.setdefault(ev.request_id, {})
        seen = layers_seen.setdefault(ev.request_id, {})
        idx = list(ev.blocks) + ([ev.partial_block] if ev.partial_block is not None else [])
        for i in idx:
            buf = buf_of.setdefault(i, np.zeros(pre.layout.block_nbytes, dtype=np.uint8))
            pre.save_block(ev.request_id, i, buf, layer=ev.layer)  # into the layer's span
            seen.setdefault(i, set()).add(ev.layer)

    ids = [pre.add_request(p, params, prefill_only=True, on_layer=on_layer) for p in PROMPTS]
    firsts = {}
    while pre.has_unfinished():
        for o in pre.step():
            if o.finished:
                assert o.finish_reason == "prefill" and len(o.token_ids) == 1
                firsts[o.request_id] = o.token_ids[0]
    assert pre.num_free_pages == 256  # prefill-only requests free their pages
    for rid, p in zip(ids, PROMPTS):
        nblocks = -(-len(p) // B)
        assert sorted(layers_seen[rid]) == list(range(nblocks))
        assert all(s == set(range(CFG.num_layers)) for s in layers_seen[rid].values())
        bufs = [slots[rid][i] for i in range(nblocks)]
        dec.add_decode_request(p, firsts[rid], params, bufs, request_id="d" + rid)
    outs = {}
    while dec.has_unfinished():
        outs.update({o.request_id: o for o in dec.step() if o.finished})
    for rid, s in zip(ids, single):
        assert outs["d" + rid].token_ids == s.token_ids
        assert outs["d" + rid].num_cached_tokens == len(s.prompt_token_ids)


def test_seeded_sampling_is_reproducible():
    sp = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=s) for s in (1, 2)]
    a = engine().generate(PROMPTS[:2], sp)
    b = engine(max_num_batched_tokens=6).generate([PROMPTS[1], PROMPTS[0]], [sp[1], sp[0]])
    assert a[0].token_ids == b[1].token_ids and a[1].token_ids == b[0].token_ids
    c = engine().generate([PROMPTS[0]], [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=99)])
    assert c[0].token_ids != a[0].token_ids


def test_stream_step_and_abort(reference):
    e = engine()
    got: dict[int, list[int]] = {}
    reasons = {}
    for ev in e.stream(PROMPTS[:3], GREEDY):
        got.setdefault(ev.index, []).append(ev.token_id)
        if ev.finish_reason:
            reasons[ev.index] = ev.finish_reason
    assert [got[i] for i in range(3)] == [reference[tuple(p)] for p in PROMPTS[:3]]
    assert reasons == {0: "length", 1: "length", 2: "length"}
    rid = e.add_request(PROMPTS[0], GREEDY, request_id="x")
    e.step()
    e.abort(rid)
    outs = e.step()
    assert outs[0].request_id == "x" and outs[0].finish_reason == "abort"
    assert not e.has_unfinished() and e.num_free_pages == 256


def test_bad_input_is_invalid_argument():
    e = engine(num_pages=8)
    for bad in ([], [CFG.vocab_size], [-1], ["a"]):
        with pytest.raises(InvalidArgument):
            e.add_request(bad, GREEDY)
    with pytest.raises(InvalidArgument, match="pages"):
        e.add_request([1] * 30, SamplingParams(max_tokens=10))  # 40 tokens > 8 pages of 4
    for kw in (dict(max_tokens=0), dict(temperature=-1.0), dict(top_k=0), dict(top_p=0.0), dict(seed=-3)):
        with pytest.raises(InvalidArgument):
            SamplingParams(**kw)
    e.add_request([1, 2], GREEDY, request_id="a")
    with pytest.raises(InvalidArgument, match="in use"):
        e.add_request([1, 2], GREEDY, request_id="a")
    with pytest.raises(InvalidArgument, match="KV blocks"):
        e.add_decode_request([1] * 9, 3, GREEDY, [np.zeros(e.layout.block_nbytes, np.uint8)])
    with pytest.raises(InvalidArgument, match="bytes"):
        e.add_decode_request([1] * 5, 3, GREEDY, [np.zeros(7, np.uint8)])
    with pytest.raises(InvalidArgument, match="no KV pages|no computed KV"):
        e.save_block("a", 0, np.zeros(e.layout.block_nbytes, np.uint8))  # not computed yet
    with pytest.raises(InvalidArgument):
        e.generate([[1]], [GREEDY, GREEDY])
    with pytest.raises(InvalidArgument):
        Engine(CFG, max_num_batched_tokens=0)


def test_measure_prefill():
    e = engine(max_num_batched_tokens=16)
    pts = e.measure_prefill([(8, 0), (24, 16)], repeats=1, warmup=0)
    assert [(p.new_tokens, p.cached_tokens) for p in pts] == [(8, 0), (24, 16)]
    assert all(p.seconds > 0 for p in pts) and e.num_free_pages == 256
    with pytest.raises(InvalidArgument):
        e.measure_prefill([(0, 4)])


def test_restored_prefix_staged_when_pool_is_full(reference):
    src = engine()
    prompt = PROMPTS[3]  # 41 tokens, 5 full blocks
    rid = src.add_request(prompt, SamplingParams(max_tokens=1), hold_kv=True)
    while src.has_unfinished():
        src.step()
    blocks = saved_blocks(src, rid, len(prompt))[:5]
    e = engine(num_pages=16)
    first = e.add_request(prompt, GREEDY)
    e.step()  # the first request now holds 11 of the 16 pages
    second = e.add_request(prompt, GREEDY, restored_kv=blocks)
    assert e._requests[second].staged is not None  # no room now: a host copy waits for admission
    for b in blocks:
        b[:] = 0  # the caller's buffers may be reused at once
    outs = {}
    while e.has_unfinished():
        outs.update({o.request_id: o for o in e.step() if o.finished})
    assert outs[first].token_ids == outs[second].token_ids == reference[tuple(prompt)]
    assert outs[second].num_cached_tokens == 40
