"""Benchmark: the fused MoE kernel on experts not in cache, its one-token tile dots built with several hints.

What this is: the measurement behind repack.STREAM_AHEAD and qact.STREAM_LOCALITY. The one-token tile dot asks for
the tile bytes STREAM_AHEAD past each block it reads (a hint per 64 bytes, among the block's own loads), at a
prefetch locality (which cache level the line goes to); both are baked into the dot when it is built. This script
loads one model file (8-bit activations, repacked experts), builds the MoE kernel once per distance and locality (0
bytes: no hints from the dots), and then, for --rounds rounds over the layers, calls each
variant in turn on K experts drawn at random from the layer (a fresh draw per call: a decode step's experts come
from DRAM, as on real text; the greedy output of a random-weight model repeats its routing). It times the kernel
call alone and prints the median and 20th percentile per variant. The variants alternate call by call in one
process, so a shared host's drift reaches them alike, in an order drawn anew for each layer (a call right after
another on the same layer finds some of its experts in cache: ~1 of 8 drawn from 64; a fixed order favours all but
the first). Every variant's y is the same bits (checked on the first call of each layer).
What this is not: a whole decode step (bench/compare_llamacpp.py, `--feed random` for the same kind of routing).

    PYTHONPATH=. python bench/stream_ahead.py /work/bigm/mid-Q4_K_M.gguf --threads 2 --localities 0,1,2,3
    PYTHONPATH=. python bench/stream_ahead.py /work/bigm/mid-Q4_K_M.gguf --distances 8192 --by-expert both
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import pymoe
from pymoe.quant import QType, kernels, qact, repack


def build(qtypes, distance: int, locality: int, by_expert: bool = kernels.BY_EXPERT):
    """The MoE kernel for these expert types, its one-token tile dots asking for the bytes `distance` ahead at
    prefetch `locality` (0: prefetchnta, 1: prefetcht2, 2: prefetcht1, 3: prefetcht0); by_expert: a decode call's
    tasks one per expert (kernels.BY_EXPERT), else the gate/up row blocks then the down row ranges."""
    dots = {QType(q): repack._make_tile_dot(QType(q), locality=locality, ahead=distance) for q in qtypes}
    name = (f"bench{distance}_l{locality}_{'e' if by_expert else 'r'}_" + "_".join(QType(q).name for q in qtypes)
            + "_" + kernels._act_fingerprint())
    return kernels.compile_moe(name, dict(kernels.moe_constants(qtypes, dots), BY_EXPERT=by_expert))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="GGUF file (expert types with a tile layout: repack.TILE_BYTES)")
    ap.add_argument("--threads", type=int, default=2, help="Numba threads (default 2)")
    ap.add_argument("--distances", default="0,4096,8192,16384", help="bytes ahead, comma-separated (0: no hints)")
    ap.add_argument("--localities", default=str(qact.STREAM_LOCALITY),
                    help="prefetch localities, comma-separated (default this CPU's for the experts, "
                         f"qact.STREAM_LOCALITY = {qact.STREAM_LOCALITY})")
    ap.add_argument("--rounds", type=int, default=30, help="rounds over the layers (default 30)")
    ap.add_argument("--by-expert", choices=("on", "off", "both"), default="on" if kernels.BY_EXPERT else "off",
                    help="decode's tasks one per expert (on; kernels.BY_EXPERT, this process's default), the row "
                         "tasks (off), or each variant both ways")
    args = ap.parse_args()

    engine = pymoe.load(args.model, threads=args.threads, n_ctx=256, backend_options=dict(act_bits=8))
    model, b = engine.model, engine.model.backend
    cfg = model.cfg
    E, K = cfg.n_expert, cfg.n_expert_used
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, cfg.n_embd)).astype(np.float32)
    layers = [layer for layer in model.layers if layer.ffn_gate_inp is not None]
    kinds = {tuple(layer.expert_types[p] for p in ("gate", "up", "down")) for layer in layers}
    if not all(q in repack.TILE_BYTES for qt in kinds for q in qt):
        raise SystemExit(f"stream_ahead: {args.model}: expert types {sorted(q.name for qt in kinds for q in qt)} "
                         "include one without a tile layout")
    distances = [int(d) for d in args.distances.split(",")]
    localities = [int(v) for v in args.localities.split(",")]
    forms = {"on": [True], "off": [False], "both": [True, False]}[args.by_expert]
    variants = [(f"{d} B ahead" + (f", locality {loc}" if d else "") + ("" if len(forms) == 1 else
                                                                        ", by expert" if e else ", row tasks"),
                 {qt: build(qt, d, loc, e) for qt in kinds})
                for d in distances for loc in (localities if d else localities[:1]) for e in forms]
    for layer in layers:  # every expert's tiles made (the first use of an expert repacks it)
        for e0 in range(0, E, K):
            ids = np.arange(e0, min(E, e0 + K))[None]
            b.moe_experts({e: model.cache.expert(layer.index, e) for e in ids[0].tolist()}, layer.expert_types, x,
                          ids, np.ones(ids.shape, np.float32))
    times = {name: [] for name, _ in variants}
    saved = dict(kernels._ACT_KERNELS)
    try:
        for r in range(args.rounds):
            for layer in layers:
                qt = tuple(layer.expert_types[p] for p in ("gate", "up", "down"))
                first = None
                # a call after another on the same layer finds ~1/8 of its experts in cache (8 of 64 drawn twice):
                # the order of the variants is drawn anew each time, so that no variant always comes first
                order = [variants[0]] + [variants[i] for i in 1 + rng.permutation(len(variants) - 1)] if r == 0 \
                    else [variants[i] for i in rng.permutation(len(variants))]
                for name, fns in order:
                    # round 0: every variant on the same experts (their bits compared); then a fresh draw per call
                    ids = first[0] if r == 0 and first is not None else np.sort(rng.choice(E, K, replace=False))[None]
                    fn, took = fns[qt], []

                    def timed(*a, fn=fn, took=took):
                        t0 = time.perf_counter()
                        out = fn(*a)
                        took.append(time.perf_counter() - t0)
                        return out
                    kernels._ACT_KERNELS[("_moe_kernel",) + qt] = timed
                    y = b.moe_experts({e: model.cache.expert(layer.index, e) for e in ids[0].tolist()},
                                      layer.expert_types, x, ids, np.full(ids.shape, 1.0 / K, np.float32))
                    times[name] += took
                    if r == 0:
                        if first is None:
                            first = (ids, y)
                        elif not np.array_equal(y, first[1]):
                            raise SystemExit(f"stream_ahead: {name} gave other bits than {variants[0][0]}")
    finally:
        kernels._ACT_KERNELS.clear()
        kernels._ACT_KERNELS.update(saved)
    print(f"{args.model}: the fused MoE kernel on {K} random experts of a layer (not in cache), {args.threads} "
          f"threads, 8-bit; {args.rounds} rounds x {len(layers)} layers, variants rotated call by call")
    for name, t in times.items():
        print(f"  {name:<28} median {np.median(t) * 1e6:7.1f} us   p20 {np.percentile(t, 20) * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
