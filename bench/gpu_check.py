"""The GPU check's model part: the `mid` preset decoded on the CUDA backend with the expert cache at several sizes.

Run by scripts/gpu-check (which first runs the CUDA-marked tests on the GPU); by hand:
    PYTHONPATH=. python bench/gpu_check.py [--model mid-q2_k.gguf] [--fractions 25,50,100] [--tokens 64]
With no --model it writes the mid preset in llama.cpp's Q2_K mix to /tmp (tools/make-tiny-model, one process per
core: about a minute on 16 cores). For each cache size (a share of all experts) it prints, for one request of a
128-token prompt and --tokens generated tokens after one warm-up request (so the cache has adapted):
    prefill tok/s, decode tok/s, decode hit rate, spill share (misses read over PCIe, of all routed), CPU share,
    achieved GB/s (weight bytes one decoded token reads x decode tok/s: dense tensors + K experts per layer)
and then the memory checks: pymoe's device allocations never above its budget, the driver's view of used device
memory against pymoe's count, and host RAM: the anonymous (non-file) resident set must not grow by the experts'
bytes (they stay in the file's page cache, pinned; the slots are on the device).
`--backend cpu` runs the same on the CPU backend (a dry run of this script where there is no GPU); a fraction of 0
means no slot pool (`--cache none`: on the CPU every expert is read in place, on CUDA over PCIe), and on the CPU
backend the RSS check applies to that run only (a CPU slot pool is host RAM by design).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import pymoe  # noqa: E402
from pymoe.experts.plan import dense_bytes  # noqa: E402
from pymoe.experts.policies import DEFAULT_POLICY  # noqa: E402

MiB = 2**20


def rss_kib(kind: str) -> int:
    """RssAnon / RssFile of this process, KiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(kind + ":"):
                return int(line.split()[1])
    return 0


def bytes_per_decoded_token(engine) -> int:
    cfg = engine.config
    experts = sum(engine.file.expert(i, 0).nbytes for i in range(cfg.n_layers)) * cfg.n_expert_used
    return dense_bytes(engine.file)[1] + experts


def ensure_model(path):
    if path:
        return path
    path = "/tmp/pymoe-mid-q2_k.gguf"
    if not os.path.exists(path):
        from pymoe.demo.tinymodel import write_model

        t0 = time.perf_counter()
        write_model(path, "qwen3moe", "mid", "q2_k", seed=0, progress=True, jobs=os.cpu_count() or 1)
        print(f"wrote {path} ({os.path.getsize(path) / 1e6:.0f} MB) in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


def check_size(path, slots: int, args, prompt) -> dict:
    anon0 = rss_kib("RssAnon")
    lines = []
    engine = pymoe.load(path, backend=args.backend, cache_slots=slots or None, cache="auto" if slots else "none",
                        policy=args.policy, pcie_frac=args.pcie_frac, log=lines.append)
    for line in lines:
        print(f"  {line}")
    list(engine.generate(prompt, max_tokens=args.tokens, stop_at_eos=False))  # warm-up request: the cache adapts
    list(engine.generate(prompt[::-1].copy(), max_tokens=args.tokens, stop_at_eos=False))  # the measured one
    s = engine.last_stats
    d = s.decode
    n = max(1, d.get("lookups", 0))
    gbs = bytes_per_decoded_token(engine) * s.decode_tok_s / 1e9
    out = dict(prefill=s.prefill_tok_s, decode=s.decode_tok_s, hit=100 * d.get("hits", 0) / n,
               spill=100 * d.get("spill", 0) / n, cpu=100 * d.get("cpu", 0) / n, gbs=gbs)
    print(f"  {s.prompt_line()}\n  {s.cache_line()}")
    b = engine.backend
    if b.name == "cuda":
        assert b.mem.used <= b.mem.limit, "device budget exceeded"
        free_now = b.cuda.current_context().get_memory_info()[0] if not args.simulated else b.free_at_start
        print(f"  device: pymoe allocated {b.mem.used / MiB:.0f} MiB of its {b.mem.limit / MiB:.0f} MiB budget "
              f"({', '.join(f'{k} {v / MiB:.0f} MiB' for k, v in b.mem.by_what.items())}); the driver reports "
              f"{(b.free_at_start - free_now) / MiB:.0f} MiB more in use than at start")
    grown = (rss_kib("RssAnon") - anon0) * 1024
    experts = engine.file.expert_bytes_total
    print(f"  host: anonymous RSS grew {grown / MiB:.0f} MiB while the experts are {experts / MiB:.0f} MiB "
          f"(file-backed RSS {rss_kib('RssFile') / 1024:.0f} MiB)")
    out["anon_growth"], out["experts"] = grown, experts
    if b.name == "cuda":
        b.close()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: write the mid preset, Q2_K mix, to /tmp)")
    ap.add_argument("--fractions", default="25,50,100", help="cache sizes, percent of all experts")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--policy", default=DEFAULT_POLICY)
    ap.add_argument("--pcie-frac", type=float, default=None, help="default: the PCIe probe's (cuda), 0 (cpu)")
    args = ap.parse_args(argv)
    from numba import config

    args.simulated = bool(config.ENABLE_CUDASIM)
    path = ensure_model(args.model)
    cfg = pymoe.load(path, backend="cpu").config
    n_total = cfg.n_layers * cfg.n_expert
    prompt = np.random.default_rng(0).integers(0, cfg.n_vocab, args.prompt_tokens)
    rows = []
    for pct in [float(x) for x in args.fractions.split(",")]:
        slots = 0 if pct == 0 else max(1, min(n_total, round(pct / 100 * n_total)))  # 0: no pool
        print(f"cache {pct:g}% = {slots} of {n_total} experts", flush=True)
        rows.append((pct, slots, check_size(path, slots, args, prompt)))
    print(f"\n{'cache':>6} {'slots':>6} {'prefill tok/s':>14} {'decode tok/s':>13} {'hit %':>6} {'spill %':>8} "
          f"{'cpu %':>6} {'GB/s':>7}")
    for pct, slots, r in rows:
        print(f"{pct:>5g}% {slots:>6} {r['prefill']:>14.1f} {r['decode']:>13.1f} {r['hit']:>6.1f} {r['spill']:>8.2f} "
              f"{r['cpu']:>6.2f} {r['gbs']:>7.2f}")
    # The CPU backend's slot pool *is* host RAM: there the check applies to runs without a pool (--fractions 0).
    checked = [r for _, slots, r in rows if args.backend == "cuda" or slots == 0]
    if not checked:
        return 0
    # A copy of the experts in host RAM would show as anonymous RSS of their size; allow a quarter of it, and at
    # least 32 MiB (allocator noise, which dominates on small models).
    worst = max(r["anon_growth"] / r["experts"] for r in checked)
    ok = all(r["anon_growth"] < max(0.25 * r["experts"], 32 * MiB) for r in checked)
    print(f"host RAM for experts: the mmap alone (anonymous RSS growth at most {100 * worst:.1f}% of the experts' "
          "bytes)" if ok else f"FAIL: anonymous RSS grew by {100 * worst:.0f}% of the experts' bytes")
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())
