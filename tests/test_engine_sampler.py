"""The sampler against a plain reference of temperature / top-k / top-p."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from mooncake_rs.engine import SamplingParams  # noqa: E402
from mooncake_rs.engine.sampler import Sampler, filtered_probs  # noqa: E402


def reference_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> dict[int, float]:
    """Token -> probability, written the obvious way."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    if top_k > 0:
        order = order[:top_k]
    z = [logits[i] / temperature for i in order]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    s = sum(e)
    p = [x / s for x in e]
    kept, mass = [], 0.0
    for tok, q in zip(order, p):
        if mass >= top_p:
            break
        kept.append((tok, q))
        mass += q
    total = sum(q for _, q in kept)
    return {tok: q / total for tok, q in kept}


CASES = [(1.0, -1, 1.0), (0.7, 5, 1.0), (1.3, -1, 0.6), (0.9, 8, 0.75), (2.0, 1, 1.0)]


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_filtered_probs_match_reference(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 2
    v = logits.shape[1]
    probs, order = filtered_probs(logits, torch.full((3,), temperature),
                                  torch.full((3,), top_k if top_k > 0 else v), torch.full((3,), top_p))
    for r in range(3):
        ref = reference_probs(logits[r].tolist(), temperature, top_k, top_p)
        ours = {int(order[r, j]): float(probs[r, j]) for j in range(v) if probs[r, j] > 0}
        assert ours.keys() == ref.keys()
        for tok, q in ref.items():
            assert ours[tok] == pytest.approx(q, rel=1e-5, abs=1e-7)


def test_samples_stay_in_support_and_follow_the_distribution():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 40, generator=g)
    params = SamplingParams(max_tokens=1, temperature=1.0, top_k=10, top_p=0.8, seed=3)
    ref = reference_probs(logits[0].tolist(), 1.0, 10, 0.8)
    sampler = Sampler(0)
    counts: dict[int, int] = {}
    n = 3000
    for i in range(n):
        tok = sampler.sample(logits, [params], [i])[0]
        counts[tok] = counts.get(tok, 0) + 1
    assert set(counts) <= set(ref)
    for tok, q in ref.items():  # 5 sigma of a binomial
        assert abs(counts.get(tok, 0) / n - q) <= 5 * math.sqrt(q * (1 - q) / n) + 1e-3


def test_seed_and_index_determine_the_draw():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    ps = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 1, 7)]
    a = Sampler(0).sample(logits, ps, [0, 0, 0, 5])
    b = Sampler(123).sample(logits[[2, 1, 0, 3]], [ps[2], ps[1], ps[0], ps[3]], [0, 0, 0, 5])
    assert a == [b[2], b[1], b[0], b[3]]
    draws = {tuple(Sampler(0).sample(logits[:1], [ps[0]], [i])) for i in range(20)}
    assert len(draws) > 1  # the index changes the draw
    greedy = Sampler(0).sample(logits, [SamplingParams()] * 4, [0] * 4)
    assert greedy == logits.argmax(-1).tolist()
