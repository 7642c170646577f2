"""Fused CPU kernels: quantized weights times activations, without ever dequantizing the whole matrix.

What this is: `matvec(w_raw, qtype, x)` (decode: one token) and `matmul(w_raw, qtype, X)` (prefill: T tokens), for
every format in the registry. Each output row walks its raw blocks in chunks of about CHUNK_WEIGHTS weights: the
format's Numba `decode_block` turns a chunk into float32 in a small per-thread scratch buffer (it stays in L1), and
the chunk is dotted with the matching slice of x (or of every token's row of X: each block is decoded once per
call, whatever T). Rows are spread over Numba's threads with `prange`; callers choose the count with
`numba.set_num_threads`, this module never sets it.
What this is not: the reference. The reference of `matvec(w, q, x)` is `dequantize(w, q) @ x` (NumPy, in
`pymoe.quant`); tests/test_kernels.py compares the two for every format. Nor is it a CUDA kernel (cuda_kernels/).
The second half of this file is the integer path (the CPU backend's default for K-quants): `matmul_act` and the
fused MoE kernel `moe_act`, built on quant/qact.py; the float kernels above stay its reference.

One kernel source, many formats. `_matvec_kernel` and `_matmul_kernel` below are written once, in terms of four
names they read as globals: DECODE_BLOCK, QK, TYPE_SIZE, CHUNK_BLOCKS. `_specialise` builds, per format, a fresh
Python function from the same code object with those names bound to the format's values, and compiles it. Numba
treats globals as compile-time constants, so each format gets straight-line code with its decoder inlined, and
unlike a closure (whose captured dispatcher pickles differently in every process, defeating `cache=True`) the
result is found again in Numba's on-disk cache by the next process. The cached function's name carries a hash of
the decoder's source files, because Numba's cache only watches this file: editing a decode_block must not
silently reuse a stale compiled kernel.

Numerics: each dot product accumulates in float32, like the float32 reference `dequantize(w) @ x` (BLAS sgemv).
The dot loop is compiled with fastmath {'reassoc', 'contract'} so LLVM may split the sum into SIMD lanes and use
FMA; the order of additions therefore differs from the reference's, and results agree within float32 summation
error (|error| <= C * 2^-24 * sum_i |w_i x_i| for C terms, the bound the tests check). The decoders are compiled
without fastmath, so decoded weights stay bit-exact with `dequantize`.

Shape legend: R rows, C cols (= n_blocks * QK), T tokens.
"""
from __future__ import annotations

import hashlib
import inspect
import os
from dataclasses import dataclass

import numpy as np
from numba import get_num_threads, njit, prange

from . import QType, QuantFormat, get_format
from .jit import bind

CHUNK_WEIGHTS = 256  # weights decoded per step (one K-quant block, 8 legacy blocks, 256 float values): 1 KiB
ROWS_PER_TASK = 8  # rows handled by one prange iteration; each iteration owns one scratch buffer
FASTMATH_DOT = {"reassoc", "contract"}  # allow SIMD partial sums and FMA in the dot product only


@njit(cache=True, fastmath=FASTMATH_DOT)
def dot(a, b):
    """sum_i a[i] * b[i] in float32 (a, b float32 [n]).

    The loop indexes from 0 over whole (sliced) arrays: Numba then can drop its negative-index wraparound test and
    LLVM turns the loop into SIMD fused multiply-adds (a loop over a[lo:hi] by absolute index would stay scalar).
    """
    acc = np.float32(0.0)
    for i in range(a.shape[0]):
        acc += a[i] * b[i]
    return acc


# ----------------------------------------------------------------------------------------------------------------
# The two kernel templates. DECODE_BLOCK, QK, TYPE_SIZE, CHUNK_BLOCKS are bound per format by _specialise; the
# placeholders below only make the templates readable (they are never compiled with these values).
# ----------------------------------------------------------------------------------------------------------------
DECODE_BLOCK = None
QK = TYPE_SIZE = CHUNK_BLOCKS = 0


def _matvec_kernel(w, x, y):
    # w uint8 [R, n_blocks * TYPE_SIZE], x float32 [C], y float32 [R] (written)
    n_rows = w.shape[0]
    n_blocks = w.shape[1] // TYPE_SIZE
    n_tasks = (n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        scratch = np.empty(CHUNK_BLOCKS * QK, dtype=np.float32)  # [CHUNK_BLOCKS * QK] decoded weights
        for r in range(task * ROWS_PER_TASK, min(n_rows, (task + 1) * ROWS_PER_TASK)):
            acc = np.float32(0.0)
            for b0 in range(0, n_blocks, CHUNK_BLOCKS):
                nb = min(CHUNK_BLOCKS, n_blocks - b0)
                w_chunk = scratch[:nb * QK]  # [nb * QK]
                DECODE_BLOCK(w[r, b0 * TYPE_SIZE:(b0 + nb) * TYPE_SIZE], w_chunk)
                acc += dot(w_chunk, x[b0 * QK:(b0 + nb) * QK])
            y[r] = acc


def _matmul_kernel(w, xs, y):
    # w uint8 [R, n_blocks * TYPE_SIZE], xs float32 [T, C], y float32 [T, R] (written)
    n_rows = w.shape[0]
    n_tokens = xs.shape[0]
    n_blocks = w.shape[1] // TYPE_SIZE
    n_tasks = (n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        scratch = np.empty(CHUNK_BLOCKS * QK, dtype=np.float32)  # [CHUNK_BLOCKS * QK] decoded weights
        acc = np.empty(n_tokens, dtype=np.float32)  # [T] one running dot product per token
        for r in range(task * ROWS_PER_TASK, min(n_rows, (task + 1) * ROWS_PER_TASK)):
            acc[:] = 0.0
            for b0 in range(0, n_blocks, CHUNK_BLOCKS):
                nb = min(CHUNK_BLOCKS, n_blocks - b0)
                w_chunk = scratch[:nb * QK]  # [nb * QK], decoded once, used by all T tokens
                DECODE_BLOCK(w[r, b0 * TYPE_SIZE:(b0 + nb) * TYPE_SIZE], w_chunk)
                for t in range(n_tokens):
                    acc[t] += dot(w_chunk, xs[t, b0 * QK:(b0 + nb) * QK])
            for t in range(n_tokens):
                y[t, r] = acc[t]


@dataclass(frozen=True)
class _Kernels:
    matvec: object  # (w uint8 [R, row_bytes], x float32 [C], y float32 [R]) -> None
    matmul: object  # (w uint8 [R, row_bytes], xs float32 [T, C], y float32 [T, R]) -> None


_KERNELS: dict[QType, _Kernels] = {}


def _source_fingerprint(paths) -> str:
    """A short hash of source files a compiled kernel depends on (Numba's cache only watches this file)."""
    digest = hashlib.sha1()
    for path in sorted(set(paths)):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]


def _decoder_fingerprint(fmt: QuantFormat) -> str:
    """A short hash of the source files the format's decoder is compiled from (its module and floats.py; for a
    format described by a layout, also the layout's module)."""
    paths = [inspect.getsourcefile(fmt.decode_block.py_func), os.path.join(os.path.dirname(__file__), "floats.py")]
    if fmt.layout is not None:
        paths.append(inspect.getsourcefile(fmt.layout.code))
    return _source_fingerprint(paths)


def _compile(template, suffix: str, constants: dict, parallel: bool = True):
    """`template` compiled with some of its globals bound to `constants`, named template_suffix (jit.bind)."""
    return bind(template, f"{template.__name__}_{suffix}", constants, parallel)


def _specialise(template, fmt: QuantFormat):
    """Compile `template` for one format: its globals DECODE_BLOCK/QK/TYPE_SIZE/CHUNK_BLOCKS bound to fmt's."""
    constants = dict(
        DECODE_BLOCK=fmt.decode_block,
        QK=fmt.block_size,
        TYPE_SIZE=fmt.type_size,
        CHUNK_BLOCKS=max(1, CHUNK_WEIGHTS // fmt.block_size),
    )
    return _compile(template, f"{fmt.name}_{_decoder_fingerprint(fmt)}", constants)


def kernels_for(fmt: QuantFormat) -> _Kernels:
    """The compiled (lazily, on first call) kernels of one format, built once per process."""
    if fmt.qtype not in _KERNELS:
        _KERNELS[fmt.qtype] = _Kernels(_specialise(_matvec_kernel, fmt), _specialise(_matmul_kernel, fmt))
    return _KERNELS[fmt.qtype]


# ----------------------------------------------------------------------------------------------------------------
# Public entry points: validate, view the weights as raw bytes, call the format's kernel.
# ----------------------------------------------------------------------------------------------------------------
def weight_rows(w_raw: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    """Weights as GGUFReader gives them -> uint8 [R, row_bytes], C-contiguous, no copy when already contiguous.

    Quantized tensors arrive as uint8 [R, row_bytes]; F32 as float32 [R, C] and F16 as float16 [R, C] (values,
    one "block" each), which are viewed as their bytes.
    """
    w_raw = np.asarray(w_raw)
    if w_raw.ndim != 2:
        raise ValueError(f"{fmt.name} weights must be 2-D [rows, row_bytes or cols], got shape {w_raw.shape}")
    if w_raw.dtype != np.uint8 and not (fmt.block_size == 1 and w_raw.dtype.itemsize == fmt.type_size):
        raise ValueError(f"{fmt.name} weights must be raw uint8 bytes, got dtype {w_raw.dtype}")
    w = np.ascontiguousarray(w_raw).view(np.uint8)  # [R, row_bytes]
    if w.shape[1] % fmt.type_size:
        raise ValueError(f"{fmt.name} rows must be whole blocks of {fmt.type_size} bytes, got {w.shape[1]} bytes")
    return w


def cols_of(w: np.ndarray, fmt: QuantFormat) -> int:
    """Number of weights per row of raw rows w (uint8 [R, row_bytes])."""
    return w.shape[1] // fmt.type_size * fmt.block_size


def matvec(w_raw: np.ndarray, qtype, x: np.ndarray) -> np.ndarray:
    """y = W x with W given as raw rows of `qtype`: w_raw [R, row_bytes], x float32 [C] -> float32 [R]."""
    fmt = get_format(qtype)
    w = weight_rows(w_raw, fmt)  # [R, row_bytes]
    x = np.ascontiguousarray(x, dtype=np.float32)  # [C]
    if x.ndim != 1 or x.shape[0] != cols_of(w, fmt):
        raise ValueError(f"matvec: x must have shape ({cols_of(w, fmt)},) for {fmt.name} weights "
                         f"{w.shape[0]}x{cols_of(w, fmt)}, got {x.shape}")
    y = np.empty(w.shape[0], dtype=np.float32)  # [R]
    kernels_for(fmt).matvec(w, x, y)
    return y


def matmul(w_raw: np.ndarray, qtype, X: np.ndarray) -> np.ndarray:
    """Y = X W^T with W given as raw rows of `qtype`: w_raw [R, row_bytes], X float32 [T, C] -> float32 [T, R]."""
    fmt = get_format(qtype)
    w = weight_rows(w_raw, fmt)  # [R, row_bytes]
    X = np.ascontiguousarray(X, dtype=np.float32)  # [T, C]
    if X.ndim != 2 or X.shape[1] != cols_of(w, fmt):
        raise ValueError(f"matmul: X must have shape (T, {cols_of(w, fmt)}) for {fmt.name} weights "
                         f"{w.shape[0]}x{cols_of(w, fmt)}, got {X.shape}")
    Y = np.empty((X.shape[0], w.shape[0]), dtype=np.float32)  # [T, R]
    kernels_for(fmt).matmul(w, X, Y)
    return Y


# ================================================================================================================
# The integer path (decode and prefill speed): activations quantized to 16 (or 8) bits once per call (qact.py),
# each weight row dotted with them in integer arithmetic by its format's vec_dot. Same structure as the float kernels above: one
# template, compiled per format (or per gate/up/down format triple) with VEC_DOT* bound as compile-time globals.
# Reference: the float kernels above / `dequantize(w) @ x`; the int8 path differs from it by the rounding of x to
# 16 or 8 bits (bound in qact.py's docstring, checked by tests/test_kernels_qact.py).
# ================================================================================================================
from llvmlite import ir  # noqa: E402
from numba import carray, types as nbtypes  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from . import qact  # noqa: E402  (qact imports the registry filled above)
from .qact import PLANE_QMAX, QK_K, SUB, prefetch_ahead, quantize_act_in, quantize_planes  # noqa: E402
from . import repack  # noqa: E402
from .repack import MANY as TILE_MANY, ROWS as TILE_ROWS, TOKENS as TILE_TOKENS  # noqa: E402

VEC_DOT = VEC_DOT_GATE = VEC_DOT_UP = VEC_DOT_DOWN = None  # bound per format by _compile
ROWS_GATE = ROWS_UP = ROWS_DOWN = ROWS = None  # (w_row, xq [n, C], xd, xbs, acc float32 [n, 16], out float32 [n])
GATE_SIZE = UP_SIZE = DOWN_SIZE = 0  # bytes per 256 weights of the gate, up and down types
TILE2_GATE = TILE2_UP = TILE2_DOWN = None  # their tile dots of two rows of x (a token's two planes: decode)
TILE_GATE = TILE_UP = TILE_DOWN = None  # their repacked layouts' tile dots (quant/repack.py; any one for a type
GATE_TILE = UP_TILE = DOWN_TILE = 0  # without a layout: never called), and bytes per 8 rows and 256 columns
PAIR_GATE_UP = PAIR_DOWN = False  # whether their many-token tile dots take two row-groups a call (repack.PAIRS)
DECODE_GATE = DECODE_UP = DECODE_DOWN = None  # their row decoders (qact.ROW_DECODES; a placeholder where none)
DECODED_GATE_UP = DECODED_DOWN = False  # whether prefill reads them through decoded scratch tiles (both gate and up)
TILE_DECODED_GATE_UP = TILE_DECODED_DOWN = None  # the decoded layout's tile dot (repack.tile_dot_decoded) where
# gate/up or down may be decoded (a placeholder elsewhere); PAIR_DECODED: in its pair form
PAIR_DECODED = False
DECODED_TILE = 0  # bytes of the decoded layout per 8 rows and 256 columns (qact.DECODED_TILE)
SCALED_GATE_UP = SCALED_DOWN = False  # whether prefill scales them into scratch (repack.SCALED_PAIRS; gate and up)
SCALE_GATE = SCALE_UP = SCALE_DOWN = None  # their repack.SCALE_PAIRS (a placeholder where none)
SCALED_DOT_GATE = SCALED_DOT_UP = SCALED_DOT_DOWN = None  # their repack.SCALED_DOTS (a placeholder where none)
SCALED_BLOCK = repack.SCALED_BLOCK  # bytes of the scaled layout per 16 rows and 256 columns
SCALED_MIN_GATE_UP = SCALED_MIN_DOWN = 0  # the fewest rows of x (pairs; at two planes two a token) of one expert
# for which prefill scales its Q2_K or Q3_K row-groups into scratch (repack.scale_pair, repack.SCALED_MIN_ROWS) and
# reads them with the scaled dot
# The fewest tokens of one expert for which prefill decodes its rows into scratch tiles (IQ1-IQ3): decoding a weight
# costs about what ~5 tokens' raw-row products of it do, which the faster dot wins back after ~7.5 tokens (1 thread,
# 512 x 1024, bench/bench_repack.py: decoding ~10 G weights/s, the decoded tile dots ~143 G MACs/s against the raw
# rows' ~49: 0.1 / (1/49 - 1/143) = 7.5)
DECODE_MIN_TOKENS = 8
MM_ROWS_PER_TASK, MM_TOKENS = 32, 64  # the tile of the integer mat-mat kernel: rows per task, tokens per step
ROWS_LANES = 16  # the float32 lanes of a multi-row dot's accumulator per row (qact._make_row_dot)
# How far ahead the MoE kernel asks for the weights it reads next (bytes; 0: not at all). Hardware prefetchers alone
# leave a compute-heavy loop waiting on DRAM: decode of the mid Q4_K_M file, in one process alternating 0 / 2048 /
# 4096 / 8192, 2 threads, 8-bit: p20 6.40 / 5.87 / 5.85 / 6.10 ms a token, median 8.34 / 6.38 / 6.39 / 7.51; 1 thread
# median 12.6 / 10.5 / 10.4 / 12.1; 16-bit (raw rows) median 8.25 / 7.11 / 7.42 (Zen 5; bench/prefetch_ahead.py).
PREFETCH_AHEAD = 4096
BY_EXPERT = os.environ.get("PYMOE_BY_EXPERT", "1") != "0"  # decode's MoE kernel one task per expert (_moe_kernel;
# the MoE kernel on 8 cold experts, 2 threads, bench/stream_ahead.py --by-expert both: Q4_K_M mid 230 / 239, 185 / 199,
# 246 / 254 us, Q2_K mix 163 / 187, 162 / 184 us, by expert / row tasks). PYMOE_BY_EXPERT=0: the row tasks
# Rows of F per gate/up task of the MoE kernel: one quantization block of h (QK_K), so that a task turns its own
# rows of silu(gate x) * up x into 8-bit (or 16-bit) values while they are in cache: h never exists as float32
# (P x F x 4 bytes, 8 MiB for a 512-token chunk of the mid preset) and needs no parallel phase of its own. Time:
# within noise (layer 5 of the mid Q4_K_M file, its real 512-token call, 1 thread, 9 alternated calls: 55.1 ms with
# 64-row tasks and that phase, 54.9 so); the tokens in chunks of TILE_TOKENS (gate/up and down) gave 61.2 -> 59.5 ms
MOE_ROWS_PER_TASK = QK_K


def _matvec_act_kernel(w, xq, xd, xbs, y):
    # w uint8 [R, row_bytes]; x quantized: xq int16/int8 [C], xd float32 [C/256], xbs int32 [C/16]; y [R] (written)
    n_rows = w.shape[0]
    for task in prange((n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        for r in range(task * ROWS_PER_TASK, min(n_rows, (task + 1) * ROWS_PER_TASK)):
            y[r] = VEC_DOT(w[r], xq, xd, xbs)


def _matmul_act_kernel(w, xq, xd, xbs, y):
    # w uint8 [R, row_bytes]; xq int16/int8 [T, C], xd [T, C/256], xbs [T, C/16]; y float32 [T, R] (written).
    # Tiled: a task owns MM_ROWS_PER_TASK rows and walks the tokens MM_TOKENS at a time, so the activations it
    # reads per row (MM_TOKENS * C * 2 bytes) stay in L2 for all its rows (all T tokens, 1 MiB at T = 512 and
    # C = 1024, would stream from L3 once per row). Each (row, token) result is the same computation either way.
    n_rows = w.shape[0]
    n_tokens = xq.shape[0]
    for task in prange((n_rows + MM_ROWS_PER_TASK - 1) // MM_ROWS_PER_TASK):
        acc = np.empty((MM_TOKENS, ROWS_LANES), dtype=np.float32)  # scratch of ROWS
        out = np.empty(MM_TOKENS, dtype=np.float32)  # one row of W times MM_TOKENS tokens
        for t0 in range(0, n_tokens, MM_TOKENS):
            t1 = min(n_tokens, t0 + MM_TOKENS)
            for r in range(task * MM_ROWS_PER_TASK, min(n_rows, (task + 1) * MM_ROWS_PER_TASK)):
                ROWS(w[r], xq[t0:t1], xd[t0:t1], xbs[t0:t1], acc[:t1 - t0], out[:t1 - t0])  # unpacked once per tile
                for t in range(t1 - t0):
                    y[t0 + t, r] = out[t]


def _dot_rows_template(w, xq, xd, xbs, acc, out):
    # ROWS for a type without a multi-row block dot: out[t] = VEC_DOT(w, xq[t], ...), row by row
    for t in range(xq.shape[0]):
        out[t] = VEC_DOT(w, xq[t], xd[t], xbs[t])


@intrinsic
def f32_from_bits(typingctx, bits):
    """An integer's low 32 bits -> the float32 with those bits (a reinterpretation: 2^k is (k + 127) << 23)."""
    if isinstance(bits, nbtypes.Integer):
        def codegen(context, builder, signature, args):
            low = builder.trunc(args[0], ir.IntType(32)) if bits.bitwidth > 32 else args[0]
            return builder.bitcast(low, ir.FloatType())

        return nbtypes.float32(bits), codegen


@njit(cache=True, inline="always")
def exp_f32(x):
    """e^x in float32 within 2 ulp (measured: |rel. error| < 1.35 * 2^-24), x clamped to [-87, 88] (the result
    stays a normal float): Cephes' expf, e^x = 2^k e^r with k = round(x / ln 2), r = x - k ln 2 (ln 2 in two parts),
    e^r a polynomial. Plain float32 operations, no libm call, so a loop of it is vectorised (np.exp on float32
    calls expf value by value); no fast-math, so its bits do not depend on the loop around it. Twin: np.exp
    (tests/test_kernels_cpu_backend.py)."""
    v = min(max(x, np.float32(-87.0)), np.float32(88.0))
    k = np.floor(v * np.float32(1.44269504) + np.float32(0.5))
    r = v - k * np.float32(0.693359375) - k * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * (r * r) + r + np.float32(1.0)
    return p * f32_from_bits((np.int64(k) + 127) << 23)


@njit(cache=True)
def silu_mul_into(g, u, h):
    """h = silu(g) * u = g / (1 + e^-g) * u over float32 [n]; h is another array than g and u: e^-g goes into it
    first, in a loop of its own, which LLVM vectorises (written as one expression in one loop, the loop stayed
    scalar: 512 values, 1 thread, Zen 4, 3.2 us against 0.9). Each value's operations are the same in the same
    order: the same bits."""
    n = g.shape[0]
    for j in range(n):
        h[j] = exp_f32(-g[j])
    for j in range(n):
        h[j] = g[j] / (np.float32(1.0) + h[j]) * u[j]


@intrinsic
def bytes_at(typingctx, address):
    """An integer address -> a uint8 pointer, for numba.carray. The one way to hand a kernel a varying number of
    arrays (experts) without a tuple, whose Numba type would change with its length (a recompilation each time)."""
    sig = nbtypes.CPointer(nbtypes.uint8)(address)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return sig, codegen


# The MoE kernel's phases (their templates below _moe_kernel), bound by compile_moe; placeholders only here
QUANTIZE_X_PHASE = DECODE_PHASE = GATE_UP_PHASE = DOWN_PHASE = None


def _moe_kernel(addr, F, D, start, tok, weight, x, xq, xd, xbs, hq, hd, hbs, qmax, y, threads, ahead):
    """y[tok[p]] += weight[p] * down_e(silu(gate_e x_p) * up_e x_p) for every (expert, token) pair p.

    addr int64 [S, 6]: per expert, the addresses of its gate, up (uint8 [F, row_bytes(D)]) and down (uint8
    [D, row_bytes(F)]) raw rows, C-contiguous (the caller keeps them alive), then of the same three matrices
    repacked 8 rows at a time (quant/repack.py, uint8 [rows / 8, row_tiles]), or 0 where there is no such copy; an
    expert's repacked matrices are read 8 rows per call (16, two row-groups, where the types have the pair form:
    PAIR_GATE_UP, PAIR_DOWN), for TILE_MANY tokens at a time (then one by one), with the same bits. In prefill, an
    IQ1-IQ3 matrix (no repacked copy: DECODED_GATE_UP, DECODED_DOWN) of an expert with DECODE_MIN_TOKENS pairs or
    more is decoded 16 rows at a time into a scratch tile (DECODE_*: qact's row_decode) that the decoded layout's
    tile dot reads for all its pairs (TILE_DECODED_GATE_UP, TILE_DECODED_DOWN), again with the bits of the raw
    rows' dots. A Q2_K or Q3_K matrix whose expert has enough rows of x (SCALED_MIN_GATE_UP, SCALED_MIN_DOWN) is
    scaled two row-groups at a time into scratch (SCALE_*: repack.scale_pair, each weight times its scale, one byte)
    that the scaled dot reads for all its pairs (SCALED_DOT_*), with the bits of the tile dots. Pairs are grouped by
    expert: expert k owns pairs start[k]:start[k+1] (start int64 [S + 1]); pair p
    is token tok[p] with routing weight weight[p]. x float32 [T, D]: the tokens' activations.
    Scratch: xq [P, D], xd, xbs: x quantized, one row per pair (so an expert's tokens are consecutive rows); hq
    [P, F], hd, hbs: h = silu(gate x) * up x quantized (qmax: the largest value of xq's and hq's dtype; PLANE_QMAX:
    two int8 planes, each pair two consecutive rows, its hi and its lo plane, whose gate x and up x are added before
    SwiGLU, and whose down products both add into y with the pair's weight: moe_act_table doubles the pairs). y float32
    [T, D] (accumulated into). Decode (T = 1, every matrix repacked, the experts a multiple of the threads:
    BY_EXPERT): one parallel phase, a task per expert (its gate, up, SwiGLU and down, one stream of its bytes), the
    experts' outputs then added into y in order. Otherwise two parallel phases (three in prefill): quantize x per
    pair; gate+up+SwiGLU over (expert, block of QK_K rows of F: the task quantizes its block of h, which is never
    stored as float32); down
    over `threads` ranges of D rows (each task owns its rows of y, so the pairs of one token never race), experts
    in order. Each task asks for the weight bytes `ahead` of the ones it reads (PREFETCH_WEIGHTS:
    qact.prefetch_ahead_stream, at this CPU's hint for bytes read once; ahead 0: no hints), a row (group) at a time,
    except where a one-token tile dot reads: that one asks for them from inside its block loop (repack.STREAM_AHEAD,
    at the same hint).
    The phases are their own functions (templates bound to the same constants: compile_moe): _moe_quantize_x,
    then _moe_decode (the decode form: a task per expert) or _moe_gate_up and _moe_down (the row tasks: prefill,
    and decode where the one-task-per-expert form does not apply).
    """
    QUANTIZE_X_PHASE(x, D, tok, xq, xd, xbs, qmax)
    # [S, 3] the repacked copies' addresses, as a C-contiguous copy: read through the strided view addr[:, 3:],
    # decode was slower in 4 of 4 alternated process pairs (4.35-5.04 vs 4.49-5.35 ms a token, Q4_K_M mid)
    tiles = np.ascontiguousarray(addr[:, 3:])
    n_exp = addr.shape[0]
    # Decode (one token, every matrix repacked, the experts shared evenly by the threads): one task per expert, its
    # gate, up and down one after another, into its own row of `o`, then added into y here in expert order, the
    # sums of the row tasks below (the same products, added in the same order: the same bits). One parallel region
    # instead of two, no wait between them, and each thread reads its experts as one stream.
    by_expert = BY_EXPERT and x.shape[0] == 1 and threads > 0 and n_exp % threads == 0
    for k in range(n_exp):
        by_expert = by_expert and tiles[k, 0] != 0 and tiles[k, 1] != 0 and tiles[k, 2] != 0
    if by_expert:
        DECODE_PHASE(tiles, F, D, start, weight, xq, xd, xbs, hq, hd, hbs, qmax, y)
        return
    GATE_UP_PHASE(addr, tiles, F, D, start, xq, xd, xbs, hq, hd, hbs, qmax, ahead)
    DOWN_PHASE(addr, tiles, F, D, start, tok, weight, hq, hd, hbs, qmax, y, threads, ahead)


def _moe_quantize_x(x, D, tok, xq, xd, xbs, qmax):
    """_moe_kernel's first phase: x float32 [T, D] quantized into xq, xd, xbs, one row per pair (tok: each pair's
    token)."""
    # x's rows quantized here, not by the caller: a decode step's glue around the kernel (quantize a row, copy it
    # to K pairs, in NumPy) cost more than this phase. Decode quantizes each pair's row (K copies of one token's
    # row: one parallel region); a prefill chunk each token's row once, then copies it to its pairs (K times less
    # quantizing, one more region). The same function on the same row: the same bits either way.
    T, P = x.shape[0], tok.shape[0]
    group = D // xd.shape[1]  # values per scale of x: 256, or 32 (qact.act_group of the gate and up type)
    if qmax == PLANE_QMAX:  # two planes (qact.quantize_planes_ref): pair rows 2 i (hi) and 2 i + 1 (lo) of one pair
        if T == 1:
            quantize_planes(x[0], xq[0:2], xd[0:2], xbs[0:2], group)
            for p in range(2, P):
                xq[p] = xq[p % 2]
                xd[p] = xd[p % 2]
                xbs[p] = xbs[p % 2]
        else:
            for p in prange(P // 2):
                quantize_planes(x[tok[2 * p]], xq[2 * p:2 * p + 2], xd[2 * p:2 * p + 2], xbs[2 * p:2 * p + 2], group)
        return
    if T == 1:  # decode: the one row quantized once, here, and copied to its K pairs (a parallel region to quantize
        # K copies of one row cost ~3 us of launch a layer)
        quantize_act_in(x[0], xq[0], xd[0], xbs[0], qmax, group)
        for p in range(1, P):
            xq[p] = xq[0]
            xd[p] = xd[0]
            xbs[p] = xbs[0]
    elif P <= T:
        for p in prange(P):
            quantize_act_in(x[tok[p]], xq[p], xd[p], xbs[p], qmax, group)
    else:
        xt = np.empty((T, D), dtype=xq.dtype)  # [T, D] each token's row, quantized once
        xdt = np.empty((T, xd.shape[1]), dtype=np.float32)
        xbst = np.empty((T, xbs.shape[1]), dtype=np.int32)
        for t in prange(T):
            quantize_act_in(x[t], xt[t], xdt[t], xbst[t], qmax, group)
        for p in prange(P):
            xq[p] = xt[tok[p]]
            xd[p] = xdt[tok[p]]
            xbs[p] = xbst[tok[p]]


def _moe_decode(tiles, F, D, start, weight, xq, xd, xbs, hq, hd, hbs, qmax, y):
    """_moe_kernel's decode form (one token, every matrix repacked: tiles int64 [S, 3] its copies' addresses, the
    experts a multiple of the threads): one task per expert, its gate, up, SwiGLU and down one after another into
    its own row of `o`; the experts' outputs then added into y[0] in expert order, with their routing weights."""
    n_exp = tiles.shape[0]
    hg = F // hd.shape[1]  # values per scale of h: 256, or 32 (qact.act_group of the down type)
    planes = qmax == PLANE_QMAX  # two planes: the expert's pair is rows a (hi) and a + 1 (lo), each dotted alone
    o = np.empty((2 * n_exp, D), dtype=np.float32)  # [2S, D] each expert's down(h) (per plane), before its weight
    for k in prange(n_exp):
        a = start[k]  # its one pair (two rows with planes)
        gt = carray(bytes_at(tiles[k, 0]), (F // TILE_ROWS, D // QK_K * GATE_TILE))  # [F / 8, row_tiles(D)]
        ut = carray(bytes_at(tiles[k, 1]), (F // TILE_ROWS, D // QK_K * UP_TILE))
        dt = carray(bytes_at(tiles[k, 2]), (D // TILE_ROWS, F // QK_K * DOWN_TILE))  # [D / 8, row_tiles(F)]
        g = np.empty(MOE_ROWS_PER_TASK, dtype=np.float32)  # [rows] one block of gate x, up x, h
        u = np.empty(MOE_ROWS_PER_TASK, dtype=np.float32)
        hb = np.empty(MOE_ROWS_PER_TASK, dtype=np.float32)
        g2 = np.empty(MOE_ROWS_PER_TASK, dtype=np.float32)  # the lo plane's gate x, up x
        u2 = np.empty(MOE_ROWS_PER_TASK, dtype=np.float32)
        o2 = np.empty((2, TILE_ROWS), dtype=np.float32)  # a two-plane call's results: [hi, lo] x 8 rows
        xq2, xd2, xbs2 = xq[a:a + 2], xd[a:a + 2], xbs[a:a + 2]  # the pair's rows, sliced once, not per call
        for r0 in range(0, F, MOE_ROWS_PER_TASK):
            for q in range(r0 // TILE_ROWS, (r0 + MOE_ROWS_PER_TASK) // TILE_ROWS):
                c = q * TILE_ROWS - r0
                if planes:  # both planes in one call: the tile unpacked once (the bits of two one-token calls)
                    TILE2_GATE(gt[q], xq2, xd2, xbs2, o2)
                    g[c:c + TILE_ROWS] = o2[0]
                    g2[c:c + TILE_ROWS] = o2[1]
                    TILE2_UP(ut[q], xq2, xd2, xbs2, o2)
                    u[c:c + TILE_ROWS] = o2[0]
                    u2[c:c + TILE_ROWS] = o2[1]
                else:
                    TILE_GATE(gt[q], xq[a], xd[a], xbs[a], g[c:c + TILE_ROWS])
                    TILE_UP(ut[q], xq[a], xd[a], xbs[a], u[c:c + TILE_ROWS])
            if planes:  # hi's plus lo's (as in the gate/up tasks below)
                for j in range(MOE_ROWS_PER_TASK):
                    g[j] += g2[j]
                    u[j] += u2[j]
            silu_mul_into(g, u, hb)  # (as in the gate/up tasks below)
            r1 = r0 + MOE_ROWS_PER_TASK
            if planes:
                quantize_planes(hb, hq[a:a + 2, r0:r1], hd[a:a + 2, r0 // hg:r1 // hg], hbs[a:a + 2, r0 // SUB:r1 // SUB],
                                hg)
            else:
                quantize_act_in(hb, hq[a, r0:r1], hd[a, r0 // hg:r1 // hg], hbs[a, r0 // SUB:r1 // SUB], qmax, hg)
        hq2, hd2, hbs2 = hq[a:a + 2], hd[a:a + 2], hbs[a:a + 2]
        for q in range(D // TILE_ROWS):
            if planes:
                TILE2_DOWN(dt[q], hq2, hd2, hbs2, o2)
                o[2 * k, q * TILE_ROWS:(q + 1) * TILE_ROWS] = o2[0]
                o[2 * k + 1, q * TILE_ROWS:(q + 1) * TILE_ROWS] = o2[1]
            else:
                TILE_DOWN(dt[q], hq[a], hd[a], hbs[a], o[2 * k, q * TILE_ROWS:(q + 1) * TILE_ROWS])
    for k in range(n_exp):  # y += weight * o[k], expert by expert, plane by plane (the down tasks' order)
        wk = weight[start[k]]
        for r in range(D):
            y[0, r] += wk * o[2 * k, r]
        if planes:
            for r in range(D):
                y[0, r] += wk * o[2 * k + 1, r]


def _moe_gate_up(addr, tiles, F, D, start, xq, xd, xbs, hq, hd, hbs, qmax, ahead):
    """_moe_kernel's gate/up phase of the row tasks: a task per (expert, block of MOE_ROWS_PER_TASK rows of F), its
    rows of gate x and up x for all the expert's pairs (from repacked tiles, decoded scratch tiles or raw rows),
    then silu(gate x) * up x quantized into its block of hq, hd, hbs."""
    n_exp = addr.shape[0]
    hg = F // hd.shape[1]  # values per scale of h: 256, or 32 (qact.act_group of the down type)
    planes = qmax == PLANE_QMAX  # two planes: a pair is two rows of xq and hq (qact.quantize_planes_ref)
    gate_bytes = D // QK_K * GATE_SIZE
    up_bytes = D // QK_K * UP_SIZE
    blocks_f = F // MOE_ROWS_PER_TASK  # (F: whole 256-blocks, or no integer path: qact.has_int_dot)
    for task in prange(n_exp * blocks_f):
        k = task // blocks_f
        a, b = start[k], start[k + 1]
        gate = carray(bytes_at(addr[k, 0]), (F, gate_bytes))  # [F, row_bytes(D)]
        up = carray(bytes_at(addr[k, 1]), (F, up_bytes))  # [F, row_bytes(D)]
        r0 = (task % blocks_f) * MOE_ROWS_PER_TASK
        r1 = r0 + MOE_ROWS_PER_TASK
        repacked = tiles[k, 0] != 0 and tiles[k, 1] != 0  # both repacked: 8 rows a call
        decoded = not repacked and DECODED_GATE_UP and xq.itemsize == 1 and b - a >= DECODE_MIN_TOKENS  # 8-bit x: IQ
        # rows decoded 16 at a time
        # The expert's pairs in chunks: TILE_TOKENS at a time over repacked tiles (the task's tiles stay in L2 from one
        # chunk to the next, the chunk's activations and its rows of g and u in L2 too), all at once otherwise
        # (decoded rows are decoded once; the raw rows' dots take all the pairs in one call).
        step = min(b - a, TILE_TOKENS) if repacked else b - a
        g = np.empty((step, MOE_ROWS_PER_TASK), dtype=np.float32)  # [step, rows] gate rows times a chunk's tokens
        u = np.empty((step, MOE_ROWS_PER_TASK), dtype=np.float32)  # [step, rows] up rows
        hb = np.empty(MOE_ROWS_PER_TASK, dtype=np.float32)  # [rows] one pair's block of h
        acc = np.empty((step, ROWS_LANES), dtype=np.float32)  # scratch of ROWS
        o = np.empty((TILE_MANY, TILE_ROWS), dtype=np.float32)  # one many-token call's results
        o2 = np.empty((TILE_MANY, 2 * TILE_ROWS), dtype=np.float32)  # a two-row-group call's
        sg = np.empty(D // QK_K * SCALED_BLOCK if SCALED_GATE_UP else 0, dtype=np.uint8)  # two row-groups of gate and
        su = np.empty(D // QK_K * SCALED_BLOCK if SCALED_GATE_UP else 0, dtype=np.uint8)  # up, scaled (SCALE_GATE)
        for c0 in range(0, b - a, max(step, 1)):
            c1 = min(b - a, c0 + step)  # this chunk: pairs a + c0 .. a + c1, rows c0 - c0 .. c1 - c0 of g and u
            if repacked:
                gt = carray(bytes_at(tiles[k, 0]), (F // TILE_ROWS, D // QK_K * GATE_TILE))  # [F / 8, row_tiles(D)]
                ut = carray(bytes_at(tiles[k, 1]), (F // TILE_ROWS, D // QK_K * UP_TILE))
                r = r0
                while r < r1:
                    # row-groups in this step: two where both types have the two-row-group form (PAIR_GATE_UP)
                    m = 2 if PAIR_GATE_UP and r + 2 * TILE_ROWS <= r1 and c1 - c0 >= TILE_MANY else 1
                    q0, q1, cr = r // TILE_ROWS, r // TILE_ROWS + m, r - r0  # its row-groups; their columns of g, u
                    if c0 == 0 and ahead > 0 and b - a >= TILE_MANY:  # (a one-token dot asks for the bytes ahead
                        # itself) kept in every cache level (not PREFETCH_WEIGHTS, non-temporal on Zen): the tiles
                        # are read again for each TILE_MANY tokens, and for each chunk (a 512-token chunk of the mid
                        # Q4_K_M file, one layer, 1 thread: 56.1-58.6 ms with the non-temporal hint, 52.8-53.8
                        # without)
                        prefetch_ahead(tiles[k, 0], q0 * gt.shape[1], m * gt.shape[1], gt.size, ahead)
                        prefetch_ahead(tiles[k, 1], q0 * ut.shape[1], m * ut.shape[1], ut.size, ahead)
                    i = c0
                    # enough rows of x: the two row-groups scaled into scratch once (repack.scale_pair), then read
                    # by the scaled dot (the same bits)
                    scaled = SCALED_GATE_UP and m == 2 and xq.itemsize == 1 and c1 - c0 >= SCALED_MIN_GATE_UP
                    if scaled:
                        SCALE_GATE(gt[q0:q1], sg)
                        SCALE_UP(ut[q0:q1], su)
                    while i + TILE_MANY <= c1:  # TILE_MANY tokens a call (prefill), the weights unpacked once
                        p0, p1, j = a + i, a + i + TILE_MANY, i - c0
                        if scaled:
                            SCALED_DOT_GATE(sg, xq[p0:p1], xd[p0:p1], xbs[p0:p1], o2)
                            g[j:j + TILE_MANY, cr:cr + 2 * TILE_ROWS] = o2
                            SCALED_DOT_UP(su, xq[p0:p1], xd[p0:p1], xbs[p0:p1], o2)
                            u[j:j + TILE_MANY, cr:cr + 2 * TILE_ROWS] = o2
                        elif m == 2:
                            TILE_GATE(gt[q0:q1], xq[p0:p1], xd[p0:p1], xbs[p0:p1], o2)
                            g[j:j + TILE_MANY, cr:cr + 2 * TILE_ROWS] = o2
                            TILE_UP(ut[q0:q1], xq[p0:p1], xd[p0:p1], xbs[p0:p1], o2)
                            u[j:j + TILE_MANY, cr:cr + 2 * TILE_ROWS] = o2
                        else:
                            TILE_GATE(gt[q0], xq[p0:p1], xd[p0:p1], xbs[p0:p1], o)
                            g[j:j + TILE_MANY, cr:cr + TILE_ROWS] = o
                            TILE_UP(ut[q0], xq[p0:p1], xd[p0:p1], xbs[p0:p1], o)
                            u[j:j + TILE_MANY, cr:cr + TILE_ROWS] = o
                        i += TILE_MANY
                    for q in range(q0, q1):
                        c = q * TILE_ROWS - r0
                        for j in range(i, c1):
                            TILE_GATE(gt[q], xq[a + j], xd[a + j], xbs[a + j], g[j - c0, c:c + TILE_ROWS])
                            TILE_UP(ut[q], xq[a + j], xd[a + j], xbs[a + j], u[j - c0, c:c + TILE_ROWS])
                    r += m * TILE_ROWS
            elif decoded:  # (one chunk: c0 = 0, c1 = b - a)
                dg = np.empty((2, D // QK_K * DECODED_TILE), dtype=np.uint8)  # [2, row_tiles(D)] gate rows, decoded
                du = np.empty((2, D // QK_K * DECODED_TILE), dtype=np.uint8)  # up rows
                r = r0
                while r < r1:
                    m = 2 if PAIR_DECODED else 1  # row-groups in this step (r1 - r0: whole pairs of them)
                    if ahead > 0:
                        PREFETCH_WEIGHTS(addr[k, 0], r * gate_bytes, m * TILE_ROWS * gate_bytes, F * gate_bytes, ahead)
                        PREFETCH_WEIGHTS(addr[k, 1], r * up_bytes, m * TILE_ROWS * up_bytes, F * up_bytes, ahead)
                    for j in range(m * TILE_ROWS):
                        DECODE_GATE(gate[r + j], dg[j // TILE_ROWS], j % TILE_ROWS)
                        DECODE_UP(up[r + j], du[j // TILE_ROWS], j % TILE_ROWS)
                    cr = r - r0
                    i = 0
                    while i + TILE_MANY <= b - a:
                        p0, p1 = a + i, a + i + TILE_MANY
                        if m == 2:
                            TILE_DECODED_GATE_UP(dg, xq[p0:p1], xd[p0:p1], xbs[p0:p1], o2)
                            g[i:i + TILE_MANY, cr:cr + 2 * TILE_ROWS] = o2
                            TILE_DECODED_GATE_UP(du, xq[p0:p1], xd[p0:p1], xbs[p0:p1], o2)
                            u[i:i + TILE_MANY, cr:cr + 2 * TILE_ROWS] = o2
                        else:
                            TILE_DECODED_GATE_UP(dg[0], xq[p0:p1], xd[p0:p1], xbs[p0:p1], o)
                            g[i:i + TILE_MANY, cr:cr + TILE_ROWS] = o
                            TILE_DECODED_GATE_UP(du[0], xq[p0:p1], xd[p0:p1], xbs[p0:p1], o)
                            u[i:i + TILE_MANY, cr:cr + TILE_ROWS] = o
                        i += TILE_MANY
                    for q in range(m):
                        c = cr + q * TILE_ROWS
                        for j in range(i, b - a):
                            TILE_DECODED_GATE_UP(dg[q], xq[a + j], xd[a + j], xbs[a + j], g[j, c:c + TILE_ROWS])
                            TILE_DECODED_GATE_UP(du[q], xq[a + j], xd[a + j], xbs[a + j], u[j, c:c + TILE_ROWS])
                    r += m * TILE_ROWS
            else:  # raw rows, one at a time (one chunk)
                for r in range(r0, r1):
                    if ahead > 0:
                        PREFETCH_WEIGHTS(addr[k, 0], r * gate_bytes, gate_bytes, F * gate_bytes, ahead)
                        PREFETCH_WEIGHTS(addr[k, 1], r * up_bytes, up_bytes, F * up_bytes, ahead)
                    if b - a == 1:  # one token (decode): the one-row dot, no call of the multi-row one
                        g[0, r - r0] = VEC_DOT_GATE(gate[r], xq[a], xd[a], xbs[a])
                        u[0, r - r0] = VEC_DOT_UP(up[r], xq[a], xd[a], xbs[a])
                    else:
                        ROWS_GATE(gate[r], xq[a:b], xd[a:b], xbs[a:b], acc, g[:, r - r0])
                        ROWS_UP(up[r], xq[a:b], xd[a:b], xbs[a:b], acc, u[:, r - r0])
            if planes:  # a pair's two rows (hi, lo) of g and u added, then h quantized into its two planes
                for i in range(c0, c1, 2):
                    gh, gl, uh, ul = g[i - c0], g[i - c0 + 1], u[i - c0], u[i - c0 + 1]
                    for j in range(MOE_ROWS_PER_TASK):  # (g and u are this chunk's scratch)
                        gh[j] += gl[j]
                        uh[j] += ul[j]
                    silu_mul_into(gh, uh, hb)
                    quantize_planes(hb, hq[a + i:a + i + 2, r0:r1], hd[a + i:a + i + 2, r0 // hg:r1 // hg],
                                    hbs[a + i:a + i + 2, r0 // SUB:r1 // SUB], hg)
                continue
            for i in range(c0, c1):  # silu(g) * u, a vector loop over the rows (exp_f32: no libm call per value)
                silu_mul_into(g[i - c0], u[i - c0], hb)
                # one block of the pair's row of h quantized: the bits of quantizing the whole row (its blocks are
                # independent)
                quantize_act_in(hb, hq[a + i, r0:r1], hd[a + i, r0 // hg:r1 // hg], hbs[a + i, r0 // SUB:r1 // SUB],
                                qmax, hg)


def _moe_down(addr, tiles, F, D, start, tok, weight, hq, hd, hbs, qmax, y, threads, ahead):
    """_moe_kernel's down phase of the row tasks: y[tok[p]] += weight[p] * down_e h_p, one task per thread over a
    range of D rows."""
    n_exp = addr.shape[0]
    down_bytes = F // QK_K * DOWN_SIZE
    n_max = 0  # the most pairs of one expert: scratch size
    for k in range(n_exp):
        n_max = max(n_max, start[k + 1] - start[k])
    # down: one task per thread, each a contiguous range of D rows (every row is the same work: all the pairs), its
    # experts one after another, so each expert's rows are read as one long stream (64-row tasks read 8 short
    # streams at once: ~10% slower on experts not in cache, measured in one process, alternated)
    rows_down = (D // TILE_ROWS + threads - 1) // threads * TILE_ROWS
    for task in prange((D + rows_down - 1) // rows_down):
        acc = np.empty((n_max, ROWS_LANES), dtype=np.float32)
        out = np.empty(n_max, dtype=np.float32)
        out8 = np.empty(TILE_ROWS, dtype=np.float32)  # one row-group's results, for one token
        out_many = np.empty((TILE_MANY, TILE_ROWS), dtype=np.float32)  # for TILE_MANY
        out_pair = np.empty((TILE_MANY, 2 * TILE_ROWS), dtype=np.float32)  # for TILE_MANY and two row-groups
        sd = np.empty(F // QK_K * SCALED_BLOCK if SCALED_DOWN else 0, dtype=np.uint8)  # two row-groups, scaled
        dd = np.empty((2, F // QK_K * DECODED_TILE), dtype=np.uint8)  # [2, row_tiles(F)] 16 down rows, decoded
        for k in range(n_exp):
            a, b = start[k], start[k + 1]
            down = carray(bytes_at(addr[k, 2]), (D, down_bytes))  # [D, row_bytes(F)]
            r0, r1 = task * rows_down, min(D, (task + 1) * rows_down)
            if tiles[k, 2] != 0:  # repacked: 8 rows a call
                dt = carray(bytes_at(tiles[k, 2]), (D // TILE_ROWS, F // QK_K * DOWN_TILE))  # [D / 8, row_tiles(F)]
                for c0 in range(0, b - a, TILE_TOKENS):  # the pairs TILE_TOKENS at a time (as in gate/up): their
                    # rows of y stay in cache from one row-group to the next, the task's tiles in L2
                    c1 = min(b - a, c0 + TILE_TOKENS)
                    r = r0
                    while r < r1:
                        n_rg = 2 if PAIR_DOWN and r + 2 * TILE_ROWS <= r1 and c1 - c0 >= TILE_MANY else 1  # (as above)
                        q0 = r // TILE_ROWS
                        if c0 == 0 and ahead > 0 and b - a >= TILE_MANY:  # (as above)
                            rg = dt.shape[1]  # bytes of a row-group
                            prefetch_ahead(tiles[k, 2], q0 * rg, n_rg * rg, r1 // TILE_ROWS * rg, ahead)  # (as above)
                        i = c0
                        scaled = SCALED_DOWN and n_rg == 2 and hq.itemsize == 1 and c1 - c0 >= SCALED_MIN_DOWN  # (as
                        if scaled:  # in gate/up)
                            SCALE_DOWN(dt[q0:q0 + 2], sd)
                        while i + TILE_MANY <= c1:
                            p0, p1 = a + i, a + i + TILE_MANY
                            if n_rg == 2:
                                if scaled:
                                    SCALED_DOT_DOWN(sd, hq[p0:p1], hd[p0:p1], hbs[p0:p1], out_pair)
                                else:
                                    TILE_DOWN(dt[q0:q0 + 2], hq[p0:p1], hd[p0:p1], hbs[p0:p1], out_pair)
                                for m in range(TILE_MANY):
                                    for j in range(2 * TILE_ROWS):
                                        y[tok[p0 + m], r + j] += weight[p0 + m] * out_pair[m, j]
                            else:
                                TILE_DOWN(dt[q0], hq[p0:p1], hd[p0:p1], hbs[p0:p1], out_many)
                                for m in range(TILE_MANY):
                                    for j in range(TILE_ROWS):
                                        y[tok[p0 + m], r + j] += weight[p0 + m] * out_many[m, j]
                            i += TILE_MANY
                        for q in range(q0, q0 + n_rg):
                            for m in range(i, c1):
                                TILE_DOWN(dt[q], hq[a + m], hd[a + m], hbs[a + m], out8)
                                for j in range(TILE_ROWS):
                                    y[tok[a + m], q * TILE_ROWS + j] += weight[a + m] * out8[j]
                        r += n_rg * TILE_ROWS
                continue
            if DECODED_DOWN and hq.itemsize == 1 and b - a >= DECODE_MIN_TOKENS and D % TILE_ROWS == 0:  # (as above)
                r = r0
                while r < r1:
                    n_rg = 2 if PAIR_DECODED and r + 2 * TILE_ROWS <= r1 else 1
                    if ahead > 0:
                        PREFETCH_WEIGHTS(addr[k, 2], r * down_bytes, n_rg * TILE_ROWS * down_bytes, r1 * down_bytes,
                                         ahead)
                    for j in range(n_rg * TILE_ROWS):
                        DECODE_DOWN(down[r + j], dd[j // TILE_ROWS], j % TILE_ROWS)
                    i = 0
                    while i + TILE_MANY <= b - a:
                        p0, p1 = a + i, a + i + TILE_MANY
                        if n_rg == 2:
                            TILE_DECODED_DOWN(dd, hq[p0:p1], hd[p0:p1], hbs[p0:p1], out_pair)
                            for m in range(TILE_MANY):
                                for j in range(2 * TILE_ROWS):
                                    y[tok[p0 + m], r + j] += weight[p0 + m] * out_pair[m, j]
                        else:
                            TILE_DECODED_DOWN(dd[0], hq[p0:p1], hd[p0:p1], hbs[p0:p1], out_many)
                            for m in range(TILE_MANY):
                                for j in range(TILE_ROWS):
                                    y[tok[p0 + m], r + j] += weight[p0 + m] * out_many[m, j]
                        i += TILE_MANY
                    for q in range(n_rg):
                        for m in range(i, b - a):
                            TILE_DECODED_DOWN(dd[q], hq[a + m], hd[a + m], hbs[a + m], out8)
                            for j in range(TILE_ROWS):
                                y[tok[a + m], r + q * TILE_ROWS + j] += weight[a + m] * out8[j]
                    r += n_rg * TILE_ROWS
                continue
            for r in range(r0, r1):
                if ahead > 0:
                    PREFETCH_WEIGHTS(addr[k, 2], r * down_bytes, down_bytes, r1 * down_bytes, ahead)
                if b - a == 1:
                    out[0] = VEC_DOT_DOWN(down[r], hq[a], hd[a], hbs[a])
                else:
                    ROWS_DOWN(down[r], hq[a:b], hd[a:b], hbs[a:b], acc[:b - a], out[:b - a])
                for i in range(b - a):
                    y[tok[a + i], r] += weight[a + i] * out[i]


_MOE_PHASES = dict(QUANTIZE_X_PHASE=_moe_quantize_x, DECODE_PHASE=_moe_decode, GATE_UP_PHASE=_moe_gate_up,
                   DOWN_PHASE=_moe_down)


_SHARED_PHASES: dict = {}  # (phase template name, suffix) -> the phase compiled for the types it reads
# The constants no weight type decides (the same in every moe_constants): a phase that reads only these and its own
# types' is the same function for every triple that agrees on those types
_TYPE_FREE = frozenset({"PAIR_DECODED", "DECODED_TILE", "PREFETCH_WEIGHTS"})


def phase_types(template, constants: dict) -> tuple:
    """-> which of the (gate, up, down) types (0, 1, 2) a phase template's bound constants come from, read off their
    names (TILE_GATE: 0, DECODED_GATE_UP: 0 and 1, ROWS_DOWN: 2); every constant it reads must name its type or be
    type-free (_TYPE_FREE), else ValueError: sharing the phase between triples would then be wrong."""
    used = set(template.__code__.co_names) & set(constants)
    which = set()
    for name in used:
        parts = name.split("_")
        found = {i for i, word in enumerate(("GATE", "UP", "DOWN")) if word in parts}
        if not found and name not in _TYPE_FREE:
            raise ValueError(f"{template.__name__} reads {name}, which names no weight type: it cannot be shared")
        which |= found
    return tuple(sorted(which))


def compile_moe(suffix: str, constants: dict, qtypes=None):
    """`_moe_kernel` compiled with `constants`: its phases first, then the kernel that calls them (not parallel:
    it has no loop of its own but its check of the decode form). Each phase is its template bound to the constants
    (Numba compiles each phase's parallel loops as it did when they were all in one function).
    qtypes (gate, up, down), with constants = moe_constants(qtypes) (act_kernel): each phase is compiled once per
    process (and cached on disk) for the types it reads (`phase_types`: the gate/up phase for (gate, up), the down
    phase for down, x's quantization for none, decode's for all three) and shared by every triple that agrees on
    them: a Q4_K_M file's two triples (down Q4_K or Q6_K) compile gate/up once, and the cold compile of a new triple
    is its decode phase and what it does not share. Without qtypes (custom constants: tests, bench/stream_ahead.py,
    BY_EXPERT overridden), every phase is bound under `suffix`, shared with nothing."""
    if qtypes is None:
        phases = {name: _compile(template, suffix, constants) for name, template in _MOE_PHASES.items()}
    else:
        qtypes = [QType(q) for q in qtypes]
        phases = {}
        for name, template in _MOE_PHASES.items():
            own = phase_types(template, constants)
            key = (template.__name__, "_".join(qtypes[i].name for i in own) + "_" + _act_fingerprint())
            if key not in _SHARED_PHASES:
                _SHARED_PHASES[key] = _compile(template, key[1], constants)
            phases[name] = _SHARED_PHASES[key]
    return _compile(_moe_kernel, suffix, {**constants, **phases}, parallel=False)


@njit(cache=True)
def _c_rows(a, rows, cols):
    """Whether a 2-D array is C-contiguous with this shape."""
    return a.shape[0] == rows and a.shape[1] == cols and a.strides[1] == 1 and (rows <= 1 or a.strides[0] == cols)


@njit(cache=True)
def expert_addresses(gate, up, down, F, D, gate_bytes, up_bytes, down_bytes):
    """The data addresses of one expert's gate, up, down raw rows (uint8 [F, gate_bytes], [F, up_bytes],
    [D, down_bytes]) if each is C-contiguous with that shape, else (-1, -1, -1). One compiled call per expert:
    `ndarray.ctypes.data` costs ~1 us of interpreter each, 24 per layer and token."""
    if _c_rows(gate, F, gate_bytes) and _c_rows(up, F, up_bytes) and _c_rows(down, D, down_bytes):
        return gate.ctypes.data, up.ctypes.data, down.ctypes.data
    return -1, -1, -1


_ACT_KERNELS: dict = {}
# The fused MoE kernel's prefetch hints for expert weights (qact.STREAM_LOCALITY, the locality of llvm.prefetch):
# non-temporal (0, prefetchnta) on AMD Zen, into L2 (2, prefetcht1) on Zen 4, kept (3, prefetcht0) elsewhere;
# PYMOE_STREAM_LOCALITY=0..3 chooses (PYMOE_NT=1 / 0: 0 / 3). A decode step reads every chosen expert once (Q4_K_M
# mid: ~100 MiB a token, 3x a Zen L3); kept hints let that stream evict what the next token reads again (dense
# weights, the KV cache, the interpreter's own data). Zen 5 VM: Q4_K_M mid, 8-bit, 2 threads, 6 rounds of alternated
# processes: 4.57 -> 4.40 ms a token with the non-temporal hint, faster in every round; on the Q2_K and MXFP4_MOE
# files the rounds split both ways. The 2-core Intel Xeon VM of rounds fifteen and sixteen (2 MiB L2 a core, a 480
# MiB L3 shared with the host) is the other way round, and by far: the kernel on 8 random experts not in cache
# (bench/stream_ahead.py, 2 threads, median us, kept / non-temporal, the one-token dots' distance 4096 / 8192 B): Q2_K
# mix 242 / 457, Q4_K_M 359 / 745. The 2-core Zen 4 VM of rounds eighteen and nineteen wants neither: there both
# made the kernel slower than no hints at all, and the hint into L2 (prefetcht1, or prefetcht2: the same there) made
# it much faster (bench/stream_ahead.py --localities 0,1,2,3, Q4_K_M, 2 threads, median / p20 us, 8 KiB ahead: none
# 317 / 217, prefetchnta 324 / 265, prefetcht0 323 / 274, prefetcht1 200 / 177, prefetcht2 193 / 173; a second run:
# none 329 / 236, prefetcht1 228 / 189 at 8 KiB and 238 / 204 at 4 KiB, prefetcht2 234 / 193 at 16 KiB).
# The distance stays PREFETCH_AHEAD (4096 best with either hint on Zen 5: bench/prefetch_ahead.py).
# PYMOE_DECODE=0: prefill reads the IQ1-IQ3 experts' raw rows (the multi-row dots), not decoded scratch tiles (the
# same bits either way; to compare them)
_DECODE = os.environ.get("PYMOE_DECODE", "1") != "0"


def _act_fingerprint() -> str:
    here = os.path.dirname(__file__)
    files = [os.path.join(here, f) for f in ("qact.py", "kquants.py", "floats.py", "repack.py")]
    return (_source_fingerprint(files) + ("v" if repack._VNNI else "") + ("w" if repack._WIDE else "")
            + ("p" if repack.PAIRS else "") + f"n{qact.STREAM_LOCALITY}" + ("d" if _DECODE else "")
            + f"s{repack.STREAM_AHEAD}" + ("e" if BY_EXPERT else "")
            + "S" + "".join(sorted(q.name for q in repack.SCALED_PAIRS)) + repack.FORM_TAG)  # PYMOE_VNNI,
    # PYMOE_WIDE, PYMOE_PAIR, PYMOE_DUAL, PYMOE_TWICE, PYMOE_WIDE_FORMATS: which instructions and forms the tile
    # dots use; PYMOE_STREAM_LOCALITY (PYMOE_NT): the MoE kernel's hint; PYMOE_STREAM_AHEAD: the one-token tile
    # dots' distance; PYMOE_BY_EXPERT: decode's tasks; PYMOE_SCALED: prefill's scaled Q2_K / Q3_K


def rows_dot(qtype):
    """The multi-row dot of a type: its block version (qact.ACT_DOTS_ROWS), else a loop of its vec_dot."""
    qtype = QType(qtype)
    if qtype in qact.ACT_DOTS_ROWS:
        return qact.ACT_DOTS_ROWS[qtype]
    key = ("rows", qtype)
    if key not in _ACT_KERNELS:
        _ACT_KERNELS[key] = _compile(_dot_rows_template, f"{qtype.name}_{_act_fingerprint()}",
                                     dict(VEC_DOT=qact.ACT_DOTS[qtype]), parallel=False)
    return _ACT_KERNELS[key]


def act_kernel(template, *qtypes):
    """The integer-path kernel `template` compiled for these weight types (one: VEC_DOT; three: gate, up, down,
    `_moe_kernel` by compile_moe)."""
    kernel = _ACT_KERNELS.get((template.__name__,) + qtypes)  # the fast lookup: QType is an IntEnum, qtypes hash
    if kernel is not None:  # as their values (the per-token path calls this for every matrix)
        return kernel
    key = (template.__name__,) + tuple(QType(q) for q in qtypes)
    if key not in _ACT_KERNELS:
        suffix = "_".join(QType(q).name for q in qtypes) + "_" + _act_fingerprint()
        if len(qtypes) == 1:
            constants = dict(VEC_DOT=qact.ACT_DOTS[QType(qtypes[0])], ROWS=rows_dot(qtypes[0]))
            _ACT_KERNELS[key] = _compile(template, suffix, constants)
        else:  # _moe_kernel and its phases
            _ACT_KERNELS[key] = compile_moe(suffix, moe_constants(qtypes), qtypes)
    return _ACT_KERNELS[key]


@njit(cache=True)
def _never_tile_dot(tiles, xq, xd, xbs, out):
    """The kernel's tile dot for a type without a tile layout: its calls are never reached (a matrix has a repacked
    copy only where its type has a layout, quant/repack.py TILE_BYTES), but Numba compiles every branch. This stub
    in place of a real tile dot compiles in no time: a real one costs seconds per call site."""
    raise AssertionError("no tile layout for this type")


@njit(cache=True)
def _never_row_decode(w, tile, r):
    """The kernel's row decoder for a type without one (not IQ1-IQ3): never reached (DECODED_GATE_UP and
    DECODED_DOWN say which matrices are decoded), compiled as a stub for the same reason as _never_tile_dot."""
    raise AssertionError("no decoded layout for this type")


@njit(cache=True)
def _never_scale(tiles, out):
    """The kernel's scaling into the scaled layout for a type without one (not Q2_K or Q3_K, or a CPU without their
    pair form): never reached (SCALED_GATE_UP and SCALED_DOWN say), compiled as a stub (as _never_tile_dot)."""
    raise AssertionError("no scaled layout for this type")


def moe_constants(qtypes, tile_dots: dict = None) -> dict:
    """The globals `_moe_kernel` is compiled with for (gate, up, down) types: their row dots, sizes, one-token and
    many-token tile dots (tile_dots: {QType: dot}; default those with the hint for bytes read once,
    `repack.TILE_DOTS_STREAM`) and the prefetch hint. bench/stream_ahead.py builds variants with its own dots."""
    qtypes = [QType(q) for q in qtypes]
    tile_dots = tile_dots or repack.TILE_DOTS_STREAM
    dots = [qact.ACT_DOTS[q] for q in qtypes]
    rows = [rows_dot(q) for q in qtypes]
    sizes = [get_format(q).row_bytes(QK_K) for q in qtypes]  # bytes per 256 weights
    tiles = [tile_dots.get(q, _never_tile_dot) for q in qtypes]
    tiles2 = [repack.TILE_DOTS2_STREAM.get(q, _never_tile_dot) for q in qtypes]
    tile_bytes = [repack.TILE_BYTES.get(q, 0) for q in qtypes]
    decoders = [qact.ROW_DECODES.get(q, _never_row_decode) for q in qtypes]
    scaled = [q in repack.SCALED_PAIRS for q in qtypes]
    scalers = [repack.SCALE_PAIRS[q] if ok else _never_scale for q, ok in zip(qtypes, scaled)]
    scaled_dots = [repack.SCALED_DOTS[q] if ok else _never_tile_dot for q, ok in zip(qtypes, scaled)]
    decoded = [repack.tile_dot_decoded if any(q in qact.ROW_DECODES for q in qs) else _never_tile_dot
               for qs in (qtypes[:2], qtypes[2:])]  # the decoded layout's dot where gate/up, or down, may use it
    return dict(VEC_DOT_GATE=dots[0], VEC_DOT_UP=dots[1], VEC_DOT_DOWN=dots[2], ROWS_GATE=rows[0],
                ROWS_UP=rows[1], ROWS_DOWN=rows[2], GATE_SIZE=sizes[0], UP_SIZE=sizes[1], DOWN_SIZE=sizes[2],
                TILE_GATE=tiles[0], TILE_UP=tiles[1], TILE_DOWN=tiles[2], TILE2_GATE=tiles2[0], TILE2_UP=tiles2[1],
                TILE2_DOWN=tiles2[2], GATE_TILE=tile_bytes[0],
                UP_TILE=tile_bytes[1], DOWN_TILE=tile_bytes[2],
                PAIR_GATE_UP=qtypes[0] in repack.PAIRS and qtypes[1] in repack.PAIRS,
                PAIR_DOWN=qtypes[2] in repack.PAIRS,
                DECODE_GATE=decoders[0], DECODE_UP=decoders[1], DECODE_DOWN=decoders[2],
                DECODED_GATE_UP=_DECODE and qtypes[0] in qact.ROW_DECODES and qtypes[1] in qact.ROW_DECODES,
                DECODED_DOWN=_DECODE and qtypes[2] in qact.ROW_DECODES,
                TILE_DECODED_GATE_UP=decoded[0], TILE_DECODED_DOWN=decoded[1],
                PAIR_DECODED=repack.DECODED in repack.PAIRS, DECODED_TILE=qact.DECODED_TILE,
                SCALED_GATE_UP=scaled[0] and scaled[1], SCALED_DOWN=scaled[2], SCALE_GATE=scalers[0],
                SCALE_UP=scalers[1], SCALE_DOWN=scalers[2], SCALED_DOT_GATE=scaled_dots[0],
                SCALED_DOT_UP=scaled_dots[1], SCALED_DOT_DOWN=scaled_dots[2],
                SCALED_MIN_GATE_UP=max(repack.SCALED_MIN_ROWS.get(q, 0) for q in qtypes[:2]),
                SCALED_MIN_DOWN=repack.SCALED_MIN_ROWS.get(qtypes[2], 0),
                PREFETCH_WEIGHTS=qact.prefetch_ahead_stream)


def matmul_act(w_raw: np.ndarray, qtype, X: np.ndarray, bits: int = 16, xact=None) -> np.ndarray:
    """Y = X W^T by the integer path: w_raw uint8 [R, row_bytes] of a K type, X float32 [T, C] -> float32 [T, R],
    X quantized to `bits` (16 or 8) per 256 values, or per 32 (8 bits, `qact.act_group`); bits 15 (qact.PLANES):
    two 8-bit planes per token, run as 2T rows of 8-bit x and added (qact.sum_planes). T = 1 runs the mat-vec
    kernel. xact: X already quantized (`qact.quantize_for(X, qtype, bits)`), to share one quantization between
    matrices that multiply the same X."""
    fmt = get_format(qtype)
    w = weight_rows(w_raw, fmt)  # [R, row_bytes]
    X = np.ascontiguousarray(X, dtype=np.float32)  # [T, C]
    if X.ndim != 2 or X.shape[1] != cols_of(w, fmt) or not qact.has_int_dot(fmt.qtype, X.shape[1]):
        raise ValueError(f"matmul_act: X must have shape (T, {cols_of(w, fmt)}) for {fmt.name} weights "
                         f"{w.shape[0]}x{cols_of(w, fmt)} of a type with an integer dot, got {X.shape}")
    # [T, C], [T, C/256] (or C/32: qact.act_group), [T, C/16]
    xq, xd, xbs = xact if xact is not None else qact.quantize_for(X, fmt.qtype, bits)
    if xd.shape[1] * qact.act_group(fmt.qtype, xq.dtype.itemsize * 8) != X.shape[1]:
        raise ValueError(f"matmul_act: {fmt.name} takes x with a scale per {qact.act_group(fmt.qtype, bits)} values, "
                         f"got xd of shape {xd.shape}")
    if bits == qact.PLANES:  # 2T rows of 8-bit x, token t's planes at 2t, 2t + 1: the 8-bit product, then their sum
        return qact.sum_planes(_matmul_act8(w, fmt.qtype, xq, xd, xbs))
    return _matmul_act8(w, fmt.qtype, xq, xd, xbs)


def _matmul_act8(w: np.ndarray, qtype, xq: np.ndarray, xd: np.ndarray, xbs: np.ndarray) -> np.ndarray:
    """matmul_act's kernels: w uint8 [R, row_bytes], x quantized (xq [T, C] int8 or int16) -> float32 [T, R]."""
    if (xq.dtype == np.int8 and xq.shape[0] >= DECODE_MIN_TOKENS and _DECODE and qtype in qact.ROW_DECODES
            and w.shape[0] % TILE_ROWS == 0):  # IQ1-IQ3 in prefill: the matrix decoded, then tiles: the same bits
        return repack.decoded_matmul(w, qtype, xq, xd, xbs)
    Y = np.empty((xq.shape[0], w.shape[0]), dtype=np.float32)  # [T, R]
    if xq.shape[0] == 1:
        act_kernel(_matvec_act_kernel, qtype)(w, xq[0], xd[0], xbs[0], Y[0])
    else:
        act_kernel(_matmul_act_kernel, qtype)(w, xq, xd, xbs, Y)
    return Y


def moe_act(experts: list, qtypes, x: np.ndarray, pairs: list, bits: int = 16) -> np.ndarray:
    """The routed experts of one layer by the integer path (x and h quantized to `bits`), fused: -> y float32 [T, D] = sum of weight * expert(x).

    experts: (gate, up, down) raw rows per expert used, in the order their outputs are added; pairs[i]: (token ids
    int [n_i], routing weights float32 [n_i]) of experts[i]; qtypes: (gate, up, down) types; x float32 [T, D].
    """
    start = np.zeros(len(pairs) + 1, dtype=np.int64)
    start[1:] = np.cumsum([len(t) for t, _ in pairs])  # [S + 1]
    tok = np.concatenate([t for t, _ in pairs]).astype(np.int64)  # [P]
    weight = np.concatenate([w for _, w in pairs]).astype(np.float32)  # [P]
    return moe_act_grouped(experts, qtypes, x, start, tok, weight, bits)


def moe_act_grouped(experts: list, qtypes, x: np.ndarray, start: np.ndarray, tok: np.ndarray, weight: np.ndarray,
                    bits: int = 16, tiles=None) -> np.ndarray:
    """moe_act with the (token, weight) pairs already grouped by expert: expert i owns pairs start[i]:start[i+1]
    (start int64 [S + 1]) of tok int64 [P] and weight float32 [P] (the form the kernel takes; the CPU backend
    builds it with one sort, not a pass per expert). Each expert's shapes are checked, and a matrix that is not
    C-contiguous is copied. tiles: per expert, the data addresses of its (gate, up, down) repacked copies
    (quant/repack.py, C-contiguous uint8 [rows / 8, row_tiles]; 0 for a matrix without one), read instead of the raw
    rows at 8 bits; None: none at all; the caller's to keep alive and right."""
    T, D = x.shape
    F = experts[0][0].shape[0]
    gb, ub, db = (get_format(q).row_bytes(n) for q, n in zip(qtypes, (D, D, F)))  # bytes of a gate, up, down row
    keep = []  # copies made C-contiguous, alive until the kernel returns (the callers hold the others)
    table = np.zeros((len(experts), 6), dtype=np.int64)  # [S, 6]: raw (gate, up, down), then their tiles
    for i, (gate, up, down) in enumerate(experts):
        table[i, :3] = expert_addresses(gate, up, down, F, D, gb, ub, db)  # -1: not C-contiguous, or wrong shape
        if table[i, 0] < 0:
            gate, up, down = (np.ascontiguousarray(m) for m in (gate, up, down))
            if gate.shape != (F, gb) or up.shape != (F, ub) or down.shape != (D, db):
                raise ValueError(f"moe_act: expert shapes {gate.shape} {up.shape} {down.shape} do not fit D={D}, "
                                 f"F={F}")
            keep.append((gate, up, down))
            table[i, :3] = [m.ctypes.data for m in (gate, up, down)]
    if tiles is not None and qact.ACT_DTYPES[bits] == np.int8:  # 8 bits or two 8-bit planes; 0: no repacked copy
        table[:, 3:] = tiles
    return moe_act_table(table, qtypes, F, x, start, tok, weight, bits)


def moe_groups(qtypes, bits: int) -> tuple:
    """(values per scale of x, of h) in the MoE kernel: qact.act_group of the gate (= the up) type and of the down
    type. Gate and up read the same quantized x, so their groups must agree."""
    g, u, dn = (qact.act_group(q, bits) for q in qtypes)
    if g != u:
        raise ValueError(f"moe_act: gate {QType(qtypes[0]).name} and up {QType(qtypes[1]).name} take x in different "
                         f"blocks ({g}, {u} values a scale)")
    return g, dn


def moe_act_table(addr: np.ndarray, qtypes, F: int, x: np.ndarray, start: np.ndarray, tok: np.ndarray,
                  weight: np.ndarray, bits: int = 16, threads: int = 0) -> np.ndarray:
    """The fused kernel's own call: moe_act_grouped with the experts given as addr int64 [S, 6], per expert the
    addresses of its (gate, up, down) raw rows (uint8 [F, row_bytes(D)], [F, row_bytes(D)], [D, row_bytes(F)],
    C-contiguous), then of their repacked copies (0: none; nonzero only at 8 bits). Nothing here checks them: the
    caller made them from checked arrays (moe_act_grouped; the CPU backend's `expert_row`, once per expert) and
    keeps those alive. A decode step's short path: no Python per expert. threads: Numba's thread count, how the
    down rows are split (0: asked of Numba, ~1 us of interpreter and a lock each time; any value gives the same
    bits)."""
    T, D = x.shape
    if bits == qact.PLANES:  # each pair twice, its hi and its lo plane (rows 2 i, 2 i + 1): the down phase adds
        # weight * down h for both, the gate/up phase adds their g and u before SwiGLU
        start, tok, weight = 2 * start, np.repeat(tok, 2), np.repeat(weight, 2)
    P = tok.shape[0]
    dtype = qact.ACT_DTYPES[bits]
    xg, hg = moe_groups(qtypes, bits)
    xq = np.empty((P, D), dtype=dtype)  # [P, D] x quantized, one row per pair (the kernel fills them)
    xd = np.empty((P, D // xg), dtype=np.float32)  # [P, D / 256] or [P, D / 32]: the kernel reads the layout off
    xbs = np.empty((P, D // qact.SUB), dtype=np.int32)  # the shapes
    hq = np.empty((P, F), dtype=dtype)
    hd = np.empty((P, F // hg), dtype=np.float32)
    hbs = np.empty((P, F // qact.SUB), dtype=np.int32)
    y = np.zeros((T, D), dtype=np.float32)  # [T, D]
    act_kernel(_moe_kernel, *qtypes)(addr, F, D, start, tok, weight, np.ascontiguousarray(x, dtype=np.float32), xq, xd,
                                     xbs, hq, hd, hbs, qact.PLANE_QMAX if bits == qact.PLANES else qact.qmax_of(dtype),
                                     y, threads or get_num_threads(),
                                     PREFETCH_AHEAD)
    return y
