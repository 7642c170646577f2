"""Batched decode and the KV cache variants: N sequences in one step == N single decodes (bit for bit); int8 and
f16 KV within measured bounds of the f32 cache, and int8 as accurate as llama.cpp's own q8_0 cache, at half the
memory of f16."""
import tracemalloc

import numpy as np
import pytest

from oracle import require_llama_cpp

import pymoe
from conftest import ARCHS
from pymoe.engine.batch import decode_batch
from pymoe.experts.cache import COUNTERS, SlotCache
from pymoe.errors import PymoeError
from pymoe.engine.kv import QuantizedPlane, kv_nbytes, new_kv
from pymoe.demo.tinymodel import make_config


def prefilled(model, prompts, n_ctx=64, kind="f32"):
    """One KV cache per prompt, prefilled -> (caches, greedy first tokens)."""
    kvs = [new_kv(model.cfg, n_ctx, kind) for _ in prompts]
    first = [int(model.prefill(np.asarray(p), kv)[-1].argmax()) for p, kv in zip(prompts, kvs)]
    return kvs, first


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mix", ["f32", "q2_k"])
def test_decode_batch_equals_single_decodes(tiny_model, arch, mix):
    """Three sequences of different lengths: batched logits == separate decode_one_token logits, bit for bit."""
    m = pymoe.load(tiny_model(arch, mix))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, m.config.n_vocab, n) for n in (5, 11, 2)]
    batched, tokens = prefilled(m.model, prompts)
    single, _ = prefilled(m.model, prompts)
    for _ in range(6):
        got = decode_batch(m.model, tokens, batched)  # [3, V]
        want = np.stack([m.model.decode_one_token(t, kv) for t, kv in zip(tokens, single)])
        np.testing.assert_array_equal(got, want)  # the fast path's contract: same bits for 1 row or N
        tokens = got.argmax(axis=1).tolist()
    assert [kv.n for kv in batched] == [len(p) + 6 for p in prompts]


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_batch_of_several_tokens_per_sequence_equals_separate_forwards(tiny_model, arch):
    """forward_batch (the server's speculative verification of several slots): 3, 1 and 5 tokens for three
    sequences in one forward -> each sequence's rows are the logits of its own Model.forward of those tokens, bit
    for bit, on every family (per-sequence attention over ragged rows, RoPE at each row's own position, the
    hybrids' recurrent state advanced per sequence), and each cache advanced by its own count."""
    from pymoe.engine.batch import forward_batch

    m = pymoe.load(tiny_model(arch, "q2_k"))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, m.config.n_vocab, n) for n in (6, 2, 9)]
    batched, _ = prefilled(m.model, prompts)
    single, _ = prefilled(m.model, prompts)
    for step in range(2):
        lists = [rng.integers(0, m.config.n_vocab, n).tolist() for n in ((3, 1, 5), (1, 4, 2))[step]]
        got = forward_batch(m.model, lists, batched)  # [sum T_j, V]
        want = np.concatenate([m.model.forward(t, kv, "decode") for t, kv in zip(lists, single)])
        np.testing.assert_array_equal(got, want)
    assert [kv.n for kv in batched] == [kv.n for kv in single] == [6 + 4, 2 + 5, 9 + 7]


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_batch_reads_each_projection_once_for_all_rows(tiny_model, arch):
    """The attention blocks project all N rows in one matmul (engine/attention.py): a batched step of 3 sequences
    makes as many linear calls (each one read of a weight) as a step of 1, on every family (GQA, gated attention
    and Gated DeltaNet on the hybrids, MLA), and its logits are those of 3 single decodes, bit for bit."""
    m = pymoe.load(tiny_model(arch, "f32"))
    b = m.model.backend
    calls = []
    for name in ("linear", "linear_many"):
        real = getattr(b, name)
        setattr(b, name, lambda w, x, real=real, name=name: calls.append(name) or real(w, x))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, m.config.n_vocab, n) for n in (4, 9, 1)]
    batched, tokens = prefilled(m.model, prompts)
    single, _ = prefilled(m.model, prompts)
    per_step = []
    for kvs, toks in ((batched, tokens), (batched[:1], tokens[:1])):  # 3 rows, then 1 (its values: unchecked)
        calls.clear()
        got = decode_batch(m.model, toks, kvs)  # [N, V]
        per_step.append(len(calls))
        if len(kvs) == 3:
            want = np.stack([m.model.decode_one_token(t, kv) for t, kv in zip(tokens, single)])
            np.testing.assert_array_equal(got, want)
    assert per_step[0] == per_step[1] and per_step[0] >= m.config.n_layers  # not N times per layer


def test_row_counts_split_the_cache_counters_without_changing_the_policy(tiny_model):
    """With a slot cache too small for the working set: per-row counters add up to the cache's, and the cache ends
    in the same state as without the split."""
    path = tiny_model("qwen3moe", "f32")
    runs = []
    for split in (False, True):
        m = pymoe.load(path)
        m.model.cache = SlotCache(m.file, 3, policy="lru")
        kvs, tokens = prefilled(m.model, [[1, 2, 3], [40, 50], [7]])
        before = m.model.cache.stats.snapshot("decode")
        rows = [{} for _ in kvs] if split else None
        for _ in range(4):
            tokens = decode_batch(m.model, tokens, kvs, rows).argmax(axis=1).tolist()
        after = m.model.cache.stats.snapshot("decode")
        runs.append((after, m.model.cache.residency.copy(), tokens))
        if split:
            cfg = m.config
            assert all(r["lookups"] == 4 * cfg.n_layers * cfg.n_expert_used for r in rows)
            for name in COUNTERS:
                assert sum(r[name] for r in rows) == after[name] - before[name]
            assert sum(r["spill"] for r in rows) > 0  # 3 slots: there were misses to split
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    assert runs[0][2] == runs[1][2]


def test_decode_batch_rejects_bad_batches(tiny_model):
    m = pymoe.load(tiny_model("qwen3moe", "f32"))
    kv = m.model.new_kv(4)
    with pytest.raises(PymoeError, match="its own KV cache"):
        decode_batch(m.model, [1, 2], [kv, kv])
    with pytest.raises(PymoeError, match="one token per KV cache"):
        decode_batch(m.model, [1, 2], [kv])
    kv.n = 4
    with pytest.raises(PymoeError, match="context full"):
        decode_batch(m.model, [1], [kv])


# --- what the cache holds --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_kv_cache_holds_only_what_each_layer_attends_over(tiny_model, arch):
    """Bytes of a cache = n_ctx x the values per token counted from the file's own tensors and keys, not from
    pymoe's config: a layer with attn_k keeps G x (Dh + Dv) values (key/value_length), an MLA layer (attn_kv_a_mqa)
    one compressed row of kv_lora_rank + rope (its V is read from it), a Gated DeltaNet layer (ssm_a) none. The f32
    cache holds a layer's keys in tiles of 64 positions (engine/kv.py KeyTiles), so 16 positions take one tile."""
    import gguf

    r = gguf.GGUFReader(tiny_model(arch, "f32"))
    key = lambda k: int(r.fields[f"{arch}.{k}"].contents())  # noqa: E731
    names = {t.name for t in r.tensors}
    keys = rows = 0  # values per token: keys of layers with a V plane; everything else (V, MLA's rows)
    for i in range(key("block_count")):
        if f"blk.{i}.attn_kv_a_mqa.weight" in names:
            rows += key("attention.kv_lora_rank") + key("rope.dimension_count")
        elif f"blk.{i}.attn_k.weight" in names:
            keys += key("attention.head_count_kv") * key("attention.key_length")
            rows += key("attention.head_count_kv") * key("attention.value_length")
        else:
            assert f"blk.{i}.ssm_a" in names
    m = pymoe.load(tiny_model(arch, "f32"))
    assert kv_nbytes(new_kv(m.config, 16, "f32")) == (64 * keys + 16 * rows) * 4
    assert kv_nbytes(new_kv(m.config, 128, "f32")) == 128 * (keys + rows) * 4
    assert kv_nbytes(new_kv(m.config, 16, "f16")) == 16 * (keys + rows) * 2


# --- int8 KV -------------------------------------------------------------------------------------------------------

def test_quantized_plane_round_trip():
    rng = np.random.default_rng(0)
    plane = QuantizedPlane((2, 8, 3, 64))  # [L, n_ctx, G, Dh]
    x = rng.standard_normal((5, 3, 64)).astype(np.float32) * np.array([0.01, 1.0, 30.0])[None, :, None]
    x[2, 1] = 0.0  # an all-zero head stays exactly zero
    plane[1, 2:7] = x
    back = plane[1, :7][2:]
    bound = np.abs(x).max(axis=-1, keepdims=True) / 254 * 1.01  # half a step, plus the f16 rounding of the scale
    assert np.all(np.abs(back - x) <= bound + 1e-12)
    assert np.all(back[2, 1] == 0.0)
    assert plane.q.dtype == np.int8 and plane.d.dtype == np.float16


def teacher_forced(model, ids, kind):
    """Logits [len(ids), V] with a `kind` KV cache: prefill the first 10 tokens, then decode the rest one by one."""
    kv = new_kv(model.cfg, 64, kind)
    return np.concatenate([model.prefill(ids[:10], kv),
                           np.stack([model.decode_one_token(int(t), kv) for t in ids[10:]])])


# Bounds of the 8- and 16-bit KV caches against the f32 one, relative to the logit scale s = max |logit| of the f32
# run. Measured (2026-11-30; 4 tiny files x prompt seeds 2, 3, 4; 40 tokens teacher-forced): int8 2.6e-3 s to
# 6.6e-3 s (the tiny llama file, whose tied output gives logits 3x larger than the others', is the worst: 0.055-0.080
# absolute), f16 8.5e-5 s to 2.2e-4 s. On the prompt tested here (seed 2) the worst are 4.2e-3 s (int8, llama) and
# 1.4e-4 s (f16). Bounds: int8 1e-2 s (1.5x the worst of all 12 runs, 2.4x this prompt's; tighter than the old
# absolute 0.05 on the three files of scale ~4), f16 5e-4 s (2.3x the worst; about one f16 rounding step of the
# logit scale, 2^-11 = 4.9e-4). Top-1 agreement: f16 1.0 everywhere; int8 1.0 on this prompt (one near-tie flip of
# 40 on another: 0.975, llama, seed 4); the old bound 0.96 is kept. The 8-bit accuracy itself has an independent
# oracle: llama.cpp's q8_0 cache (next test).
KV_REL_BOUND = {"int8": 1e-2, "f16": 5e-4}
KV_TOP1 = {"int8": 0.96, "f16": 1.0}


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_and_f16_kv_close_to_the_f32_cache(tiny_model, arch):
    """Teacher-forced over 40 tokens (prefill 10, decode 30): int8- and f16-KV logits vs the f32 cache within the
    measured bounds above; then 16 greedy tokens with the int8 cache identical to the f32 run."""
    m = pymoe.load(tiny_model(arch, "f32"))
    ids = np.random.default_rng(2).integers(0, m.config.n_vocab, 40)
    ref = m.model.prefill(ids, m.model.new_kv(64))  # [40, V]
    scale = np.abs(ref).max()
    for kind in ("int8", "f16"):
        got = teacher_forced(m.model, ids, kind)
        err = float(np.abs(got - ref).max())
        assert 0 < err <= KV_REL_BOUND[kind] * scale, (kind, err, err / scale)
        assert (got.argmax(axis=1) == ref.argmax(axis=1)).mean() >= KV_TOP1[kind], kind
    greedy = list(m.generate([3, 4, 5], max_tokens=16, stop_at_eos=False))  # f32 KV cache
    kv = new_kv(m.config, 64, "int8")
    logits, out = m.model.prefill(np.array([3, 4, 5]), kv)[-1], []
    for _ in range(16):
        out.append(int(logits.argmax()))
        logits = m.model.decode_one_token(out[-1], kv)
    assert out == greedy


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_kv_is_as_accurate_as_llamacpp_q8_0_cache(tiny_model, arch):
    """The 8-bit oracle: llama.cpp's q8_0 K/V cache (GGML Q8_0 blocks, flash attention) against its own F32 cache
    on the same file and prompt, vs pymoe's int8 cache against pymoe's f32 one. Compared on the mean over tokens of
    the per-token max |diff| (the overall max is one event: a near-tie in a router can flip under either cache).
    Measured ratio pymoe / llama.cpp: 0.80-1.13 over 4 files x 5 prompts; 0.91-0.98 on this prompt."""
    llama_cpp = require_llama_cpp()
    path = tiny_model(arch, "f32")
    m = pymoe.load(path)
    ids = np.random.default_rng(2).integers(0, m.config.n_vocab, 40)

    def llamacpp_logits(ggml_type):  # 0 = F32, 8 = Q8_0 (GGML type ids, as llama-cpp-python takes them)
        llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=2, n_batch=64, verbose=False, logits_all=True,
                              type_k=ggml_type, type_v=ggml_type, flash_attn=True, seed=0)
        llm.eval(ids.tolist())
        return np.asarray(llm.scores[: len(ids)])  # [40, V]

    theirs = np.abs(llamacpp_logits(8) - llamacpp_logits(0)).max(axis=1).mean()
    ours = np.abs(teacher_forced(m.model, ids, "int8") - m.model.prefill(ids, m.model.new_kv(64))).max(axis=1).mean()
    assert 0 < ours <= 1.25 * theirs, (ours, theirs)


@pytest.mark.parametrize("preset", ["tiny", "mid"])
def test_int8_kv_halves_the_memory_of_f16(preset):
    """Measured twice: the arrays' nbytes, and what tracemalloc sees NumPy allocate for one cache (full context:
    tiny 512 positions, 2 layers; mid 4096 positions, 12 layers, 4 KV heads; both Dh = 64)."""
    cfg = make_config("qwen3moe", preset)

    def allocated(kind):
        tracemalloc.start()
        kv = new_kv(cfg, cfg.n_ctx_train, kind)
        size = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        return size, kv_nbytes(kv)

    (f32, f32_n), (f16, f16_n), (i8, i8_n) = allocated("f32"), allocated("f16"), allocated("int8")
    assert f16_n * 2 == f32_n
    assert i8_n / f16_n == pytest.approx((64 + 4) / 128)  # Dh = 64 int8 values + one f16 scale per 32 values
    assert i8 / f16 < 0.55 and f16 / f32 < 0.55
    assert f16 >= f16_n and i8 >= i8_n  # tracemalloc saw the arrays themselves, not just their bookkeeping
