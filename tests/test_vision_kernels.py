"""The vision tower's linear layers through pymoe's CPU kernels (vision/encoder.encode(..., backend)) against its
NumPy twin (backend None: float32 copies of the weights, BLAS), block by block and whole, on the tiny towers with
and without deepstack mergers, F32 and F16 weights (pymoe/demo/tinyvision.py)."""
import numpy as np
import pytest

from pymoe.backends.cpu import CPUBackend
from pymoe.demo.tinyvision import TINY, TINY_DEEPSTACK, write_mmproj
from pymoe.vision import encoder
from pymoe.vision.mmproj import load_mmproj
from pymoe.vision.preprocess import preprocess
from pymoe.vision.testimages import png_bytes

# Both paths multiply the same float32 numbers (F16 rows widen exactly) and differ only in summation order: the
# kernels' per-row dot against BLAS's blocked sums, over at most 128 terms (the merger's 4 x 32 row) of values up
# to ~3. Float32 rounding of such sums is ~1e-6 relative; measured 7e-7 .. 1.4e-6 absolute per block (inputs of
# unit variance) and 1.1e-6 .. 1.5e-6 on the tower's output (values up to 2.8), F32 and F16 alike (F16 rows take the
# float path: CPUBackend.integer_path is false for F16). Bound 2e-5 absolute, ten times that: far below what a wrong
# weight row or a transpose moves (order 1).
BOUND = 2e-5


@pytest.fixture(scope="module")
def backend():
    return CPUBackend(threads=2)


@pytest.fixture(scope="module", params=[("plain", False), ("deepstack", False), ("deepstack", True)],
                ids=["f32", "deepstack-f32", "deepstack-f16"])
def tower(request, tmp_path_factory):
    kind, f16 = request.param
    path = str(tmp_path_factory.mktemp("vk") / f"mmproj-{kind}-{'f16' if f16 else 'f32'}.gguf")
    write_mmproj(path, shape=TINY_DEEPSTACK if kind == "deepstack" else TINY, f16=f16)
    return load_mmproj(path)


def test_each_block_matches_its_numpy_twin(tower, backend):
    c = tower.config
    pixels = preprocess(png_bytes(160, 96), c)
    gh, gw = encoder.grid(pixels, c)
    pos = encoder.patch_positions(gh, gw, c.merge)
    x = np.random.default_rng(0).standard_normal((gh * gw, c.n_embd)).astype(np.float32)
    for i in range(c.n_layers):
        ref = encoder.block(x, tower, i, pos)
        ours = encoder.block(x, tower, i, pos, backend)
        assert np.abs(ours - ref).max() < BOUND
        if i in c.deepstack:
            assert np.abs(encoder.deepstack_merger(ref, tower, i, backend)
                          - encoder.deepstack_merger(ref, tower, i)).max() < BOUND
        x = ref


def test_the_tower_matches_its_numpy_twin(tower, backend):
    pixels = preprocess(png_bytes(128, 128), tower.config)
    ref = encoder.encode(pixels, tower)
    ours = encoder.encode(pixels, tower, backend)
    assert ours.shape == ref.shape == (16, 256 * (1 + len(tower.config.deepstack)))
    assert np.abs(ours - ref).max() < BOUND
    assert np.abs(ref).max() > 0.5  # a tower whose output is all zeros would pass the line above
