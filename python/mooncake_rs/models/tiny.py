"""A tiny tokenizer (trained here with the ``tokenizers`` library, non-ASCII included) and
a tiny random-weight Llama directory that carries it and a chat template: nothing is
downloaded. ``mooncake-rs make-model DIR`` writes one; the tests use the same maker.

A preset's front (``serve --model tiny``): :func:`write_preset_front` writes the
byte-level tokenizer, chat template and config.json the HTTP front needs for a
random-weight preset, whose token ids are bytes.

Needs the ``tokenizers`` library (the http extra) and, for weights, torch and
safetensors (the torch extra)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "front_dir", "make_tokenizer", "write_model_dir", "write_llama_weights", "write_preset_front"]

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello mooncake, hello cluster",
    "a cache of keys and values for every block of the prompt",
    "prefill and decode run on separate instances",
    "naïve café crème brûlée, déjà vu, façade",
    "grüße aus köln, schöne straße",
    "日本語のテキストと中文的文本",
    "你好世界 こんにちは 세계",
    "emoji 😀 🎉 🚀 ✨ are four bytes",
]
SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user, assistant') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(vocab_size: int = 320) -> Any:
    """A byte-level BPE with few merges, so multi-byte characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return tok


def write_model_dir(path: str | Path, *, max_position_embeddings: int = 4096, seed: int = 0,
                    chat_template: str = CHAT_TEMPLATE) -> Path:
    """Writes tokenizer.json, tokenizer_config.json, config.json and model.safetensors of a
    2-layer random Llama whose vocabulary is the tokenizer's. Returns the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id("</s>")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "chat_template": chat_template}))
    return write_llama_weights(path, vocab=vocab, hidden=64, inter=96, layers=2, heads=4, kv_heads=2,
                               max_position_embeddings=max_position_embeddings, seed=seed,
                               eos=eos, bos=tok.token_to_id("<s>"))


def write_llama_weights(path: str | Path, *, vocab: int, hidden: int, inter: int, layers: int, heads: int,
                        kv_heads: int, max_position_embeddings: int = 4096, seed: int = 0, eos: int | None = None,
                        bos: int | None = None) -> Path:
    """Writes config.json and model.safetensors of a random Llama of these dimensions
    into ``path`` (no tokenizer). Returns the path."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_size=hidden,
               intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv_heads, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
               rope_theta=10000.0, eos_token_id=eos, bos_token_id=bos, tie_word_embeddings=False,
               torch_dtype="float32", hidden_act="silu")
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)

    def mat(rows: int, cols: int) -> Any:
        return torch.randn(rows, cols, generator=g) / math.sqrt(cols)

    h, hd = hidden, hidden // heads
    t = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=g), "model.norm.weight": torch.ones(h),
         "lm_head.weight": mat(vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": mat(heads * hd, h), p + "self_attn.k_proj.weight": mat(kv_heads * hd, h),
                  p + "self_attn.v_proj.weight": mat(kv_heads * hd, h), p + "self_attn.o_proj.weight": mat(h, heads * hd),
                  p + "mlp.gate_proj.weight": mat(inter, h), p + "mlp.up_proj.weight": mat(inter, h),
                  p + "mlp.down_proj.weight": mat(h, inter), p + "input_layernorm.weight": torch.ones(h),
                  p + "post_attention_layernorm.weight": torch.ones(h)})
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    return path


# Plain-text role markers: a byte-level vocabulary has no special tokens to spend on them.
PRESET_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user, assistant') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def write_preset_front(path: str | Path, *, vocab_size: int, max_position_embeddings: int) -> Path:
    """What the HTTP front reads of a model directory, for a random-weight preset: a
    byte-level tokenizer of exactly 256 ids (one a byte, no merges, no special tokens),
    a chat template, and a config.json with the preset's context length and no EOS (a
    random model has none: generation ends at max_tokens). Returns the path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from ..errors import InvalidArgument

    if vocab_size < 256:
        raise InvalidArgument(f"a byte-level tokenizer needs a vocabulary of at least 256 ids, the preset has {vocab_size}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([], trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": PRESET_CHAT_TEMPLATE}))
    (path / "config.json").write_text(json.dumps({"vocab_size": vocab_size,
                                                  "max_position_embeddings": max_position_embeddings}))
    return path


def front_dir(model: str, scratch: str | Path, *, weights: bool = True) -> Path:
    """The directory the HTTP front reads for ``--model``: a model directory, checked
    (config.json, and ``weights``: *.safetensors) before anything starts on it, or for a
    preset name (``tiny``, ...) its byte-level front written into ``scratch``. Raises
    :class:`InvalidArgument` with a one-line reason."""
    import os

    from ..base.model_config import PRESETS, model_dir_config

    if model in PRESETS and not os.path.isdir(model):
        cfg = PRESETS[model]
        return write_preset_front(scratch, vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings)
    model_dir_config(model, weights=weights)
    return Path(model)
