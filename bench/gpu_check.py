"""The GPU check's model part: the `mid` preset on the CUDA backend, measured beside `pymoe plan`'s prediction.

Run by scripts/gpu-check (which first runs the CUDA-marked tests on the GPU and passes their summary line in); by
hand:
    PYTHONPATH=. python bench/gpu_check.py [--model mid-q2_k.gguf] [--fractions 0,25,50,100]
        [--spill 0,0.5,1,3,5] [--tokens 64] [--report PATH]
With no --model it writes the mid preset in llama.cpp's Q2_K mix to /tmp (tools/make-tiny-model, one process per
core: about a minute on 16 cores; scripts/gpu-check writes it while the CUDA tests run). Stages, each timed
(`== stage: N s (total T s)`):
  1. model: the file (written if not given and not there yet);
  2. probes: the PCIe probe (experts/probe.py: a pinned 64 MiB host->device copy, best of 4, and the CPU's expert
     rate, hence pcie_frac, which every run below uses unless --pcie-frac is given) and the device's memory
     bandwidth (experts/probe.device_bandwidth: 4 device-to-device copies of 512 MiB, read + written bytes, best
     of 4);
  3. cache sizes: first each code path once, without a pool and with one (`compile_first`: Numba's first calls
     compile, which grows RSS before the memory checks start); then for each share of all experts in slots (0: no
     pool, every expert read over PCIe), one warm-up request (the cache adapts), then one measured request of a
     --prompt-tokens prompt and --tokens generated: prefill and decode tok/s, decode hit rate, spill and CPU shares of
     the routed lookups, achieved GB/s (weight bytes one decoded token reads x decode tok/s: dense tensors + K experts
     per layer), the device counts per decoded token (launches, syncs, host<->device bytes:
     backends/device_counts.py), and beside them `pymoe plan`'s prediction for that slot count (experts/plan.py
     `plan_row`: uniform routing, its default hit model; the cost model with the probed device and PCIe bandwidths and
     plan's default fixed cost);
  4. forced spill: every expert in a slot, and a share s of the decode lookups served over PCIe anyway
     (experts/cache.py `SlotCache.force_spill`: each lookup forced with probability s, from a generator seeded per
     decode forward; the device step reads the same mask through its residency table), one measured request per
     share: the spill cliff, beside the plan's tok/s at hit rate 1 - s (its 0% row measures the 100% cache row
     again: the spread of one measurement);
then the report.
Then the memory checks: pymoe's device allocations never above its budget, the driver's view of used device memory
against pymoe's count, and host RAM: the anonymous (non-file) resident set must not grow by the experts' bytes (they
stay in the file's page cache, pinned; the slots are on the device). Exit status 0, or 1 when the host RAM check
fails.

Output: each run's engine lines (start-up, `prompt ...`, `decode expert cache ...`, `decode device per token ...`,
device and host memory), indented by two spaces, as it goes; then the report, printed and written as markdown to
--report (default: in bench/results/, named "gpu-check-", the UTC date, "-", the device's name in lower case with
dashes, ".md"; a dry run adds "-dry-run" before the ".md", and .gitignore keeps those out of git). In order:
    # pymoe GPU check: <device>, <UTC date and time>
    one bullet each: command, model (arch, layers x experts, top-K, bytes per expert slot, file size), the CUDA
      tests' summary line (scripts/gpu-check; "not run" otherwise), code (git describe);
    ## Probes            table: probe | GB/s | detail   (PCIe host->device, CPU expert rate, device memory), then
                         the pcie_frac line
    ## Cache sizes       table: cache % | slots | prefill tok/s | decode tok/s | plan tok/s | hit % | plan hit % |
                         spill % | cpu % | GB/s | launches/tok | syncs/tok | bytes/tok, then the plan's inputs and
                         the `pymoe plan` command that prints each row's prediction
    ## Forced spill      table: forced % | lookups | spill | spill % | decode tok/s | plan tok/s | GB/s |
                         launches/tok | syncs/tok | bytes/tok   (every expert in a slot; spill = lookups served over
                         PCIe, counted by the cache: the share measured)
    ## Bandwidth         achieved GB/s at 100% of experts in slots against the device's copy bandwidth
    ## Memory            the device-budget and host-RAM verdicts
    ## Time              table: stage | s  (the CUDA tests' from scripts/gpu-check, each stage here, the total)
docs/expert-cache.md ("scripts/gpu-check") shows a dry run's report.
`--dry-run` (or `scripts/gpu-check --dry-run`; needs NUMBA_ENABLE_CUDASIM=1, which the script sets) runs the same
code path in Numba's CUDA simulator with the NumPy reference kernels, on the `micro` preset (F32, written to /tmp),
4-token prompt, 8 tokens, 16 MiB probe copies: what CI runs (tests/test_device_counts.py), so the check cannot rot
between GPU sessions; its speeds and bandwidths are the simulator's, not a GPU's, and the report says so.
`--backend cpu` runs the cache sizes on the CPU backend (no probes, no forced spill; on the CPU backend the RSS
check applies to runs with no pool: a CPU slot pool is host RAM by design).
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import pymoe  # noqa: E402
from pymoe.experts.plan import (DEFAULT_FIXED_MS, CostModel, decode_time_per_token, dense_bytes,  # noqa: E402
                                facts_from_gguf, plan_row, uniform_hit_model)
from pymoe.experts.policies import DEFAULT_POLICY  # noqa: E402

MiB = 2**20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORCED_SEED = 0  # force_spill's generator seed: the same masks on every run


def rss_kib(kind: str) -> int:
    """RssAnon / RssFile of this process, KiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(kind + ":"):
                return int(line.split()[1])
    return 0


def bytes_per_decoded_token(engine) -> int:
    cfg = engine.config
    experts = sum(engine.file.expert(i, 0).nbytes for i in cfg.moe_layers) * cfg.n_expert_used
    return dense_bytes(engine.file)[1] + experts


class Stages:
    """Wall time per stage, printed as each ends and kept for the report."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.times: list = []  # [(stage, seconds)]

    def run(self, name: str, fn, *a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        dt = time.perf_counter() - t
        self.times.append((name, dt))
        print(f"== {name}: {dt:.1f} s (total {time.perf_counter() - self.t0:.1f} s)", flush=True)
        return out


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
        part = f"{path}.{os.getpid()}.part"  # renamed when whole: a run killed half-way leaves no truncated file
        write_model(part, "qwen3moe", "mid", "q2_k", seed=0, progress=True, jobs=os.cpu_count() or 1)
        os.replace(part, path)
        print(f"wrote {path} ({os.path.getsize(path) / 1e6:.0f} MB) in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


# --- stage 2: the probes ----------------------------------------------------------------------------------------
def device_name(cuda, simulated: bool) -> str:
    if simulated:
        return "simulator"
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def run_probes(path, args) -> dict:
    """The PCIe probe (its pcie_frac is every run's unless --pcie-frac is given) and the device memory bandwidth."""
    from pymoe.backends import get_backend
    from pymoe.experts.probe import device_bandwidth, pcie_bandwidth, ProbeResult, cpu_expert_rate
    from pymoe.gguf.loader import load_gguf

    b = get_backend("cuda", kernels=args.kernels)
    nbytes = (16 if args.dry_run else 64) * MiB
    pcie = pcie_bandwidth(b.cuda, nbytes=nbytes)
    result = ProbeResult(pcie_gbs=pcie, cpu_gbs=cpu_expert_rate(load_gguf(path), b.cpu), threads=b.cpu.threads)
    dev_nbytes = (16 if args.dry_run else 512) * MiB
    dev = device_bandwidth(b.cuda, nbytes=dev_nbytes)
    out = dict(pcie=pcie, cpu=result.cpu_gbs, threads=result.threads, device=dev, pcie_nbytes=nbytes,
               device_nbytes=dev_nbytes, name=device_name(b.cuda, args.simulated),
               pcie_frac=result.pcie_frac if args.pcie_frac is None else args.pcie_frac)
    print(f"  {result.line()}\n  {result.cpu_line()}\n  device memory: {max(dev):.1f} GB/s device-to-device "
          f"(read + written, best of {' '.join(f'{g:.1f}' for g in sorted(dev))})"
          f"{' (the simulator: a NumPy copy, not a GPU)' if args.simulated else ''}", flush=True)
    b.close()
    return out


# --- stages 3 and 4: runs --------------------------------------------------------------------------------------
def load_engine(path, slots: int, args, pcie_frac):
    lines = []
    engine = pymoe.load(path, backend=args.backend, cache_slots=slots or None, cache="auto" if slots else "none",
                        policy=args.policy, pcie_frac=pcie_frac, log=lines.append,
                        backend_options=dict(kernels=args.kernels) if args.backend == "cuda" else None)
    for line in lines:
        print(f"  {line}")
    return engine


def measure(engine, prompt, tokens: int) -> dict:
    """One request; its speeds, shares of the decode lookups, and device counts per decoded token."""
    list(engine.generate(prompt, max_tokens=tokens, stop_at_eos=False))
    s = engine.last_stats
    d = s.decode
    n = max(1, d.get("lookups", 0))
    out = dict(prefill=s.prefill_tok_s, decode=s.decode_tok_s, lookups=d.get("lookups", 0), hits=d.get("hits", 0),
               spill_n=d.get("spill", 0), hit=100 * d.get("hits", 0) / n, spill=100 * d.get("spill", 0) / n,
               cpu=100 * d.get("cpu", 0) / n, gbs=bytes_per_decoded_token(engine) * s.decode_tok_s / 1e9,
               launches=0.0, syncs=0.0, bytes=0.0)
    print(f"  {s.prompt_line()}\n  {s.cache_line()}")
    if s.device is not None:  # CUDA: launches, host<->device bytes, syncs per decoded token
        from pymoe.backends.device_counts import per_token

        print(f"  {s.device_line()}")
        m = per_token({**s.device, "tokens": s.n_decoded})
        out["launches"], out["syncs"], out["bytes"] = m["launches"], m["synchronisations"], m["bytes"]
    return out


def memory_checks(engine, anon0: int, args) -> dict:
    """Device budget (an assertion) and the host RSS growth of this run; closes a CUDA engine's backend."""
    b = engine.backend
    out = {}
    if b.name == "cuda":
        assert b.mem.used <= b.mem.limit, "device budget exceeded"
        free_now = b.cuda.current_context().get_memory_info()[0] if not args.simulated else b.free_at_start
        line = (f"device: pymoe allocated {b.mem.used / MiB:.0f} MiB of its {b.mem.limit / MiB:.0f} MiB budget "
                f"({', '.join(f'{k} {v / MiB:.0f} MiB' for k, v in b.mem.by_what.items())}); the driver reports "
                f"{(b.free_at_start - free_now) / MiB:.0f} MiB more in use than at start")
        print(f"  {line}")
        out["device_line"] = line
    grown = (rss_kib("RssAnon") - anon0) * 1024
    experts = engine.file.expert_bytes_total
    print(f"  host: anonymous RSS grew {grown / MiB:.0f} MiB while the experts are {experts / MiB:.0f} MiB "
          f"(file-backed RSS {rss_kib('RssFile') / 1024:.0f} MiB)")
    out["anon_growth"], out["experts"] = grown, experts
    if b.name == "cuda":
        b.close()
    return out


def compile_first(path, args, prompt, n_total, pcie_frac) -> None:
    """The code paths run once, without a pool and with one, before any RSS is measured: Numba compiles each kernel
    at its first call (or loads it from its disk cache), which grows anonymous RSS by tens of MiB on its own, more
    than a small model's experts, and ram_check would read that as a copy of the experts."""
    print("warm-up: each code path once (its kernels compiled before anything is measured)", flush=True)
    for slots in (0, max(1, n_total // 4)):
        engine = load_engine(path, slots, args, pcie_frac)
        list(engine.generate(prompt, max_tokens=2, stop_at_eos=False))
        if engine.backend.name == "cuda":
            engine.backend.close()


def cache_sizes(path, args, prompt, n_total, pcie_frac, plan) -> list:
    compile_first(path, args, prompt, n_total, pcie_frac)
    rows = []
    for pct in args.fraction_list:
        slots = 0 if pct == 0 else max(1, min(n_total, round(pct / 100 * n_total)))  # 0: no pool
        print(f"cache {pct:g}% = {slots} of {n_total} experts", flush=True)
        anon0 = rss_kib("RssAnon")
        engine = load_engine(path, slots, args, pcie_frac)
        list(engine.generate(prompt, max_tokens=args.tokens, stop_at_eos=False))  # warm-up request: the cache adapts
        r = measure(engine, prompt[::-1].copy(), args.tokens)
        if plan is not None:
            row = plan_row(slots * plan["facts"].slot_bytes, plan["facts"], 0, plan["hits"], plan["cost"])
            r["plan_tok_s"], r["plan_hit"] = row.tok_s, 100 * row.hit_rate
        r.update(memory_checks(engine, anon0, args), pct=pct, slots=slots)
        rows.append(r)
    return rows


def forced_spill(path, args, prompt, n_total, pcie_frac, plan) -> list:
    """Every expert in a slot; for each share, the cache forces it over PCIe (SlotCache.force_spill)."""
    print(f"forced spill: cache 100% = {n_total} of {n_total} experts", flush=True)
    anon0 = rss_kib("RssAnon")
    engine = load_engine(path, n_total, args, pcie_frac)
    list(engine.generate(prompt, max_tokens=args.tokens, stop_at_eos=False))  # warm-up request
    rows = []
    for i, share in enumerate(args.spill_list):
        print(f"forced spill {share:g}%", flush=True)
        engine.cache.force_spill(share / 100, seed=FORCED_SEED)
        r = measure(engine, np.roll(prompt[::-1], i + 1), args.tokens)  # a new first token: no prefix reused
        r["share"] = share
        r["plan_tok_s"] = decode_time_per_token(1 - share / 100, plan["facts"], plan["cost"]).tok_s
        rows.append(r)
    engine.cache.force_spill(0.0)
    mem = memory_checks(engine, anon0, args)
    for r in rows:
        r.update(mem)
    return rows


# --- stage 5: the report -----------------------------------------------------------------------------------------
def table(head: list, rows: list) -> list:
    return ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"] + [
        "| " + " | ".join(r) + " |" for r in rows]


def git_describe() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def report(args, cfg, path, facts, probes, sizes, spill, ram, stages, now) -> str:
    sim = " (Numba's CUDA simulator with the NumPy reference kernels: speeds and bandwidths are not a GPU's)" \
        if args.simulated else ""
    lines = [f"# pymoe GPU check: {probes['name'] if probes else args.backend}, {now:%Y-%m-%d %H:%M} UTC", "",
             f"- command: `{' '.join(['scripts/gpu-check' if args.from_script else 'bench/gpu_check.py'] + ARGV)}`"
             f"{sim}",
             f"- model: `{path}`: {cfg.arch}, {cfg.n_layers} layers x {cfg.n_expert} experts, top-{cfg.n_expert_used},"
             f" {facts.slot_bytes:,} bytes per expert slot, {os.path.getsize(path) / 1e6:.1f} MB",
             f"- CUDA tests: {args.tests or 'not run (bench/gpu_check.py alone, or scripts/gpu-check --dry-run)'}",
             f"- code: {git_describe()}", ""]
    if probes:
        p, d = probes["pcie"], probes["device"]
        lines += ["## Probes", ""] + table(["probe", "GB/s", "detail"], [
            ["PCIe host->device", f"{max(p):.1f}", f"pinned {probes['pcie_nbytes'] // MiB} MiB copy, best of "
             + " ".join(f"{g:.1f}" for g in sorted(p))],
            ["CPU expert rate", f"{probes['cpu']:.3g}", f"expert bytes computed per second, {probes['threads']} "
             "threads"],
            ["device memory", f"{max(d):.1f}", f"4 device-to-device {probes['device_nbytes'] // MiB} MiB copies, "
             "read + written, best of " + " ".join(f"{g:.1f}" for g in sorted(d))]])
        lines += ["", f"pcie_frac {probes['pcie_frac']:.3g} for every run"
                  f"{' (--pcie-frac)' if args.pcie_frac is not None else ' (the probe)'}", ""]
    lines += ["## Cache sizes", ""]
    lines += table(["cache %", "slots", "prefill tok/s", "decode tok/s", "plan tok/s", "hit %", "plan hit %",
                    "spill %", "cpu %", "GB/s", "launches/tok", "syncs/tok", "bytes/tok"],
                   [[f"{r['pct']:g}", str(r["slots"]), f"{r['prefill']:.1f}", f"{r['decode']:.1f}",
                     f"{r['plan_tok_s']:.1f}" if "plan_tok_s" in r else "-", f"{r['hit']:.1f}",
                     f"{r['plan_hit']:.1f}" if "plan_hit" in r else "-", f"{r['spill']:.2f}", f"{r['cpu']:.2f}",
                     f"{r['gbs']:.2f}", f"{r['launches']:.1f}", f"{r['syncs']:.1f}", f"{r['bytes']:.0f}"]
                    for r in sizes])
    if probes:
        c = probes["cost"]
        lines += ["", f"One warm-up request, then one of {args.prompt_tokens} prompt tokens and {args.tokens} "
                  f"generated. plan: `pymoe plan {path} --free <slots x {facts.slot_bytes}>B --reserve 0 "
                  f"--device-bw {c.device_bw / 1e9:.1f} --pcie {c.pcie_bw / 1e9:.1f} --fixed-ms {DEFAULT_FIXED_MS}` "
                  "(hit model: uniform routing, its default; bandwidths: the probes above; fixed cost: its default)."]
    if spill:
        lines += ["", "## Forced spill", ""]
        lines += table(["forced %", "lookups", "spill", "spill %", "decode tok/s", "plan tok/s", "GB/s",
                        "launches/tok", "syncs/tok", "bytes/tok"],
                       [[f"{r['share']:g}", str(r["lookups"]), str(r["spill_n"]), f"{r['spill']:.2f}",
                         f"{r['decode']:.1f}", f"{r['plan_tok_s']:.1f}", f"{r['gbs']:.2f}", f"{r['launches']:.1f}",
                         f"{r['syncs']:.1f}", f"{r['bytes']:.0f}"] for r in spill])
        lines += ["", "Every expert in a slot; each decode lookup is read over PCIe with probability forced % "
                  f"(SlotCache.force_spill, seed {FORCED_SEED}): spill = the lookups the cache served so, its share "
                  "measured. plan tok/s: the cost model at hit rate 1 - forced share."]
    full = [r for r in sizes if r["slots"] and r["slots"] == max(x["slots"] for x in sizes)]
    if probes and full:
        r = full[-1]
        lines += ["", "## Bandwidth", "",
                  f"Decode at {r['pct']:g}% of experts in slots: {r['gbs']:.2f} GB/s achieved (weight bytes one "
                  f"decoded token reads x {r['decode']:.1f} tok/s) against the device's {max(probes['device']):.1f} "
                  f"GB/s copy bandwidth: {100 * r['gbs'] / max(probes['device']):.1f}%."]
    lines += ["", "## Memory", ""] + [f"- {r['pct']:g}%: {r['device_line']}" for r in sizes if "device_line" in r]
    lines += [f"- forced spill, 100%: {spill[0]['device_line']}"] if spill and "device_line" in spill[0] else []
    lines += [f"- {ram}", "", "## Time", ""]
    tests = [["CUDA tests (and the mid preset's writing beside them)", f"{args.tests_s:.0f}"]] \
        if args.tests_s is not None else []  # (scripts/gpu-check's)
    lines += table(["stage", "s"], tests + [[name, f"{dt:.1f}"] for name, dt in stages.times])
    return "\n".join(lines) + "\n"


def report_path(args, name: str, now) -> str:
    if args.report:
        return args.report
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"
    return os.path.join(ROOT, "bench", "results",
                        f"gpu-check-{now:%Y-%m-%d}-{slug}{'-dry-run' if args.dry_run else ''}.md")


def ram_check(args, sizes, spill):
    # The CPU backend's slot pool *is* host RAM: there the check applies to runs without a pool (--fractions 0).
    checked = [r for r in sizes + spill[:1] if args.backend == "cuda" or r.get("slots") == 0]
    if not checked:
        return True, "host RAM for experts: not checked (the CPU backend's slot pool is host RAM)"
    # A copy of the experts in host RAM would show as anonymous RSS of their size; allow a quarter of it, and at
    # least 32 MiB (allocator noise, which dominates on small models).
    worst = max(r["anon_growth"] / r["experts"] for r in checked)
    ok = all(r["anon_growth"] < max(0.25 * r["experts"], 32 * MiB) for r in checked)
    return ok, (f"host RAM for experts: the mmap alone (anonymous RSS growth at most {100 * worst:.1f}% of the "
                "experts' bytes)" if ok else f"FAIL: anonymous RSS grew by {100 * worst:.0f}% of the experts' bytes")


ARGV: list = []  # the command line, for the report


def main(argv=None):
    global ARGV
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: write the mid preset, Q2_K mix, to /tmp)")
    ap.add_argument("--fractions", default="0,25,50,100", help="cache sizes, percent of all experts (0: no pool)")
    ap.add_argument("--spill", default="0,0.5,1,3,5", help="forced spill shares, percent of decode lookups, at 100%% "
                    "of experts in slots ('' : none)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens generated per request (default 64; dry run 8)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="default 128; dry run 4")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--policy", default=DEFAULT_POLICY)
    ap.add_argument("--pcie-frac", type=float, default=None, help="default: the PCIe probe's (cuda), 0 (cpu)")
    ap.add_argument("--kernels", default="cuda_kernels", help="cuda_kernels, or reference (NumPy, for the simulator)")
    ap.add_argument("--report", default=None, help="the markdown report's path (default: bench/results/gpu-check-"
                    "<date>-<device>.md)")
    ap.add_argument("--tests", default=None, help="the CUDA tests' summary line (scripts/gpu-check passes it)")
    ap.add_argument("--tests-s", type=float, default=None, help="the CUDA tests' wall time, with the model's writing "
                    "beside them, s (scripts/gpu-check)")
    ap.add_argument("--from-script", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--write-model", action="store_true", help="only write the mid preset to /tmp, if not there "
                    "(scripts/gpu-check does it beside the CUDA tests)")
    ap.add_argument("--dry-run", action="store_true",
                    help="in the CUDA simulator (NUMBA_ENABLE_CUDASIM=1), reference kernels, the micro preset")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    ARGV = [a for i, a in enumerate(argv)  # as typed: what scripts/gpu-check adds left out
            if a != "--from-script" and a not in ("--tests", "--tests-s") and argv[i - 1:i] not in (["--tests"],
                                                                                                  ["--tests-s"])]
    from numba import config

    args.simulated = bool(config.ENABLE_CUDASIM)
    if args.dry_run:
        if not args.simulated:
            print("gpu_check: --dry-run needs NUMBA_ENABLE_CUDASIM=1 (scripts/gpu-check --dry-run sets it)",
                  file=sys.stderr)
            return 2
        args.kernels = "reference"
    args.tokens = args.tokens or (8 if args.dry_run else 64)
    args.prompt_tokens = args.prompt_tokens or (4 if args.dry_run else 128)
    args.fraction_list = [float(x) for x in args.fractions.split(",") if x.strip()]
    args.spill_list = [float(x) for x in args.spill.split(",") if x.strip()] if args.backend == "cuda" else []
    if args.write_model:
        ensure_model(args.model, args.dry_run)
        return 0
    stages = Stages()
    now = datetime.datetime.now(datetime.timezone.utc)
    path = stages.run("model", ensure_model, args.model, args.dry_run)
    cfg = pymoe.load(path, backend="cpu").config
    n_total = len(cfg.moe_layers) * cfg.n_expert
    prompt = np.random.default_rng(0).integers(0, cfg.n_vocab, args.prompt_tokens)
    facts = facts_from_gguf(path)
    probes = plan = None
    pcie_frac = args.pcie_frac
    if args.backend == "cuda":
        probes = stages.run("probes", run_probes, path, args)
        pcie_frac = probes["pcie_frac"]
        probes["cost"] = cost = CostModel.from_options(max(probes["device"]), max(probes["pcie"]), DEFAULT_FIXED_MS)
        plan = dict(facts=facts, hits=uniform_hit_model(facts.n_total), cost=cost)  # what `pymoe plan` predicts
    sizes = stages.run("cache sizes", cache_sizes, path, args, prompt, n_total, pcie_frac, plan)
    spill = stages.run("forced spill", forced_spill, path, args, prompt, n_total, pcie_frac, plan) \
        if args.spill_list else []
    ok, ram = ram_check(args, sizes, spill)
    stages.times.append(("total", time.perf_counter() - stages.t0))
    text = report(args, cfg, path, facts, probes, sizes, spill, ram, stages, now)
    out = report_path(args, probes["name"] if probes else args.backend, now)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(text)
    print("\n" + text + f"\nreport: {out}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
