"""The 8-row repacked layouts of Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_0, MXFP4 and IQ4_XS (pymoe/quant/repack.py), the
decoded layout of IQ1-IQ3 (prefill's scratch tiles), and the CPU backend's use of them.

What this is: the layout against its NumPy reference and its inverse (the raw bytes come back); the tile dot against
the one-row and multi-row dots of the same rows, bit for bit (the repacked layout exists to be faster, never to
change a result: its numerics are qact's `exact_blocks`), and against float math within the integer path's bound
(tests/test_kernels_qact.py); its other forms (portable IR, AVX2, VNNI) against it; the fused MoE kernel and the dense
products with and without repacked copies, bit for bit, with a check that the copies are what was read; a Q4_K_M file
made by llama.cpp's quantizer decoded with and without repacking, bit for bit, and one MXFP4_MOE file likewise.
What this is not: a speed test (bench/bench_forward.py with PYMOE_REPACK=0/1; docs/performance.md "Repacked 8-row tiles").
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from numba import njit

import pymoe
import pymoe.quant as Q
from oracle import require_llama_cpp
from pymoe.backends.cpu import CPUBackend
from pymoe.quant import QType, dequantize, kernels, qact, repack
from quant_helpers import random_rows

U = 2.0 ** -24


TILED = [QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q8_0, QType.MXFP4, QType.IQ4_XS]
IDS = [q.name for q in TILED]


@pytest.mark.parametrize("qtype", TILED, ids=IDS)
def test_repack_is_the_reference_layout_and_comes_back(qtype):
    rng = np.random.default_rng(0)
    raw = random_rows(qtype, 24, 768, rng)  # [24, 3 * RAW]: every byte random (all scale bits, all nibbles)
    tiles = repack.repack(raw, qtype)
    assert tiles.shape == (3, 3 * repack.TILE_BYTES[qtype])
    assert np.array_equal(tiles, repack.repack_ref(raw, qtype))
    assert np.array_equal(repack.unpack(tiles, qtype), raw)
    with pytest.raises(ValueError, match="8-row tiles"):
        repack.repack(raw[:12], qtype)
    assert repack.fits(qtype, 16, 512) and not repack.fits(qtype, 12, 512) and not repack.fits(qtype, 16, 100)


def test_q4_k_tiles_hold_the_decoders_scales():
    """Q4_K's 6-bit scales and mins are unpacked into the tile (the one part that is not a byte copy): each is
    the value kquants.get_scale_min decodes for its row and sub-block."""
    from pymoe.quant.kquants import get_scale_min

    raw = random_rows(QType.Q4_K, 8, 256, np.random.default_rng(1))
    t = repack.repack(raw, QType.Q4_K)[0]
    for r in range(8):
        for j in range(8):
            assert (t[32 + 8 * j + r], t[96 + 8 * j + r]) == get_scale_min(raw[r], 4, j)
    assert not repack.fits(QType.Q4_0, 16, 512)  # no layout


def _x8(X, qtype=QType.Q4_K):
    """X at 8 bits in the layout a weight of this type takes (qact.act_group: per 32 values for Q8_0, MXFP4)."""
    return qact.quantize_for(np.ascontiguousarray(X, dtype=np.float32), qtype, 8)


@pytest.mark.parametrize("qtype", TILED, ids=IDS)
@pytest.mark.parametrize("R, C", [(8, 256), (64, 1024), (40, 512)])
def test_tile_dot_has_the_bits_of_the_row_dots(qtype, R, C):
    """Each of a tile's 8 results, for one token alone or among MANY, is bit for bit the one-row dot of its row and
    the multi-row dot's (prefill), and within float32 rounding of dequantize(w) @ dequantize(x): the integer sums are exact, then a few float
    operations per block or group (4 C u sum|w x|, tests/test_kernels_qact.py)."""
    rng = np.random.default_rng(R + C)
    raw = random_rows(qtype, R, C, rng)
    T = repack.MANY + 3  # the prefill form: one many-token call, then 3 tokens one by one
    X = rng.standard_normal((T, C)).astype(np.float32)
    xq, xd, xbs = _x8(X, qtype)
    tiles = repack.repack(raw, qtype)
    w_deq = dequantize(raw, qtype).reshape(R, C).astype(np.float64)
    x_deq = qact.dequantize_act(xq, xd).astype(np.float64)  # [T, C]
    rows = np.empty((T, R), np.float32)
    acc = np.empty((T, 16), np.float32)
    for r in range(R):
        qact.ACT_DOTS_ROWS[qtype](raw[r], xq, xd, xbs, acc, rows[:, r])
    many = repack.tile_matmul(tiles, qtype, xq, xd, xbs)  # [T, R]
    for t in range(T):
        y = repack.tile_matmul(tiles, qtype, xq[t:t + 1], xd[t:t + 1], xbs[t:t + 1])[0]
        assert np.array_equal(y, many[t])
        one = np.array([qact.ACT_DOTS[qtype](raw[r], xq[t], xd[t], xbs[t]) for r in range(R)], np.float32)
        assert np.array_equal(y, one) and np.array_equal(y, rows[t])
        bound = 4 * C * U * (np.abs(w_deq) @ np.abs(x_deq[t]))
        assert (np.abs(y - w_deq @ x_deq[t]) <= bound).all()


@pytest.mark.parametrize("types", [(QType.Q4_K, QType.Q4_K, QType.Q6_K), (QType.Q2_K, QType.Q3_K, QType.IQ4_XS),
                                   (QType.Q8_0, QType.MXFP4, QType.Q8_0)],
                         ids=lambda t: "-".join(q.name for q in t))
def test_three_matrix_decode_call_has_the_bits_of_three_calls(types):
    """repack.tile_matvec3 (a decode step's q, k and v in one call; row counts not multiples of a task's 32 rows)
    gives each matrix tile_matmul's one-token bits."""
    rng = np.random.default_rng(3)
    C = 512
    raws = [random_rows(q, R, C, rng) for q, R in zip(types, (72, 48, 40))]  # 9, 6, 5 row-groups: tasks of 4 and less
    tiles = [repack.repack(r, q) for r, q in zip(raws, types)]
    xq, xd, xbs = _x8(rng.standard_normal((1, C)).astype(np.float32), types[0])  # (the three take one layout)
    got = repack.tile_matvec3(tiles, types, xq, xd, xbs)
    for y, t, q in zip(got, tiles, types):
        assert np.array_equal(y, repack.tile_matmul(t, q, xq, xd, xbs))


@pytest.mark.parametrize("types", [(QType.Q4_K, QType.Q4_K, QType.Q6_K), (QType.Q2_K, QType.Q3_K, QType.Q5_K),
                                   (QType.Q8_0, QType.MXFP4, QType.Q8_0), (QType.IQ4_XS, QType.IQ4_XS, QType.IQ4_XS)],
                         ids=lambda t: "-".join(q.name for q in t))
def test_two_plane_decode_calls_have_the_bits_of_one_token_calls(types):
    """A token's two planes (qact.quantize_planes_ref: xq int8 [2, C]) through the two-row tile dot (repack.TILE_DOTS2:
    tile_matmul's last two rows, tile_matvec3's q, k, v) give, row by row, the one-token call's bits on each plane."""
    rng = np.random.default_rng(5)
    C = 512
    raws = [random_rows(q, R, C, rng) for q, R in zip(types, (72, 48, 40))]
    tiles = [repack.repack(r, q) for r, q in zip(raws, types)]
    xq, xd, xbs = qact.quantize_for(rng.standard_normal((1, C)).astype(np.float32), types[0], qact.PLANES)  # [2, C]
    assert xq.shape == (2, C) and xq.dtype == np.int8
    alone = [np.concatenate([repack.tile_matmul(t, q, xq[i:i + 1], xd[i:i + 1], xbs[i:i + 1]) for i in range(2)])
             for t, q in zip(tiles, types)]  # [2, R] one one-token call per plane
    for y, want, t, q, raw in zip(repack.tile_matvec3(tiles, types, xq, xd, xbs), alone, tiles, types, raws):
        assert np.array_equal(y, want)
        assert np.array_equal(repack.tile_matmul(t, q, xq, xd, xbs), want)
        assert np.array_equal(kernels.matmul_act(raw, q, np.zeros((1, C), np.float32), qact.PLANES, xact=(xq, xd, xbs)),
                              want[:1] + want[1:])  # the raw rows' product: the planes' sum


def _extreme_rows(qtype) -> np.ndarray:
    """8 rows of 256 weights at the largest integer magnitude of the format: every quant bit set (Q2_K q = 3, Q3_K
    q' = 7, Q4_K q = 15, Q5_K q = 31, Q6_K q' = 63) with the largest scales (and mins); MXFP4 level 12 in rows 0-3
    (nibbles 7), -12 in rows 4-7 (nibbles 15); IQ4_XS level -127 (nibbles 0) at scale -32 (6-bit field 0) in rows
    0-3, level 113 (nibbles 15) at scale 31 in rows 4-7; Q8_0 weight 127 in rows 0-3, -128 in rows 4-7."""
    if qtype == QType.Q8_0:
        raw = np.full((8, 8, 34), 127, np.uint8)
        raw[4:, :, 2:] = 0x80  # -128
        raw[:, :, 0:2] = np.frombuffer(np.array([0.5], np.float16).tobytes(), np.uint8)  # d 0.5
        return raw.reshape(8, 272)
    if qtype == QType.IQ4_XS:
        raw = np.zeros((8, 136), np.uint8)
        raw[:, 0:2] = np.frombuffer(np.array([0.5], np.float16).tobytes(), np.uint8)  # d 0.5
        raw[4:, 2:] = 0xFF  # rows 4-7: every scale bit and nibble set
        return raw
    if qtype == QType.MXFP4:
        raw = np.full((8, 8, 17), 0x77, np.uint8)
        raw[4:] = 0xFF
        raw[:, :, 0] = 127  # scale 2^-1
        return raw.reshape(8, 136)
    raw = np.full((8, Q.get_format(qtype).type_size), 0xFF, np.uint8)
    half = np.frombuffer(np.array([0.5], np.float16).tobytes(), np.uint8)
    at = {QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,)}[qtype]
    for off in at:  # d (and dmin) 0.5
        raw[:, off:off + 2] = half
    if qtype == QType.Q6_K:
        raw[:, 192:208] = 127  # int8 scales at their largest
    return raw


# The forms of the tile dot this machine can compile: the portable IR (CPUs without AVX2) always; AVX2's intrinsics,
# VNNI's (vpdpbusd on 256 bits: AVX-512 VNNI or AVX-VNNI) and the wide one (512 bits, two chunks an operation: Q4_K,
# Q5_K and IQ4_XS on AVX-512 VNNI) where the CPU has them (LLVM cannot select them elsewhere).
# Each with the one-token dot's prefetch hints as this CPU has them (repack.STREAM_AHEAD, at the dense weights'
# locality), and this CPU's own form again without hints (PYMOE_STREAM_AHEAD=0): hints must not change a bit.
FORMS = [("portable", dict(portable=True))] + ([("avx2", dict(vnni=False))] if qact._AVX2 else []) + (
    [("vnni", dict(vnni=True, wide=False))] if repack._VNNI else []) + (
    [("vnni-wide", dict(vnni=True, wide=True))] if repack._WIDE else []) + [
    ("no hints", dict(ahead=0))]
_RUNNERS = {}


def _form(qtype, form, tiles, xq, xd, xbs):
    """One form of the tile dot over every row-group: -> (one-token results of token 0 float32 [R], many-token
    results float32 [MANY, R]); xq etc. have MANY rows. One compiled runner per (format, form), for both tests."""
    run = _RUNNERS.get((qtype, form))
    if run is None:
        dot = repack._make_tile_dot(qtype, **dict(FORMS)[form])

        @njit
        def run(tiles, xq, xd, xbs, y, y4):
            for g in range(tiles.shape[0]):
                dot(tiles[g], xq[0], xd[0], xbs[0], y[g * 8:(g + 1) * 8])
                dot(tiles[g], xq, xd, xbs, y4[g])  # the many-token form: [MANY, 8]

        _RUNNERS[(qtype, form)] = run
    G = tiles.shape[0]
    y, y4 = np.empty(8 * G, np.float32), np.empty((G, repack.MANY, 8), np.float32)
    run(tiles, xq, xd, xbs, y, y4)
    return y, y4.transpose(1, 0, 2).reshape(repack.MANY, 8 * G)


@pytest.mark.parametrize("qtype", TILED, ids=IDS)
def test_tile_dot_at_the_int16_bound(qtype):
    """Every weight at the format's largest magnitude and every activation +-127: a group's int16 lanes reach their
    bound (Q2_K 3048, Q3_K 7112, Q4_K 8 * 2 * 15 * 127 = 30480, Q5_K half a sub-block's 4 * 2 * 31 * 127 = 31496, Q6_K 2 * 2 *
    63 * 127 = 32004, MXFP4 8 * 2 * 12 * 127 = 24384, IQ4_XS one chunk's 2 * 127 * 127 = 32258, Q8_0 one chunk's 2 * 128
    * 127 = 32512, all below 2^15); the tile still has the row dot's bits, and float math's value, in every form this
    CPU compiles (the int16 lanes are the AVX2 and portable forms'), for one token and for MANY."""
    raw = _extreme_rows(qtype)
    tiles = repack.repack(raw, qtype)
    for sign in (1, -1):
        X = np.full((repack.MANY, 256), sign * 126.75, np.float32)  # d = 1 (the power of two above 126.75 / 127)
        xq, xd, xbs = _x8(X, qtype)
        assert np.abs(xq).min() == 127  # q = +-127
        y = repack.tile_matmul(tiles, qtype, xq[:1], xd[:1], xbs[:1])[0]
        one = [qact.ACT_DOTS[qtype](raw[r], xq[0], xd[0], xbs[0]) for r in range(8)]
        want = dequantize(raw, qtype).reshape(8, 256).astype(np.float64) @ qact.dequantize_act(xq, xd)[0]
        assert np.array_equal(y, one) and np.allclose(y, want, rtol=1e-6, atol=0)  # rtol: float32 rounding of
        for form, _ in FORMS:  # the block's integer sum (up to 2^28) and of d * dx, a few 2^-24 each
            y1, y4 = _form(qtype, form, tiles, xq, xd, xbs)
            assert np.array_equal(y1, y) and all(np.array_equal(r, y) for r in y4), form




@pytest.mark.parametrize("form", [f for f, _ in FORMS])
@pytest.mark.parametrize("qtype", TILED, ids=IDS)
def test_every_form_of_the_tile_dot_has_the_same_bits(qtype, form):
    """Each form against the one this machine runs (tile_matmul): the portable IR (vpmaddubsw, vpmaddwd, vpsignb,
    vpshufb as plain IR), AVX2 (int16 pair sums, then vpmaddwd with the scales), VNNI (each row's 4 products
    straight into int32 by vpdpbusd, the scales by an int32 multiply) and wide VNNI (two chunks in 16 int32 lanes,
    the halves added) reach the same integers by different instructions, then do the same float operations: the
    same bits, for one token and for MANY."""
    rng = np.random.default_rng(3)
    raw = random_rows(qtype, 16, 512, rng)
    xq, xd, xbs = _x8(rng.standard_normal((repack.MANY, 512)), qtype)
    tiles = repack.repack(raw, qtype)
    a, a4 = _form(qtype, form, tiles, xq, xd, xbs)
    here = repack.tile_matmul(tiles, qtype, xq, xd, xbs)  # [MANY, 16]
    assert np.array_equal(a, here[0]) and np.array_equal(a4, here)


def test_prefetch_hints_follow_the_cpu_and_the_environment(monkeypatch):
    """The prefetch hint of the experts' one-token dots (qact._stream_locality: read once a token) and of the dense
    weights' (qact._dense_locality: read again next token), per CPU as measured (Zen 4: both into L2, prefetcht1;
    other AMD Zen: the experts' non-temporal; elsewhere prefetcht0) and as the environment forces it; and the dots
    compiled here ask with them (llvm.prefetch's locality in their IR). Hints change no bit (the forms above), so a
    wrong one shows only here and in bench/stream_ahead.py."""
    for var in ("PYMOE_STREAM_LOCALITY", "PYMOE_NT", "PYMOE_DENSE_LOCALITY"):
        monkeypatch.delenv(var, raising=False)
    for cpu, stream, dense in (("znver4", 2, 2), ("znver5", 0, 3), ("sapphirerapids", 3, 3)):
        monkeypatch.setattr(qact, "host_cpu_name", lambda cpu=cpu: cpu)
        assert (qact._stream_locality(), qact._dense_locality()) == (stream, dense), cpu
    for env, stream in (({"PYMOE_NT": "1"}, 0), ({"PYMOE_NT": "0"}, 3),
                        ({"PYMOE_NT": "0", "PYMOE_STREAM_LOCALITY": "1"}, 1)):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert qact._stream_locality() == stream, env
    monkeypatch.setenv("PYMOE_DENSE_LOCALITY", "1")
    assert qact._dense_locality() == 1
    if not repack.STREAM_AHEAD:
        return
    assert _dot_hints() == {"stream": {qact.STREAM_LOCALITY}, "dense": {qact.DENSE_LOCALITY}}
    # and with both forced to values no CPU's default has, in a fresh interpreter (the dots are built at import):
    # a dot that takes the other's hint, or a fixed one, shows here on any CPU
    env = dict(os.environ, PYMOE_STREAM_LOCALITY="1", PYMOE_DENSE_LOCALITY="2")
    env.pop("PYMOE_NT", None)
    code = "import test_repack as t; print(sorted((k, sorted(v)) for k, v in t._dot_hints().items()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=os.path.dirname(os.path.abspath(__file__)),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[('dense', [2]), ('stream', [1])]", out.stdout


def _dot_hints() -> dict:
    """The prefetch localities (llvm.prefetch's third argument) in the IR of the Q4_K one-token tile dot compiled
    for the experts (repack.TILE_DOTS_STREAM) and for the dense weights (repack.TILE_DOTS): {"stream": {...},
    "dense": {...}}."""
    out = {}
    for which, dots in (("stream", repack.TILE_DOTS_STREAM), ("dense", repack.TILE_DOTS)):
        dot = dots[QType.Q4_K]

        @njit
        def one(tiles, xq, xd, xbs, out):
            dot(tiles, xq, xd, xbs, out)

        C = 256
        one(np.zeros(repack.TILE_BYTES[QType.Q4_K], np.uint8), *(a[0] for a in _x8(np.ones((1, C)))),
            np.zeros(8, np.float32))
        ir_text = next(iter(one.inspect_llvm().values()))
        hints = re.findall(r"call void @llvm\.prefetch[.\w]*\([^,]+, i32 0, i32 (\d), i32 1\)", ir_text)
        out[which] = {int(h) for h in hints}
    return out


_PAIR_RUNNERS = {}


@pytest.mark.parametrize("qtype", sorted(q for q in repack.PAIR if q != repack.DECODED), ids=lambda q: q.name)
def test_two_row_group_dot_has_the_bits_of_two_calls(qtype):
    """The two-row-group form (tiles [2, row_tiles] -> [MANY, 16]: lanes 8-15 the second row-group's rows, each
    chunk's activations one dword broadcast to all 16 lanes, IQ4_XS's and Q8_0's sums starting from -128 * bsum)
    gives, lane by lane, the bits of the one-row-group call on each, for every pair of neighbours of a 5-group
    matrix, of random and of the format's extreme weights (_extreme_rows). Where this CPU has no 512-bit VNNI, the
    form is not used (PAIRS is empty)."""
    if qtype not in repack.PAIRS:
        assert not (repack._WIDE and qact._AVX2)  # only a CPU without the 512-bit form goes without
        return
    if qtype not in _PAIR_RUNNERS:
        dot = repack.TILE_DOTS[qtype]

        @njit
        def run(tiles, xq, xd, xbs, y2, y1):
            for g in range(tiles.shape[0] - 1):
                dot(tiles[g:g + 2], xq, xd, xbs, y2[g])
                dot(tiles[g], xq, xd, xbs, y1[g])
            dot(tiles[tiles.shape[0] - 1], xq, xd, xbs, y1[tiles.shape[0] - 1])

        _PAIR_RUNNERS[qtype] = run
    rng = np.random.default_rng(11)
    for raw in (random_rows(qtype, 40, 512, rng), np.concatenate([_extreme_rows(qtype)] * 5)):
        tiles = repack.repack(raw, qtype)
        G, C = tiles.shape[0], raw.shape[1] // repack.RAW_BYTES[qtype] * 256
        xq, xd, xbs = _x8(rng.standard_normal((repack.MANY, C)) * rng.uniform(0.1, 100), qtype)
        y2 = np.full((G - 1, repack.MANY, 16), np.nan, np.float32)
        y1 = np.full((G, repack.MANY, 8), np.nan, np.float32)
        _PAIR_RUNNERS[qtype](tiles, xq, xd, xbs, y2, y1)
        for g in range(G - 1):
            assert np.array_equal(y2[g], np.concatenate([y1[g], y1[g + 1]], axis=1)), g


@pytest.mark.parametrize("qtype", sorted(q for q in repack.PAIR if q != repack.DECODED), ids=lambda q: q.name)
def test_dual_two_row_dot_has_the_bits_of_one_token_calls(qtype):
    """The dual form of the two-row dot (repack._make_tile_dot2(dual=True): the row-group's weights broadcast to both
    halves of a 512-bit vector, each plane's activations in one half) gives, row by row, the one-token call's bits on
    each plane, as the plain two-row form does, on random and on the format's extreme weights (_extreme_rows), for
    every format whose blocks are written for 16 lanes (PAIR), in DUAL or not (DUAL is a measured choice per CPU);
    and so does the form `twice` (the one-token dot on each row). Where this CPU has no 512-bit VNNI the dual form is
    not used (DUALS is empty) and LLVM could not select it."""
    if not (repack._WIDE and qact._AVX2):
        assert not repack.DUALS
        return
    dual, plain, twice = (repack._make_tile_dot2(qtype, dual=d, twice=t)
                          for d, t in ((True, False), (False, False), (None, True)))
    one = repack.TILE_DOTS[qtype]

    @njit
    def run(tiles, xq, xd, xbs, y_dual, y_plain, y_twice, y_one):
        for g in range(tiles.shape[0]):
            dual(tiles[g], xq, xd, xbs, y_dual[g])
            plain(tiles[g], xq, xd, xbs, y_plain[g])
            twice(tiles[g], xq, xd, xbs, y_twice[g])
            for i in range(2):
                one(tiles[g], xq[i], xd[i], xbs[i], y_one[g, i])

    rng = np.random.default_rng(13)
    for raw in (random_rows(qtype, 40, 512, rng), np.concatenate([_extreme_rows(qtype)] * 2)):
        tiles = repack.repack(raw, qtype)
        G, C = tiles.shape[0], raw.shape[1] // repack.RAW_BYTES[qtype] * 256
        xq, xd, xbs = qact.quantize_for(rng.standard_normal((1, C)).astype(np.float32) * rng.uniform(0.1, 100), qtype,
                                        qact.PLANES)  # a token's two planes [2, C]
        ys = [np.full((G, 2, 8), np.nan, np.float32) for _ in range(4)]
        run(tiles, xq, xd, xbs, *ys)
        assert all(np.array_equal(y, ys[3]) for y in ys[:3])


@pytest.mark.parametrize("qtype", [QType.Q3_K, QType.Q6_K], ids=lambda q: q.name)
def test_two_row_dot_twice_has_the_bits_of_one_token_calls(qtype):
    """The form `twice` of the two-row dot (repack._make_tile_dot2(twice=True): the one-token dot on each plane, what
    Zen 4 runs for Q3_K) gives each plane the one-token call's bits, on any CPU (its form of the one-token dot)."""
    twice, one = repack._make_tile_dot2(qtype, twice=True), repack.TILE_DOTS[qtype]

    @njit
    def run(tiles, xq, xd, xbs, y_twice, y_one):
        for g in range(tiles.shape[0]):
            twice(tiles[g], xq, xd, xbs, y_twice[g])
            for i in range(2):
                one(tiles[g], xq[i], xd[i], xbs[i], y_one[g, i])

    rng = np.random.default_rng(17)
    tiles = repack.repack(random_rows(qtype, 24, 512, rng), qtype)
    xq, xd, xbs = qact.quantize_for(rng.standard_normal((1, 512)).astype(np.float32) * 7, qtype, qact.PLANES)
    ys = [np.full((3, 2, 8), np.nan, np.float32) for _ in range(2)]
    run(tiles, xq, xd, xbs, *ys)
    assert np.array_equal(ys[0], ys[1]) and not np.array_equal(ys[1][:, 0], ys[1][:, 1])


def test_two_row_forms_follow_the_cpu_and_the_environment(monkeypatch):
    """The two-row dot's form per format (repack._two_row_forms): as measured for the CPU Numba compiles for (Zen 4:
    no dual form; elsewhere the dual form for DUAL where 512-bit VNNI allows it), PYMOE_DUAL and
    PYMOE_TWICE over that; a format is never both. The same for the one-token and many-token dots' width
    (repack._wides, PYMOE_WIDE_FORMATS). The choice is in the compiled kernels' names (FORM_TAG), so
    Numba's cache does not hand one form's kernels to another."""
    wide = repack._WIDE and qact._AVX2
    for cpu, env, want_dual, want_twice in (("znver4", {}, set(), set()),
                                            ("znver4", {"PYMOE_TWICE": "Q3_K"}, set(), {QType.Q3_K}),
                                            ("sapphirerapids", {}, repack.DUAL, set()),
                                            ("znver4", {"PYMOE_DUAL": "1", "PYMOE_TWICE": ""}, repack.DUAL, set()),
                                            ("sapphirerapids", {"PYMOE_DUAL": "0", "PYMOE_TWICE": "Q6_K,Q4_K"}, set(),
                                             {QType.Q6_K, QType.Q4_K}),
                                            ("sapphirerapids", {"PYMOE_TWICE": "Q4_K"}, repack.DUAL - {QType.Q4_K},
                                             {QType.Q4_K})):
        monkeypatch.setattr(qact, "host_cpu_name", lambda cpu=cpu: cpu)
        for k in ("PYMOE_DUAL", "PYMOE_TWICE", "PYMOE_WIDE_FORMATS"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        duals, twices = repack._two_row_forms()
        if not env:  # and the formats it runs 512 bits wide: none on Zen 4 (repack.CPU_FORMS)
            assert repack._wides() == (set() if cpu == "znver4" or not repack._WIDE else repack.WIDE), cpu
        assert duals == (want_dual if wide else set()), (cpu, env)
        assert twices == (want_twice if qact._AVX2 else set()), (cpu, env)
        assert not duals & twices
    monkeypatch.setenv("PYMOE_WIDE_FORMATS", "Q8_0,Q2_K")  # Q2_K has no wide blocks
    assert repack._wides() == ({QType.Q8_0} if repack._WIDE else set())
    for var in ("PYMOE_WIDE_FORMATS", "PYMOE_TWICE"):  # a name that is no format: one line naming the variable
        monkeypatch.setenv(var, "Q4_K,Q9_K")
        with pytest.raises(ValueError, match=f"{var}: no such format.*Q9_K"):
            repack._wides() if var == "PYMOE_WIDE_FORMATS" else repack._two_row_forms()
        monkeypatch.delenv(var)
    assert repack.FORM_TAG == "d" + "".join(sorted(q.name for q in repack.DUALS)) + "t" + "".join(
        sorted(q.name for q in repack.TWICES)) + "w" + "".join(sorted(q.name for q in repack.WIDES))
    from pymoe.quant import kernels  # the tag in the names that key Numba's cache: the dense products', the MoE's
    assert repack._MATMULS[QType.Q4_K].py_func.__qualname__.endswith(f"_{repack.FORM_TAG}_{repack.DENSE_TAG}")
    assert kernels._act_fingerprint().endswith(repack.FORM_TAG)


def test_dense_hints_per_format(monkeypatch):
    """How far ahead the dense weights' dots ask for bytes (repack._dense_ahead): STREAM_AHEAD, but none for Q8_0,
    whose plain stream the hardware prefetcher follows alone (bench/dense_ahead.py); PYMOE_DENSE_AHEAD sets every
    format's. The distances are in the dense products' kernel names (DENSE_TAG), which key Numba's cache."""
    monkeypatch.delenv("PYMOE_DENSE_AHEAD", raising=False)
    assert {q: repack._dense_ahead(q) for q in repack.TILE_DOTS} == {
        q: 0 if q == QType.Q8_0 else repack.STREAM_AHEAD for q in repack.TILE_DOTS}
    monkeypatch.setenv("PYMOE_DENSE_AHEAD", "4096")
    assert {repack._dense_ahead(q) for q in repack.TILE_DOTS} == {4096}
    assert repack.DENSE_TAG == "a" + "-".join(str(repack.DENSE_AHEAD[q]) for q in repack.TILE_DOTS)
    assert repack._MATMULS[QType.Q8_0].py_func.__qualname__.endswith(repack.DENSE_TAG)


GRID = sorted(qact.ROW_DECODES, key=lambda q: q.name)  # IQ1-IQ3: the formats prefill reads decoded


@pytest.mark.parametrize("qtype", GRID, ids=lambda q: q.name)
def test_decoded_layout_holds_the_weights_and_gives_the_row_dots_bits(qtype):
    """IQ1-IQ3 rows decoded (repack.decode_tiles through qact's row_decode: what the MoE kernel does to an expert's
    rows in prefill) hold gguf-py's dequantized weights exactly (d * scale * q, each product exact in float32:
    repack.decoded_values); the decoded layout's tile dot gives, for one token, among MANY and in the two-row-group
    form (tile_matmul: 5 row-groups, 11 tokens; and matmul_act's prefill form, which decodes as it goes), the bits of
    the raw rows' one-row and multi-row dots (qact's
    exact_blocks: the same integers, the same float operations), in every form this CPU compiles, and is within
    float32 rounding of float math (4 C u sum|w x|, as test_tile_dot_has_the_bits_of_the_row_dots)."""
    import gguf

    rng = np.random.default_rng(int(qtype))
    R, C = 40, 512
    raw = random_rows(qtype, R, C, rng)
    tiles = repack.decode_tiles(raw, qtype)  # [5, 2 * DECODED_TILE]
    ref = gguf.dequantize(raw, gguf.GGMLQuantizationType(int(qtype))).reshape(R, C)
    assert np.array_equal(repack.decoded_values(tiles), ref)
    T = 2 * repack.MANY + 3
    X = (rng.standard_normal((T, C)) * rng.uniform(0.1, 100)).astype(np.float32)
    xq, xd, xbs = _x8(X)
    many = repack.tile_matmul(tiles, repack.DECODED, xq, xd, xbs)  # [T, R]
    rows, acc = np.empty((T, R), np.float32), np.empty((T, 16), np.float32)
    for r in range(R):
        qact.ACT_DOTS_ROWS[qtype](raw[r], xq, xd, xbs, acc, rows[:, r])
    assert T >= kernels.DECODE_MIN_TOKENS  # so matmul_act decodes (repack.decoded_matmul: decode_tiles, then tile_matmul)
    assert np.array_equal(kernels.matmul_act(raw, qtype, X, 8, xact=(xq, xd, xbs)), rows)
    x_deq = qact.dequantize_act(xq, xd).astype(np.float64)  # [T, C]
    for t in range(T):
        one = np.array([qact.ACT_DOTS[qtype](raw[r], xq[t], xd[t], xbs[t]) for r in range(R)], np.float32)
        assert np.array_equal(many[t], one) and np.array_equal(many[t], rows[t]), t
        bound = 4 * C * U * (np.abs(ref.astype(np.float64)) @ np.abs(x_deq[t]))
        assert (np.abs(many[t] - ref.astype(np.float64) @ x_deq[t]) <= bound).all()
    for form, _ in FORMS:
        y1, y4 = _form(repack.DECODED, form, tiles, xq[:repack.MANY], xd[:repack.MANY], xbs[:repack.MANY])
        assert np.array_equal(y1, many[0]) and np.array_equal(y4, many[:repack.MANY]), form


@pytest.mark.parametrize("types", [(QType.IQ2_XXS, QType.IQ2_XXS, QType.IQ3_XXS), (QType.Q4_K, QType.Q4_K, QType.IQ1_M)],
                         ids=lambda t: "-".join(q.name for q in t))
def test_fused_moe_kernel_decodes_iq_experts_with_the_bits_of_one_token_calls(types):
    """A prefill chunk of 40 tokens whose 4 experts have 3, 9, 20 and 33 of them: gate, up and down of an IQ1-IQ3
    type are read through decoded scratch tiles (16 rows at a time) for the experts with DECODE_MIN_TOKENS or more,
    through the raw rows for the others; every token's output is bit for bit the kernel's on that token alone (one
    token an expert: the raw rows' one-row dots), whose integers and float operations the decoded tiles repeat."""
    rng = np.random.default_rng(17)
    D, F, T = 512, 256, 40
    experts = [tuple(random_rows(q, *shape, rng) for q, shape in zip(types, ((F, D), (F, D), (D, F))))
               for _ in range(4)]
    x = rng.standard_normal((T, D)).astype(np.float32)
    pairs = [(np.sort(rng.choice(T, n, replace=False)), rng.uniform(0.1, 1, n).astype(np.float32))
             for n in (3, 9, 20, 33)]
    assert kernels.DECODE_MIN_TOKENS <= 9
    y = kernels.moe_act(experts, types, x, pairs, bits=8)  # [T, D]
    for t in range(T):
        mine = [(ex, (np.zeros(1, np.int64), w[tok == t])) for ex, (tok, w) in zip(experts, pairs) if (tok == t).any()]
        if not mine:  # a token no expert took
            assert not y[t].any()
            continue
        alone = kernels.moe_act([ex for ex, _ in mine], types, x[t:t + 1], [p for _, p in mine], bits=8)[0]
        assert np.array_equal(y[t], alone), t
    y16 = kernels.moe_act(experts, types, x, pairs, bits=16)  # 16-bit activations: the raw rows (no 8-bit tiles)
    assert np.array_equal(y16[:1], kernels.moe_act(experts, types, x[:1], [(t[t == 0], w[t == 0]) for t, w in pairs],
                                                   bits=16))


def _scaled_extremes(qtype) -> np.ndarray:
    """16 rows of 512 weights at the scaled layout's bounds: Q3_K rows 0-7 with every 6-bit scale field 0 (sc -32)
    and every quant bit clear (q -4): sc q = 128, u = 255; rows 8-15 with every scale bit set (sc 31) and q -4: u 3;
    Q2_K every bit set (sc 15, q 3, min 15: u 45) in rows 0-7, every quant bit clear in 8-15 (u 0). d 0.5."""
    size = Q.get_format(qtype).type_size
    raw = np.zeros((16, 2, size), np.uint8)
    half = np.frombuffer(np.array([0.5], np.float16).tobytes(), np.uint8)
    if qtype == QType.Q3_K:
        raw[8:, :, 96:108] = 0xFF
        raw[..., 108:110] = half
    else:
        raw[:8] = 0xFF
        raw[8:, :, 0:16] = 0xFF
        raw[..., 80:82] = half
        raw[..., 82:84] = half
    return raw.reshape(16, 2 * size)


@pytest.mark.parametrize("qtype", sorted(repack.SCALED), ids=lambda q: q.name)
def test_scaled_layout_is_its_reference_and_gives_the_tile_dots_bits(qtype):
    """The scaled layout (prefill's scratch for Q2_K and Q3_K: sc * q + bias a byte): the compiled expansion of two
    row-groups (repack.scale_pair) is its NumPy reference byte for byte, whose integers times d (minus dmin times the
    min, Q2_K) are the dequantized weights; the scaled dot, for 24 and 27 rows of x (MANY at a time, the rest through
    the tile dot) at 8 bits and as two planes' rows, random rows and the layout's bounds (_scaled_extremes), is the
    one-token and multi-row dots' bits on the raw rows; tile_matmul with that many rows, which takes this path, too.
    Where this CPU has no pair form the path is not taken (SCALED_PAIRS is empty)."""
    if qtype not in repack.SCALED_PAIRS:  # only a CPU without the pair form (or PYMOE_SCALED=0) goes without
        assert qtype not in repack.PAIRS or not repack._VNNI or os.environ.get("PYMOE_SCALED") == "0"
        return
    rng = np.random.default_rng(13)
    for raw in (random_rows(qtype, 48, 512, rng), _scaled_extremes(qtype)):
        tiles = repack.repack(raw, qtype)
        R, C = raw.shape[0], 512
        scaled = repack.scale_pair(tiles[:2], qtype)
        assert np.array_equal(scaled, repack.scale_pair_ref(tiles[:2], qtype))
        u = scaled.reshape(2, repack.SCALED_BLOCK)[:, repack.SCALED_QS:].reshape(2, 8, 8, 2, 8, 4)  # [nb, g, c, rg..]
        v = u.transpose(3, 4, 0, 1, 2, 5).reshape(16, C).astype(np.int64) - repack.SCALED_BIAS[qtype]  # [16, C]
        blk = raw[:16].reshape(16, 2, -1)
        d = blk[..., {QType.Q2_K: 80, QType.Q3_K: 108}[qtype]:][..., :2].copy().view(np.float16)[..., 0]  # [16, 2]
        w = np.repeat(d.astype(np.float64), 256, axis=1) * v
        size = np.abs(w)  # the terms' magnitudes, which the rounding is relative to
        if qtype == QType.Q2_K:
            dmin = blk[..., 82:84].copy().view(np.float16)[..., 0].astype(np.float64)
            mins = (blk[..., 0:16] >> 4).astype(np.float64)  # [16, 2, 16 sub-blocks]
            m = np.repeat((dmin[..., None] * mins).reshape(16, 32), 16, axis=1)
            w, size = w - m, size + np.abs(m)
        # dequantize rounds to float32 at most four times a weight (d * sc, times q, dmin * m, the difference), each
        # within 2^-24 of the terms' magnitude
        assert (np.abs(w - dequantize(raw[:16], qtype).reshape(16, C)) <= 4 * 2.0 ** -24 * size).all()
        for T, bits in ((24, 8), (27, 8), (24, qact.PLANES)):
            X = rng.standard_normal((T // (2 if bits == qact.PLANES else 1), C)) * rng.uniform(0.1, 100)
            xq, xd, xbs = qact.quantize_rows(np.asarray(X, np.float32), bits, qact.act_group(qtype, bits))
            rows = np.empty((T, R), np.float32)
            acc = np.empty((T, 16), np.float32)
            for r in range(R):
                qact.ACT_DOTS_ROWS[qtype](raw[r], xq, xd, xbs, acc, rows[:, r])
            one = np.array([[qact.ACT_DOTS[qtype](raw[r], xq[t], xd[t], xbs[t]) for r in range(R)] for t in range(T)],
                           np.float32)
            assert np.array_equal(rows, one)
            assert np.array_equal(repack.tile_matmul(tiles, qtype, xq, xd, xbs), rows)
            if T % repack.MANY == 0:
                assert np.array_equal(repack.scaled_matmul(tiles, qtype, xq, xd, xbs), rows)


def _addresses(mats):
    return tuple(0 if m is None else m.ctypes.data for m in mats)


@pytest.mark.parametrize("types", [(QType.Q4_K, QType.Q4_K, QType.Q6_K), (QType.MXFP4, QType.MXFP4, QType.MXFP4),
                                   (QType.Q2_K, QType.Q2_K, QType.Q3_K), (QType.Q4_K, QType.Q4_K, QType.Q4_0),
                                   (QType.IQ4_XS, QType.IQ4_XS, QType.IQ4_XS), (QType.Q5_K, QType.Q5_K, QType.Q6_K)],
                         ids=["Q4_K-Q6_K", "MXFP4", "Q2_K-Q3_K", "Q4_K-Q4_0-untiled", "IQ4_XS", "Q5_K-Q6_K"])
def test_fused_moe_kernel_reads_the_tiles_with_the_same_bits(types):
    """Decode (one token, 4 experts), a prefill chunk (6 tokens: experts with one token, with 2, and with 5: one
    many-token call and one single) and a longer one (70 tokens: an expert with all of them, read in two chunks of
    repack.TOKENS = 64 and 6, the second with a single at its end):
    the kernel's result with repacked copies (of every matrix of a tiled type) is the result without, bit for bit;
    with the copies zeroed it changes (so they are what the kernel reads)."""
    rng = np.random.default_rng(7)
    D, F, S = 512, 256, 4
    experts = [tuple(random_rows(q, *shape, rng) for q, shape in zip(types, ((F, D), (F, D), (D, F))))
               for _ in range(S)]
    mats = [tuple(repack.repack(m, q) if q in repack.TILE_BYTES else None for q, m in zip(types, ex)) for ex in experts]
    zeroed = [tuple(None if m is None else np.zeros_like(m) for m in ms) for ms in mats]
    assert kernels.TILE_TOKENS == 64 and repack.MANY == 4  # (the chunks and calls the 70-token case makes)
    for T, start, tok in ((1, [0, 1, 2, 3, 4], [0, 0, 0, 0]), (6, [0, 1, 6, 7, 9], [2, 0, 1, 2, 3, 5, 4, 1, 3]),
                          (70, [0, 70, 71, 74, 76], list(range(70)) + [3, 5, 9, 69, 0, 1])):
        x = rng.standard_normal((T, D)).astype(np.float32)
        if qact.act_group(types[2], 8) == 32:  # h per 32 values has an fp16 scale (llama.cpp's block_q8_0): random
            x *= np.float32(1e-3)  # Q4_K gate and up rows (|w| up to ~2000) make |h| ~ 1e8, past max|h| = 127 * 65504
        start, tok = np.array(start, np.int64), np.array(tok, np.int64)
        weight = rng.uniform(0.1, 1, tok.size).astype(np.float32)

        def run(tiles, bits=8):
            return kernels.moe_act_grouped(experts, types, x, start, tok, weight, bits,
                                           None if tiles is None else [_addresses(m) for m in tiles])

        for bits in (8, qact.PLANES):  # 8-bit x, and x as two 8-bit planes (the same compiled kernel)
            plain = run(None, bits)
            assert np.array_equal(run(mats, bits), plain)
            assert not np.array_equal(run(zeroed, bits), plain)
        if types[2] == QType.Q4_0:  # at 16 bits the copies are not read (their dots are 8-bit only): the same
            assert np.array_equal(run(zeroed, 16), run(None, 16))  # result with zeroed ones (one triple: compile time)


@pytest.fixture(scope="module")
def llama_quantized(tiny_model, tmp_path_factory):
    """llama_quantized(ftype) -> the tiny qwen3moe quantized to that file type by llama.cpp's quantizer (Q4_K_M:
    Q4_K attention and experts, Q6_K ffn_down in layer 1, as tests/test_llamacpp_quant_mixes.py pins; MXFP4_MOE:
    MXFP4 experts, Q8_0 attention; Q2_K: Q2_K gate and up, Q3_K down; IQ4_XS: IQ4_XS experts and attention; Q5_K_M:
    Q5_K and Q6_K; Q8_0): every expert matrix has a tile layout."""
    llama_cpp = require_llama_cpp()
    root = tmp_path_factory.mktemp("repack")

    def get(ftype):
        dst = str(root / f"tiny-qwen3moe-{ftype}.gguf")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
        params.nthread = 2
        assert llama_cpp.llama_model_quantize(tiny_model("qwen3moe", "f32").encode(), dst.encode(), params) == 0
        return dst

    return get


@pytest.mark.parametrize("ftype, bits", [("Q4_K_M", 8), ("MXFP4_MOE", 8), ("Q2_K", 8), ("IQ4_XS", 8), ("Q5_K_M", 8),
                                         ("Q8_0", 8), ("Q4_K_M", 15), ("MXFP4_MOE", 15), ("Q2_K", 15)])
def test_decode_with_repacking_has_the_bits_of_decode_without(llama_quantized, ftype, bits):
    """The whole model at 8 bits (and as two 8-bit planes, 15): prefill, then greedy decode with the repacked copies
    (dense and experts) against the same without, logits bit for bit; the copies were made and used. At 15 bits the
    prompt is 48 tokens (96 rows of x: the Q2_K file's experts and dense matrices meet repack.SCALED_MIN_ROWS, so its
    prefill reads the scaled layout where this CPU has it)."""
    path = llama_quantized(ftype)
    prompt = list(range(5, 53)) if bits == qact.PLANES else [5, 17, 42, 7, 99, 3, 250, 11]
    runs = {}
    for rp in (True, False):
        eng = pymoe.load(path, backend_options={"act_bits": bits, "repack": rp})
        m = eng.model
        kv = m.new_kv(64)
        logits = [m.prefill(prompt, kv)[-1]]
        for _ in range(10):
            logits.append(m.decode_one_token(int(np.argmax(logits[-1])), kv))
        runs[rp] = np.array(logits)
        made = [v[2][3:] for v in m.backend._rows.values() if any(v[2][3:])]  # tile addresses of the experts run
        if rp:
            if ftype in ("Q4_K_M", "IQ4_XS", "MXFP4_MOE", "Q8_0"):
                assert m.layers[0].attn_q.tiles is not None  # Q4_K / IQ4_XS / Q8_0: repacked at load
            assert len(made) == len(m.backend._rows)  # every expert the model ran, every matrix of it
            assert made and all(a[0] and a[1] and a[2] for a in made)
        else:
            assert m.layers[0].attn_q.tiles is None and not made
    assert np.array_equal(runs[True], runs[False])


def test_repacking_is_off_at_16_bits_and_by_request(monkeypatch):
    assert CPUBackend(act_bits=8).repack and CPUBackend(act_bits=15).repack and not CPUBackend(act_bits=16).repack
    assert not CPUBackend(act_bits=8, repack=False).repack
    monkeypatch.setenv("PYMOE_REPACK", "0")
    assert not CPUBackend(act_bits=8).repack


def test_decode_one_task_per_expert_has_the_bits_of_the_row_tasks():
    """Decode's MoE kernel with one task per expert (kernels.BY_EXPERT: gate, up and down of an expert in one task,
    the experts' outputs added in order afterwards) gives the bits of the row tasks (gate/up row blocks, then down
    row ranges), on 1 and 2 threads' splits and on 4 and 6 experts; with a count the threads do not divide, the
    row tasks run."""
    types = (QType.Q4_K, QType.Q4_K, QType.Q6_K)
    rng = np.random.default_rng(11)
    D, F = 512, 512
    rows_form = kernels.compile_moe("test_rows_" + "_".join(q.name for q in types) + "_" + kernels._act_fingerprint(),
                                    dict(kernels.moe_constants(types), BY_EXPERT=False))
    by_expert = kernels.act_kernel(kernels._moe_kernel, *types)
    assert kernels.BY_EXPERT
    for S in (4, 6):
        experts = [tuple(random_rows(q, *shape, rng) for q, shape in zip(types, ((F, D), (F, D), (D, F))))
                   for _ in range(S)]
        mats = [tuple(repack.repack(m, q) for q, m in zip(types, ex)) for ex in experts]
        addr = np.array([tuple(m.ctypes.data for m in ex) + _addresses(ms) for ex, ms in zip(experts, mats)],
                        np.int64)  # [S, 6]
        x = rng.standard_normal((1, D)).astype(np.float32)
        start, tok = np.arange(S + 1, dtype=np.int64), np.zeros(S, np.int64)
        weight = rng.uniform(0.1, 1, S).astype(np.float32)
        for threads, bits in ((1, 8), (2, 8), (4, 8), (1, qact.PLANES), (2, qact.PLANES)):  # (15: two planes)
            got = {}
            for name, fn in (("rows", rows_form), ("experts", by_expert)):
                saved = kernels._ACT_KERNELS.get(("_moe_kernel",) + types)
                kernels._ACT_KERNELS[("_moe_kernel",) + types] = fn
                try:
                    got[name] = kernels.moe_act_table(addr, types, F, x, start, tok, weight, bits, threads)
                finally:
                    kernels._ACT_KERNELS[("_moe_kernel",) + types] = saved
            assert np.array_equal(got["rows"], got["experts"]), (S, threads, bits)
            assert np.abs(got["rows"]).max() > 0


@pytest.mark.parametrize("bits", [8, qact.PLANES])
def test_dense_rows_past_the_last_tile_pad_it(tiny_model, bits):
    """A dense weight whose rows are not a multiple of 8 (the mid preset's output head has 746): its last tile
    padded with rows of zero bytes (CPUBackend.dense), their results dropped (CPUBackend._tiled). Its products, one
    token and several, alone and among others (linear_many), have the bits of kernels.matmul_act on the raw rows."""
    import dataclasses

    path = tiny_model("qwen3moe", "q2_k")
    b = pymoe.load(path, backend="cpu", backend_options={"act_bits": bits}).model.backend
    head = pymoe.load_gguf(path).tensor("output.weight")  # Q6_K, 512 x 256
    rows = head.shape[0] - 6  # 506: 63 tiles and 2 rows
    t = dataclasses.replace(head, shape=(rows, head.shape[1]), data=head.rows()[:rows])
    w = b.dense(t)
    assert w.tiles is not None and w.tiles.shape[0] == rows // 8 + 1 and w.shape == (rows, head.shape[1])
    rng = np.random.default_rng(0)
    for T in (1, 3):
        x = rng.standard_normal((T, head.shape[1])).astype(np.float32)
        want = kernels.matmul_act(head.rows()[:rows], head.qtype, x, bits)  # [T, rows]
        for got in (b.linear(w, x), b.linear_many([w, w, w], x)[2]):  # (not the three-matrix call: a padded tile)
            assert got.flags.c_contiguous
            np.testing.assert_array_equal(got, want)
