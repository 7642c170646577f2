"""Quantized mat-vec and mat-mat on the GPU (Numba CUDA): Y[T, R] = X[T, C] W[R, C]^T, W as raw GGML blocks.

What this is: for every format in `pymoe.quant.FORMATS` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K,
Q4_K, Q5_K, Q6_K, Q2_0), a per-format pair of scalar decode functions (below), one kernel source per version that is
specialised per format, and host wrappers `matvec(w, qtype, x)` / `matmul(w, qtype, X)`.
What this is not: the reference (that is `pymoe.quant.dequantize(w, qtype) @ x`, NumPy; tests/test_cuda_kernels.py
compares the two), nor memory management: the caller owns every device buffer and stream (pymoe/backends).

Where the weights live does not matter. `w` is a device-visible uint8 array [R, row_bytes] exactly as the rows sit in
the GGUF file: either an expert's copy in a VRAM slot of the expert cache, or a mapped (pinned, page-locked) host
buffer whose device pointer the GPU reads over PCIe (numba `cuda.mapped_array`, or cupy/cuda-python memory wrapped
through `__cuda_array_interface__`). The kernels only index `w[r, byte]`: same kernel, different pointer. Reading
mapped host memory is slower per byte (PCIe instead of HBM) but each byte is read once, so no copy is wasted.

One decode, two targets. A weight is always `w = dl * code - ml`: a float32 multiplier and offset shared by a group
of GROUP consecutive weights (a K-quant sub-block, a legacy block, or one float), and the integer code of the weight
(or the float itself for F32/F16/BF16, with dl = 1, ml = 0). Each format below is two plain-Python functions,
`<fmt>_scale(src, s, g)` -> (dl, ml) of group g and `<fmt>_code(src, s, k)` -> code of weight k, for the block whose
first byte is src[s]. They use only integer/float scalar arithmetic, so the very same source is compiled by
`cuda.jit(device=True)` for the kernels and by `numba.njit` for the CPU twin `decode_rows` that the tests check
bit-exactly against `dequantize` (fast, no simulator). They reuse pymoe.quant's scalar helpers (`f16_to_f32`,
`read_f16`, `scale_min_k4`/`get_scale_min`, `_q3_k_scale`, `_int8_at`) the same way: `retarget` recompiles a
function's Python source for a target with the names it calls rebound to that target's versions (the trick
`pymoe.quant.kernels._specialise` uses on the CPU). The bit layouts are drawn once, in pymoe/quant/floats.py,
legacy.py and kquants.py; the comments below only say which field each line reads. The float32 operation order of
the references (e.g. K-quants: (d * sc) * q - (dmin * m), no FMA) is kept, so decoded weights are bit-exact;
`x - 0.0` and `1.0 * x` are exact, and `d * q + m == d * q - (-m)` in IEEE arithmetic.

Versions (llm.c dev/cuda style, naive -> fast), all computing Y[T, R] (matvec is T = 1):
  1. `matmul_kernel_1`: one thread per (row, tile of TOKEN_TILE tokens); the thread walks its whole row. Simplest
     possible, poor for few rows (a 2048-row matrix keeps 2048 threads busy), uncoalesced (neighbouring threads
     read bytes a row apart). Kept as the readable twin.
  2. `matmul_kernel_2`: one block of THREADS threads per (row, token tile). The row is cut into units of one
     scale group (n_blocks * QK / GROUP units); thread i takes units i, i + THREADS, ...: decodes the group's
     (dl, ml) once, then each weight once, in registers, and applies it to every token of the tile; the THREADS
     partial sums per token are added with a shared-memory tree (cuda_kernels/reduce.py). Each weight block is
     decoded once per token tile, so prefill (T tokens) decodes the matrix ceil(T / TOKEN_TILE) times, decode once.
  Not done (next versions): int8 dot products on pre-quantized activations (llama.cpp mmvq, dp4a), vectorised
  32-bit loads, warp shuffles, several rows per block.

Test (CPU, simulator): NUMBA_ENABLE_CUDASIM=1 pytest -m cuda tests/test_cuda_kernels.py
Test on a GPU:        NUMBA_ENABLE_CUDASIM=0 pytest -m cuda tests/test_cuda_kernels.py
Bench on a GPU:       python -m pymoe.cuda_kernels.quant_matvec Q4_K 2048 2048 [T]    (rows, cols, tokens; GB/s of weights)

Shape legend: R rows (output features), C cols (input features) = n_blocks * QK, T tokens, S bytes per row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
from numba import cuda, njit

from pymoe.quant import QType, get_format
from pymoe.quant import FORMATS, floats, kquants, layout

from .reduce import block_sum_rows

THREADS = 32  # threads per block in version 2 (one warp per row); a power of two (reduce.py)
TOKEN_TILE = 4  # tokens per block: each decoded weight is applied to up to this many tokens held in registers

F32_ONE = np.float32(1.0)
F32_ZERO = np.float32(0.0)


# ----------------------------------------------------------------------------------------------------------------
# retarget: the same Python source, compiled for another target
# ----------------------------------------------------------------------------------------------------------------
# `retarget` (pymoe/quant/layout.py) compiles a plain-Python function for a target with some global names rebound;
# `compile_fn` also compiles the module-local functions it calls. Both live with the layouts they were made for.
retarget, compile_fn = layout.retarget, layout.compile_fn


# ----------------------------------------------------------------------------------------------------------------
# Scalar helpers. The names below are what the decode functions call; as plain Python they are pymoe.quant's own
# functions (so the decoders also run uncompiled, e.g. in the simulator), and `helpers_for` rebinds them per target.
# ----------------------------------------------------------------------------------------------------------------
f16_to_f32 = floats.f16_to_f32.py_func  # fp16 bits -> float32, exact (floats.py)
read_f16 = floats.read_f16.py_func  # little-endian fp16 at src[i] -> float32
get_scale_min = kquants.get_scale_min.py_func  # Q4_K/Q5_K 6-bit (scale, min) of sub-block j (kquants.py table)
q3_k_scale = kquants._q3_k_scale.py_func  # Q3_K signed 6-bit scale of sub-block s
int8_at = kquants._int8_at.py_func  # src[i] as a two's-complement int8


def f32_from_bits(bits):
    """IEEE binary32 bits (an integer) -> float32, by arithmetic (exact; NaN payload not kept).

    The device cannot reinterpret a register the way the CPU decoder views its output buffer, so this is the
    float32 twin of f16_to_f32:  s eeeeeeee m(23)  ->  (-1)^s * (2^23 + m) * 2^(e - 150)   (e = 1..254)
                                                      (-1)^s * m * 2^-149                   (e = 0, subnormal)
    Both products are exact powers-of-two scalings (ldexp), so the result is the float32 with those bits.
    """
    bits = np.int64(bits)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    if exponent == 0:
        magnitude = math.ldexp(np.float32(mantissa), -149)
    elif exponent == 255:
        magnitude = np.float32(np.inf) if mantissa == 0 else np.float32(np.nan)
    else:
        magnitude = math.ldexp(np.float32(mantissa + 0x800000), int(exponent) - 150)
    return -magnitude if (bits >> 31) & 1 else magnitude


def helpers_for(jit) -> dict:
    """The scalar helpers compiled for one target, each one's callees rebound to the same target's versions: this
    module's (for the formats restated below) on top of pymoe.quant.layout's (for the formats described there)."""
    h = layout.helpers_for(jit)
    h["f16_to_f32"] = retarget(f16_to_f32, jit)
    h["read_f16"] = retarget(read_f16, jit, f16_to_f32=h["f16_to_f32"])
    h["get_scale_min"] = retarget(get_scale_min, jit, _scale_min_k4_jit=retarget(kquants.scale_min_k4, jit))
    h["q3_k_scale"] = retarget(q3_k_scale, jit)
    h["int8_at"] = retarget(int8_at, jit)
    h["f32_from_bits"] = retarget(f32_from_bits, jit)
    return h


# ----------------------------------------------------------------------------------------------------------------
# The formats: (dl, ml) of scale group g and code of weight k, for the block at src[s]. Layouts: floats.py,
# legacy.py, kquants.py. Integers are widened to int64 before any arithmetic (uint8 - 8 would wrap).
# ----------------------------------------------------------------------------------------------------------------
def float_scale(src, s, g):  # F32 / F16 / BF16: every "block" is one weight, the code is its value
    return F32_ONE, F32_ZERO


def f32_code(src, s, k):  # 4 bytes little-endian binary32
    return f32_from_bits(np.int64(src[s]) | (np.int64(src[s + 1]) << 8)
                         | (np.int64(src[s + 2]) << 16) | (np.int64(src[s + 3]) << 24))


def f16_code(src, s, k):  # 2 bytes little-endian binary16
    return read_f16(src, s)


def bf16_code(src, s, k):  # 2 bytes: the high half of a binary32
    return f32_from_bits((np.int64(src[s]) | (np.int64(src[s + 1]) << 8)) << 16)


def q8_0_scale(src, s, g):  # d fp16 at 0; w = d * q
    return read_f16(src, s), F32_ZERO


def q8_0_code(src, s, k):  # qs[k] int8 at 2 + k
    return np.float32(int8_at(src, s + 2 + k))


def q4_0_scale(src, s, g):  # d fp16 at 0; w = d * (q - 8)
    return read_f16(src, s), F32_ZERO


def q4_0_code(src, s, k):  # qs[16] at 2: byte k % 16, low nibble for k < 16, high nibble for k >= 16
    return np.float32(((np.int64(src[s + 2 + (k & 15)]) >> (4 * (k >> 4))) & 15) - 8)


def q4_1_scale(src, s, g):  # d fp16 at 0, m fp16 at 2; w = d * q + m
    return read_f16(src, s), -read_f16(src, s + 2)


def q4_1_code(src, s, k):  # qs[16] at 4, nibbles as Q4_0
    return np.float32((np.int64(src[s + 4 + (k & 15)]) >> (4 * (k >> 4))) & 15)


def q5_0_scale(src, s, g):  # d fp16 at 0; w = d * (q - 16)
    return read_f16(src, s), F32_ZERO


def q5_0_code(src, s, k):  # qh (32 bits) at 2: bit k = bit 4 of q[k]; qs[16] at 6, nibbles as Q4_0
    low = (np.int64(src[s + 6 + (k & 15)]) >> (4 * (k >> 4))) & 15
    high = (np.int64(src[s + 2 + (k >> 3)]) >> (k & 7)) & 1
    return np.float32((low | (high << 4)) - 16)


def q5_1_scale(src, s, g):  # d fp16 at 0, m fp16 at 2; w = d * q + m
    return read_f16(src, s), -read_f16(src, s + 2)


def q5_1_code(src, s, k):  # qh at 4, qs[16] at 8
    low = (np.int64(src[s + 8 + (k & 15)]) >> (4 * (k >> 4))) & 15
    high = (np.int64(src[s + 4 + (k >> 3)]) >> (k & 7)) & 1
    return np.float32(low | (high << 4))


def q2_k_scale(src, s, g):  # scales[16] at 0 (low nibble scale, high nibble min); d fp16 at 80, dmin at 82
    sc = np.int64(src[s + g])
    return read_f16(src, s + 80) * np.float32(sc & 15), read_f16(src, s + 82) * np.float32(sc >> 4)


def q2_k_code(src, s, k):  # qs[64] at 16: weight 128h + 32j + l in byte 32h + l, bits 2j..2j+1
    h, j, l = k >> 7, (k >> 5) & 3, k & 31
    return np.float32((np.int64(src[s + 16 + 32 * h + l]) >> (2 * j)) & 3)


def q3_k_scale_pair(src, s, g):  # scales[12] at 96 (6-bit, biased by 32); d fp16 at 108; w = (d * sc) * q
    return read_f16(src, s + 108) * np.float32(q3_k_scale(src, s + 96, g)), F32_ZERO


def q3_k_code(src, s, k):  # hmask[32] at 0: bit k // 32 of byte k % 32; qs[64] at 32, walked as Q2_K
    h, j, l = k >> 7, (k >> 5) & 3, k & 31
    low = (np.int64(src[s + 32 + 32 * h + l]) >> (2 * j)) & 3
    high = (np.int64(src[s + l]) >> (k >> 5)) & 1  # stored inverted: 0 means "subtract 4"
    return np.float32(low - (0 if high else 4))


def q4_k_scale(src, s, g):  # d fp16 at 0, dmin at 2, 6-bit (scale, min) table at 4; sub-block g of 32 weights
    sc, m = get_scale_min(src, s + 4, g)
    return read_f16(src, s) * np.float32(sc), read_f16(src, s + 2) * np.float32(m)


def q4_k_code(src, s, k):  # qs[128] at 16: weight 64c + 32n + l in byte 32c + l, nibble n
    c, n, l = k >> 6, (k >> 5) & 1, k & 31
    return np.float32((np.int64(src[s + 16 + 32 * c + l]) >> (4 * n)) & 15)


def q5_k_code(src, s, k):  # qh[32] at 16: bit k // 32 of byte k % 32 is bit 4; qs[128] at 48, walked as Q4_K
    c, n, l = k >> 6, (k >> 5) & 1, k & 31
    low = (np.int64(src[s + 48 + 32 * c + l]) >> (4 * n)) & 15
    high = (np.int64(src[s + 16 + l]) >> (k >> 5)) & 1
    return np.float32(low | (high << 4))


def q2_0_scale(src, s, g):  # d fp16 at 0; w = d * (q - 1), one group of 64 (q2_0.py)
    return read_f16(src, s), F32_ZERO


def q2_0_code(src, s, k):  # qs[16] at 2: weight k in byte k // 4, bits 2(k % 4)..2(k % 4)+1
    return np.float32(((np.int64(src[s + 2 + (k >> 2)]) >> (2 * (k & 3))) & 3) - 1)


def q6_k_scale(src, s, g):  # scales[16] int8 at 192, d fp16 at 208; w = (d * sc) * q
    return read_f16(src, s + 208) * np.float32(int8_at(src, s + 192 + g)), F32_ZERO


def q6_k_code(src, s, k):  # ql[128] at 0, qh[64] at 128; weight 128h + 32j + l (j 0..3, l 0..31):
    h, j, l = k >> 7, (k >> 5) & 3, k & 31  # low 4 bits: ql[64h + 32(j & 1) + l], nibble j >> 1
    low = (np.int64(src[s + 64 * h + 32 * (j & 1) + l]) >> (4 * (j >> 1))) & 15
    high = (np.int64(src[s + 128 + 32 * h + l]) >> (2 * j)) & 3  # high 2 bits: qh[32h + l], bits 2j..2j+1
    return np.float32((low | (high << 4)) - 32)


@dataclass(frozen=True)
class DeviceFormat:
    """How the GPU kernels read one GGML type: its scale groups and its two decode functions (plain Python)."""

    qtype: QType
    group: int  # consecutive weights sharing one (dl, ml): 1 (floats), 16 or 32
    scale: Callable  # (src, s, g) -> (dl, ml) float32
    code: Callable  # (src, s, k) -> float32 code of weight k (0 <= k < QK) of the block at src[s]

    @property
    def block_size(self) -> int:
        return get_format(self.qtype).block_size

    @property
    def type_size(self) -> int:
        return get_format(self.qtype).type_size


DEVICE_FORMATS: dict[QType, DeviceFormat] = {
    f.qtype: f for f in (
        DeviceFormat(QType.F32, 1, float_scale, f32_code),
        DeviceFormat(QType.F16, 1, float_scale, f16_code),
        DeviceFormat(QType.BF16, 1, float_scale, bf16_code),
        DeviceFormat(QType.Q8_0, 32, q8_0_scale, q8_0_code),
        DeviceFormat(QType.Q4_0, 32, q4_0_scale, q4_0_code),
        DeviceFormat(QType.Q4_1, 32, q4_1_scale, q4_1_code),
        DeviceFormat(QType.Q5_0, 32, q5_0_scale, q5_0_code),
        DeviceFormat(QType.Q5_1, 32, q5_1_scale, q5_1_code),
        DeviceFormat(QType.Q2_K, 16, q2_k_scale, q2_k_code),
        DeviceFormat(QType.Q3_K, 16, q3_k_scale_pair, q3_k_code),
        DeviceFormat(QType.Q4_K, 32, q4_k_scale, q4_k_code),
        DeviceFormat(QType.Q5_K, 32, q4_k_scale, q5_k_code),  # Q5_K's d, dmin and scale table sit where Q4_K's do
        DeviceFormat(QType.Q6_K, 16, q6_k_scale, q6_k_code),
        DeviceFormat(QType.Q2_0, 64, q2_0_scale, q2_0_code),
    )
}
# The formats described once as a layout (MXFP4, IQ*, TQ*: pymoe/quant/layout.py) are taken as they are.
DEVICE_FORMATS.update({q: DeviceFormat(q, f.layout.group, f.layout.scale, f.layout.code)
                       for q, f in FORMATS.items() if f.layout is not None})
# tests/test_cuda_kernels.py checks that this covers every format of pymoe.quant.FORMATS.


def device_format(qtype) -> DeviceFormat:
    """The device decoder of a GGML type, or KeyError naming it (same message as pymoe.quant.get_format)."""
    qtype = get_format(qtype).qtype
    if qtype not in DEVICE_FORMATS:
        raise KeyError(f"tensor type {qtype.name} has no CUDA decoder (cuda_kernels/quant_matvec.py)")
    return DEVICE_FORMATS[qtype]


# ----------------------------------------------------------------------------------------------------------------
# Row templates, written once, in terms of per-format globals SCALE, CODE, QK, TYPE_SIZE, GROUP, GROUPS (= QK //
# GROUP) bound by `specialise`. The placeholders only make them readable.
# ----------------------------------------------------------------------------------------------------------------
SCALE = CODE = None
QK = TYPE_SIZE = GROUP = GROUPS = 0


def row_partial(row, X, t0, nt, first, step, acc):
    """acc[t] += sum over units u = first, first + step, ... of the row of  w . X[t0 + t]  (t < nt).

    row uint8 [S] (one weight row), X float32 [T, C], acc float32 [>= nt] (the caller's registers).
    A unit is one scale group: (dl, ml) decoded once, each weight once, applied to nt tokens.
    """
    n_units = (row.shape[0] // TYPE_SIZE) * GROUPS
    for u in range(first, n_units, step):
        b = u // GROUPS  # block
        g = u - b * GROUPS  # scale group inside the block
        s = b * TYPE_SIZE  # first byte of the block
        k0 = g * GROUP  # first weight of the group inside the block
        c0 = b * QK + k0  # its column in X
        dl, ml = SCALE(row, s, g)
        for i in range(GROUP):
            w = dl * CODE(row, s, k0 + i) - ml
            for t in range(nt):
                acc[t] += w * X[t0 + t, c0 + i]


def decode_rows(w, out):
    """CPU twin of the decode (tests): w uint8 [R, S] -> out float32 [R, C], every weight as `row_partial` sees it."""
    for r in range(w.shape[0]):
        row = w[r]
        n_units = (row.shape[0] // TYPE_SIZE) * GROUPS
        for u in range(n_units):
            b = u // GROUPS
            g = u - b * GROUPS
            s = b * TYPE_SIZE
            k0 = g * GROUP
            dl, ml = SCALE(row, s, g)
            for i in range(GROUP):
                out[r, b * QK + k0 + i] = dl * CODE(row, s, k0 + i) - ml


_COMPILED: dict = {}


def specialise(template, qtype, target: str):
    """`template` compiled for one format on one target ('cuda': a device function, 'cpu': numba.njit)."""
    fmt = device_format(qtype)
    key = (template.__name__, fmt.qtype, target)
    if key not in _COMPILED:
        jit = cuda.jit(device=True) if target == "cuda" else njit
        if ("helpers", target) not in _COMPILED:
            _COMPILED["helpers", target] = helpers_for(jit)
        helpers = _COMPILED["helpers", target]
        _COMPILED[key] = retarget(
            template, jit, f"{template.__name__}_{fmt.qtype.name}",
            SCALE=compile_fn(fmt.scale, jit, helpers, f"{fmt.scale.__name__}_{fmt.qtype.name}"),
            CODE=compile_fn(fmt.code, jit, helpers),
            QK=fmt.block_size, TYPE_SIZE=fmt.type_size, GROUP=fmt.group, GROUPS=fmt.block_size // fmt.group)
    return _COMPILED[key]


def row_partial_for(qtype):
    """The device function `row_partial` of one format (what the MoE kernels call for gate, up and down)."""
    return specialise(row_partial, qtype, "cuda")


def decode_rows_cpu(w: np.ndarray, qtype) -> np.ndarray:
    """CPU twin: uint8 [R, S] -> float32 [R, C] through the same decode source the GPU kernels use (njit)."""
    fmt = device_format(qtype)
    w = np.ascontiguousarray(w, dtype=np.uint8)
    out = np.empty((w.shape[0], w.shape[1] // fmt.type_size * fmt.block_size), np.float32)  # [R, C]
    specialise(decode_rows, qtype, "cpu")(w, out)
    return out


# ----------------------------------------------------------------------------------------------------------------
# The kernels (templates: ROW_PARTIAL bound per format by `kernel_for`)
# ----------------------------------------------------------------------------------------------------------------
ROW_PARTIAL = None


@cuda.jit(device=True)
def tile_size(n_left):
    """Tokens in this block's tile: min(TOKEN_TILE, n_left). (Not the builtin min: compiled to PTX here, numba 0.68.1
    built-in CUDA target failed to type min/max of two scalars; `if` works on every target.)"""
    return TOKEN_TILE if n_left > TOKEN_TILE else n_left


def matmul_kernel_1(w, X, Y):
    """Version 1. w uint8 [R, S], X float32 [T, C], Y float32 [T, R]; grid (ceil(R / bx), n_tiles), block (bx,)."""
    r = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    t0 = cuda.blockIdx.y * TOKEN_TILE
    if r < w.shape[0]:
        nt = tile_size(X.shape[0] - t0)
        acc = cuda.local.array(TOKEN_TILE, np.float32)  # [TOKEN_TILE] running dot products, in registers
        for t in range(TOKEN_TILE):
            acc[t] = 0.0
        ROW_PARTIAL(w[r], X, t0, nt, 0, 1, acc)  # this thread does every unit of the row
        for t in range(nt):
            Y[t0 + t, r] = acc[t]


def matmul_kernel_2(w, X, Y):
    """Version 2. w uint8 [R, S], X float32 [T, C], Y float32 [T, R]; grid (R, n_tiles), block (THREADS,)."""
    r = cuda.blockIdx.x
    t0 = cuda.blockIdx.y * TOKEN_TILE
    tid = cuda.threadIdx.x
    nt = tile_size(X.shape[0] - t0)
    acc = cuda.local.array(TOKEN_TILE, np.float32)  # [TOKEN_TILE] this thread's partial dot products
    for t in range(TOKEN_TILE):
        acc[t] = 0.0
    ROW_PARTIAL(w[r], X, t0, nt, tid, THREADS, acc)  # units tid, tid + THREADS, ...
    buf = cuda.shared.array((TOKEN_TILE, THREADS), np.float32)  # [TOKEN_TILE, THREADS]
    block_sum_rows(buf, tid, acc, nt)  # acc[t] = the whole row's dot product with token t0 + t
    if tid < nt:
        Y[t0 + tid, r] = acc[tid]


VERSIONS = {1: matmul_kernel_1, 2: matmul_kernel_2}


def kernel_for(template, **row_partials):
    """A kernel template compiled with its ROW_PARTIAL-like globals bound to per-format device functions.

    row_partials: global name -> qtype, e.g. ROW_PARTIAL=QType.Q4_K (moe.py binds GATE_/UP_/DOWN_PARTIAL).
    """
    key = (template.__name__,) + tuple(sorted((k, QType(v)) for k, v in row_partials.items()))
    if key not in _COMPILED:
        name = "_".join([template.__name__] + [QType(v).name for _, v in sorted(row_partials.items())])
        _COMPILED[key] = retarget(template, cuda.jit, name,
                                  **{k: row_partial_for(v) for k, v in row_partials.items()})
    return _COMPILED[key]


# ----------------------------------------------------------------------------------------------------------------
# Host side: checks, launches
# ----------------------------------------------------------------------------------------------------------------
def on_device(a, name: str):
    """A device array for a kernel argument: numba device arrays as they are, anything with
    `__cuda_array_interface__` (cupy, mapped host memory) wrapped without a copy; host NumPy arrays refused (Numba
    would silently copy them both ways on every launch)."""
    if getattr(a, "__cuda_ndarray__", False):  # numba's own (also mapped arrays, and the simulator's)
        return a
    if hasattr(a, "__cuda_array_interface__"):  # cupy, torch, cuda-python buffers: a zero-copy numba view
        return cuda.as_cuda_array(a)
    raise TypeError(f"{name} must be a device array (numba, or anything with __cuda_array_interface__), got "
                    f"{type(a).__name__}" + (": copy a host NumPy array once with numba.cuda.to_device"
                                             if isinstance(a, np.ndarray) else ""))


def check(a, name: str, dtype, ndim: int):
    if a.dtype != np.dtype(dtype) or len(a.shape) != ndim:
        raise ValueError(f"{name} must be {np.dtype(dtype).name} with {ndim} dimensions, "
                         f"got {a.dtype} with shape {tuple(a.shape)}")


def weight_cols(w, qtype, name: str = "w") -> int:
    """Columns of device weight rows w uint8 [R, S] of `qtype`, after checking that S is whole blocks."""
    fmt = get_format(qtype)
    check(w, name, np.uint8, 2)
    if w.shape[1] % fmt.type_size:
        raise ValueError(f"{fmt.name} rows must be whole blocks of {fmt.type_size} bytes, got {w.shape[1]} bytes")
    return w.shape[1] // fmt.type_size * fmt.block_size


def n_tiles(T: int) -> int:
    return (T + TOKEN_TILE - 1) // TOKEN_TILE


def matmul(w, qtype, X, out=None, version: int = 2, stream=0):
    """Y = X W^T: w uint8 [R, S] raw rows of `qtype` (slot or mapped host), X float32 [T, C] -> Y float32 [T, R].

    All arrays are device arrays; `out` (float32 [T, R]) is written if given, else allocated. Returns Y.
    """
    w, X = on_device(w, "w"), on_device(X, "X")
    C = weight_cols(w, qtype)
    check(X, "X", np.float32, 2)
    if X.shape[1] != C:
        raise ValueError(f"matmul: X must have shape (T, {C}) for {get_format(qtype).name} weights, "
                         f"got {tuple(X.shape)}")
    R, T = w.shape[0], X.shape[0]
    Y = cuda.device_array((T, R), np.float32, stream=stream) if out is None else on_device(out, "out")
    check(Y, "out", np.float32, 2)
    if tuple(Y.shape) != (T, R):
        raise ValueError(f"matmul: out must have shape {(T, R)}, got {tuple(Y.shape)}")
    if R == 0 or T == 0:
        return Y
    kernel = kernel_for(VERSIONS[version], ROW_PARTIAL=qtype)
    if version == 1:
        kernel[(math.ceil(R / THREADS), n_tiles(T)), THREADS, stream](w, X, Y)
    else:
        kernel[(R, n_tiles(T)), THREADS, stream](w, X, Y)
    return Y


def matvec(w, qtype, x, out=None, version: int = 2, stream=0):
    """y = W x: w uint8 [R, S] raw rows of `qtype`, x float32 [C] -> y float32 [R] (device arrays; out [R])."""
    x = on_device(x, "x")
    check(x, "x", np.float32, 1)
    R = w.shape[0]
    Y = None if out is None else on_device(out, "out").reshape(1, R)  # [1, R] view of out
    return matmul(w, qtype, x.reshape(1, x.shape[0]), Y, version, stream).reshape(R)  # [R]


# ----------------------------------------------------------------------------------------------------------------
# Bench (a real GPU): python -m pymoe.cuda_kernels.quant_matvec QTYPE ROWS COLS [TOKENS]
# ----------------------------------------------------------------------------------------------------------------
def bench(qtype, rows: int, cols: int, tokens: int = 1, repeats: int = 20) -> None:
    from pymoe.quant import quantize

    fmt = get_format(qtype)
    rng = np.random.default_rng(0)
    w = cuda.to_device(quantize(rng.standard_normal((rows, cols)).astype(np.float32), fmt.qtype))  # [R, S]
    X = cuda.to_device(rng.standard_normal((tokens, cols)).astype(np.float32))  # [T, C]
    for version in sorted(VERSIONS):
        matmul(w, fmt.qtype, X, version=version)  # compile and warm up
        start, stop = cuda.event(), cuda.event()
        start.record()
        for _ in range(repeats):
            matmul(w, fmt.qtype, X, version=version)
        stop.record()
        stop.synchronize()
        ms = cuda.event_elapsed_time(start, stop) / repeats
        print(f"{fmt.name} {rows}x{cols} T={tokens} version {version}: {ms * 1e3:8.1f} us, "
              f"{w.nbytes / ms / 1e6:7.1f} GB/s of weights")


if __name__ == "__main__":
    import sys

    args = sys.argv[1:]
    if len(args) not in (3, 4):
        raise SystemExit("usage: python -m pymoe.cuda_kernels.quant_matvec QTYPE ROWS COLS [TOKENS]")
    bench(QType[args[0]], int(args[1]), int(args[2]), *(int(a) for a in args[3:]))
