"""Qwen2, Qwen3, Mistral (and Llama with attention bias) against transformers (CPU, float32).

Sliding windows (one window on every layer) included; windows on some layers only refused.

Each family is a random tiny model built with transformers' own config and model classes,
saved with ``save_pretrained`` (safetensors) and loaded by our Engine from that directory.
Biases (zero at transformers' init) and norm weights (one at init) are redrawn, so a
missing bias or norm changes the logits.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


from mooncake_rs import InvalidArgument  # noqa: E402
from mooncake_rs.engine import Engine, ModelConfig, SamplingParams  # noqa: E402
from engine_helpers import saved_blocks  # noqa: E402
from mooncake_rs.base.model_config import SUPPORTED_ARCHITECTURES  # noqa: E402

B = 4  # block size: prompts span several blocks
PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 27, 11, 90, 4], [7, 7, 100, 12],
           [(13 * j + 5) % 128 for j in range(23)]]
N_NEW = 24

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.3,
            eos_token_id=None, bos_token_id=None, pad_token_id=0)

# family -> (config class name, model class name, overrides of TINY)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_parameters={"rope_type": "default",
                                                                       "rope_theta": 1e6})),
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    # head_dim 32 with hidden 64 and 4 heads: q is wider than the residual stream
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "qwen3_bias_tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, attention_bias=True,
                                                                 tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=24, sliding_window=None)),
    # a window no shorter than the context never masks: full attention, accepted
    "mistral_long_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4096)),
    "llama_bias": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    # sliding windows shorter than the prompts (23 tokens) and the generations
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=7,
                                                             max_window_layers=0)),
}


def make_family(path, family, *, seed=0, dtype=None, **over):
    cfg_cls, model_cls, fam_over = FAMILIES[family]
    cfg = getattr(transformers, cfg_cls)(**{**TINY, **fam_over, **over})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # input/post/final norms and Qwen3's q_norm/k_norm
                p.uniform_(0.7, 1.3)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path)
    return model


def hf_generate(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(model, prompt):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def check_logits(ours, ref, rel=1e-4):
    assert ours.shape == ref.shape
    scale = float(ref.abs().max())
    err = float((ours - ref).abs().max())
    assert err <= rel * scale, (err, scale)


def engine(path, **kw):
    return Engine(str(path), block_size=B, **{"max_num_batched_tokens": 16, **kw})


GREEDY = SamplingParams(max_tokens=N_NEW, ignore_eos=True)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_transformers(tmp_path, family):
    model = make_family(tmp_path, family)
    e = engine(tmp_path)
    cfg = e.config
    assert cfg.architecture == FAMILIES[family][1]
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    assert cfg.tie_word_embeddings == model.config.tie_word_embeddings
    for p in PROMPTS:  # prefill logits (23 tokens: chunked under the 16-token budget)
        check_logits(e.prompt_logits(p), hf_logits(model, p))
    outs = e.generate(PROMPTS, GREEDY)  # batched, paged decode
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_generate(model, p, N_NEW), p
        assert o.finish_reason == "length"


def _run(e, rid):
    out = None
    while e.has_unfinished():
        for o in e.step():
            out = o if o.request_id == rid and o.finished else out
    return out


@pytest.mark.parametrize("family", ["qwen2", "qwen3_bias_tied", "mistral", "mistral_window"])
def test_restored_prefix_and_split_decode(tmp_path, family):
    """KV computed by one engine (q/k already biased and normed) is reused by another:
    a restored prefix, then a prefill-only / decode-side split; greedy tokens stay equal."""
    model = make_family(tmp_path, family, seed=1)
    prompt = PROMPTS[2]  # 23 tokens: 5 full blocks and a partial one
    want = hf_generate(model, prompt, N_NEW)
    src = engine(tmp_path)
    rid = src.add_request(prompt, SamplingParams(max_tokens=1), hold_kv=True)
    _run(src, rid)
    blocks = saved_blocks(src, rid, len(prompt))
    src.release(rid)

    dst = engine(tmp_path, max_num_batched_tokens=5)
    out = _run(dst, dst.add_request(prompt, GREEDY, restored_kv=blocks[:5]))
    assert out.token_ids == want and out.num_cached_tokens == 20
    # a different prompt sharing the first two blocks reuses them
    other = prompt[:8] + [3, 1, 4, 1, 5]
    out = _run(dst, dst.add_request(other, GREEDY, restored_kv=blocks[:2]))
    assert out.token_ids == hf_generate(model, other, N_NEW) and out.num_cached_tokens == 8

    # the decode side gets every prompt block (the last partial) and the first token
    pre = engine(tmp_path)
    first = _run(pre, pre.add_request(prompt, GREEDY, prefill_only=True, hold_kv=True, request_id="p"))
    assert first.finish_reason == "prefill" and first.token_ids == want[:1]
    kv = saved_blocks(pre, "p", len(prompt))
    pre.release("p")
    dec = engine(tmp_path)
    out = _run(dec, dec.add_decode_request(prompt, first.token_ids[0], GREEDY, kv))
    assert out.token_ids == want


def test_bfloat16_checkpoint(tmp_path):
    """A bfloat16 checkpoint loads bit for bit in bfloat16 and computes close to float32."""
    model = make_family(tmp_path, "qwen3_bias_tied", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text()).get("dtype") == "bfloat16"
    e = engine(tmp_path, dtype="bfloat16")
    lw, att = e.model.w.layers[1], model.model.layers[1].self_attn
    assert lw.qkv.dtype == torch.bfloat16
    assert torch.equal(lw.q_norm, att.q_norm.weight) and torch.equal(lw.k_norm, att.k_norm.weight)
    assert torch.equal(lw.qkv_bias, torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]))
    assert torch.equal(lw.o_bias, att.o_proj.bias)
    ref_model = model.float()
    for p in PROMPTS:
        check_logits(e.prompt_logits(p), hf_logits(ref_model, p), rel=5e-2)


def test_random_weights_with_family_switches():
    """A ModelConfig with the switches gets random biases and q/k norms that change the output."""
    base = ModelConfig.tiny()
    plain = Engine(base, seed=3, num_pages=64)
    qwen3 = Engine(base.replace(qkv_bias=True, o_bias=True, qk_norm=True, mlp_bias=True), seed=3, num_pages=64)
    lw = qwen3.model.w.layers[0]
    assert lw.qkv_bias.shape == (base.q_size + 2 * base.kv_size,) and lw.o_bias.shape == (base.hidden_size,)
    assert lw.q_norm.shape == lw.k_norm.shape == (base.head_dim,)
    assert plain.model.w.layers[0].qkv_bias is None
    assert torch.equal(plain.model.w.layers[0].qkv, lw.qkv)  # drawn in the same order as before
    p = PROMPTS[0]
    assert not torch.allclose(plain.prompt_logits(p), qwen3.prompt_logits(p))
    assert len(qwen3.generate([p], SamplingParams(max_tokens=5))[0].token_ids) == 5
    assert lw.gate_up_bias.shape == (2 * base.intermediate_size,) and lw.down_bias.shape == (base.hidden_size,)
    cfg = base.replace(qkv_bias=True, o_bias=True, qk_norm=True, mlp_bias=True)
    assert cfg.num_params() == base.num_params() + base.num_layers * (
        base.q_size + 2 * base.kv_size + base.hidden_size + 2 * base.head_dim + 2 * base.intermediate_size
        + base.hidden_size)


def _hf_dict(family, **over):
    cfg_cls, _, fam_over = FAMILIES[family]
    return getattr(transformers, cfg_cls)(**{**TINY, **fam_over, **over}).to_dict()


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    for cfg in ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, {"model_type": "gemma"},
                {**_hf_dict("qwen2"), "architectures": ["Qwen2MoeForCausalLM"]}):
        with pytest.raises(InvalidArgument) as ei:
            ModelConfig.from_hf_config(cfg)
        for a in SUPPORTED_ARCHITECTURES:
            assert a in str(ei.value)
    (tmp_path / "config.json").write_text(json.dumps({**_hf_dict("qwen2"), "architectures": ["PhiForCausalLM"]}))
    with pytest.raises(InvalidArgument, match="PhiForCausalLM.*supported architectures.*Qwen3ForCausalLM"):
        Engine(str(tmp_path))
    # without architectures the model_type decides; with neither, Llama (older hand-written configs)
    d = _hf_dict("qwen3")
    d.pop("architectures", None)
    assert ModelConfig.from_hf_config(d).qk_norm
    bare = {k: v for k, v in _hf_dict("llama_bias").items() if k not in ("architectures", "model_type")}
    assert ModelConfig.from_hf_config(bare).architecture == "LlamaForCausalLM"


def test_sliding_window_config():
    assert ModelConfig.from_hf_config(_hf_dict("mistral_window")).sliding_window == 5
    assert ModelConfig.from_hf_config(_hf_dict("qwen2_window")).sliding_window == 7
    assert ModelConfig.from_hf_config(_hf_dict("mistral_long_window")).sliding_window is None  # 4096 >= 512
    assert ModelConfig.tiny().replace(sliding_window=10**6).sliding_window is None
    with pytest.raises(InvalidArgument, match="sliding_window"):
        ModelConfig.tiny().replace(sliding_window=0)
    with pytest.raises(InvalidArgument, match="sliding_window"):
        ModelConfig.from_hf_config({**_hf_dict("mistral"), "sliding_window": -3})
    # Qwen checkpoints carry a sliding_window even when it is off
    qwen = {**_hf_dict("qwen2"), "sliding_window": 32, "use_sliding_window": False}
    qwen.pop("layer_types")
    assert ModelConfig.from_hf_config(qwen).sliding_window is None
    with pytest.raises(InvalidArgument, match="layer_types"):
        ModelConfig.from_hf_config({**_hf_dict("qwen3"), "layer_types": ["linear_attention"] * 2})


def test_transformers_4x_style_configs():
    """Keys as transformers 4.x wrote them: rope_theta and torch_dtype at the top level, no
    layer_types, Qwen's sliding_window present but switched off by use_sliding_window."""
    qwen25 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
              "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "max_position_embeddings": 32768, "max_window_layers": 21,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False,
              "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 151936,
              "eos_token_id": 151643, "bos_token_id": 151643}
    c = ModelConfig.from_hf_config(qwen25)
    assert (c.head_dim, c.qkv_bias, c.o_bias, c.qk_norm, c.sliding_window) == (64, True, False, False, None)
    assert (c.rope_theta, c.dtype, c.tie_word_embeddings, c.eos_token_ids) == (1e6, "bfloat16", True, (151643,))
    # a dormant window shorter than the context stays off too
    assert ModelConfig.from_hf_config({**qwen25, "sliding_window": 4096}).sliding_window is None
    with pytest.raises(InvalidArgument, match="some layers only"):  # layers 21..23 windowed
        ModelConfig.from_hf_config({**qwen25, "sliding_window": 4096, "use_sliding_window": True})
    qwen3 = {**qwen25, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
             "num_attention_heads": 16, "num_key_value_heads": 8, "attention_bias": False, "sliding_window": None}
    c = ModelConfig.from_hf_config(qwen3)  # no head_dim key: Qwen3's default 128, not 1024 // 16
    assert (c.head_dim, c.qkv_bias, c.qk_norm, c.q_size) == (128, False, True, 2048)
    mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
               "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
               "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "bfloat16", "vocab_size": 32000}
    c = ModelConfig.from_hf_config(mistral)
    assert (c.sliding_window, c.head_dim, c.qkv_bias, c.rms_norm_eps) == (4096, 128, False, 1e-5)
    assert ModelConfig.from_hf_config({**mistral, "sliding_window": None}).sliding_window is None
    with pytest.raises(InvalidArgument, match="rope_scaling"):  # the opt-in YaRN long context
        ModelConfig.from_hf_config({**qwen25, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                               "original_max_position_embeddings": 32768}})


def test_malformed_config_is_invalid(tmp_path):
    d = _hf_dict("qwen2")
    with pytest.raises(InvalidArgument, match="lacks the key 'num_attention_heads'"):
        ModelConfig.from_hf_config({k: v for k, v in d.items() if k != "num_attention_heads"})
    with pytest.raises(InvalidArgument, match="wrong kind"):
        ModelConfig.from_hf_config({**d, "vocab_size": "many"})
    with pytest.raises(InvalidArgument, match="JSON object"):
        ModelConfig.from_hf_config([d])  # type: ignore[arg-type]
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InvalidArgument, match="not readable JSON"):
        Engine(str(tmp_path))


def test_window_on_some_layers_is_refused(tmp_path):
    make_family(tmp_path, "qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with pytest.raises(InvalidArgument, match="sliding-window attention on some layers only"):
        Engine(str(tmp_path))
    d = _hf_dict("qwen3", use_sliding_window=True, sliding_window=32, max_window_layers=1)
    assert d["layer_types"] == ["full_attention", "sliding_attention"]
    # the same without layer_types (transformers 4.x files): max_window_layers decides
    with pytest.raises(InvalidArgument, match="some layers only"):
        ModelConfig.from_hf_config({k: v for k, v in d.items() if k != "layer_types"})


def test_checkpoint_config_mismatch(tmp_path):
    """Qwen2 tensors under a Llama config.json: the biases are left over, an error."""
    make_family(tmp_path, "qwen2")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"],
                                                      "model_type": "llama"}))
    with pytest.raises(InvalidArgument, match="does not use.*q_proj.bias"):
        Engine(str(tmp_path))
    # and Qwen3 without its q/k norms in the file
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForCausalLM"],
                                                      "model_type": "qwen3", "head_dim": 16}))
    with pytest.raises(InvalidArgument, match="q_norm"):
        Engine(str(tmp_path))
    # a head_dim that does not match the tensors
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "head_dim": 8}))
    with pytest.raises(InvalidArgument, match="shape"):
        Engine(str(tmp_path))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
@pytest.mark.parametrize("family", ["qwen3_bias_tied", "mistral_window"])
def test_cuda_family_matches_transformers(tmp_path, backend, family):
    """The CUDA path applies the biases, q/k norms (they precede attention) and the window."""
    from mooncake_rs.engine.attention import flashinfer_available

    if backend == "flashinfer" and not flashinfer_available():
        pytest.skip("needs flashinfer")
    model = make_family(tmp_path, family, head_dim=64)  # a head size FlashInfer compiles
    dtype = "float32" if backend == "torch" else "bfloat16"
    e = engine(tmp_path, device="cuda", dtype=dtype, attention_backend=backend, num_pages=128)
    rel = 1e-3 if backend == "torch" else 5e-2
    for p in PROMPTS:
        check_logits(e.prompt_logits(p).cpu(), hf_logits(model, p), rel=rel)
    if backend == "torch":
        outs = e.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == [hf_generate(model, p, N_NEW) for p in PROMPTS]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flashinfer_window_matches_reference():
    """FlashInfer's window_left against the torch reference's window mask, prefill and decode."""
    from mooncake_rs.engine.attention import BatchMeta, FlashInferAttention, TorchAttention, flashinfer_available

    if not flashinfer_available():
        pytest.skip("needs flashinfer")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q_lens, kv_lens = [1, 33, 1, 200], [70, 33, 513, 260]
    npages = sum(-(-kv // 16) for kv in kv_lens) + 4
    k = torch.randn(npages, 16, 2, 128, generator=g, device=dev).bfloat16()
    v = torch.randn(npages, 16, 2, 128, generator=g, device=dev).bfloat16()
    perm = torch.randperm(npages, generator=g, device=dev).tolist()
    tables = [[perm.pop() for _ in range(-(-kv // 16))] for kv in kv_lens]
    q = torch.randn(sum(q_lens), 8, 128, generator=g, device=dev).bfloat16()
    for ql in (q_lens, [1, 1, 1, 1]):
        q_ = q[:sum(ql)]
        meta = BatchMeta.build(ql, kv_lens, tables, 16, dev)
        ref, fi = TorchAttention(8, 2, 128, torch.bfloat16, dev), FlashInferAttention(8, 2, 128, torch.bfloat16, dev)
        ref.plan(meta, 37)
        fi.plan(meta, 37)
        a, b = fi.forward(q_, k, v).float(), ref.forward(q_, k, v).float()
        assert (a - b).abs().max() / b.abs().max() < 2e-2


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("window", [1, 3, 6, 40])
def test_torch_window_mask_equals_dense(page_size, window):
    """The reference backend's window against attention by hand, in a mixed step (a decode,
    a chunk after a cached prefix, a whole prompt, one token) and on the single-prompt path."""
    from mooncake_rs.engine.attention import BatchMeta, TorchAttention
    from mooncake_rs.engine.kv_cache import KVCache

    g = torch.Generator().manual_seed(window)
    cfg = ModelConfig.tiny()
    h, hkv, d = 4, 2, 16
    cache = KVCache(cfg, num_pages=200, page_size=page_size, dtype="float32", device="cpu")
    q_lens, kv_lens = [1, 5, 8, 1], [23, 17, 8, 1]
    perm = torch.randperm(200, generator=g).tolist()
    tables, ks, vs = [], [], []
    for kv in kv_lens:
        tables.append([perm.pop() for _ in range(-(-kv // page_size))])
        k, v = torch.randn(kv, hkv, d, generator=g), torch.randn(kv, hkv, d, generator=g)
        slots = torch.tensor([tables[-1][t // page_size] * page_size + t % page_size for t in range(kv)])
        cache.write(0, slots, k, v)
        ks.append(k)
        vs.append(v)

    def dense(q, k, v, n, kv):
        k, v = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
        qpos, kpos = torch.arange(kv - n, kv)[:, None], torch.arange(kv)[None, :]
        s = s.masked_fill((kpos > qpos) | (kpos <= qpos - window), float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)

    q = torch.randn(sum(q_lens), h, d, generator=g)
    att = TorchAttention(h, hkv, d, torch.float32, torch.device("cpu"))
    for ql, kvl, idx in ((q_lens, kv_lens, [0, 1, 2, 3]), ([1, 1], [23, 17], [0, 1]), ([8], [8], [2])):
        meta = BatchMeta.build(ql, kvl, [tables[i] for i in idx], page_size, torch.device("cpu"))
        att.plan(meta, window)
        out, start = att.forward(q[:sum(ql)], cache.k(0), cache.v(0)), 0
        for n, kv, i in zip(ql, kvl, idx):
            ref = dense(q[start:start + n], ks[i], vs[i], n, kv)
            torch.testing.assert_close(out[start:start + n], ref, rtol=1e-5, atol=1e-5)
            start += n


@pytest.mark.parametrize("family", ["qwen3_bias_tied", "mistral_window"])
def test_cluster_serves_a_family_directory(tmp_path, family):
    """The embedded cluster (prefill instances, a decode instance, KV through the stores)
    built from a family's directory gives transformers' greedy tokens, also when the
    second round reuses the stored prefix blocks."""
    from mooncake_rs import Cluster

    model = make_family(tmp_path, family, seed=2)
    shared = PROMPTS[2][:16]
    prompts = [shared + [9, 8, 7], shared + [1, 2], PROMPTS[0]]
    want = [hf_generate(model, p, 12) for p in prompts]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    with Cluster(str(tmp_path), prefill=1, decode=1, block_size=B, dram_bytes_per_instance=4 << 20) as c:
        assert [o.token_ids for o in c.generate(prompts, sp)] == want
        again = c.generate(prompts, sp)
        assert [o.token_ids for o in again] == want
        assert sum(o.metrics.reused_tokens for o in again) > 0
