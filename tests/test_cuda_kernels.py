"""The Numba CUDA kernels (cuda_kernels/) against their NumPy references, in Numba's CUDA simulator (no GPU needed).

What this is: every kernel on small odd shapes -- quantized matvec (versions 1 and 2) and matmul for every format in
pymoe.quant.FORMATS, the MoE expert block, RMSNorm, RoPE (NEOX and normal), decode and chunk (prefill) attention with GQA -- compared
with pymoe.quant.dequantize(w) @ x and the NumPy forms of pymoe.backends.reference (rmsnorm, apply_rope, attention,
silu); plus the CPU twin of the device decoders bit-exact against `dequantize`, and (when a CUDA toolkit's NVVM is installed, no GPU needed)
every kernel compiled to PTX for a real GPU, which the simulator cannot check: it runs the kernels as plain Python,
so a construct Numba's CUDA target cannot type (e.g. the builtin min() in numba 0.68) would pass it unnoticed.
What this is not: a benchmark (python -m pymoe.cuda_kernels.quant_matvec on a GPU), nor a test of the backend.

How the simulator is switched on: tests/cuda_sim.py (imported first).
All tests carry the `cuda` marker: `pytest -m cuda` selects them, `-m "not cuda"` leaves them out.
Tolerance: as tests/test_kernels.py, |got - ref| <= 2 C u sum_i |w_i x_i| for a C-term float32 dot product.
Shapes are tiny because the simulator runs one Python thread per CUDA thread.
"""
from cuda_sim import IN_PROCESS, fresh_interpreter_test, in_process  # first: the simulator on

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402

import pymoe.quant as Q  # noqa: E402
from pymoe.backends.reference import apply_rope, attention, rmsnorm, silu  # noqa: E402
from pymoe.quant import QType  # noqa: E402
from cuda_ptx import compile_kernel, ptx_target, ptx_test  # noqa: E402
from quant_helpers import random_rows  # noqa: E402

import pymoe.cuda_kernels as K  # noqa: E402
from pymoe.cuda_kernels import quant_matvec  # noqa: E402

pytestmark = pytest.mark.cuda


def at(p: int, given: str):
    """A position as the kernels take it: an int, or ("device") int32 [1] in device memory (a device step's, read by
    the kernel: the `_at_kernel` forms, which a CUDA graph replays at every position)."""
    return cuda.to_device(np.array([p], np.int32)) if given == "device" else p

FORMATS = sorted(Q.FORMATS.values(), key=lambda f: f.name)
IDS = [f.name for f in FORMATS]
U = 2.0 ** -24  # float32 unit roundoff


def assert_dot_close(got, w, x):
    """got ~ w @ x (w [R, C] float32, x [C] or [C, T]) within 2 C u sum|w x|, elementwise."""
    ref = w @ x
    bound = 2 * w.shape[1] * U * (np.abs(w) @ np.abs(x))
    err = np.abs(got - ref)
    assert (err <= bound + np.finfo(np.float32).tiny).all(), f"max err {err.max()}, bound {bound.ravel()[err.argmax()]}"


def shape_for(i, fmt):
    """Rows 3..9 and 1 or 2 blocks per row, varied over the formats; floats get 33 columns (> 32 threads)."""
    rows = 3 + (2 * i) % 7
    cols = 33 if fmt.block_size == 1 else fmt.block_size * (1 + i % 2)
    return rows, cols


# ----------------------------------------------------------------------------------------------------------------
# The decoders (CPU twin: the same source compiled with numba.njit) -- no simulator involved

def test_every_registered_format_has_a_device_decoder():
    assert set(K.DEVICE_FORMATS) == set(Q.FORMATS)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_device_decode_is_bit_exact_with_dequantize(fmt):
    w = random_rows(fmt.qtype, 5, 2 * max(fmt.block_size, 16), np.random.default_rng(1))  # [5, row_bytes]
    got = K.decode_rows_cpu(w, fmt.qtype)
    assert np.array_equal(got.view(np.uint32), Q.dequantize(w, fmt.qtype).view(np.uint32))


def test_float_decode_of_special_values():
    """Zeros of both signs, subnormals, the extremes and infinities keep their bits; NaN stays NaN."""
    v = np.array([0.0, -0.0, 1e-45, -3e-39, 1e-40, 3.4028235e38, -np.inf, np.inf, 1.5, -2.75, np.nan], np.float32)
    with np.errstate(over="ignore"):
        v16 = v.astype(np.float16)  # 3.4e38 -> inf, small ones -> fp16 subnormals or zero
    for qtype, raw in ((QType.F32, v.view(np.uint8)),
                       (QType.F16, v16.view(np.uint8)),
                       (QType.BF16, (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8))):
        got = K.decode_rows_cpu(raw.reshape(1, -1), qtype)[0]
        ref = Q.dequantize(raw.reshape(1, -1), qtype)[0]
        assert np.array_equal(got[:-1].view(np.uint32), ref[:-1].view(np.uint32)), qtype.name
        assert np.isnan(got[-1]), qtype.name


# ----------------------------------------------------------------------------------------------------------------
# Quantized matvec / matmul

@in_process
@pytest.mark.parametrize("i_fmt", list(enumerate(FORMATS)), ids=IDS)
def test_matvec_and_matmul_match_reference(i_fmt):
    i, fmt = i_fmt
    rng = np.random.default_rng(10 + i)
    rows, cols = shape_for(i, fmt)
    w = random_rows(fmt.qtype, rows, cols, rng)  # [R, row_bytes]
    w_deq = Q.dequantize(w, fmt.qtype)  # [R, C]
    w_dev = cuda.to_device(w)
    x = rng.standard_normal(cols).astype(np.float32)  # [C]
    for version in (1, 2):
        y = K.matvec(w_dev, fmt.qtype, cuda.to_device(x), version=version).copy_to_host()  # [R]
        assert y.shape == (rows,) and y.dtype == np.float32
        assert_dot_close(y, w_deq, x)
    X = rng.standard_normal((3, cols)).astype(np.float32)  # [T, C]
    Y = K.matmul(w_dev, fmt.qtype, cuda.to_device(X)).copy_to_host()  # [T, R]
    assert Y.shape == (3, rows)
    assert_dot_close(Y.T, w_deq, X.T)


@in_process
@pytest.mark.parametrize("version", (1, 2))
def test_matmul_over_several_token_tiles(version):
    """T = 6 > TOKEN_TILE: a full tile and a partial one, written into a caller's `out`."""
    rng = np.random.default_rng(20)
    w = random_rows(QType.Q4_K, 3, 256, rng)  # [3, 144]
    X = rng.standard_normal((6, 256)).astype(np.float32)  # [T, C]
    out = cuda.device_array((6, 3), np.float32)
    Y = K.matmul(cuda.to_device(w), QType.Q4_K, cuda.to_device(X), out=out, version=version)
    assert Y is out or Y.shape == out.shape
    assert_dot_close(out.copy_to_host().T, Q.dequantize(w, QType.Q4_K), X.T)


@in_process
def test_slot_and_mapped_host_memory_run_the_same_kernel():
    """The expert cache hands the kernel a VRAM slot or a mapped pinned-host buffer: same bytes, same result."""
    rng = np.random.default_rng(21)
    w = random_rows(QType.Q6_K, 3, 256, rng)  # [3, 210]
    x = cuda.to_device(rng.standard_normal(256).astype(np.float32))
    mapped = cuda.mapped_array(w.shape, np.uint8)  # page-locked host memory the device reads over the bus
    mapped[...] = w
    in_slot = K.matvec(cuda.to_device(w), QType.Q6_K, x).copy_to_host()
    in_host = K.matvec(mapped, QType.Q6_K, x).copy_to_host()
    assert np.array_equal(in_slot, in_host)


@in_process
def test_input_errors_are_clear():
    w = cuda.to_device(random_rows(QType.Q4_0, 3, 64, np.random.default_rng(22)))  # [3, 36]
    with pytest.raises(TypeError, match="host NumPy array"):
        K.matvec(w, QType.Q4_0, np.zeros(64, np.float32))
    with pytest.raises(ValueError, match=r"X must have shape \(T, 64\)"):
        K.matvec(w, QType.Q4_0, cuda.to_device(np.zeros(32, np.float32)))
    with pytest.raises(ValueError, match="float32"):
        K.matvec(w, QType.Q4_0, cuda.to_device(np.zeros(64, np.float64)))
    with pytest.raises(ValueError, match="whole blocks"):
        K.matvec(cuda.to_device(np.zeros((3, 35), np.uint8)), QType.Q4_0, cuda.to_device(np.zeros(64, np.float32)))
    with pytest.raises(KeyError, match="unsupported tensor type"):
        K.matvec(w, QType.Q8_K, cuda.to_device(np.zeros(64, np.float32)))


# ----------------------------------------------------------------------------------------------------------------
# The MoE expert block

@in_process
def test_expert_block_matches_swiglu_reference_and_accumulates():
    """Y += wt * down(silu(gate X) * up X), with three different weight types (as in llama.cpp's mixes)."""
    rng = np.random.default_rng(30)
    T, D, F = 3, 32, 5
    types = {"gate": QType.Q8_0, "up": QType.Q4_1, "down": QType.F16}
    gate = random_rows(types["gate"], F, D, rng)  # [F, S_D]
    up = random_rows(types["up"], F, D, rng)  # [F, S_D]
    down = random_rows(types["down"], D, F, rng)  # [D, S_F]
    X = (0.01 * rng.standard_normal((T, D))).astype(np.float32)  # [T, D], small: random blocks have big scales
    wt = rng.random(T).astype(np.float32)  # [T]
    Y0 = rng.standard_normal((T, D)).astype(np.float32)  # [T, D] what earlier experts already added

    Y = cuda.to_device(Y0)
    K.expert_block(cuda.to_device(gate), cuda.to_device(up), cuda.to_device(down), types, cuda.to_device(X),
                   cuda.to_device(wt), Y)

    G, Up, Dn = (Q.dequantize(w, types[n]) for w, n in ((gate, "gate"), (up, "up"), (down, "down")))
    H = silu(X @ G.T) * (X @ Up.T)  # [T, F]
    ref = Y0 + wt[:, None] * (H @ Dn.T)  # [T, D]
    scale = np.abs(Y0) + wt[:, None] * (np.abs(H) @ np.abs(Dn.T))  # [T, D] size of the terms summed
    np.testing.assert_array_less(np.abs(Y.copy_to_host() - ref), 1e-5 * scale + 1e-6)


# ----------------------------------------------------------------------------------------------------------------
# RMSNorm, RoPE, decode attention

@in_process
def test_rmsnorm_matches_reference():
    rng = np.random.default_rng(40)
    X = rng.standard_normal((3, 150)).astype(np.float32)  # [T, n], n > THREADS: strided loops
    w = rng.standard_normal(150).astype(np.float32)  # [n]
    got = K.rmsnorm(cuda.to_device(X), cuda.to_device(w), 1e-6).copy_to_host()
    np.testing.assert_allclose(got, rmsnorm(X, w, 1e-6), rtol=1e-5, atol=1e-6)
    one = K.rmsnorm(cuda.to_device(X[1]), cuda.to_device(w), 1e-6).copy_to_host()  # a single [n] row
    np.testing.assert_allclose(one, rmsnorm(X[1], w, 1e-6), rtol=1e-5, atol=1e-6)
    dX = cuda.to_device(X)
    K.rmsnorm(dX, cuda.to_device(w), 1e-6, out=dX)  # in place (the CUDA backend's q/k norms)
    np.testing.assert_array_equal(dX.copy_to_host(), got)


@in_process
def test_add_bias_matches_reference():
    rng = np.random.default_rng(42)
    Y = rng.standard_normal((3, 150)).astype(np.float32)  # [T, n]
    b = rng.standard_normal(150).astype(np.float32)  # [n]
    dY = cuda.to_device(Y)
    K.add_bias(dY, cuda.to_device(b))
    np.testing.assert_array_equal(dY.copy_to_host(), Y + b)
    with pytest.raises(ValueError, match="add_bias: b has 149 values for rows of 150"):
        K.add_bias(dY, cuda.to_device(b[:149]))


@in_process
@pytest.mark.parametrize("given", ("int", "device"))
@pytest.mark.parametrize("neox", (True, False), ids=("neox", "normal"))
def test_rope_matches_reference(neox, given):
    """Partial rotary (rope_dim 8 of head size 10), tables for the whole context, tokens at positions 2..4."""
    rng = np.random.default_rng(41)
    x = rng.standard_normal((3, 2, 10)).astype(np.float32)  # [T, heads, Dh]
    theta = np.arange(8)[:, None] * 10000.0 ** (-2.0 * np.arange(4) / 8)  # [P, rope_dim / 2]
    cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
    got = K.rope(cuda.to_device(x), cuda.to_device(cos), cuda.to_device(sin), neox, p0=at(2, given)).copy_to_host()
    np.testing.assert_allclose(got, apply_rope(x, cos[2:5], sin[2:5], neox), rtol=1e-6, atol=1e-6)


@in_process
@pytest.mark.parametrize("given", ("int", "device"))
@pytest.mark.parametrize("pos", (0, 6))
def test_decode_attention_matches_reference(pos, given):
    """4 query heads over 2 KV heads (GQA), Dh 8, Dv 6; the cache has 9 rows, garbage after pos (never read)."""
    rng = np.random.default_rng(42 + pos)
    H, G, Dh, Dv, S_max = 4, 2, 8, 6, 9
    q = rng.standard_normal((H, Dh)).astype(np.float32)  # [H, Dh]
    k = rng.standard_normal((S_max, G, Dh)).astype(np.float32)  # [S_max, G, Dh]
    v = rng.standard_normal((S_max, G, Dv)).astype(np.float32)  # [S_max, G, Dv]
    k[pos + 1:], v[pos + 1:] = 1e30, np.nan  # future rows: any read would show
    got = K.decode_attention(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), at(pos, given)).copy_to_host()
    ref = attention(q[None], k[:pos + 1], v[:pos + 1], pos)  # [1, H * Dv]
    np.testing.assert_allclose(got.reshape(1, -1), ref, rtol=1e-5, atol=1e-6)


@in_process
def test_kv_store_writes_the_rows_the_device_names():
    """attention.kv_store (a device step's KV write, its row read from device memory) against its twin: the new
    rows copied exactly, every other row untouched."""
    from pymoe.cuda_kernels.attention import kv_store_reference

    rng = np.random.default_rng(43)
    G, Dh, Dv, S_max, r0 = 2, 8, 6, 9, 5
    k, v = rng.standard_normal((1, G, Dh)).astype(np.float32), rng.standard_normal((1, G, Dv)).astype(np.float32)
    kc, vc = np.full((S_max, G, Dh), 7.0, np.float32), np.full((S_max, G, Dv), 7.0, np.float32)
    kd, vd = cuda.to_device(kc), cuda.to_device(vc)
    K.kv_store(cuda.to_device(k), cuda.to_device(v), kd, vd, at(r0, "device"))
    kv_store_reference(k, v, kc, vc, r0)
    assert (kc[r0] != 7.0).all()  # (the twin wrote the row)
    assert np.array_equal(kd.copy_to_host(), kc) and np.array_equal(vd.copy_to_host(), vc)


# (T, p0, H, G, Dh, Dv, window, sinks, strided V): one token; a chunk at the start; a chunk starting mid-context; a
# window with sinks (gpt-oss); MLA's form (one KV head, V the first Dv values of K's rows, a strided view); over
# THREADS keys and Dv (two key tiles, two output dimensions per thread)
CHUNKS = [(1, 4, 4, 2, 8, 6, 0, False, False), (3, 0, 4, 2, 8, 6, 0, False, False),
          (4, 5, 6, 2, 8, 6, 0, False, False), (4, 5, 4, 2, 8, 6, 3, True, False),
          (3, 2, 4, 1, 10, 6, 0, False, True), (2, 64, 2, 1, 4, 66, 0, False, False)]


@in_process
@pytest.mark.parametrize("T, p0, H, G, Dh, Dv, window, with_sinks, strided", CHUNKS,
                         ids=["T1", "chunk-at-0", "mid-context", "window-sinks", "mla-strided-v", "two-tiles"])
def test_chunk_attention_matches_reference_and_the_decode_kernel(T, p0, H, G, Dh, Dv, window, with_sinks, strided):
    """T queries at positions p0..p0+T-1 in one launch against reference.attention (same tolerance as the decode
    test above: float32 sums of a few terms in another order), and bit-equal to the decode kernel launched once per
    token (decode_attention, or gpt_oss.decode_attention_ws with a window or sinks): the same float32 operations in
    the same order. Cache rows after p0 + T hold 1e30 and NaN: any read of the future would show."""
    from pymoe.cuda_kernels import gpt_oss

    rng = np.random.default_rng(7 + T + p0)
    S_max = p0 + T + 2
    q = rng.standard_normal((T, H, Dh)).astype(np.float32)  # [T, H, Dh]
    k = rng.standard_normal((S_max, G, Dh)).astype(np.float32)  # [S_max, G, Dh]
    v = rng.standard_normal((S_max, G, Dv)).astype(np.float32)  # [S_max, G, Dv]
    k[p0 + T:], v[p0 + T:] = 1e30, np.nan
    sinks = rng.standard_normal(H).astype(np.float32) if with_sinks else None  # [H]
    dk = cuda.to_device(k)
    dv = dk[:, :, :Dv] if strided else cuda.to_device(v)  # MLA: V a view of K's first Dv values
    if strided:
        v = k[:, :, :Dv]
    ds = None if sinks is None else cuda.to_device(sinks)
    got = K.chunk_attention(cuda.to_device(q), dk, dv, p0, window, ds).copy_to_host()  # [T, H, Dv]
    ref = attention(q, k[:p0 + T], v[:p0 + T], p0, window, sinks)  # [T, H * Dv]
    np.testing.assert_allclose(got.reshape(T, -1), ref, rtol=1e-5, atol=1e-6)
    scores = cuda.device_array((H, S_max), np.float32)
    for t in range(T):
        out = cuda.device_array((H, Dv), np.float32)
        if window or with_sinks:
            gpt_oss.decode_attention_ws(cuda.to_device(q[t]), dk, dv, p0 + t, window, ds, out, scores)
        else:
            K.decode_attention(cuda.to_device(q[t]), dk, dv, p0 + t, out=out, scores=scores)
        np.testing.assert_array_equal(got[t], out.copy_to_host())


@in_process
def test_chunk_attention_refuses_what_does_not_fit():
    q, k = cuda.to_device(np.zeros((2, 2, 4), np.float32)), cuda.to_device(np.zeros((5, 1, 4), np.float32))
    with pytest.raises(ValueError, match=r"chunk_attention: positions 4..5 outside the cache of 5 rows"):
        K.chunk_attention(q, k, k, 4)
    with pytest.raises(ValueError, match="chunk_attention: value head size 513 over 512"):
        K.chunk_attention(q, k, cuda.to_device(np.zeros((5, 1, 513), np.float32)), 0)


# ----------------------------------------------------------------------------------------------------------------
# What the simulator cannot check: that Numba's real CUDA target types and lowers every kernel (PTX, no GPU needed)

def compile_every_kernel_to_ptx():
    """Run in a fresh interpreter without the simulator: type and compile every kernel for sm_75."""
    from numba import types as nt

    if not ptx_target():
        return
    from pymoe.cuda_kernels import attention as A, moe as M, norm_rope as N

    u8, f1 = nt.Array(nt.uint8, 2, "C"), nt.Array(nt.float32, 1, "C")
    f2, f3 = nt.Array(nt.float32, 2, "C"), nt.Array(nt.float32, 3, "C")

    jobs = [(quant_matvec.kernel_for(quant_matvec.VERSIONS[v], ROW_PARTIAL=q), (u8, f2, f2))
            for q in Q.FORMATS for v in quant_matvec.VERSIONS]
    jobs += [(quant_matvec.kernel_for(M.gate_up_kernel, GATE_PARTIAL=QType.Q2_K, UP_PARTIAL=QType.Q4_K),
              (u8, u8, f2, f2)),
             (quant_matvec.kernel_for(M.down_kernel, DOWN_PARTIAL=QType.Q3_K), (u8, f2, f1, f2)),
             (N.rmsnorm_kernel, (f2, f1, nt.float32, f2)),
             (N.rope_kernel, (f3, f2, f2, nt.int64, nt.boolean)),
             (N.add_bias_kernel, (f2, f1)),
             (A.decode_attention_kernel, (f2, f3, f3, nt.int64, nt.float32, f2, f2)),
             (A.chunk_attention_kernel, (f3, f3, f3, nt.int64, nt.int64, nt.float32, f1, nt.boolean, f3))]
    # the device decode step's kernels (cuda_kernels/step.py)
    from pymoe.cuda_kernels import step as S
    from pymoe.quant.layout import retarget

    u81, i1, i2 = nt.Array(nt.uint8, 1, "C"), nt.Array(nt.int32, 1, "C"), nt.Array(nt.int32, 2, "C")
    l1, l2 = nt.Array(nt.int64, 1, "C"), nt.Array(nt.int64, 2, "C")
    jobs += [(retarget(S.embed_kernel, cuda.jit, "embed_kernel_Q4_K",
                       DECODE_ROW=quant_matvec.specialise(S.decode_row_into, QType.Q4_K, "cuda")), (u8, i1, f2)),
             (S.add_kernel, (f2, f2)), (S.swiglu_kernel, (f2, f2)), (S.sigmoid_gate_kernel, (f2, f2, f1)),
             (S.route_softmax_kernel, (f2, nt.int64, nt.boolean, nt.float32, i2, f2)),
             (S.route_sigmoid_kernel, (f2, f1, nt.boolean, nt.int64, nt.boolean, nt.float32, i2, f2)),
             (S.argmax_kernel, (f2, i1)),
             (retarget(S.routed_gate_up_kernel, cuda.jit, "routed_gate_up_Q2_K_Q4_K", ACTIVATE=S.silu_times,
                       GATE_PARTIAL=quant_matvec.row_partial_for(QType.Q2_K),
                       UP_PARTIAL=quant_matvec.row_partial_for(QType.Q4_K)),
              (u8, u81, i1, l2, l1, l1, i2, f2, f2, f2, f2)),
             (retarget(S.routed_down_kernel, cuda.jit, "routed_down_Q3_K",
                       DOWN_PARTIAL=quant_matvec.row_partial_for(QType.Q3_K)),
              (u8, u81, i1, l2, l1, l1, i2, f2, f2, f2, f2))]
    # gpt-oss's (cuda_kernels/gpt_oss.py)
    from pymoe.cuda_kernels import gpt_oss as O

    jobs += [(O.decode_attention_ws_kernel, (f2, f3, f3, nt.int64, nt.int64, nt.float32, f1, nt.boolean, f2, f2)),
             (O.decode_attention_ws_kernel, (f2, f3, f3, nt.int64, nt.int64, nt.float32, nt.Array(nt.float32, 1, "A"),
                                             nt.boolean, f2, f2)),  # no sinks: a column of the scores stands in
             (O.route_softmax_weight_kernel, (f2, f1, nt.boolean, nt.int64, i2, f2)),
             (retarget(S.routed_gate_up_kernel, cuda.jit, "routed_gate_up_oai_Q2_K_Q4_K", BIASED=True,
                       ACTIVATE=O.swiglu_oai, GATE_PARTIAL=quant_matvec.row_partial_for(QType.Q2_K),
                       UP_PARTIAL=quant_matvec.row_partial_for(QType.Q4_K)),
              (u8, u81, i1, l2, l1, l1, i2, f2, f2, f2, f2)),
             (retarget(S.routed_down_kernel, cuda.jit, "routed_down_oai_Q3_K", BIASED=True,
                       DOWN_PARTIAL=quant_matvec.row_partial_for(QType.Q3_K)),
              (u8, u81, i1, l2, l1, l1, i2, f2, f2, f2, f2))]
    # DeepSeek's (cuda_kernels/mla.py, route_groups.py), and decode attention with V a strided view of the MLA cache
    from pymoe.cuda_kernels import mla as MLA, route_groups as RG

    f3a = nt.Array(nt.float32, 3, "A")  # any layout: V = the cache rows' first kv_lora_rank values
    jobs += [(MLA.mla_kv_row_kernel, (f2, f1, nt.float32, f2, f2, nt.int64, nt.boolean, f3, nt.int64)),
             (MLA.mla_query_kernel, (f3, f3, f2, f2, nt.int64, nt.boolean, nt.float32, f3)),
             (MLA.mla_value_kernel, (f3, f3, f3)),
             (MLA._for(MLA.mla_query_q_kernel, QType.Q8_0), (f3, u8, f2, f2, nt.int64, nt.boolean, nt.float32, f3)),
             (MLA._for(MLA.mla_query_q_at_kernel, QType.F16), (f3, u8, f2, f2, i1, nt.boolean, nt.float32, f3)),
             (MLA._for(MLA.mla_value_q_kernel, QType.Q4_K), (f3, u8, f3)),
             (RG.route_groups_kernel, (f2, f1, nt.boolean, nt.boolean, nt.int64, nt.int64, nt.int64, nt.boolean,
                                       nt.float32, i2, f2)),
             (A.decode_attention_kernel, (f2, f3, f3a, nt.int64, nt.float32, f2, f2)),
             (A.chunk_attention_kernel, (f3, f3, f3a, nt.int64, nt.int64, nt.float32, f1, nt.boolean, f3))]
    # Gated DeltaNet's decode step and gated attention (cuda_kernels/deltanet.py, gated_attention.py)
    from pymoe.cuda_kernels import deltanet as DN, gated_attention as GA

    jobs += [(DN.conv_step_kernel, (f1, f2, f2, f1)),
             (DN.rule_step_kernel, (f1, f1, f1, f1, f1, f1, f1, f3, f1, nt.int64, nt.boolean, nt.float32)),
             (DN.conv_chunk_kernel, (f2, f2, f2, f2)),
             (DN.rule_chunk_kernel, (f2, f2, f2, f2, f1, f1, f1, f3, f2, nt.int64, nt.boolean, nt.float32)),
             (GA.split_gate_kernel, (f2, f2, f2, nt.int64)), (GA.gate_output_kernel, (f2, f2))]
    # the device draw (cuda_kernels/sample.py)
    from pymoe.cuda_kernels import sample as SA

    jobs += [(SA.sample_kernel, (f2, nt.Array(nt.uint32, 2, "C"), nt.Array(nt.int32, 1, "A"),  # draw_k, draw_f:
                                 nt.Array(nt.float64, 1, "A"), i1))]  # views of the step's `at` record
    for kernel, sig in jobs:
        compile_kernel(kernel, sig)


# the kernels compile_every_kernel_to_ptx compiles: two versions of the mat-vec per format and 7 more, + step.py's 9,
# gpt_oss.py's 5, MLA's and groups' 9 (chunk attention with MLA's strided V among them; k_b and v_b in their stored
# type: 3), deltanet.py's and gated_attention.py's 6 (the chunk's conv and rule: 2), sample.py's 1
test_every_kernel_compiles_for_a_real_gpu = ptx_test(
    compile_every_kernel_to_ptx, 2 * len(Q.FORMATS) + 7 + 9 + 5 + 9 + 6 + 1,
    "What the simulator cannot check: that Numba's real CUDA target types and lowers every kernel.")


if not IN_PROCESS:  # numba.cuda is in the other mode in this process (tests/cuda_sim.py)
    test_this_file_in_a_fresh_interpreter = fresh_interpreter_test(__file__)

