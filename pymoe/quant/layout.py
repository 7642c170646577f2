"""One layout description per format, compiled three ways: the NumPy reference, the CPU decoder, the CUDA decoder.

What this is: the machinery behind the formats added in the second round (MXFP4, the IQ family, TQ1_0, TQ2_0; see
iquants.py, mxfp4.py, ternary.py). A format is described once, as two plain-Python functions of the raw bytes:

    scale(src, s, g) -> (dl, ml)   the float32 multiplier and offset of scale group g of the block at src[s]
    code(src, s, k)  -> c          the float32 code of weight k (0 <= k < QK) of that block

and a weight is  w = dl * c - ml  (g = k // GROUP). The functions use only integer and float32 arithmetic, the
helpers below and global lookup tables, never `if` on data, so the *same source* runs
  - on NumPy arrays (`s` a column of block offsets, `k` a row of weight indices): `reference(layout)`, the
    readable reference dequantizer, bit-exact with gguf-py's `gguf.dequantize` and ggml's own `dequantize_row_*`
    (tests/test_iquants.py);
  - compiled by `numba.njit` on scalars: `decoder(layout)`, the `decode_block` the fused CPU kernels in kernels.py
    inline;
  - compiled by `numba.cuda.jit(device=True)`: the GPU kernels in cuda_kernels/quant_matvec.py take the
    pair as they are (their `DeviceFormat`).
So the bit layout of these formats is written in exactly one place, and the three targets cannot drift apart. The
older formats (floats.py, legacy.py, kquants.py, q2_0.py) keep their hand-vectorised NumPy references and byte-loop
decoders, faster on the CPU; quant_matvec.py restates them as scale/code pairs for the GPU (docs/formats.md).

Why no `if`: a Python `if` on a NumPy array is an error, so a choice is written as arithmetic: a select of two
values by a 0/1 integer (`pick`), a sign as `1 - 2 * bit`. NumPy 2 keeps the dtype of a uint8 array in `a * 3`
(it would wrap), so every byte is widened with `u8` before arithmetic, exactly like the scalar code must.

`retarget` is how one source becomes several compiled functions: a fresh function from the same code object, with
some global names rebound (the helpers compiled for the target, per-format constants). Numba treats globals as
compile-time constants, so each binding is straight-line code.
"""
from __future__ import annotations

import hashlib
import inspect
import math
import types as pytypes
from dataclasses import dataclass
from typing import Callable

import numpy as np
from numba import njit

from .floats import f16_to_f32

F32_ZERO = np.float32(0.0)


def retarget(fn, jit, name: str | None = None, **bindings):
    """Compile plain-Python `fn` with `jit` (numba.njit, cuda.jit(device=True), or `plain` for NumPy), with the
    global names in `bindings` replaced (callees compiled for the same target, per-format constants)."""
    fn = getattr(fn, "py_func", fn)  # a Numba CPU dispatcher -> its Python source function
    glbs = dict(fn.__globals__)
    glbs.update(bindings)
    clone = pytypes.FunctionType(fn.__code__, glbs, name or fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__qualname__ = clone.__name__
    return jit(clone)


def plain(fn):
    """The 'jit' of the NumPy target: the function as it is."""
    return fn


# ----------------------------------------------------------------------------------------------------------------
# Helpers a layout calls. Integer ones are the same source on every target; the two float conversions need one
# version for arrays (NumPy views) and one for scalars (arithmetic, also valid on the device).
# ----------------------------------------------------------------------------------------------------------------
def u8(src, i):
    """Byte i of src, widened to int64."""
    return np.int64(src[i])


def u16(src, i):
    """Little-endian uint16 at src[i] (any alignment)."""
    return u8(src, i) | (u8(src, i + 1) << 8)


def u32(src, i):
    """Little-endian uint32 at src[i] (any alignment)."""
    return u16(src, i) | (u16(src, i + 2) << 16)


def pick(cond, a, b):
    """a where cond (0/1 integer or bool) else b, by arithmetic: no branch, so it runs on arrays and on the device."""
    c = np.int64(cond)
    return c * a + (1 - c) * b


f16_bits_scalar = f16_to_f32.py_func  # IEEE binary16 bits -> float32 by arithmetic, exact (floats.py)


def f16_bits_numpy(h):
    """The same on arrays, by reinterpreting the bits."""
    return np.asarray(h).astype(np.uint16).view(np.float16).astype(np.float32)


def pow2_scalar(e):
    """2^e as float32 (exact for -149 <= e <= 127: MXFP4's scales, subnormal ones included)."""
    return np.float32(math.ldexp(np.float32(1.0), int(e)))


def pow2_numpy(e):
    return np.ldexp(np.float32(1.0), np.asarray(e).astype(np.int32)).astype(np.float32)


def read_f16(src, i):
    """Little-endian fp16 at src[i] -> float32 (f16_bits is bound per target)."""
    return f16_bits(u16(src, i))


f16_bits = f16_bits_scalar  # rebound per target by helpers_for
pow2 = pow2_scalar

INTEGER_HELPERS = {"u8": u8, "u16": u16, "u32": u32, "pick": pick}


def helpers_for(jit, numpy_target: bool = False) -> dict:
    """The helpers compiled for one target, each one's callees rebound to the same target's versions."""
    if numpy_target:
        h = {name: fn for name, fn in INTEGER_HELPERS.items()}
        h["f16_bits"], h["pow2"] = f16_bits_numpy, pow2_numpy
    else:
        h = {"u8": retarget(u8, jit)}
        h["u16"] = retarget(u16, jit, u8=h["u8"])
        h["u32"] = retarget(u32, jit, u16=h["u16"])
        h["pick"] = retarget(pick, jit)
        h["f16_bits"] = retarget(f16_bits_scalar, jit)
        h["pow2"] = retarget(pow2_scalar, jit)
    h["read_f16"] = retarget(read_f16, jit, u16=h["u16"], f16_bits=h["f16_bits"])
    return h


def compile_fn(fn, jit, helpers: dict, name: str | None = None):
    """`retarget` for a layout function: the helpers bound, and so are the plain-Python functions of the layout's
    own module that it calls (e.g. iquants.signed), each compiled the same way, recursively."""
    bindings = dict(helpers)
    for callee in fn.__code__.co_names:
        obj = fn.__globals__.get(callee)
        if callee not in helpers and isinstance(obj, pytypes.FunctionType) and obj.__module__ == fn.__module__:
            bindings[callee] = compile_fn(obj, jit, helpers)
    return retarget(fn, jit, name, **bindings)


# ----------------------------------------------------------------------------------------------------------------
# A format's layout and what is built from it
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """One GGML type's bit layout: QK weights in TYPE_SIZE bytes, scale groups of GROUP weights, scale and code."""

    name: str
    block_size: int  # QK
    type_size: int  # bytes per block
    group: int  # consecutive weights sharing one (dl, ml)
    scale: Callable  # (src, s, g) -> (dl, ml) float32
    code: Callable  # (src, s, k) -> float32 code of weight k

    def fingerprint(self) -> str:
        """A short hash of the source files the compiled decoders depend on (the format's module and this one)."""
        digest = hashlib.sha1()
        for path in sorted({inspect.getsourcefile(self.code), __file__}):
            with open(path, "rb") as f:
                digest.update(f.read())
        return digest.hexdigest()[:12]


def reference(layout: Layout):
    """The NumPy reference dequantizer of a layout: uint8 [B, type_size] -> float32 [B, QK]."""
    helpers = helpers_for(plain, numpy_target=True)
    scale = compile_fn(layout.scale, plain, helpers)
    code = compile_fn(layout.code, plain, helpers)

    def dequantize(blocks: np.ndarray) -> np.ndarray:
        blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
        src = blocks.reshape(-1)  # [B * type_size] the bytes, as the scalar code sees them
        s = (np.arange(blocks.shape[0], dtype=np.int64) * layout.type_size)[:, None]  # [B, 1] first byte of each block
        k = np.arange(layout.block_size, dtype=np.int64)[None, :]  # [1, QK] weight index in the block
        dl, ml = scale(src, s, k // layout.group)  # [B, QK] each: the scale of each weight's group
        w = dl * code(src, s, k) - ml  # [B, QK]
        return np.broadcast_to(w, (blocks.shape[0], layout.block_size)).astype(np.float32)

    dequantize.__name__ = f"dequantize_{layout.name.lower()}"
    dequantize.__doc__ = f"{layout.name} reference: uint8 [B, {layout.type_size}] -> float32 [B, {layout.block_size}]"
    return dequantize


# The CPU decode template: DECODE's globals SCALE, CODE, QK, TYPE_SIZE, GROUP bound per format by `decoder`.
SCALE = CODE = None
QK = TYPE_SIZE = GROUP = 0


def decode_template(src, out):
    # src uint8 [n * TYPE_SIZE] (n whole blocks), out float32 [n * QK] (written)
    for b in range(src.shape[0] // TYPE_SIZE):
        s = b * TYPE_SIZE  # first byte of the block
        for g in range(QK // GROUP):
            dl, ml = SCALE(src, s, g)
            for i in range(GROUP):
                k = g * GROUP + i
                out[b * QK + k] = dl * CODE(src, s, k) - ml


def decoder(layout: Layout):
    """The Numba `decode_block` of a layout (what kernels.py inlines), cached on disk under a name that carries the
    hash of the layout's source, so an edited layout is recompiled."""
    helpers = helpers_for(njit)
    tag = f"{layout.name}_{layout.fingerprint()}"
    return retarget(decode_template, lambda fn: njit(cache=True)(fn), f"decode_{tag}",
                    SCALE=compile_fn(layout.scale, njit, helpers, f"scale_{tag}"),
                    CODE=compile_fn(layout.code, njit, helpers, f"code_{tag}"),
                    QK=layout.block_size, TYPE_SIZE=layout.type_size, GROUP=layout.group)
