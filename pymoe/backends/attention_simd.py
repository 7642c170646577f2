"""The two inner loops of CPU attention (backends/cpu.py, `attention_rows`), as LLVM IR with accumulators in registers.

What this is: for one query and the nh query heads that share one KV head (GQA),
  scores_into(q, kt, n, out):  out[j, s] = sum_d q[j, d] * key(d, s) for s < n, the sum in order d = 0, 1, .. (a
                               multiply, then an add, both float32: no fused multiply-add), from 0.0;
  weighted_into(p, total, v, n, out):  out[j, d] = sum_s (p[j, s] / total[j]) * v[s, d] for d < Dv, in order
                               s = 0, 1, .. (p[j, s] / total[j] rounded once, then a multiply and an add).
These are the loops `attention_rows` wrote in Numba, one head at a time (`scores[s] += qd * kd[s]`, `o[d] += p *
vs[d]`). There the running sums lived in memory (a load, a store and a dependency through the store buffer per 16
values) and every head read its KV head's keys and values again; here 16 vectors of sums stay in registers for the
whole loop (4 heads x 64 keys, or 8 x 16 keys of one head; 4 heads' output rows at Dv = 64) and each key or value
row is loaded once for the heads taken together. Each value is computed by the same float operations in the same
order, so the bits are the Numba loops' (tests/test_attention_simd.py holds them to NumPy twins, `scores_ref` /
`weighted_ref`, bit for bit).
Shapes: q float32 [nh, Dh] (any strides); kt float32 [nb, Dh, 64] C-contiguous, the keys in tiles of 64 positions,
key(d, s) = kt[s // 64, d, s % 64], nb * 64 >= n (lanes past n are read, computed and written to out but never
used: out's rows have room for n rounded up to 16; the f32 KV cache stores its keys so, engine/kv.py `KeyTiles`); p float32 [nh, >= n], total [nh], v float32 [n', Dv] whose rows may be strided (a KV head's rows of [S, G, Dv])
but whose values are contiguous, Dv a multiple of 16 up to 256, out [nh, Dv] with contiguous rows.
What this is not: the softmax (Numba's loops in `attention_rows`, which vectorise on their own).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_f32, _i64 = ir.FloatType(), ir.IntType(64)
_V16F = ir.VectorType(_f32, 16)
BLOCK = 8  # vectors of 16 keys summed at once by scores_into for one head (4 per head for 4 heads): independent
# add chains that hide the add's latency
HEADS = 4  # query heads of one KV head taken together: each key or value row loaded once for them
MAX_DV = 256  # the widest value row weighted_into keeps in registers (16 vectors)
TILE_KEYS = 64  # keys per tile of scores_into's kt: a tile [Dh, 64] is one 4-head run's keys, contiguous


class KeyBlocks:
    """The first S positions of one layer's keys as key tiles: tiles float32 [G, nb, Dh, 64] C-contiguous (nb * 64
    >= S), key d of head g at position s in tiles[g, s // 64, d, s % 64] (the f32 KV cache's own layout,
    engine/kv.py `KeyTiles`, read in place by backends/cpu.py). It stands for K [S, G, Dh]: `shape`, and
    np.asarray(it) for code that wants that array (a copy)."""

    def __init__(self, tiles: np.ndarray, S: int):
        self.tiles, self.S = tiles, S
        self.shape = (S, tiles.shape[0], tiles.shape[2])
        self.dtype = tiles.dtype

    def __array__(self, dtype=None, copy=None):
        G, nb, Dh, w = self.tiles.shape
        k = self.tiles.transpose(1, 3, 0, 2).reshape(nb * w, G, Dh)[:self.S]  # [S, G, Dh]
        return k if dtype is None else k.astype(dtype, copy=False)


def _splat(builder, scalar):
    v = builder.insert_element(ir.Constant(_V16F, ir.Undefined), scalar, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, ir.Constant(_V16F, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), 16),
                                                                                    [0] * 16))


def _vload(builder, base, off):  # 16 floats at base + off (elements), unaligned
    return builder.load(builder.bitcast(builder.gep(base, [off]), _V16F.as_pointer()), align=4)


def _vstore(builder, value, base, off):
    builder.store(value, builder.bitcast(builder.gep(base, [off]), _V16F.as_pointer()), align=4)


def _c(a, nd):
    return isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == nd


@intrinsic
def scores_into(typingctx, q, kt, n, out):
    """out[j, s] = sum_d q[j, d] * kt[s // 64, d, s % 64] for the nh heads j of q [nh, Dh], s < n rounded up to 16
    (see the module's docstring), kt float32 [nb, Dh, 64] C-contiguous, nb * 64 >= n (key tiles: each block of 64
    keys a contiguous [Dh, 64] tile): 4 heads at a time (4 vectors of 16 keys each, one tile's row: read once for
    them), then the rest one by one (8 vectors)."""
    if not (_c(q, 2) and _c(kt, 3) and kt.layout == "C" and isinstance(n, types.Integer) and _c(out, 2)):
        return None

    def codegen(context, builder, signature, args):
        qa, ka, oa = (context.make_array(t)(context, builder, a) for t, a in zip(
            (signature.args[0], signature.args[1], signature.args[3]), (args[0], args[1], args[3])))
        const = lambda v: ir.Constant(_i64, v)  # noqa: E731
        n_ = context.cast(builder, args[2], signature.args[2], types.int64)
        nh = cgutils.unpack_tuple(builder, qa.shape, 2)[0]
        Dh = cgutils.unpack_tuple(builder, ka.shape, 3)[1]
        tile = builder.mul(Dh, const(TILE_KEYS))  # elements from one tile to the next
        q_row, q_col = (builder.udiv(x, const(4)) for x in cgutils.unpack_tuple(builder, qa.strides, 2))
        o_row = builder.udiv(cgutils.unpack_tuple(builder, oa.strides, 2)[0], const(4))
        vecs = builder.udiv(builder.add(n_, const(15)), const(16))  # vectors of 16 keys
        accs = [cgutils.alloca_once(builder, _V16F) for _ in range(HEADS * (BLOCK // 2))]

        def run(h0, heads, first_vec, width):  # heads h0.., `width` vectors from key 16 * first_vec, over every d
            for a in accs[:heads * width]:
                builder.store(ir.Constant(_V16F, [0.0] * 16), a)
            s0 = builder.mul(first_vec, const(16))
            starts = []  # vector j (keys s0 + 16 j ..): its tile's start plus its lane offset
            for j in range(width):
                sj = builder.add(s0, const(16 * j))
                starts.append(builder.add(builder.mul(builder.udiv(sj, const(TILE_KEYS)), tile),
                                          builder.urem(sj, const(TILE_KEYS))))
            with cgutils.for_range(builder, Dh) as loop:
                d = loop.index
                row = builder.mul(d, const(TILE_KEYS))
                ks = [_vload(builder, ka.data, builder.add(row, starts[j])) for j in range(width)]
                for i in range(heads):
                    at = builder.add(builder.mul(builder.add(h0, const(i)), q_row), builder.mul(d, q_col))
                    qd = _splat(builder, builder.load(builder.gep(qa.data, [at])))
                    for j in range(width):
                        a = accs[i * width + j]
                        builder.store(builder.fadd(builder.load(a), builder.fmul(qd, ks[j])), a)
            for i in range(heads):
                base = builder.add(builder.mul(builder.add(h0, const(i)), o_row), s0)
                for j in range(width):
                    _vstore(builder, builder.load(accs[i * width + j]), oa.data, builder.add(base, const(16 * j)))

        def heads_of(h0, heads, width):  # every vector of these heads: blocks of `width`, then one at a time
            full = builder.udiv(vecs, const(width))
            with cgutils.for_range(builder, full) as loop:
                run(h0, heads, builder.mul(loop.index, const(width)), width)
            with cgutils.for_range(builder, builder.sub(vecs, builder.mul(full, const(width)))) as loop:
                run(h0, heads, builder.add(builder.mul(full, const(width)), loop.index), 1)

        groups = builder.udiv(nh, const(HEADS))
        with cgutils.for_range(builder, groups) as loop:
            heads_of(builder.mul(loop.index, const(HEADS)), HEADS, BLOCK // 2)
        with cgutils.for_range(builder, builder.sub(nh, builder.mul(groups, const(HEADS)))) as loop:
            heads_of(builder.add(builder.mul(groups, const(HEADS)), loop.index), 1, BLOCK)
        return context.get_dummy_value()

    return types.none(q, kt, n, out), codegen


@intrinsic
def weighted_into(typingctx, p, total, v, n, out):
    """out[j, d] = sum_{s < n} (p[j, s] / total[j]) * v[s, d] for the nh heads j of p [nh, >= n] (see the module's
    docstring); v's rows may be strided. Heads in groups of up to 4 (16 accumulators: 4 heads at Dv = 64, 2 at
    128, 1 at 256), each value row read once for the group."""
    if not (_c(p, 2) and _c(total, 1) and _c(v, 2) and isinstance(n, types.Integer) and _c(out, 2)):
        return None

    def codegen(context, builder, signature, args):
        pa, ta, va, oa = (context.make_array(t)(context, builder, a) for t, a in zip(
            (signature.args[0], signature.args[1], signature.args[2], signature.args[4]),
            (args[0], args[1], args[2], args[4])))
        const = lambda v: ir.Constant(_i64, v)  # noqa: E731
        n_ = context.cast(builder, args[3], signature.args[3], types.int64)
        nh = cgutils.unpack_tuple(builder, pa.shape, 2)[0]
        Dv = cgutils.unpack_tuple(builder, va.shape, 2)[1]
        v_row = builder.udiv(cgutils.unpack_tuple(builder, va.strides, 2)[0], const(4))
        p_row, p_col = (builder.udiv(x, const(4)) for x in cgutils.unpack_tuple(builder, pa.strides, 2))
        t_col = builder.udiv(cgutils.unpack_tuple(builder, ta.strides, 1)[0], const(4))
        o_row = builder.udiv(cgutils.unpack_tuple(builder, oa.strides, 2)[0], const(4))
        accs = [cgutils.alloca_once(builder, _V16F) for _ in range(MAX_DV // 16)]

        def run(h0, heads, width):  # heads h0 .. h0 + heads - 1, Dv = 16 width
            tots = [builder.load(builder.gep(ta.data, [builder.mul(builder.add(h0, const(i)), t_col)]))
                    for i in range(heads)]
            for a in accs[:heads * width]:
                builder.store(ir.Constant(_V16F, [0.0] * 16), a)
            with cgutils.for_range(builder, n_) as loop:
                s = loop.index
                row = builder.mul(s, v_row)
                xs = [_vload(builder, va.data, builder.add(row, const(16 * j))) for j in range(width)]
                for i in range(heads):
                    at = builder.add(builder.mul(builder.add(h0, const(i)), p_row), builder.mul(s, p_col))
                    pv = _splat(builder, builder.fdiv(builder.load(builder.gep(pa.data, [at])), tots[i]))
                    for j in range(width):
                        a = accs[i * width + j]
                        builder.store(builder.fadd(builder.load(a), builder.fmul(pv, xs[j])), a)
            for i in range(heads):
                base = builder.mul(builder.add(h0, const(i)), o_row)
                for j in range(width):
                    _vstore(builder, builder.load(accs[i * width + j]), oa.data, builder.add(base, const(16 * j)))

        for width in range(1, MAX_DV // 16 + 1):  # one loop per value-row width, chosen at run time
            heads = max(1, min(HEADS, (MAX_DV // 16) // width))
            with builder.if_then(builder.icmp_unsigned("==", Dv, const(16 * width))):
                groups = builder.udiv(nh, const(heads))
                with cgutils.for_range(builder, groups) as loop:
                    run(builder.mul(loop.index, const(heads)), heads, width)
                with cgutils.for_range(builder, builder.sub(nh, builder.mul(groups, const(heads)))) as loop:
                    run(builder.add(builder.mul(groups, const(heads)), loop.index), 1, width)
        return context.get_dummy_value()

    return types.none(p, total, v, n, out), codegen


def scores_ref(q: np.ndarray, kt: np.ndarray, n: int) -> np.ndarray:
    """NumPy twin of scores_into: q [nh, Dh], key tiles kt [nb, Dh, 64] -> float32 [nh, n], each sum over d in
    order, multiply then add."""
    keys = kt.transpose(1, 0, 2).reshape(kt.shape[1], -1)  # [Dh, nb * 64]: key d of position s at [d, s]
    out = np.zeros((q.shape[0], n), np.float32)
    for d in range(keys.shape[0]):
        out += q[:, d:d + 1].astype(np.float32) * keys[d, :n]
    return out


def weighted_ref(p: np.ndarray, total: np.ndarray, v: np.ndarray, n: int) -> np.ndarray:
    """NumPy twin of weighted_into: p [nh, >= n], total [nh] -> float32 [nh, Dv], each sum over s in order."""
    out = np.zeros((p.shape[0], v.shape[1]), np.float32)
    for s in range(n):
        out += (p[:, s:s + 1].astype(np.float32) / total.astype(np.float32)[:, None]) * v[s]
    return out
