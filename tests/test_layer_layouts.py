"""Expert types that change from layer to layer (llama.cpp's _M mixes: ffn_down Q4_K in some layers, Q6_K in
others): a slot is sized for the largest expert of any layer, and each expert is laid out in its slot, and read back
from it, with its own layer's types and byte sizes.

The file here needs no llama.cpp: the tiny Q2_K-mix model (ffn_down Q3_K everywhere) with layer 1's ffn_down
re-quantized to Q6_K by pymoe's quantizer. tests/test_layer_layouts_cuda.py runs it on the CUDA backend's DevicePool
(simulator), tests/test_llamacpp_quant_mixes.py runs the files llama.cpp's own quantizer writes.
"""
import numpy as np
import pytest

import pymoe
from gguf_rewrite import write_mixed_down
from pymoe import quant
from pymoe.experts.cache import SlotCache
from pymoe.gguf.inspect import describe_model
from pymoe.gguf.loader import load_gguf

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11]
N_NEW = 12
Q = quant.QType


@pytest.fixture(scope="module")
def mixed_file(tiny_model, tmp_path_factory):
    """The tiny qwen3moe Q2_K mix, its blk.1.ffn_down_exps re-quantized Q3_K -> Q6_K."""
    return write_mixed_down(tiny_model("qwen3moe", "q2_k"), str(tmp_path_factory.mktemp("mixed") / "tiny-mixed.gguf"))


def test_layers_have_their_own_expert_layout(mixed_file):
    m = load_gguf(mixed_file)
    assert m.expert_types(0)["down"] == Q.Q3_K and m.expert_types(1)["down"] == Q.Q6_K
    sizes = [m.expert(i, 0).nbytes for i in range(m.config.n_layers)]
    assert sizes[1] > sizes[0] and m.slot_bytes == max(sizes)
    for i in range(m.config.n_layers):
        lay = m.expert_layout(i)
        assert lay.nbytes == sizes[i]
        assert [(p, shape) for p, _, shape in lay.parts] == [(p, getattr(m.expert(i, 0), p).shape)
                                                             for p in ("gate", "up", "down")]


def test_slot_pool_serves_every_layer_with_its_own_types(mixed_file):
    """A pool that holds experts of both layers: slot bytes equal host bytes, shapes are each layer's, and greedy
    decoding equals decoding with no pool."""
    want = list(pymoe.load(mixed_file).generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False))
    engine = pymoe.load(mixed_file, cache_slots=6, policy="lru")
    assert list(engine.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False)) == want
    cache = engine.cache
    assert isinstance(cache, SlotCache)
    resident = np.argwhere(cache.residency >= 0)
    assert {int(layer) for layer, _ in resident} == {0, 1}
    for layer, e in resident:
        slot = int(cache.residency[layer, e])
        ex_slot, ex_host = cache.pool.view(slot, int(layer), int(e)), engine.file.expert(int(layer), int(e))
        for p in ("gate", "up", "down"):
            np.testing.assert_array_equal(getattr(ex_slot, p), getattr(ex_host, p))


def test_inspect_shows_each_layout(mixed_file):
    text = describe_model(mixed_file)
    assert "down Q3_K" in text and "down Q6_K" in text
    assert f"slot size: {load_gguf(mixed_file).slot_bytes} bytes" in text
