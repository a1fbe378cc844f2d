"""Engine on CUDA (skipped without it): the torch backend and FlashInfer agree with CPU.

The FlashInfer engine tests use the ``tiny-gpu`` preset (head_dim 64: FlashInfer has no
kernels for the ``tiny`` preset's 16) and compare against the torch backend in the same
dtype: every prompt's logits within bf16 bounds, and every greedy token of every prompt.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from mooncake_rs.engine import Engine, ModelConfig, SamplingParams  # noqa: E402
from mooncake_rs.engine.attention import BatchMeta, TorchAttention, flashinfer_available  # noqa: E402

PROMPTS = [[(11 * i + 3 * j) % 256 for j in range(n)] for i, n in enumerate((37, 5, 64, 100))]


def test_cuda_torch_backend_matches_cpu():
    gpu = Engine(ModelConfig.tiny(), device="cuda", dtype="float32", num_pages=256, seed=2,
                 attention_backend="torch")
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


GPU_PROMPTS = [[(37 * i + 5 * j) % 512 for j in range(n)] for i, n in enumerate((37, 5, 64, 100, 1, 300))]
REL = 2e-2  # bf16 bound: max |a - b| / max |b|


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def test_cuda_default_dtype_is_bfloat16():
    e = Engine(ModelConfig.preset("tiny-gpu"), device="cuda", num_pages=64)
    assert e.dtype == "bfloat16"
    assert e.attention_backend == ("flashinfer" if flashinfer_available() else "torch")
    # fp32 on CUDA: auto falls back to torch; flashinfer asked for is refused, naming the dtype
    assert Engine(ModelConfig.preset("tiny-gpu"), device="cuda", dtype="float32", num_pages=64).attention_backend == "torch"
    from mooncake_rs.errors import InvalidArgument
    with pytest.raises(InvalidArgument, match="dtype float32 has no FlashInfer kernels"):
        Engine(ModelConfig.preset("tiny-gpu"), device="cuda", dtype="float32", num_pages=64,
               attention_backend="flashinfer")


@pytest.mark.skipif(not flashinfer_available(), reason="needs flashinfer")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_flashinfer_engine_greedy_matches_torch_backend(dtype):
    """All prompts, all tokens. bf16/fp16 rounding can only flip a token at an exact near-tie:
    a divergence is accepted only where the torch backend's own top two logits are within
    the bf16 bound of each other (a tie the dtype cannot resolve), and the rest of that
    sequence (now a different context) is not compared."""
    n_new = 24
    sp = SamplingParams(max_tokens=n_new, ignore_eos=True)
    kw = dict(device="cuda", dtype=dtype, num_pages=512, seed=4, max_num_batched_tokens=48)
    fi = Engine(ModelConfig.preset("tiny-gpu"), attention_backend="flashinfer", **kw)
    ref = Engine(ModelConfig.preset("tiny-gpu"), attention_backend="torch", **kw)
    assert fi.attention_backend == "flashinfer" and ref.attention_backend == "torch"
    for p in GPU_PROMPTS:  # prefill logits of every position
        assert _rel(fi.prompt_logits(p), ref.prompt_logits(p)) <= REL
    a = fi.generate(GPU_PROMPTS, sp)
    b = ref.generate(GPU_PROMPTS, sp)
    ties = 0
    for p, x, y in zip(GPU_PROMPTS, a, b):
        assert len(x.token_ids) == len(y.token_ids) == n_new
        if x.token_ids == y.token_ids:
            continue
        i = next(k for k, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t)
        logits = ref.prompt_logits(p + y.token_ids[:i])[-1].float()
        gap = abs(float(logits[y.token_ids[i]] - logits[x.token_ids[i]]))
        assert gap <= REL * float(logits.abs().max()), (
            f"prompt of {len(p)} tokens diverges at token {i} with a logit gap {gap:.3g}: not a tie")
        ties += 1
    assert ties <= 1, f"{ties} of {len(GPU_PROMPTS)} prompts diverged at near-ties"


@pytest.mark.parametrize("pinned", [True, False])
def test_save_blocks_on_cuda_equals_save_block(pinned):
    """The CUDA save_blocks (blocks put in the buffer's order on the device, one contiguous
    copy out) writes the bytes save_block writes block by block, whole blocks and one layer,
    into pinned and pageable host memory and into device memory."""
    eng = Engine(ModelConfig.preset("tiny-gpu"), device="cuda", num_pages=256, seed=5, attention_backend="torch")
    rid = eng.add_request(list(range(3, 3 + 5 * eng.block_size + 7)), SamplingParams(max_tokens=1, ignore_eos=True),
                          prefill_only=True, hold_kv=True)
    while eng.has_unfinished():
        eng.step()
    nb, n = eng.layout.block_nbytes, 5
    for layer, per in ((None, nb), (1, eng.layout.layer_nbytes)):
        want = torch.empty(n * per, dtype=torch.uint8, pin_memory=pinned)
        for b in range(n):
            eng.save_block(rid, b, want[b * per:(b + 1) * per], layer=layer)
        for dev in ("cpu", "cuda"):
            got = torch.zeros(n * per, dtype=torch.uint8, device=dev, pin_memory=pinned and dev == "cpu")
            eng.save_blocks(rid, 0, n, got, layer=layer)
            assert torch.equal(got.cpu(), want), f"layer {layer}, buffer on {dev}"
        part = torch.zeros(2 * per, dtype=torch.uint8)
        eng.save_blocks(rid, 2, 2, part, layer=layer)
        assert torch.equal(part, want[2 * per:4 * per])
    eng.release(rid)
