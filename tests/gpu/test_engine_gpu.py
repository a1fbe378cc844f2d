"""Engine on CUDA (skipped without it): the torch backend and FlashInfer agree with CPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from mooncake_rs.engine import Engine, ModelConfig, SamplingParams  # noqa: E402
from mooncake_rs.engine.attention import BatchMeta, TorchAttention, flashinfer_available  # noqa: E402

PROMPTS = [[(11 * i + 3 * j) % 256 for j in range(n)] for i, n in enumerate((37, 5, 64, 100))]


def test_cuda_torch_backend_matches_cpu():
    gpu = Engine(ModelConfig.tiny(), device="cuda", num_pages=256, seed=2, attention_backend="torch")
    ref = Engine(ModelConfig.tiny(), num_pages=256, seed=2)
    ref.model.w = _to_cpu(gpu.model.w)  # weights drawn on the device differ from CPU draws
    for p in PROMPTS:
        torch.testing.assert_close(gpu.prompt_logits(p).cpu(), ref.prompt_logits(p), rtol=1e-3, atol=1e-3)
    sp = SamplingParams(max_tokens=8)
    assert [o.token_ids for o in gpu.generate(PROMPTS, sp)] == [o.token_ids for o in ref.generate(PROMPTS, sp)]


def _to_cpu(w):
    return w.to("cpu")  # optional tensors (biases, q/k norms) stay None


@pytest.mark.skipif(not flashinfer_available(), reason="needs flashinfer")
def test_flashinfer_matches_reference_bf16():
    from mooncake_rs.engine.attention import FlashInferAttention

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q_lens, kv_lens = [1, 33, 1, 200], [70, 33, 513, 260]
    npages = sum(-(-kv // 16) for kv in kv_lens) + 4
    k = torch.randn(npages, 16, 8, 128, generator=g, device=dev).bfloat16()
    v = torch.randn(npages, 16, 8, 128, generator=g, device=dev).bfloat16()
    perm = torch.randperm(npages, generator=g, device=dev).tolist()
    tables = [[perm.pop() for _ in range(-(-kv // 16))] for kv in kv_lens]
    q = torch.randn(sum(q_lens), 32, 128, generator=g, device=dev).bfloat16()
    for ql in (q_lens, [1, 1, 1, 1]):
        q_ = q[:sum(ql)]
        meta = BatchMeta.build(ql, kv_lens, tables, 16, dev)
        ref, fi = TorchAttention(32, 8, 128, torch.bfloat16, dev), FlashInferAttention(32, 8, 128, torch.bfloat16, dev)
        ref.plan(meta)
        fi.plan(meta)
        a, b = fi.forward(q_, k, v).float(), ref.forward(q_, k, v).float()
        assert (a - b).abs().max() / b.abs().max() < 2e-2


@pytest.mark.skipif(not flashinfer_available(), reason="needs flashinfer")
def test_flashinfer_engine_greedy_matches_torch_backend():
    sp = SamplingParams(max_tokens=8)
    kw = dict(device="cuda", dtype="float16", num_pages=256, seed=4, max_num_batched_tokens=48)
    a = Engine(ModelConfig.tiny(), attention_backend="flashinfer", **kw).generate(PROMPTS, sp)
    b = Engine(ModelConfig.tiny(), attention_backend="torch", **kw).generate(PROMPTS, sp)
    same = sum(x.token_ids[:4] == y.token_ids[:4] for x, y in zip(a, b))
    assert same >= 3  # fp16 kernels may flip a near-tie late; the first tokens agree
