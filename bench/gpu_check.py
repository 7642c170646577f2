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

Report: per cache size, the engine's start-up lines, then its request lines (`prompt ...`, `decode expert cache
...`, on CUDA `decode device per token: L launches, B host<->device bytes, S synchronisations`: backends/
device_counts.py) and the device and host memory lines, indented by two spaces; then one table, a row per size:
    cache  slots  prefill tok/s  decode tok/s  hit %  spill %  cpu %  GB/s  launches/tok  syncs/tok  bytes/tok
(the last three: CUDA's device counts per decoded token; 0 on the CPU backend), then the host RAM verdict line.
Exit status 0, or 1 when the host RAM check fails.
`--dry-run` (or `scripts/gpu-check --dry-run`; needs NUMBA_ENABLE_CUDASIM=1, which the script sets) runs the same
code path in Numba's CUDA simulator with the NumPy reference kernels, on the `micro` preset (F32, written to /tmp),
4-token prompt, 4 tokens: what CI runs (tests/test_device_counts.py), so the check cannot rot between GPU
sessions; its speeds are the simulator's, not a GPU's. `--backend cpu` runs the same on the CPU backend; a fraction
of 0 means no slot pool (`--cache none`: on the CPU every expert is read in place, on CUDA over PCIe), and on the CPU
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


def ensure_model(path, dry_run: bool = False):
    if path:
        return path
    if dry_run:  # the micro preset: the simulator runs it in seconds with the reference kernels
        from pymoe.demo.tinymodel import write_model

        path = "/tmp/pymoe-micro-qwen3moe-f32.gguf"
        write_model(path, "qwen3moe", "micro", "f32", seed=0)
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
                        policy=args.policy, pcie_frac=args.pcie_frac, log=lines.append,
                        backend_options=dict(kernels=args.kernels) if args.backend == "cuda" else None)
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
    out["launches"] = out["syncs"] = out["bytes"] = 0.0
    if s.device is not None:  # CUDA: launches, host<->device bytes, syncs per decoded token
        from pymoe.backends.device_counts import per_token

        print(f"  {s.device_line()}")
        m = per_token({**s.device, "tokens": s.n_decoded})
        out["launches"], out["syncs"], out["bytes"] = m["launches"], m["synchronisations"], m["bytes"]
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
    ap.add_argument("--kernels", default="cuda_kernels", help="cuda_kernels, or reference (NumPy, for the simulator)")
    ap.add_argument("--dry-run", action="store_true",
                    help="in the CUDA simulator (NUMBA_ENABLE_CUDASIM=1), reference kernels, the micro preset")
    args = ap.parse_args(argv)
    from numba import config

    args.simulated = bool(config.ENABLE_CUDASIM)
    if args.dry_run:
        if not args.simulated:
            print("gpu_check: --dry-run needs NUMBA_ENABLE_CUDASIM=1 (scripts/gpu-check --dry-run sets it)",
                  file=sys.stderr)
            return 2
        args.kernels, args.tokens, args.prompt_tokens = "reference", 4, 4
    path = ensure_model(args.model, args.dry_run)
    cfg = pymoe.load(path, backend="cpu").config
    n_total = cfg.n_layers * cfg.n_expert
    prompt = np.random.default_rng(0).integers(0, cfg.n_vocab, args.prompt_tokens)
    rows = []
    for pct in [float(x) for x in args.fractions.split(",")]:
        slots = 0 if pct == 0 else max(1, min(n_total, round(pct / 100 * n_total)))  # 0: no pool
        print(f"cache {pct:g}% = {slots} of {n_total} experts", flush=True)
        rows.append((pct, slots, check_size(path, slots, args, prompt)))
    print(f"\n{'cache':>6} {'slots':>6} {'prefill tok/s':>14} {'decode tok/s':>13} {'hit %':>6} {'spill %':>8} "
          f"{'cpu %':>6} {'GB/s':>7} {'launches/tok':>12} {'syncs/tok':>9} {'bytes/tok':>10}")
    for pct, slots, r in rows:
        print(f"{pct:>5g}% {slots:>6} {r['prefill']:>14.1f} {r['decode']:>13.1f} {r['hit']:>6.1f} {r['spill']:>8.2f} "
              f"{r['cpu']:>6.2f} {r['gbs']:>7.2f} {r['launches']:>12.1f} {r['syncs']:>9.1f} {r['bytes']:>10.0f}")
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
