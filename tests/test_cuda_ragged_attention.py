"""cuda_kernels/ragged_attention.py in Numba's CUDA simulator: B sequences' decode attention in one launch, each row
over its own cache (a row of one pool) of its own length, against its NumPy twin and bit for bit against the
chunk-attention kernel run alone on that row's cache (itself bit-equal to the decode kernels: test_cuda_kernels.py);
and the CUDA backend's device KV caches as the rows of one pool, which is what the kernel reads.
"""
from cuda_sim import IN_PROCESS, fresh_interpreter_test, in_process  # first: the simulator on


import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402
from cuda_ptx import compile_kernel, ptx_target, ptx_test  # noqa: E402

pytestmark = pytest.mark.cuda

MiB = 2**20

# (H, G, Dh, Dv, positions per row, caches read per row, window, sinks, strided V): three sequences of different
# lengths; two rows on one cache and a cache nobody reads; a window with sinks (gpt-oss); MLA's form (one KV head,
# V the first Dv values of K's rows, a strided view); over THREADS keys and Dv (two tiles, two outputs per thread)
CASES = [(4, 2, 8, 6, (0, 5, 2), (0, 1, 2), 0, False, False),
         (4, 2, 8, 6, (3, 1), (2, 2), 0, False, False),
         (4, 2, 8, 6, (6, 2, 4), (1, 0, 3), 3, True, False),
         (4, 1, 10, 6, (4, 0), (1, 0), 0, False, True),
         (2, 1, 4, 66, (70, 3), (0, 1), 0, False, False)]


@in_process
@pytest.mark.parametrize("H, G, Dh, Dv, pos, seqs, window, with_sinks, strided", CASES,
                         ids=["three-lengths", "one-cache-twice", "window-sinks", "mla-strided-v", "two-tiles"])
def test_ragged_attention_matches_its_twin_and_each_row_alone(H, G, Dh, Dv, pos, seqs, window, with_sinks, strided):
    """Against the twin (reference.attention per row): float32 sums of a few terms in another order, the tolerance
    of test_cuda_kernels.py's attention tests; against chunk_attention on the row's own cache at its position:
    equal bits (the same float32 operations in the same order). Rows past each row's position hold 1e30 and NaN
    in every cache: a read of the future, or of another row's cache, would show."""
    from pymoe.cuda_kernels import attention as A
    from pymoe.cuda_kernels.ragged_attention import ragged_decode_attention, ragged_decode_attention_reference

    rng = np.random.default_rng(11 + sum(pos))
    B, S, S_max = len(pos), 4, max(pos) + 3
    q = rng.standard_normal((B, H, Dh)).astype(np.float32)  # [B, H, Dh]
    k = np.full((S, S_max, G, Dh), 1e30, np.float32)  # [S, S_max, G, Dh]: the pool, future rows poisoned
    v = np.full((S, S_max, G, Dv), np.nan, np.float32)
    for c in range(S):
        n = max([p + 1 for p, s in zip(pos, seqs) if s == c], default=0)  # what the rows on cache c have written
        k[c, :n] = rng.standard_normal((n, G, Dh))
        v[c, :n] = rng.standard_normal((n, G, Dv))
    if strided:
        v = k[..., :Dv]
    sinks = rng.standard_normal(H).astype(np.float32) if with_sinks else None  # [H]
    dk = cuda.to_device(k)
    dv = dk[..., :Dv] if strided else cuda.to_device(v)
    ds = None if sinks is None else cuda.to_device(sinks)
    dseqs, dpos = cuda.to_device(np.array(seqs, np.int32)), cuda.to_device(np.array(pos, np.int32))
    got = ragged_decode_attention(cuda.to_device(q), dk, dv, dseqs, dpos, window, ds).copy_to_host()  # [B, H, Dv]
    want = ragged_decode_attention_reference(q, k, v, seqs, pos, window, sinks)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for b, (p, c) in enumerate(zip(pos, seqs)):
        alone = A.chunk_attention(cuda.to_device(q[b][None]), dk[c], dv[c], p, window, ds).copy_to_host()
        np.testing.assert_array_equal(got[b], alone[0])


@in_process
def test_ragged_attention_refuses_what_does_not_fit():
    from pymoe.cuda_kernels.ragged_attention import ragged_decode_attention

    q, k = cuda.to_device(np.zeros((2, 2, 4), np.float32)), cuda.to_device(np.zeros((3, 5, 1, 4), np.float32))
    one = cuda.to_device(np.zeros(1, np.int32))
    with pytest.raises(ValueError, match=r"seqs \(1,\) and pos \(1,\) must have one entry per row \(2\)"):
        ragged_decode_attention(q, k, k, one, one)
    with pytest.raises(ValueError, match="seqs must be int32 with 1 dimensions, got int64"):
        ragged_decode_attention(q, k, k, cuda.to_device(np.zeros(2, np.int64)), cuda.to_device(np.zeros(2, np.int32)))


@in_process
def test_the_device_kv_caches_are_rows_of_one_pool(tiny_model):
    """backends/cuda.py: the sequences' device KV caches are slices of one pool per plane ([S, L_kv, n_ctx, G, Dh]),
    so a layer's caches of every sequence are one array the ragged kernel reads (pool[:, row]); what a sequence's
    prefill writes lands in its own slice only."""
    import pymoe

    path = tiny_model("qwen3moe", "q2_k")
    engine = pymoe.load(path, backend="cuda", backend_options=dict(kernels="reference", free_bytes=764 * MiB),
                        cache="none", sequences=3, n_ctx=32)
    b = engine.backend
    k_pool, v_pool = b.kv_pool
    assert k_pool.shape[0] == 3 and len(b._kvs) == 3
    kvs = [engine.model.new_kv(32) for _ in range(3)]
    k_pool.copy_to_device(np.zeros(k_pool.shape, np.float32))  # (device memory starts as whatever was there)
    engine.model.prefill([5, 17, 42], kvs[1])
    pool = k_pool.copy_to_host()  # [S, L_kv, n_ctx, G, Dh]
    assert np.abs(pool[1, :, :3]).sum() > 0 and not pool[0].any() and not pool[2].any()
    for s, kv in enumerate(kvs):
        np.testing.assert_array_equal(kv.k.copy_to_host(), pool[s])
    np.testing.assert_array_equal(kvs[1].v.copy_to_host(), v_pool.copy_to_host()[1])


def compile_to_ptx():
    """Run in a fresh interpreter without the simulator: type and compile the kernel for sm_75, the cache planes
    contiguous (a test's) and strided (a layer's rows of the pool, pool[:, row]; MLA's V a view of K)."""
    from numba import types as nt

    if not ptx_target():
        return
    from pymoe.cuda_kernels.ragged_attention import ragged_decode_attention_kernel as kernel

    f1, f3, i1 = nt.Array(nt.float32, 1, "C"), nt.Array(nt.float32, 3, "C"), nt.Array(nt.int32, 1, "C")

    for planes in (nt.Array(nt.float32, 4, "C"), nt.Array(nt.float32, 4, "A")):
        compile_kernel(kernel, (f3, planes, planes, i1, i1, nt.int64, nt.float32, f1, nt.boolean, f3))


test_the_kernel_compiles_for_a_real_gpu = ptx_test(
    compile_to_ptx, 2, "What the simulator cannot check: that Numba's real CUDA target types and lowers the kernel "
                       "(its cache planes contiguous and strided).")


if not IN_PROCESS:
    test_this_file_in_a_fresh_interpreter = fresh_interpreter_test(__file__)

