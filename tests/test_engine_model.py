"""The engine's Llama against transformers' LlamaForCausalLM (CPU, float32)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_helpers import hf_greedy, make_hf_model  # noqa: E402

from mooncake_rs import InvalidArgument  # noqa: E402
from mooncake_rs.engine import Engine, ModelConfig, SamplingParams  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 27, 11, 90, 4], [7, 7, 100, 12]]


def _check_logits(engine, model, prompt):
    ours = engine.prompt_logits(prompt)
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].float()
    assert ours.shape == ref.shape
    scale = ref.abs().max()
    assert (ours - ref).abs().max() <= 1e-4 * scale, float((ours - ref).abs().max() / scale)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5 * float(scale))


@pytest.mark.parametrize("variant", ["plain", "llama3_rope_tied_sharded"])
def test_matches_transformers(tmp_path, variant):
    if variant == "plain":
        model = make_hf_model(tmp_path)
    else:  # llama3 rope scaling with a short original context so it bends many frequencies
        rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        model = make_hf_model(tmp_path, rope=rope, tie=True, shard="60KB")
        assert len(list(tmp_path.glob("*.safetensors"))) > 1, "expected a sharded checkpoint"
    engine = Engine(str(tmp_path), block_size=4, max_num_batched_tokens=64)
    assert engine.config.tie_word_embeddings == (variant != "plain")
    for p in PROMPTS:
        _check_logits(engine, model, p)
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = engine.generate(PROMPTS, sp)
    for p, o in zip(PROMPTS, outs):
        assert o.prompt_token_ids == p
        assert o.token_ids == hf_greedy(model, p, 10)
        assert o.finish_reason == "length"


def test_eos_from_config_stops(tmp_path):
    model = make_hf_model(tmp_path)
    ref = hf_greedy(model, PROMPTS[0], 6)
    engine = Engine(str(tmp_path), block_size=4)
    # make the third greedy token a stop token: generation ends right after it
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=6, stop_token_ids=(ref[2],)))[0]
    assert out.token_ids == ref[:ref.index(ref[2]) + 1] and out.finish_reason == "stop"


def test_config_presets_and_validation():
    cfg8 = ModelConfig.preset("Llama-3-8B")
    assert (cfg8.num_layers, cfg8.num_kv_heads, cfg8.head_dim, cfg8.intermediate_size) == (32, 8, 128, 14336)
    assert 7.9e9 < cfg8.num_params() < 8.1e9
    cfg70 = ModelConfig.preset("llama-3-70b")
    assert 69e9 < cfg70.num_params() < 72e9
    assert ModelConfig.tiny().num_layers == 2
    with pytest.raises(InvalidArgument, match="num_kv_heads"):
        ModelConfig(vocab_size=8, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=3, intermediate_size=8)
    with pytest.raises(InvalidArgument, match="preset"):
        ModelConfig.preset("gpt-5")
    with pytest.raises(InvalidArgument, match="rope_scaling"):
        ModelConfig.tiny().replace(rope_scaling={"rope_type": "yarn", "factor": 2.0})


def test_missing_directory_is_invalid(tmp_path):
    with pytest.raises(InvalidArgument):
        Engine(str(tmp_path))  # a directory without config.json
    with pytest.raises(InvalidArgument):
        Engine(ModelConfig.tiny(), dtype="float64")
    with pytest.raises(InvalidArgument, match="page_size"):
        Engine(ModelConfig.tiny(), block_size=12, page_size=8)
    with pytest.raises(InvalidArgument, match="attention_backend"):
        Engine(ModelConfig.tiny(), attention_backend="triton")


def test_same_seed_same_weights():
    a = Engine(ModelConfig.tiny(), seed=3, num_pages=64)
    b = Engine(ModelConfig.tiny(), seed=3, num_pages=64)
    c = Engine(ModelConfig.tiny(), seed=4, num_pages=64)
    assert torch.equal(a.model.w.layers[1].qkv, b.model.w.layers[1].qkv)
    assert not torch.equal(a.model.w.layers[1].qkv, c.model.w.layers[1].qkv)


def test_engine_is_imported_lazily():
    import subprocess
    import sys

    code = ("import sys, mooncake_rs; assert 'torch' not in sys.modules; "
            "E = mooncake_rs.engine.Engine; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
