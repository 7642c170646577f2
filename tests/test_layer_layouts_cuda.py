"""Expert types that change from layer to layer on the CUDA backend (Numba's simulator, reference kernels): the
DevicePool lays out and reads back each expert with its own layer's types, like pool.HostPool (the CPU side of
this is tests/test_layer_layouts.py)."""
from cuda_sim import IN_PROCESS, fresh_interpreter_test, in_process  # first: the simulator on

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import pymoe  # noqa: E402
from gguf_rewrite import write_mixed_down  # noqa: E402
from pymoe.gguf.loader import EXPERT_PROJ  # noqa: E402

pytestmark = pytest.mark.cuda

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11, 64, 128, 200, 31]
N_NEW = 8
MiB = 2**20
SIM = dict(kernels="reference", free_bytes=700 * MiB + 64 * MiB)  # a 64 MiB "device" beyond the reserve


def check_device_pool(path):
    """Greedy tokens on the CUDA backend (simulator, reference kernels, 6 slots, LRU, half the misses spilled) equal
    the reference backend's; slots of both layers are used, and each slot's device bytes are the host bytes of the
    expert it holds (with that layer's own types and sizes)."""
    want = list(pymoe.load(path, backend="reference").generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False))
    engine = pymoe.load(path, backend="cuda", backend_options=SIM, cache_slots=6, policy="lru", pcie_frac=0.5,
                        chunk=8)
    assert list(engine.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False)) == want
    cache = engine.cache
    resident = np.argwhere(cache.residency >= 0)
    assert {int(layer) for layer, _ in resident} == {0, 1}
    for layer, e in resident:  # the device's bytes of every slot: the host bytes of the expert it holds
        host = np.concatenate([getattr(engine.file.expert(int(layer), int(e)), p).reshape(-1) for p in EXPERT_PROJ])
        np.testing.assert_array_equal(cache.pool.read(int(cache.residency[layer, e]))[:host.size], host)


@in_process
def test_device_pool_uses_each_layers_layout(tiny_model, tmp_path, monkeypatch):
    check_device_pool(write_mixed_down(tiny_model("qwen3moe", "q2_k"), str(tmp_path / "tiny-mixed.gguf")))


@in_process
@pytest.mark.parametrize("ftype", ["IQ2_M", "IQ4_XS", "MXFP4_MOE", "TQ1_0"])
def test_device_pool_holds_llama_cpp_quantized_experts(ftype, tiny_model, tmp_path):
    """Files llama.cpp's quantizer wrote (tests/llama_quantize.py), codebook, FP4 and ternary experts: slots sized
    from the file's own types."""
    from llama_quantize import llama_quantize

    path = str(tmp_path / f"tiny-{ftype}.gguf")
    llama_quantize(tiny_model("qwen3moe", "f32"), path, ftype)
    check_device_pool(path)


if not IN_PROCESS:
    test_this_file_in_a_fresh_interpreter = fresh_interpreter_test(__file__)
