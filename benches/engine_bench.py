"""Engine step loop on CPU (tiny model): tokens/s and the share of step time spent
outside the model math (scheduling, page tables, attention planning, sampling).

Side by side, the same batch through transformers' LlamaForCausalLM.generate with its
own KV cache (same dimensions, random weights) as a reference for tokens/s.

    python benches/engine_bench.py [--batch 8] [--steps 64] [--prompt 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mooncake_rs.engine import Engine, ModelConfig, SamplingParams


class Timer:
    """Accumulates the time spent in a wrapped callable."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.total += time.perf_counter() - t0


def bench_engine(batch: int, steps: int, prompt_len: int, threads: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    cfg = ModelConfig.tiny()
    eng = Engine(cfg, num_pages=4096, max_num_seqs=batch, max_num_batched_tokens=4096, seed=0)
    fwd = Timer(eng.model.forward)
    plan = Timer(eng.attn.plan)
    eng.model.forward = fwd  # type: ignore[method-assign]
    eng.attn.plan = plan  # type: ignore[method-assign]
    prompts = [[(7 * i + j) % cfg.vocab_size for j in range(prompt_len)] for i in range(batch)]
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    eng.step()  # prefill of the whole batch
    for _ in range(3):  # warm-up decode steps
        eng.step()
    fwd.total = plan.total = 0.0
    times = []
    t_all = time.perf_counter()
    n_tok = 0
    for _ in range(steps - 4):
        t0 = time.perf_counter()
        outs = eng.step()
        times.append(time.perf_counter() - t0)
        n_tok += sum(len(o.new_token_ids) for o in outs)
    wall = time.perf_counter() - t_all
    step_s = sum(times)
    math_s = fwd.total - plan.total
    return {"tokens_per_s": n_tok / wall, "step_ms_median": statistics.median(times) * 1e3,
            "overhead_share": (step_s - math_s) / step_s, "plan_share": plan.total / step_s}


def bench_hf(batch: int, steps: int, prompt_len: int, threads: int) -> float:
    import transformers

    torch.set_num_threads(threads)
    c = ModelConfig.tiny()
    hcfg = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                    intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
                                    num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                                    max_position_embeddings=c.max_position_embeddings)
    model = transformers.LlamaForCausalLM(hcfg).eval()
    ids = torch.tensor([[(7 * i + j) % c.vocab_size for j in range(prompt_len)] for i in range(batch)])
    kw = dict(do_sample=False, min_new_tokens=steps, max_new_tokens=steps, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, **dict(kw, min_new_tokens=4, max_new_tokens=4))
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        wall = time.perf_counter() - t0
    return batch * steps / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    runs = [bench_engine(a.batch, a.steps, a.prompt, a.threads) for _ in range(a.repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    hf = statistics.median(bench_hf(a.batch, a.steps, a.prompt, a.threads) for _ in range(a.repeats))
    print(f"tiny model, CPU, batch {a.batch}, {a.steps} decode steps, prompt {a.prompt}, "
          f"{a.threads} thread(s), median of {a.repeats}")
    print(f"  engine        : {med['tokens_per_s']:9.0f} tokens/s  step {med['step_ms_median']:.3f} ms")
    print(f"  transformers  : {hf:9.0f} tokens/s  (generate with its KV cache)")
    print(f"  ratio engine/transformers: {med['tokens_per_s'] / hf:.2f}x")
    print(f"  overhead outside model math: {100 * med['overhead_share']:.1f}% of step time "
          f"(of which attention planning {100 * med['plan_share']:.1f}%); target <= 15%")


if __name__ == "__main__":
    main()
