"""A prompt's attention blocks on the device, in Numba's CUDA simulator: MLA (deepseek2, engine/mla.mla_device) and
Gated DeltaNet (qwen3next, qwen35moe, engine/deltanet.gdn_device) over T rows of a prompt chunk, one copy up and one
back per layer, the recurrent state left on the device for the decode steps.

What this is: on the micro files (F32), a prompt of several chunks (`--chunk` 4) on the CUDA backend gives the CPU
backend's greedy tokens, its prefill logits are the reference backend's within a float32 bound, and the counts of
one prompt chunk (backends/device_counts.py: exact in the simulator) are the ones worked out below from the code.

Tolerance of the logits: the same float32 operations in other orders (other reduction trees in the products and the
attention), so the logits differ by a few roundings of their own size s = max |logit|: ULPS = 8 ulp of s, as
tests/test_cuda_device_step.py (its docstring gives the measured spread: 1.5 ulp on deepseek2, 2.25 on the
hybrids). The prompts here are shorter than engine/deltanet.CHUNK, so the CPU backend runs the recurrent form of the
rule, as the device's kernels do (cuda_kernels/deltanet.py rule_chunk; its test holds it to the chunked form too).
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
ARCHS = ["deepseek2", "qwen3next", "qwen35moe"]
ULPS = 8  # of the logit scale s: see the module docstring
F32 = 4


def on_cuda(path):
    return pymoe.load(path, backend="cuda", chunk=CHUNK, backend_options=SIM)


@in_process
@pytest.mark.parametrize("arch, mix", [(a, "f32") for a in ARCHS] + [("deepseek2", "q2_k")])
def test_a_prompt_of_several_chunks_gives_the_cpu_float_paths_tokens(micro, arch, mix):
    """q2_k: MLA's k_b and v_b stored as Q4_0 (the mix's fallback for rows not whole K-quant blocks), read so on
    the device (cuda_kernels/mla.py mla_query_q, mla_value_q) and dequantized on the CPU."""
    path = micro(arch, mix)
    want = list(pymoe.load(path, backend="cpu", chunk=CHUNK).generate(PROMPT, max_tokens=4, stop_at_eos=False))
    engine = on_cuda(path)
    assert list(engine.generate(PROMPT, max_tokens=4, stop_at_eos=False)) == want


@in_process
@pytest.mark.parametrize("arch", ARCHS)
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
    from pymoe.engine import mla

    engine = on_cuda(micro("deepseek2"))
    cfg = engine.config
    seen = counted_blocks(monkeypatch, mla, "mla_device", engine.backend.counts)
    engine.model.prefill(PROMPT[:CHUNK], engine.model.new_kv(32))
    total = {"launches": sum(s["launches"] for s in seen),
             "synchronisations": sum(s["synchronisations"] for s in seen), "bytes_by_name": {}}
    for s in seen:
        for w, n in s["bytes"].items():
            total["bytes_by_name"][w] = total["bytes_by_name"].get(w, 0) + n
    assert total == mla_chunk_counts(cfg, CHUNK)




@in_process
def test_mla_reads_k_b_and_v_b_in_their_stored_type(micro):
    """The device holds attn_k_b and attn_v_b as the file's rows (q2_k mix: Q4_0), not float32 copies: the layer's
    device weights are those rows, byte for byte, and no float32 [H, C, N] / [H, V, C] array was uploaded."""
    from pymoe.quant import QType

    engine = on_cuda(micro("deepseek2", "q2_k"))
    list(engine.generate(PROMPT, max_tokens=2, stop_at_eos=False))
    for la in engine.model.layers:
        for name in ("k_b", "v_b"):
            rows = la.mla[f"{name}_rows"]
            assert rows.qtype == QType.Q4_0
            assert rows.raw.nbytes == la.mla[name].size // 32 * 18  # Q4_0: 18 bytes per 32 weights
            assert id(la.mla[name]) not in engine.backend._vectors


BLOCK_OPS = ("mla_kv_row", "mla_query_q", "mla_value_q", "chunk_attention", "decode_attention", "rmsnorm",
             "conv_chunk", "rule_chunk", "conv_step", "rule_step")  # the blocks' own kernels (not the products)


def block_kernels(monkeypatch) -> str:
    """Register (for this test) the kernel set "mixed": the reference kernels, but the real ones of BLOCK_OPS ->
    its name, for backend_options' `kernels`."""
    from pymoe.backends import cuda as cuda_backend

    class Mixed(cuda_backend.ReferenceKernels):
        name = "mixed"

    for op in BLOCK_OPS:
        setattr(Mixed, op, lambda self, *args, _op=op: getattr(cuda_backend.DeviceKernels(), _op)(*args))
    monkeypatch.setitem(cuda_backend.KERNEL_SETS, "mixed", Mixed)
    return "mixed"


@in_process
@pytest.mark.parametrize("arch, mix", [("deepseek2", "f32"), ("deepseek2", "q2_k"), ("qwen3next", "f32"),
                                       ("qwen35moe", "f32")])
def test_the_blocks_real_kernels_give_the_cpu_float_paths_tokens(micro, monkeypatch, arch, mix):
    """The prompt chunks and decode steps with the real kernels of the blocks (BLOCK_OPS: on the backend's own
    device views, strided ones included), the products and experts on the reference kernels (the real ones of every
    op cost minutes here: tests/test_cuda_real_kernels_sim.py)."""
    path = micro(arch, mix)
    want = list(pymoe.load(path, backend="cpu", chunk=CHUNK).generate(PROMPT, max_tokens=2, stop_at_eos=False))
    engine = pymoe.load(path, backend="cuda", chunk=CHUNK,
                        backend_options=dict(SIM, kernels=block_kernels(monkeypatch)))
    assert list(engine.generate(PROMPT, max_tokens=2, stop_at_eos=False)) == want  # 3 chunks, 1 decode step


@in_process
@pytest.mark.parametrize("arch, mix", [("deepseek2", "f32"), ("deepseek2", "q2_k"), ("qwen3next", "f32"),
                                       ("qwen35moe", "f32")])
def test_a_verify_steps_blocks_with_the_real_block_kernels(micro, monkeypatch, arch, mix):
    """Speculation's verify forward as one device step of T = 3 rows (the last token and two drafts) with the real
    kernels of the blocks (BLOCK_OPS; the products and experts on the reference kernels): on deepseek2 the cache
    rows written from the step's `at` over the T rows (mla_kv_row's at-kernel), the absorbed queries
    (mla_query_q's), causal chunk attention over the compressed cache, the values; on the hybrids the conv and the
    rule over the T rows on the device state (conv_chunk, rule_chunk) and the gated attention's chunk attention.
    Each row's argmax and logits against the reference backend's forward of the same rows (ULPS: the module
    docstring; measured 4.5 ulp of s on deepseek2 f32, 3.5 on q2_k, 5 on qwen3next, 3 on qwen35moe); one
    synchronisation, no copy but the step's two (its ids and position up, its argmax and routing ids back)."""
    from pymoe.backends.device_counts import difference
    from pymoe.experts.profile import Profile

    path = micro(arch, mix)
    ref = pymoe.load(path, backend="reference", chunk=CHUNK)
    cfg = ref.config
    pairs = [(i, e) for i in range(len(cfg.moe_layers)) for e in range(cfg.n_expert)]
    engine = pymoe.load(path, backend="cuda", chunk=CHUNK, cache_slots=len(pairs), pcie_frac=1.0,
                        profile=Profile(len(cfg.moe_layers), cfg.n_expert, pairs=pairs, counts=[1] * len(pairs)),
                        backend_options=dict(SIM, kernels=block_kernels(monkeypatch)))
    kv_ref, kv = ref.model.new_kv(32), engine.model.new_kv(32)
    ref.model.prefill(PROMPT[:6], kv_ref)
    engine.model.prefill(PROMPT[:6], kv)
    rows = [9, 200, 31]
    assert engine.model.verify_on_device(len(rows))
    want = ref.model.forward(rows, kv_ref, "decode")  # [3, V]
    before = engine.backend.counts.snapshot("decode")
    got = engine.model.forward(rows, kv, "decode")
    c = difference(engine.backend.counts.snapshot("decode"), before)
    T, n_ids = len(rows), len(cfg.moe_layers) * cfg.n_expert_used
    assert c["synchronisations"] == 1
    assert c["bytes"] == {"verify token ids and position to device": 4 * (2 + T),
                          "verify argmax and routing ids to host": 4 * T * (1 + n_ids)}
    assert [got[t].greedy_token for t in range(len(rows))] == [int(np.argmax(w)) for w in want]
    s = np.float32(np.abs(want).max())
    assert np.abs(np.asarray(got) - want).max() <= ULPS * np.spacing(s)


def counted_blocks(monkeypatch, module, name: str, counts) -> list:
    """Wrap module.name (a block) so that each call's own counts (backends/device_counts.difference) are kept."""
    from pymoe.backends.device_counts import difference

    seen, inner = [], getattr(module, name)

    def counted(b, *args):
        before = counts.snapshot("prefill")
        y = inner(b, *args)
        seen.append(difference(counts.snapshot("prefill"), before))
        return y

    monkeypatch.setattr(module, name, counted)
    return seen


@in_process
@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe"])
def test_a_prompt_chunks_gated_deltanet_is_one_round_trip_per_layer(micro, monkeypatch, arch):
    """One prompt chunk's Gated DeltaNet blocks, from the code (engine/deltanet.gdn_device): per layer the normed
    residual [T, D] up, the products qkv, gate, ba (qwen35moe: beta and alpha apart), conv_chunk, rule_chunk,
    ssm_out, [T, D] back (one sync); the recurrent state is on the device afterwards (no copy at the prefill's end,
    none at the first decode step)."""
    from pymoe.engine import deltanet

    engine = on_cuda(micro(arch))
    cfg = engine.config
    seen = counted_blocks(monkeypatch, deltanet, "gdn_device", engine.backend.counts)
    kv = engine.model.new_kv(32)
    engine.model.prefill(PROMPT[:CHUNK], kv)
    n = sum(1 for p in cfg.layer_plan() if p.attention == "gdn")
    products = 4 if cfg.traits.gdn_tiled else 3
    assert len(seen) == n
    for s in seen:
        assert (s["launches"], s["synchronisations"]) == (products + 2 + 1, 1)
        assert {w: b for w, b in s["bytes"].items() if w != "recurrent state to device"} == {
            "residual to device (attention block)": CHUNK * cfg.n_embd * F32,
            "attention block to host": CHUNK * cfg.n_embd * F32}
    assert kv.fresh == "device"
    before = engine.backend.counts.snapshot("decode")["bytes"].get("recurrent state to device", 0)
    engine.model.decode_one_token(3, kv)
    assert engine.backend.counts.snapshot("decode")["bytes"].get("recurrent state to device", 0) == before

if not IN_PROCESS:
    test_this_file_in_a_fresh_interpreter = fresh_interpreter_test(__file__)
