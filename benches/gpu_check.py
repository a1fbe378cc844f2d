"""GPU check of the engine (one prepared script for a session that is lent a GPU).

1. FlashInfer against the torch reference on random paged inputs (bf16): decode and
   mixed prefill batches; relative error must stay within bf16 bounds (<= 2e-2); each
   case also timed with both backends (CUDA events, medians of 20), a 64 x 2048 decode
   batch and a 4096-token prefill among them.
2. Llama-3-8B dimensions with dummy bf16 weights: prefill timings, and decode at batch
   1..64, tokens/s next to the HBM-bandwidth bound
   ``batch / ((weight bytes + KV bytes read per step) / measured copy bandwidth)``.

3. Prefill MFU on those shapes: model FLOPs per second over ``--peak-tflops`` (default
   989, the dense bf16 tensor-core peak of an H100/H200 SXM); target >= 40% at 4k tokens.

Every check ends in a verdict (``OK``/``MET`` or ``FAIL``/``MISSED``); the script exits 1
when any is FAIL or MISSED and names them in its last lines, 0 only when all passed. A
GPU check that could not run (no CUDA, flashinfer not importable) is MISSED, not passed.
``--dry-run`` runs only the CPU-safe part (the torch reference against itself on a paged vs
contiguous layout) and the self-check of the verdict logic, and exits 0 when they pass.
Results (and the verdicts) also go to ``$OUT/gpu_check.json`` when ``OUT`` is set.

    python benches/gpu_check.py [--dry-run] [--batches 1,2,4,8,16,32,64] [--context 1024] [--steps 16]

FlashInfer is not installed on the device machine: carry pinned wheels of
``flashinfer-python`` and what it needs (see docs/engine.md, "GPU check").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from mooncake_rs.engine import Engine, ModelConfig, SamplingParams
from mooncake_rs.engine.attention import BatchMeta, TorchAttention, flashinfer_available

RESULTS: dict[str, object] = {}
PASS_WORDS = ("OK", "MET")
FAIL_WORDS = ("FAIL", "MISSED")


class Verdicts:
    """Each check's verdict; :meth:`exit_code` turns them into the script's exit status."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str, str]] = []  # (check, word, detail)

    def record(self, check: str, word: str, detail: str = "") -> str:
        if word not in PASS_WORDS + FAIL_WORDS:
            raise ValueError(f"verdict must be one of {PASS_WORDS + FAIL_WORDS}, got {word!r}")
        self.items.append((check, word, detail))
        return word

    def check(self, check: str, passed: bool, detail: str = "", *, target: bool = False) -> str:
        """OK/FAIL for correctness checks, MET/MISSED for ``target`` ones."""
        word = ("MET" if passed else "MISSED") if target else ("OK" if passed else "FAIL")
        return self.record(check, word, detail)

    def failed(self) -> list[tuple[str, str, str]]:
        return [v for v in self.items if v[1] in FAIL_WORDS]

    def exit_code(self) -> tuple[int, str]:
        """``(0, summary)`` when every verdict passed (and there is at least one), else
        ``(1, summary naming each FAIL and MISSED)``."""
        if not self.items:
            return 1, "no check ran"
        bad = self.failed()
        if not bad:
            return 0, f"all {len(self.items)} checks passed"
        lines = [f"{len(bad)} of {len(self.items)} checks did not pass:"]
        lines += [f"  {word}: {check}" + (f" ({detail})" if detail else "") for check, word, detail in bad]
        return 1, "\n".join(lines)


VERDICTS = Verdicts()


def self_check_verdicts() -> None:
    """The exit status logic on made-up verdicts (CPU; run by --dry-run and the tests)."""
    v = Verdicts()
    assert v.exit_code()[0] == 1  # nothing ran: not a pass
    v.check("a", True)
    v.check("b", True, target=True)
    assert v.exit_code() == (0, "all 2 checks passed")
    v.check("c", False, "err 3e-2")
    v.check("d", False, "2.5x", target=True)
    rc, msg = v.exit_code()
    assert rc == 1 and "FAIL: c (err 3e-2)" in msg and "MISSED: d (2.5x)" in msg
    assert len(msg.splitlines()) == 3  # the header and the two that did not pass, not a or b
    try:
        v.record("e", "PASS")
    except ValueError:
        pass
    else:
        raise AssertionError("an unknown verdict word was accepted")


def random_paged(b_q, b_kv, page, hq, hkv, d, dtype, dev, seed=0):
    """Random caches, shuffled page tables, queries, and the step's BatchMeta."""
    g = torch.Generator(device=dev).manual_seed(seed)
    npages = sum(-(-kv // page) for kv in b_kv) + 8
    k = torch.randn(npages, page, hkv, d, generator=g, device=dev).to(dtype)
    v = torch.randn(npages, page, hkv, d, generator=g, device=dev).to(dtype)
    perm = torch.randperm(npages, generator=g, device=dev).tolist()
    tables = [[perm.pop() for _ in range(-(-kv // page))] for kv in b_kv]
    meta = BatchMeta.build(b_q, b_kv, tables, page, torch.device(dev))
    q = torch.randn(sum(b_q), hq, d, generator=g, device=dev).to(dtype)
    return q, k, v, meta


def rel_err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def check_reference_cpu() -> None:
    """CPU-safe: the paged reference on shuffled pages equals it on one contiguous page run."""
    q, k, v, meta = random_paged([1, 7, 1], [37, 20, 5], 4, 8, 2, 64, torch.float32, "cpu")
    ref = TorchAttention(8, 2, 64, torch.float32, torch.device("cpu"))
    ref.plan(meta)
    out = ref.forward(q, k, v)
    # same KV rewritten into pages 0.. in order
    rows = torch.cat([k[t].reshape(-1, 2, 64)[:kv] for t, kv in zip(meta.page_tables, meta.kv_lens)])
    vrows = torch.cat([v[t].reshape(-1, 2, 64)[:kv] for t, kv in zip(meta.page_tables, meta.kv_lens)])
    n = rows.shape[0]
    k2 = torch.zeros(n + 8, 1, 2, 64)
    v2 = torch.zeros(n + 8, 1, 2, 64)
    k2[:n, 0], v2[:n, 0] = rows, vrows
    starts, acc = [], 0
    for kv in meta.kv_lens:
        starts.append(acc)
        acc += kv
    meta2 = BatchMeta.build(meta.q_lens, meta.kv_lens, [list(range(s, s + kv)) for s, kv in zip(starts, meta.kv_lens)],
                            1, torch.device("cpu"))
    ref.plan(meta2)
    err = rel_err(ref.forward(q, k2, v2), out)
    RESULTS["cpu_reference_paged_vs_contiguous_rel_err"] = err
    word = VERDICTS.check("cpu: torch reference paged vs contiguous", err < 1e-5, f"rel err {err:.2e}")
    print(f"[cpu] torch reference, paged vs contiguous: rel err {err:.2e}: {word}")


def check_flashinfer() -> None:
    from mooncake_rs.engine.attention import FlashInferAttention

    dev = torch.device("cuda")
    cases = {"decode": ([1] * 16, [int(x) for x in torch.randint(1, 900, (16,)).tolist()]),
             "prefill+decode": ([300, 1, 77, 1, 128], [300, 513, 200, 64, 1000]),
             # the shapes the timing is about: a decode batch at 2k context, a 4k-token prefill
             "decode 64x2048": ([1] * 64, [2048] * 64),
             "prefill 4096": ([4096], [4096])}
    worst = 0.0
    timings: list[dict[str, object]] = []
    for name, (ql, kvl) in cases.items():
        for hq, hkv, d in ((32, 8, 128), (64, 8, 128)):
            q, k, v, meta = random_paged(ql, kvl, 16, hq, hkv, d, torch.bfloat16, "cuda")
            ref = TorchAttention(hq, hkv, d, torch.bfloat16, dev)
            fi = FlashInferAttention(hq, hkv, d, torch.bfloat16, dev)
            ref.plan(meta)
            fi.plan(meta)
            err = rel_err(fi.forward(q, k, v), ref.forward(q, k, v))
            worst = max(worst, err)
            t_fi, t_ref = cuda_median_s(lambda: fi.forward(q, k, v)), cuda_median_s(lambda: ref.forward(q, k, v))
            timings.append({"case": name, "heads": f"{hq}/{hkv}", "flashinfer_ms": t_fi * 1e3,
                            "torch_ms": t_ref * 1e3, "speedup": t_ref / t_fi, "rel_err": err})
            print(f"[gpu] flashinfer vs torch, {name:15s} heads {hq}/{hkv}: rel err {err:.2e}; "
                  f"{t_fi * 1e3:.3f} ms vs {t_ref * 1e3:.3f} ms ({t_ref / t_fi:.1f}x)")
    RESULTS["flashinfer_rel_err_max"] = worst
    RESULTS["attention_timings"] = timings
    word = VERDICTS.check("flashinfer vs torch reference (bf16 bound 2e-2)", worst <= 2e-2, f"worst {worst:.2e}")
    print(f"[gpu] worst relative error {worst:.2e} (bf16 bound 2e-2): {word}")


def cuda_median_s(fn, repeats: int = 20) -> float:
    """Median seconds of ``fn`` on the GPU (CUDA events), after two warm-up calls."""
    fn()
    fn()
    ts = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) / 1e3)
    return sorted(ts)[len(ts) // 2]


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written)."""
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    reps = 10
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize()
    bw = 2 * n * reps / (time.perf_counter() - t0)
    del a, b
    torch.cuda.empty_cache()
    return bw


def prefill_flops(cfg: ModelConfig, new: int, cached: int) -> float:
    """Model FLOPs of prefilling ``new`` tokens after ``cached`` ones: 2 per weight per token
    for the matmuls (the embedding lookup excluded) plus causal attention's QK and PV."""
    matmul_params = cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)
    ctx = cached * new + new * (new + 1) / 2  # key positions attended, summed over new tokens
    attn = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * ctx
    return 2.0 * matmul_params * new + attn


def bench_8b(batches: list[int], context: int, steps: int, backend: str, peak_tflops: float) -> None:
    cfg = ModelConfig.preset("llama-3-8b")
    bw = copy_bandwidth()
    RESULTS["copy_bandwidth_GBps"] = bw / 1e9
    print(f"[gpu] measured copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    tokens_needed = max(batches) * (context + steps + 8)
    num_pages = tokens_needed // 16 + 64
    eng = Engine(cfg, dtype="bfloat16", device="cuda", num_pages=num_pages, max_num_seqs=max(batches),
                 max_num_batched_tokens=8192, attention_backend=backend, seed=0)
    wbytes = eng.model.w.nbytes()
    kv_tok = cfg.kv_bytes_per_token(2)
    print(f"[gpu] llama-3-8b dims, dummy bf16 weights {wbytes / 1e9:.1f} GB, backend {eng.attention_backend}")
    pts = eng.measure_prefill([(512, 0), (2048, 0), (512, 1536), (4096, 0)], repeats=3)
    RESULTS["prefill"] = [p.__dict__ for p in pts]
    mfu = {}
    for p in pts:
        mfu[(p.new_tokens, p.cached_tokens)] = m = prefill_flops(cfg, p.new_tokens, p.cached_tokens) / p.seconds / (
            peak_tflops * 1e12)
        print(f"[gpu] prefill new={p.new_tokens:5d} cached={p.cached_tokens:5d}: {p.seconds * 1e3:8.2f} ms  "
              f"{p.new_tokens / p.seconds:9.0f} tokens/s  MFU {m:.1%} of {peak_tflops:.0f} TFLOPS")
    RESULTS["prefill_mfu"] = {f"{n}+{c}": m for (n, c), m in mfu.items()}
    m4k = mfu[(4096, 0)]
    word = VERDICTS.check("prefill MFU >= 40% at 4096 tokens", m4k >= 0.4, f"{m4k:.1%}", target=True)
    print(f"[gpu] target: prefill at 4096 tokens >= 40% MFU: {word} ({m4k:.1%})")
    rows = []
    for b in batches:
        ids = [eng.add_request([(13 * i + j) % cfg.vocab_size for j in range(context)],
                               SamplingParams(max_tokens=steps + 4, ignore_eos=True)) for i in range(b)]
        while any(eng._requests[i].in_prefill for i in ids):  # prefill everything first
            eng.step()
        eng.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / steps
        for i in ids:
            eng.abort(i)
        eng.step()
        kv_read = b * (context + steps) * kv_tok
        bound = (wbytes + kv_read) / (bw / 2)  # each byte read once: half of read+write copy traffic
        row = {"batch": b, "step_ms": dt * 1e3, "tokens_per_s": b / dt, "bound_tokens_per_s": b / bound,
               "ratio_to_bound": dt / bound}
        rows.append(row)
        print(f"[gpu] decode batch {b:3d}: step {dt * 1e3:7.2f} ms  {b / dt:9.0f} tokens/s  "
              f"bound {b / bound:9.0f} tokens/s  ({dt / bound:.2f}x the bound)")
    RESULTS["decode"] = rows
    kv = bench_kv_save(eng, n_req=8, context=2048)
    RESULTS["kv_save"] = kv
    # the target is on save_blocks (a call a request): what a store write of a request's
    # blocks does; save_block (a call a block) is reported beside it
    word = VERDICTS.check("KV save (save_blocks) GPU -> host >= 0.8x the plain pinned copy", kv["batched_ratio"] >= 0.8,
                          f"{kv['batched_ratio']:.2f}x; save_block {kv['ratio']:.2f}x", target=True)
    print(f"[gpu] target: KV save (save_blocks) >= 0.8x the plain pinned copy: {word} ({kv['batched_ratio']:.2f}x; "
          f"a call a block {kv['ratio']:.2f}x)")
    last = rows[-1]
    word = VERDICTS.check(f"decode at batch {last['batch']} within 2x of the HBM bound",
                          last["ratio_to_bound"] <= 2, f"{last['ratio_to_bound']:.2f}x", target=True)
    print(f"[gpu] target: decode at batch {last['batch']} within 2x of the bound: {word} "
          f"({last['ratio_to_bound']:.2f}x)")


def bench_kv_save(eng: Engine, n_req: int, context: int, repeats: int = 3) -> dict[str, float]:
    """KV save GPU -> host: ``Engine.save_block`` of every block of ``n_req`` prefilled
    requests into one pinned host buffer (a stand-in for the store's arena), against the
    plain copy of the same number of bytes, ``tensor.to("cpu", non_blocking=True)`` into
    pinned memory. Medians of ``repeats``; ratio = save bytes/s over plain bytes/s.
    Three saves: a call a block, a call a request (``save_blocks``), and one call for
    every request (``Engine.save_requests``: what a store write of a step's finished
    requests does); and ``save_blocks`` again into destination views made before the
    clock starts (the row above slices the buffer inside each timed call). On CPU torch runs on one thread here, as our copy does: on this
    shared host its copy of >= 64 KiB otherwise waits for OpenMP threads (BENCHMARKS.md)."""
    dev = eng.device
    cuda = dev.type == "cuda"
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)
    try:
        return _bench_kv_save(eng, n_req, context, repeats)
    finally:
        torch.set_num_threads(threads)


def _bench_kv_save(eng: Engine, n_req: int, context: int, repeats: int) -> dict[str, float]:
    import numpy as np

    from mooncake_rs import Store

    dev = eng.device
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ids = [eng.add_request([(7 * i + j) % eng.config.vocab_size for j in range(context)],
                           SamplingParams(max_tokens=1, ignore_eos=True), prefill_only=True, hold_kv=True)
           for i in range(n_req)]
    while eng.has_unfinished():
        eng.step()
    nblocks = context // eng.block_size
    nb = eng.layout.block_nbytes
    total = n_req * nblocks * nb
    host = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
    src = torch.empty(total, dtype=torch.uint8, device=dev)
    dst = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)

    def save() -> None:
        k = 0
        for rid in ids:
            for b in range(nblocks):
                eng.save_block(rid, b, host[k * nb:(k + 1) * nb])
                k += 1
        sync()

    def save_batched() -> None:
        # one call a request: all its blocks gathered and copied at once (what a store
        # write of a layer's or a prompt's blocks does)
        for k, rid in enumerate(ids):
            eng.save_blocks(rid, 0, nblocks, host[k * nblocks * nb:(k + 1) * nblocks * nb])
        sync()

    # the same calls into destinations sliced before the clock starts (a store write's
    # reserved destination exists already): slicing a tensor costs ~0.9 us on CPU, as much
    # as the 32 KiB save itself, so this row shows the save's own cost beside the one above
    views = [host[k * nblocks * nb:(k + 1) * nblocks * nb] for k in range(len(ids))]

    def save_batched_views() -> None:
        for rid, view in zip(ids, views):
            eng.save_blocks(rid, 0, nblocks, view)
        sync()

    spans = [(rid, 0, nblocks) for rid in ids]

    def save_all() -> None:
        # one call for every block of every request, into the buffer as it is
        eng.save_requests(spans, host)
        sync()

    def plain() -> None:
        dst.copy_(src, non_blocking=True) if cuda else dst.copy_(src)
        sync()

    # CPU: into the slots of a store (what a serving instance's prefill does): the old way
    # a save_block a block into its slot, and save_blocks_each, one call a request
    store = Store(nb, 2 * total) if not cuda else None
    slots = [store.reserve(1 + k) for k in range(n_req * nblocks)] if store is not None else []
    slot_views = [np.asarray(s) for s in slots]

    def slots_per_block() -> None:
        k = 0
        for rid in ids:
            for b in range(nblocks):
                eng.save_block(rid, b, slot_views[k])
                k += 1

    def slots_each() -> None:
        for k, rid in enumerate(ids):
            eng.save_blocks_each(rid, range(nblocks), slots[k * nblocks:(k + 1) * nblocks])

    save()
    per_block = host.clone()  # the reference bytes: a call a block
    # the saves and the plain copy interleaved round by round (each warmed up first), so
    # a change of load on this shared host hits all of them alike
    fns = [save, save_batched, save_all, plain, save_batched_views] + ([slots_per_block, slots_each] if store is not None else [])
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            sync()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    t_save, t_batched, t_all, t_plain, t_views, *t_slots = (sorted(ts)[len(ts) // 2] for ts in times)
    for fn, name in [(save_batched, "save_blocks"), (save_all, "save_requests"),
                     (save_batched_views, "save_blocks into views")]:
        host.zero_()
        fn()
        if not torch.equal(host, per_block):
            raise AssertionError(f"{name} wrote other bytes than save_block")
    def slots_hold_the_reference(fn) -> bool:
        for view in slot_views:
            view[:] = 0
        fn()
        return b"".join(view.tobytes() for view in slot_views) == per_block.numpy().tobytes()

    for fn, name in [(slots_per_block, "save_block into slots"), (slots_each, "save_blocks_each")] if slots else []:
        if not slots_hold_the_reference(fn):
            raise AssertionError(f"{name} wrote other bytes than save_block")
    slot_views.clear()  # a slot's views must be gone before it is aborted
    for s in slots:
        s.abort()
    for rid in ids:
        eng.release(rid)
    row = {"bytes": total, "save_GBps": total / t_save / 1e9, "plain_pinned_GBps": total / t_plain / 1e9,
           "ratio": t_plain / t_save, "save_blocks_GBps": total / t_batched / 1e9, "batched_ratio": t_plain / t_batched,
           "save_requests_GBps": total / t_all / 1e9, "one_call_ratio": t_plain / t_all,
           "save_blocks_views_ratio": t_plain / t_views, "repeats": repeats}
    print(f"[{dev.type}] KV save {total / 1e6:.3f} MB in {n_req * nblocks} blocks ({n_req} requests), medians of "
          f"{repeats}: plain copy {row['plain_pinned_GBps']:.2f} GB/s; save_block (a call a block) "
          f"{row['save_GBps']:.2f} GB/s ({row['ratio']:.2f}x), save_blocks (a call a request) "
          f"{row['save_blocks_GBps']:.2f} GB/s ({row['batched_ratio']:.2f}x), save_requests (one call) "
          f"{row['save_requests_GBps']:.2f} GB/s ({row['one_call_ratio']:.2f}x); save_blocks into views "
          f"sliced beforehand {total / t_views / 1e9:.2f} GB/s ({row['save_blocks_views_ratio']:.2f}x)")
    if t_slots:
        row.update({"slots_save_block_ratio": t_plain / t_slots[0], "slots_each_ratio": t_plain / t_slots[1]})
        print(f"[{dev.type}] KV save into {len(slots)} store slots: save_block a block {total / t_slots[0] / 1e9:.2f} GB/s "
              f"({row['slots_save_block_ratio']:.2f}x), save_blocks_each a request {total / t_slots[1] / 1e9:.2f} GB/s "
              f"({row['slots_each_ratio']:.2f}x the plain copy)")
    return row


def finish() -> int:
    """Write the results, print every failed verdict, and return the exit status."""
    rc, summary = VERDICTS.exit_code()
    RESULTS["verdicts"] = [{"check": c, "verdict": w, "detail": d} for c, w, d in VERDICTS.items]
    RESULTS["exit_code"] = rc
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_check.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    print(("[done] " if rc == 0 else "[FAILED] ") + summary)
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description="engine GPU check")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU-safe part and the verdict self-check only (exit 0 when they pass)")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--cpu-requests", type=int, default=2, help="requests of the CPU KV save bench")
    ap.add_argument("--cpu-context", type=int, default=64, help="tokens a request of the CPU KV save bench")
    ap.add_argument("--cpu-repeats", type=int, default=301,
                    help="rounds of the CPU KV save bench (microsecond calls: many rounds for a stable median)")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="dense bf16 matmul peak of the device, for MFU (H100/H200 SXM: 989)")
    a = ap.parse_args()
    self_check_verdicts()
    VERDICTS.check("verdict logic self-check", True)
    check_reference_cpu()
    # the KV save path runs on CPU too (tiny model): it exercises the code; no target on CPU
    RESULTS["cpu_kv_save"] = bench_kv_save(Engine("tiny", num_pages=max(64, -(-a.cpu_requests * a.cpu_context // 16))),
                                             n_req=a.cpu_requests, context=a.cpu_context, repeats=a.cpu_repeats)
    if a.dry_run:
        print("[dry-run] CPU part only; the GPU checks were not run")
        return finish()
    if not torch.cuda.is_available():
        VERDICTS.record("GPU checks", "MISSED", "no CUDA device (use --dry-run for the CPU part only)")
        return finish()
    RESULTS["device"] = torch.cuda.get_device_name()
    print(f"[gpu] {RESULTS['device']}, torch {torch.__version__}")
    try:
        run_gpu(a)
    except Exception as e:  # a crash is a FAIL too, and what ran before it is still written
        import traceback

        traceback.print_exc()
        VERDICTS.record("GPU part ran to the end", "FAIL", f"{type(e).__name__}: {e}")
    return finish()


def run_gpu(a: argparse.Namespace) -> None:
    if flashinfer_available():
        backend = "flashinfer"
        try:
            check_flashinfer()
        except Exception as e:  # e.g. its JIT build failed: still time the torch backend
            import traceback

            traceback.print_exc()
            VERDICTS.record("flashinfer vs torch reference", "FAIL", f"{type(e).__name__}: {e}")
            print("[gpu] the flashinfer check crashed: timing the torch reference backend")
            backend = "torch"
    else:
        VERDICTS.record("flashinfer vs torch reference", "MISSED", "flashinfer is not importable")
        print("[gpu] flashinfer is not importable: its check is MISSED; timing the torch reference backend")
        backend = "torch"
    bench_8b([int(x) for x in a.batches.split(",")], a.context, a.steps, backend, a.peak_tflops)


if __name__ == "__main__":
    sys.exit(main())
