"""The CUDA backend's cost per decoded token, counted in Numba's CUDA simulator: kernel launches, host<->device bytes
by what they carry, host synchronisations (backends/device_counts.py), for each family's micro model.

    NUMBA_ENABLE_CUDASIM=1 PYTHONPATH=. python bench/device_counts.py [--families qwen3moe,llama] [--tokens 4]
        [--settings slots,spill,misses,"2 slots","2 slots, one step","spec ngram verify"] [--sample]
    NUMBA_ENABLE_CUDASIM=1 PYTHONPATH=. python bench/device_counts.py --prefill [--families deepseek2,qwen3next]

Each family's `micro` preset (pymoe/demo/tinymodel.py, F32, seed 0) is written to a temporary folder and decoded
greedily from the prompt [5, 17] for --tokens new tokens (the first from the prefill, the rest one decode step
each; with --sample, drawn at temperature 0.8, top-k 40, top-p 0.9, seed 1 instead: `SAMPLE`), in three
settings:
  slots:  a slot for every expert, all pre-filled from a profile: every expert is served from a slot;
  spill:  one slot per MoE layer (LRU), pcie_frac 1: every miss is read over PCIe, and promoted;
  misses: one slot per MoE layer (LRU), pcie_frac 0.5: misses alternate between spill (read over PCIe) and the CPU,
          and each is promoted (version 3: each MoE layer's lookup inside the step).
  2 slots: as "slots", two requests (prompts [5, 17] and [9, 12]) decoded at once by the server's scheduler
          (serve/scheduler.py, --parallel 2), each slot on a device KV cache of its own (the engine loaded for 2
          sequences): version 2 decodes both in one batched forward, version 3 runs one device step per slot
          (PYMOE_BATCH_STEP=0);
  2 slots, one step: as "2 slots", version 3 only, the default: a scheduler step in which both slots decode is one
          batched device step for the two (engine/device_batch.py; a step with one slot decoding is a single step).
  spec ngram verify: as "slots", a greedy request with `--spec ngram` (k 3, no back-off) on a prompt of six random
          tokens three times (`SPEC_PROMPT`: prompt lookup drafts, some drafts are kept, some rejected), 12 new
          tokens, the engine prepared for speculation (as `pymoe run --spec`: a hybrid's device snapshot of its
          state); the row counts its verify forwards only, as means per verify forward (not per token), "rows"
          their mean T = 1 + drafts: version 3 runs each as one device step of T rows where the family allows it
          (engine/model.py `verify_on_device`: every family), else version 2.
and in two versions of the GPU path: 2 (PYMOE_DEVICE_STEP=0: the residual stream on the host, three round trips
per layer) and 3 (the default: a decode step on the device from token id to token where the family and the
setting allow it, backends/cuda.py `begin_step`; elsewhere version 3 runs version 2, and the row says so).
--prefill: instead, per prompt chunk: the prompt `PREFILL_PROMPT` (12 tokens) in chunks of `PREFILL_CHUNK` (4), a
slot for every expert ("slots"), the prefill phase's counts divided by its 3 forward calls, in both versions
(version 3 runs the MLA and Gated DeltaNet blocks of a chunk on the device: engine/mla.mla_device,
engine/deltanet.gdn_device; the rest of a prompt's forward is version 2's in both).
The counts are exact (the simulator runs the same launches, copies and syncs as a GPU would; the reference
kernels stand in for the real ones, which the counts do not depend on: backends/cuda.py LAUNCHES). Prints one
Markdown row per family and setting: the table of docs/expert-cache.md ("The GPU path's cost, counted"), the
bytes grouped under short names (`SHORT`: "expert rows" = the pairs' inputs, router weights, zeroed outputs in
and the outputs back; "residual in" = the attention block's input; "logits" = the output projection's input and
output).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402

import pymoe  # noqa: E402
from pymoe.backends.device_counts import per_token  # noqa: E402
from pymoe.experts.profile import Profile  # noqa: E402
from pymoe.gguf.config import ARCHS  # noqa: E402

FAMILIES = list(ARCHS)  # every family pymoe runs (pymoe/gguf/config.py)
PROMPT = [5, 17]
PROMPT_2 = [9, 12]  # the second slot's ("2 slots")
SETTINGS = ("slots", "spill", "misses", "2 slots", "2 slots, one step", "spec ngram verify")
SERVER = ("2 slots", "2 slots, one step")  # the settings run through the server's scheduler
SPEC_PROMPT = [int(t) for t in np.random.default_rng(0).integers(0, 250, 6)] * 3  # "spec ngram verify"
PREFILL_PROMPT, PREFILL_CHUNK = list(range(3, 15)), 4  # --prefill: 3 chunks
SAMPLE = dict(temperature=0.8, top_k=40, top_p=0.9, seed=1)  # --sample: a random draw the device makes
MiB = 2**20
SIM = dict(kernels="reference", free_bytes=700 * MiB + 64 * MiB)  # a 64 MiB "device" beyond the reserve


def load(path: str, setting: str, version: int = 3):
    """The engine of one setting and version (see the module docstring)."""
    os.environ["PYMOE_DEVICE_STEP"] = "1" if version == 3 else "0"  # read when the backend is made
    if setting in ("slots", *SERVER, "spec ngram verify"):  # (a profile's layers are the MoE layers, numbered
        # from 0: experts/trace.py)
        cfg = pymoe.load(path, backend="reference").config
        pairs = [(i, e) for i in range(len(cfg.moe_layers)) for e in range(cfg.n_expert)]
        profile = Profile(len(cfg.moe_layers), cfg.n_expert, pairs=pairs, counts=[1] * len(pairs))
        return pymoe.load(path, backend="cuda", cache_slots=len(pairs), profile=profile, pcie_frac=1.0,
                          backend_options=SIM, sequences=2 if setting in SERVER else 1,
                          speculation=setting == "spec ngram verify")  # (as `pymoe run --spec`)
    cfg = pymoe.load(path, backend="reference").config
    return pymoe.load(path, backend="cuda", cache_slots=len(cfg.moe_layers), policy="lru",
                      pcie_frac=1.0 if setting == "spill" else 0.5, backend_options=SIM)


def decode_counts(path: str, setting: str, tokens: int, version: int = 3, sampling=None) -> tuple[dict, dict, bool]:
    """(per decoded token means, the decode cache counters, whether the decode steps ran on the device) of one
    request, greedy or with `sampling` (generate's keywords)."""
    engine = load(path, setting, version)
    if setting in SERVER:  # "2 slots": a device step per slot; "2 slots, one step": one for both where both decode
        os.environ["PYMOE_BATCH_STEP"] = "0" if setting == "2 slots" else "1"
        return server_counts(engine, tokens)
    if setting == "spec ngram verify":
        return verify_counts(engine)
    list(engine.generate(PROMPT, max_tokens=tokens, stop_at_eos=False, **(sampling or {})))
    st = engine.last_stats
    on_device = engine.model.step_on_device and engine.model._cache_allows_step()
    return per_token({**st.device, "tokens": st.n_decoded}), st.decode, on_device


def server_counts(engine, tokens: int) -> tuple[dict, dict, bool]:
    """"2 slots": two greedy requests through the scheduler with 2 slots, the decode counts of the whole run per
    decoded token (both slots' tokens), the decode cache counters, whether the decode steps ran on the device."""
    from pymoe.backends.device_counts import difference
    from pymoe.engine.sampler import SamplingParams
    from pymoe.serve.scheduler import Job, Scheduler

    counts, stats = engine.backend.counts, engine.cache.stats
    before, cache_before, steps = counts.snapshot("decode"), stats.snapshot("decode"), engine.backend._steps
    with Scheduler(engine, parallel=2, kv="f32") as sched:
        if sched.device_slots() != 2:
            raise SystemExit("2 slots: the slots did not get a device KV cache each")
        jobs = [sched.submit(Job(prompt_ids=list(p), max_tokens=tokens, ignore_eos=True,
                                 sampling=SamplingParams(temperature=0))) for p in (PROMPT, PROMPT_2)]
        for job in jobs:
            list(job.events(timeout=3600))
        if sched.max_batch != 2:
            raise SystemExit("2 slots: the two requests were never decoded in one step")
    cache = {k: v - cache_before[k] for k, v in stats.snapshot("decode").items()}
    return per_token(difference(counts.snapshot("decode"), before)), cache, engine.backend._steps > steps


def verify_counts(engine) -> tuple[dict, dict, bool]:
    """"spec ngram verify": the counts of the request's verify forwards, means per verify forward ("tokens" = the
    verify forwards, "rows" = their mean number of rows), the decode cache counters of the whole request, whether
    the verify forwards ran as device steps."""
    from pymoe.backends.device_counts import difference
    from pymoe.engine.speculative import NgramDrafter, Speculator

    counts, forward, total, rows, b = engine.backend.counts, engine.model.forward, None, [], engine.backend
    on_device = []  # per verify forward: whether it began a device step

    def counted(tokens, kv, phase, *a, **k):
        nonlocal total
        before, steps = counts.snapshot("decode"), b._steps
        out = forward(tokens, kv, phase, *a, **k)
        if phase == "decode" and len(tokens) > 1:
            on_device.append(b._steps > steps)
            d = difference(counts.snapshot("decode"), before)
            total = d if total is None else {key: (total[key] + d[key] if key != "bytes" else
                                                   {w: total["bytes"].get(w, 0) + d["bytes"].get(w, 0)
                                                    for w in {*total["bytes"], *d["bytes"]}})
                                             for key in total}
            rows.append(len(tokens))
        return out

    engine.model.forward = counted
    spec = Speculator(NgramDrafter(), k=3, backoff=False)
    list(engine.generate(SPEC_PROMPT, max_tokens=12, stop_at_eos=False, spec=spec))
    if not rows:  # (the drafter proposed nothing on this prompt: the row says so)
        total = {"forwards": 0, "tokens": 0, "launches": 0, "synchronisations": 0, "bytes": {}}
    m = per_token({**total, "tokens": len(rows)})
    m["rows"] = sum(rows) / max(len(rows), 1)
    return m, engine.last_stats.decode, bool(on_device) and all(on_device)
def prefill_counts(path: str, version: int) -> dict:
    """--prefill: the prefill phase's counts per forward call (per prompt chunk), a slot for every expert."""
    os.environ["PYMOE_DEVICE_STEP"] = "1" if version == 3 else "0"
    cfg = pymoe.load(path, backend="reference").config
    pairs = [(i, e) for i in range(len(cfg.moe_layers)) for e in range(cfg.n_expert)]
    profile = Profile(len(cfg.moe_layers), cfg.n_expert, pairs=pairs, counts=[1] * len(pairs))
    engine = pymoe.load(path, backend="cuda", cache_slots=len(pairs), profile=profile, pcie_frac=1.0,
                        backend_options=SIM, chunk=PREFILL_CHUNK)
    engine.model.prefill(PREFILL_PROMPT, engine.model.new_kv(64))
    c = engine.backend.counts.snapshot("prefill")
    return per_token({**c, "tokens": c["forwards"]})  # (per forward call: "tokens" is the divisor)


# The table's short names for DeviceCounts' byte names (backends/cuda.py), by the start of the name.
SHORT = [("residual to device", "residual in"), ("attention block to host", "attention out"), ("router:", "router"),
         ("expert inputs", "expert rows"), ("expert weights", "expert rows"), ("expert output zeros", "expert rows"),
         ("expert outputs", "expert rows"), ("expert spill", "spill (PCIe reads)"), ("slot copies", "promotions"),
         ("token id and position to device", "token id + position"), ("token and routing ids", "token + routing ids"),
         ("token id, position and draw", "token id + position + draw"),
         ("verify token ids and position", "token ids + position"),
         ("verify argmax and routing", "argmax + routing ids"),
         ("token ids, positions and sequence table", "token ids + positions + sequences"),
         ("token ids, positions, sequence table and draws", "token ids + positions + sequences + draws"),
         ("token, routing and drawn ids", "token + routing + drawn ids"), ("draw to device", "draw settings"),
         ("residency table", "table rows"), ("logits to host", "logits"), ("sampled token id", "sampled token id"),
         ("cpu experts' output", "cpu misses"),
         ("expert input to host (cpu", "cpu misses"), ("routing ids to host (cpu", "cpu misses"),
         ("routing weights to host (cpu", "cpu misses"), ("served table row", "cpu misses"),
         ("prefill staging", "staging"), ("output projection:", "logits"), ("RoPE", "RoPE"), ("KV", "KV"),
         ("shared expert:", "shared expert"), ("dense MLP:", "dense MLP"), ("host-side attention:", "host attention"),
         ("experts one at a time:", "experts one by one"), ("MLA ", "MLA attention"),
         ("recurrent state", "recurrent state")]


def short(name: str) -> str:
    return next((s for prefix, s in SHORT if name.startswith(prefix)), name)


def row(arch: str, setting: str, version: str, m: dict, cache: dict) -> str:
    grouped: dict = {}
    for w, b in m["bytes_by_name"].items():
        grouped[short(w)] = grouped.get(short(w), 0) + b
    names = ", ".join(f"{w} {b:,.0f}" for w, b in grouped.items())
    how = (("no verify forward: nothing drafted" if not m["tokens"] else f"{m['rows']:.2f} rows; "
            f"{cache.get('hits', 0)} hits") if setting == "spec ngram verify" else
           f"{cache.get('hits', 0)} hits" if setting in ("slots", *SERVER) else
           f"{cache.get('hits', 0)} hits, {cache.get('spill', 0)} spill, {cache.get('cpu', 0)} cpu")
    num = lambda x: f"{x:.1f}".removesuffix(".0")  # noqa: E731  (a mean over the tokens of several forwards)
    return (f"| {arch} | {setting} ({how}) | {version} | {num(m['launches'])} | {num(m['synchronisations'])} "
            f"| {m['bytes']:,.0f} | {names} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated archs [default: all of them]")
    ap.add_argument("--tokens", type=int, default=4, help="new tokens per request (decode steps: one less)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, of: " + ", ".join(SETTINGS))
    ap.add_argument("--sample", action="store_true", help="draw at temperature 0.8, top-k 40, top-p 0.9, seed 1 "
                    "[default: greedy]")
    ap.add_argument("--prefill", action="store_true", help="count per prompt chunk instead (see the docstring)")
    args = ap.parse_args()
    settings = re.split(r",(?! )", args.settings)  # (a comma and a space: inside "2 slots, one step")
    for setting in settings:
        if setting not in SETTINGS:
            raise SystemExit(f"--settings: unknown setting {setting!r} (choose from {', '.join(SETTINGS)})")
    if args.prefill:
        return main_prefill(args.families.split(","))
    from pymoe.demo.tinymodel import write_model

    print("| family | setting (decode lookups) | version | launches | syncs | host<->device bytes | bytes by name |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.families.split(","):
            path = os.path.join(tmp, f"micro-{arch}-f32.gguf")
            write_model(path, arch, "micro", "f32", seed=0)
            for setting in settings:
                for version in (2, 3) if setting != "2 slots, one step" else (3,):
                    m, cache, on_device = decode_counts(path, setting, args.tokens, version,
                                                   SAMPLE if args.sample else {})
                    shown = "3" if on_device else "2" if version == 2 else "3 (runs 2)"
                    print(row(arch, setting, shown, m, cache), flush=True)


def main_prefill(families: list) -> None:
    from pymoe.demo.tinymodel import write_model

    print("| family | prompt chunk | version | launches | syncs | host<->device bytes | bytes by name |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in families:
            path = os.path.join(tmp, f"micro-{arch}-f32.gguf")
            write_model(path, arch, "micro", "f32", seed=0)
            for version in (2, 3):
                m = prefill_counts(path, version)
                grouped: dict = {}
                for w, b in m["bytes_by_name"].items():
                    grouped[short(w)] = grouped.get(short(w), 0) + b
                names = ", ".join(f"{w} {b:,.0f}" for w, b in grouped.items())
                num = lambda x: f"{x:.1f}".removesuffix(".0")  # noqa: E731
                print(f"| {arch} | {PREFILL_CHUNK} tokens | {version} | {num(m['launches'])} "
                      f"| {num(m['synchronisations'])} | {m['bytes']:,.0f} | {names} |", flush=True)


if __name__ == "__main__":
    main()
