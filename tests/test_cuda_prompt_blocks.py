"""A prompt's attention blocks on the device, in Numba's CUDA simulator: MLA (deepseek2, engine/mla.mla_device) over
T rows of a prompt chunk, one copy up and one back per layer.

What this is: on the micro files (F32), a prompt of several chunks (`--chunk` 4) on the CUDA backend gives the CPU
backend's greedy tokens, its prefill logits are the reference backend's within a float32 bound, and the counts of
one prompt chunk (backends/device_counts.py: exact in the simulator) are the ones worked out below from the code.

Tolerance of the logits: the same float32 operations in other orders (other reduction trees in the products and the
attention), so the logits differ by a few roundings of their own size s = max |logit|: ULPS = 8 ulp of s, as
tests/test_cuda_device_step.py (its docstring gives the measured spread, 1.5 ulp on deepseek2).
"""
from cuda_sim import IN_PROCESS, fresh_interpreter_test, in_process  # first: the simulator on

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import pymoe  # noqa: E402

pytestmark = pytest.mark.cuda

MiB = 2**20
SIM = dict(kernels="reference", free_bytes=700 * MiB + 64 * MiB)  # a 64 MiB "device" beyond the reserve
CHUNK = 4
PROMPT = [5, 17, 42, 9, 3, 7, 11, 2, 8, 13]  # 3 chunks: 4 + 4 + 2
ULPS = 8  # of the logit scale s: see the module docstring
F32 = 4


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    from pymoe.demo.tinymodel import write_model

    root, made = tmp_path_factory.mktemp("micro"), {}

    def make(arch):
        if arch not in made:
            made[arch] = str(root / f"micro-{arch}-f32.gguf")
            write_model(made[arch], arch, "micro", "f32", seed=0)
        return made[arch]

    return make


def on_cuda(path):
    return pymoe.load(path, backend="cuda", chunk=CHUNK, backend_options=SIM)


@in_process
@pytest.mark.parametrize("arch", ["deepseek2"])
def test_a_prompt_of_several_chunks_gives_the_cpu_float_paths_tokens(micro, arch):
    path = micro(arch)
    want = list(pymoe.load(path, backend="cpu", chunk=CHUNK).generate(PROMPT, max_tokens=4, stop_at_eos=False))
    engine = on_cuda(path)
    assert list(engine.generate(PROMPT, max_tokens=4, stop_at_eos=False)) == want


@in_process
@pytest.mark.parametrize("arch", ["deepseek2"])
def test_prefill_logits_match_the_float_path(micro, arch):
    path = micro(arch)
    ref = pymoe.load(path, backend="reference", chunk=CHUNK)
    engine = on_cuda(path)
    want = ref.model.prefill(PROMPT, ref.model.new_kv(32))  # [T, V]
    got = np.asarray(engine.model.prefill(PROMPT, engine.model.new_kv(32)))
    s = float(np.abs(want).max())
    assert np.abs(got - want).max() <= ULPS * np.spacing(np.float32(s))


def mla_chunk_counts(cfg, T: int) -> dict:
    """One prompt chunk's MLA blocks (engine/mla.mla_device), from the code: per MLA layer the normed residual
    [T, D] up (one copy), q_a, its rmsnorm, q_b, kv_a (4 launches), the cache rows (mla_kv_row), the absorbed query
    (mla_query), chunk_attention, the value up-projection (mla_value), the output projection (9 launches), the
    block's [T, D] back (one copy, one synchronisation); the forward's RoPE tables [T, R / 2] x 2 up once."""
    n = sum(1 for p in cfg.layer_plan() if p.attention == "mla")
    return dict(launches=9 * n, synchronisations=n, bytes_by_name={
        "residual to device (attention block)": n * T * cfg.n_embd * F32,
        "RoPE tables to device": 2 * T * (cfg.rope_dim // 2) * F32,
        "attention block to host": n * T * cfg.n_embd * F32})


@in_process
def test_a_prompt_chunks_mla_is_one_round_trip_per_layer(micro, monkeypatch):
    """One prompt chunk's MLA blocks (their own launches, copies and syncs, counted around each call of
    engine/mla.mla_device): one round trip per layer, no host-side product, no query or attention output crossing."""
    from pymoe.backends.device_counts import difference
    from pymoe.engine import mla

    engine = on_cuda(micro("deepseek2"))
    cfg, counts = engine.config, engine.backend.counts
    seen = []
    inner = mla.mla_device

    def counted(b, *args):
        before = counts.snapshot("prefill")
        y = inner(b, *args)
        seen.append(difference(counts.snapshot("prefill"), before))
        return y

    monkeypatch.setattr(mla, "mla_device", counted)
    engine.model.prefill(PROMPT[:CHUNK], engine.model.new_kv(32))
    total = {"launches": sum(s["launches"] for s in seen),
             "synchronisations": sum(s["synchronisations"] for s in seen), "bytes_by_name": {}}
    for s in seen:
        for w, n in s["bytes"].items():
            total["bytes_by_name"][w] = total["bytes_by_name"].get(w, 0) + n
    assert total == mla_chunk_counts(cfg, CHUNK)


if not IN_PROCESS:
    test_this_file_in_a_fresh_interpreter = fresh_interpreter_test(__file__)
