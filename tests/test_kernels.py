"""The fused CPU kernels (pymoe.quant.kernels) against their NumPy reference `dequantize(w) @ x`, for every format.

What this is: matvec (one token) and matmul (T tokens) on odd shapes (rows not a multiple of the 8-row task, 1 to 3
blocks per row, odd float widths, partial decode chunks), plus the input errors callers can make.
Tolerance, scale-aware: the kernel and the float32 reference each sum C products in float32, in different orders,
so each is within C * u * sum_i |w_i x_i| of the exact result (u = 2^-24, the standard bound for recursive
summation; SIMD or pairwise orders only do better), and they are within twice that of each other. Compilation of a
format's two kernels takes ~2 s once; later runs load them from Numba's cache.
What this is not: the dequantization oracle (tests/test_dequant.py).
"""
import numpy as np
import pytest

import pymoe.quant as Q
from pymoe.quant import QType
from quant_helpers import random_rows

FORMATS = sorted(Q.FORMATS.values(), key=lambda f: f.name)
IDS = [f.name for f in FORMATS]
U = 2.0 ** -24  # float32 unit roundoff


def widths(fmt):
    """Row widths C to try: 1, 2 and 3 blocks; floats get odd widths and one past a 256-value decode chunk."""
    if fmt.block_size == 1:
        return (7, 33, 300)
    return tuple(n * fmt.block_size for n in (1, 2, 3))


def assert_close_to_reference(got, w_deq, x):
    """got ~ w_deq @ x (x [C] or [C, T]) within 2 C u sum|w x|, elementwise."""
    ref = w_deq @ x  # float32 reference
    bound = 2 * w_deq.shape[1] * U * (np.abs(w_deq) @ np.abs(x))  # float64 not needed: a bound, not a result
    err = np.abs(got - ref)
    assert (err <= bound + np.finfo(np.float32).tiny).all(), f"max err {err.max()}, bound there {bound.ravel()[err.argmax()]}"


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_matvec_and_matmul_match_reference(fmt):
    rng = np.random.default_rng(4)
    for rows in (3, 17, 33):
        for cols in widths(fmt):
            w = random_rows(fmt.qtype, rows, cols, rng)  # [R, row_bytes]
            w_deq = Q.dequantize(w, fmt.qtype)  # [R, C]

            x = rng.standard_normal(cols).astype(np.float32)  # [C]
            y = Q.matvec(w, fmt.qtype, x)  # [R]
            assert y.shape == (rows,) and y.dtype == np.float32
            assert_close_to_reference(y, w_deq, x)

            for tokens in (1, 5):
                X = rng.standard_normal((tokens, cols)).astype(np.float32)  # [T, C]
                Y = Q.matmul(w, fmt.qtype, X)  # [T, R]
                assert Y.shape == (tokens, rows) and Y.dtype == np.float32
                assert_close_to_reference(Y.T, w_deq, X.T)


def test_float_weights_are_accepted_as_gguf_reader_gives_them():
    """F32 comes as float32 [R, C] and F16 as float16 [R, C]: same result as their raw bytes."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((5, 33)).astype(np.float32)  # [R, C]
    x = rng.standard_normal(33).astype(np.float32)  # [C]
    for qtype, values in ((QType.F32, w), (QType.F16, w.astype(np.float16))):
        y_values = Q.matvec(values, qtype, x)
        y_bytes = Q.matvec(values.view(np.uint8), qtype, x)
        assert np.array_equal(y_values, y_bytes)
        assert_close_to_reference(y_values, values.astype(np.float32), x)


def test_read_only_and_strided_inputs():
    """GGUF tensors are read-only mmap views; a row slice with a step is not contiguous: both must work."""
    rng = np.random.default_rng(6)
    w = random_rows(QType.Q8_0, 10, 64, rng)  # [R, row_bytes]
    x = rng.standard_normal(64).astype(np.float32)  # [C]
    expected = Q.matvec(w, QType.Q8_0, x)
    w_ro = w.copy()
    w_ro.flags.writeable = False
    assert np.array_equal(Q.matvec(w_ro, QType.Q8_0, x), expected)
    assert np.array_equal(Q.matvec(w[::2], QType.Q8_0, x), expected[::2])
    assert np.array_equal(Q.matvec(w, QType.Q8_0, x.astype(np.float64)), expected)  # x cast to float32


def test_input_errors_are_clear():
    rng = np.random.default_rng(7)
    w = random_rows(QType.Q4_0, 4, 64, rng)  # [4, 36]
    with pytest.raises(ValueError, match=r"x must have shape \(64,\)"):
        Q.matvec(w, QType.Q4_0, np.zeros(63, np.float32))
    with pytest.raises(ValueError, match=r"X must have shape \(T, 64\)"):
        Q.matmul(w, QType.Q4_0, np.zeros(64, np.float32))  # 1-D X
    with pytest.raises(ValueError, match=r"X must have shape \(T, 64\)"):
        Q.matmul(w, QType.Q4_0, np.zeros((2, 32), np.float32))
    with pytest.raises(ValueError, match="whole blocks"):
        Q.matvec(w[:, :35], QType.Q4_0, np.zeros(64, np.float32))
    with pytest.raises(ValueError, match="2-D"):
        Q.matvec(w.ravel(), QType.Q4_0, np.zeros(64, np.float32))
    with pytest.raises(ValueError, match="raw uint8"):
        Q.matvec(np.zeros((4, 64), np.float32), QType.Q4_0, np.zeros(64, np.float32))
    with pytest.raises(KeyError, match="unsupported tensor type"):
        Q.matvec(w, QType.Q8_K, np.zeros(64, np.float32))  # Q8_K: llama.cpp's activation type, never a weight


def test_empty_shapes():
    w = np.zeros((0, 18), np.uint8)  # no rows of Q4_0
    assert Q.matvec(w, QType.Q4_0, np.zeros(32, np.float32)).shape == (0,)
    w = random_rows(QType.Q4_0, 3, 32, np.random.default_rng(8))
    assert Q.matmul(w, QType.Q4_0, np.zeros((0, 32), np.float32)).shape == (0, 3)
