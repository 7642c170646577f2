"""Benchmark: the CPU's peak int8 multiply-add rate (512-bit `vpdpbusd`), and what a prefill rate asks of it.

What this is: a loop of 12 independent `vpdpbusd` chains on registers (no memory: each instruction is 64 int8 x int8
products added into int32), run on 1 thread and on --threads threads (Numba's prange, one loop per thread), printed
as G MAC/s. With a GGUF file and a prefill rate (`--model FILE --tok-s R --planes P`) it also prints the int8 MACs a
token of that file costs (every matrix product of a layer, the routed experts K of E; the output head left out, as
prefill computes it for the last token only) and the MAC rate a prefill of R tok/s at P 8-bit planes needs: the
arithmetic bound of the integer path, the weights' unpacking, the scales and everything else left out.
What this is not: a kernel of pymoe's (the dots are pymoe/quant/repack.py's); a memory probe (bench_matvec.py).

    PYTHONPATH=. python bench/vnni_peak.py --threads 2 --model /work/bigm/mid-Q4_K_M.gguf --tok-s 924 --planes 2
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

CHAINS = 12  # independent accumulators: more than vpdpbusd's latency x throughput (5 x 1-2) on the cores measured
V16 = ir.VectorType(ir.IntType(32), 16)


@intrinsic
def _dots(typingctx, n):
    """n rounds of CHAINS vpdpbusd -> the lanes' sum (kept, so the loop is not removed)."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16, [V16, V16, V16]),
                                            "llvm.x86.avx512.vpdpbusd.512")
        a = ir.Constant(V16, [0x01020304 + i for i in range(16)])
        b = ir.Constant(V16, [0x01010101 * (i % 3) for i in range(16)])
        pre = builder.block
        loop = builder.append_basic_block("peak.loop")
        done = builder.append_basic_block("peak.done")
        builder.branch(loop)
        builder.position_at_end(loop)
        i = builder.phi(ir.IntType(64))
        accs = [builder.phi(V16) for _ in range(CHAINS)]
        new = [builder.call(fn, [acc, a, b]) for acc in accs]
        i2 = builder.add(i, ir.Constant(ir.IntType(64), 1))
        i.add_incoming(ir.Constant(ir.IntType(64), 0), pre)
        i.add_incoming(i2, loop)
        for k, (acc, nv) in enumerate(zip(accs, new)):
            acc.add_incoming(ir.Constant(V16, [k] * 16), pre)
            acc.add_incoming(nv, loop)
        builder.cbranch(builder.icmp_signed("<", i2, args[0]), loop, done)
        builder.position_at_end(done)
        total = new[0]
        for v in new[1:]:
            total = builder.add(total, v)
        s = builder.extract_element(total, ir.Constant(ir.IntType(32), 0))
        for lane in range(1, 16):
            s = builder.add(s, builder.extract_element(total, ir.Constant(ir.IntType(32), lane)))
        return builder.sext(s, ir.IntType(64))
    return types.int64(types.int64), codegen


@njit(cache=False)
def _one(n):
    return _dots(n)


@njit(parallel=True, cache=False)
def _many(n, threads):
    out = np.zeros(threads, np.int64)
    for t in prange(threads):
        out[t] = _dots(n)
    return out


def peak(threads: int, rounds: int, repeats: int = 5) -> float:
    """-> the best of `repeats` timings, in G int8 MAC/s, of `rounds` rounds on `threads` threads."""
    macs = rounds * CHAINS * 64 * threads
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        if threads == 1:
            _one(rounds)
        else:
            _many(rounds, threads)
        best = max(best, macs / (time.perf_counter() - t0) / 1e9)
    return best


def macs_per_prefill_token(path: str) -> int:
    """int8 multiply-adds one prompt token costs in a file: every 2-D weight of a block, the routed experts K of E
    (3-D tensors: one [rows, cols] matrix an expert), the embedding and output head left out."""
    from pymoe.gguf.loader import load_gguf

    model = load_gguf(path)
    total = 0
    for name, t in model.tensors.items():
        if not name.startswith("blk.") or len(t.shape) < 2 or name.endswith("_inp.weight"):
            continue  # vectors; the router (F32 math, not the integer path)
        rows_cols = int(np.prod(t.shape[-2:]))
        total += rows_cols * (model.config.n_expert_used if len(t.shape) == 3 else 1)  # [E, rows, cols]: K of E
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("--rounds", type=int, default=20_000_000)
    ap.add_argument("--model", help="a GGUF file: print its int8 MACs per prompt token")
    ap.add_argument("--tok-s", type=float, help="a prefill rate (tok/s) to put against the peak")
    ap.add_argument("--planes", type=int, default=2, help="8-bit planes per token (15-bit path: 2; 8-bit: 1)")
    args = ap.parse_args()
    _one(10), _many(10, max(args.threads, 1))  # compile
    one = peak(1, args.rounds)
    many = peak(args.threads, args.rounds) if args.threads > 1 else one
    print(f"vpdpbusd (512-bit) peak: {one:.1f} G int8 MAC/s on 1 thread, {many:.1f} on {args.threads}")
    if args.model:
        m = macs_per_prefill_token(args.model)
        print(f"{args.model}: {m / 1e6:.1f} M int8 MACs per prompt token at 8 bits (the output head left out)")
        if args.tok_s:
            need = m * args.planes * args.tok_s / 1e9
            print(f"prefill at {args.tok_s:.0f} tok/s with {args.planes} plane(s): {need:.1f} G MAC/s, "
                  f"{100 * need / many:.0f}% of the {args.threads}-thread peak, before unpacking and scales")


if __name__ == "__main__":
    main()
