"""Gated DeltaNet (qwen3next's linear-attention layers): the two forms of the gated delta rule, the carried state,
and the whole hybrid model against llama.cpp on a prompt long enough for the chunked form.

What this is:
  - delta_rule_chunked == delta_rule_recurrent on random inputs, outputs and final state (float32 rounding of two
    orders of the same sums; bound derived below), for chunk sizes that divide the length and that do not;
  - a hand-worked single step (one head, dk = dv = 2) of the rule;
  - the conv and recurrent state carry over: a prefill of 100 tokens (chunked, T >= 64) then decodes equals
    decoding all of them one by one (recurrent), within the same bound;
  - llama.cpp on the tiny qwen3next file (F32) at 100 tokens, where its prefill chunks too: within 1e-5 of the
    logit scale (tests/test_model_vs_llamacpp.py's bound; it covers 50 tokens, the recurrent form);
  - the server does not reuse a prefix from the middle of a recurrent state.
What this is not: the other layers of the model (tests/test_model_vs_llamacpp.py runs qwen3next like every arch).
"""
import numpy as np
import pytest

import pymoe
from oracle import require_llama_cpp
from pymoe.engine.deltanet import CHUNK, delta_rule_chunked, delta_rule_recurrent, l2norm

# Relative bound between the two forms: both are float32 evaluations of the same sums over at most T = 150 terms of
# size <= 1 (q, k unit vectors, |beta| < 1, 0 < decay <= 1, |v| ~ 1), so each output carries about T * 2^-24 * |o|
# of rounding per form; the chunked form also solves a triangular system (float64 inside). Measured: 2e-6 of the
# largest output; 1e-4 allows for other BLAS orders.
FORMS_REL = 1e-4
EXACT_REL_BOUND = 1e-5  # tests/test_model_vs_llamacpp.py


def random_inputs(T, H=3, dk=8, dv=5, seed=0):
    rng = np.random.default_rng(seed)
    q = l2norm(rng.standard_normal((T, H, dk)).astype(np.float32), 1e-6) / np.float32(np.sqrt(dk))
    k = l2norm(rng.standard_normal((T, H, dk)).astype(np.float32), 1e-6)
    v = rng.standard_normal((T, H, dv)).astype(np.float32)
    g = -np.exp(rng.standard_normal((T, H))).astype(np.float32) * 0.3  # log-decays
    beta = (1 / (1 + np.exp(-rng.standard_normal((T, H))))).astype(np.float32)
    M = rng.standard_normal((H, dv, dk)).astype(np.float32) * 0.1
    return q, k, v, g, beta, M


@pytest.mark.parametrize("T, chunk", [(1, 64), (37, 8), (64, 64), (150, 64), (150, 7)])
def test_chunked_form_equals_recurrent_form(T, chunk):
    q, k, v, g, beta, M = random_inputs(T)
    M_rec, M_chunk = M.copy(), M.copy()
    o_rec = delta_rule_recurrent(q, k, v, g, beta, M_rec)
    o_chunk = delta_rule_chunked(q, k, v, g, beta, M_chunk, chunk=chunk)
    assert np.abs(o_chunk - o_rec).max() <= FORMS_REL * np.abs(o_rec).max()
    assert np.abs(M_chunk - M_rec).max() <= FORMS_REL * np.abs(M_rec).max()


def test_one_step_by_hand():
    """M0 = I (dv = dk = 2), decay e^g = 1/2, k = e1, v = (1, 1), beta = 1/2, q = e2:
    M = M0/2 = diag(1/2, 1/2); d = beta (v - M k) = (1/4, 1/2); M += d k^T -> [[3/4, 0], [1/2, 1/2]]; o = M q = (0, 1/2)."""
    M = np.eye(2, dtype=np.float32)[None]
    o = delta_rule_recurrent(np.array([[[0, 1]]], np.float32), np.array([[[1, 0]]], np.float32),
                             np.array([[[1, 1]]], np.float32), np.log(np.array([[0.5]], np.float32)),
                             np.array([[0.5]], np.float32), M)
    np.testing.assert_allclose(M[0], [[0.75, 0.0], [0.5, 0.5]], rtol=1e-6)
    np.testing.assert_allclose(o[0, 0], [0.0, 0.5], rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model("qwen3next", "f32")


def test_state_carries_over_from_a_chunked_prefill_to_decode(model_path):
    engine = pymoe.load(model_path, backend="reference")
    ids = np.random.default_rng(3).integers(0, engine.config.n_vocab, 100)
    m = engine.model
    kv = m.new_kv(128)
    assert 100 >= CHUNK  # the prefill below takes the chunked form
    long = np.concatenate([m.prefill(ids[:90], kv), np.stack([m.decode_one_token(int(t), kv) for t in ids[90:]])])
    kv = m.new_kv(128)
    steps = np.stack([m.decode_one_token(int(t), kv) for t in ids])  # recurrent all the way
    assert np.abs(long - steps).max() <= FORMS_REL * np.abs(steps).max()


def test_llama_cpp_agrees_at_100_tokens(model_path):
    engine = pymoe.load(model_path, backend="reference")
    ids = np.random.default_rng(4).integers(0, engine.config.n_vocab, 100).tolist()
    ours = engine.logits(ids)  # [100, V] one prefill call: the chunked form
    llm = require_llama_cpp().Llama(model_path=model_path, n_ctx=128, n_threads=2, n_batch=128, verbose=False,
                                    logits_all=True, type_k=0, type_v=0, seed=0)
    llm.eval(ids)
    ref = np.asarray(llm.scores[:100])
    assert np.abs(ours - ref).max() <= EXACT_REL_BOUND * np.abs(ref).max(), np.abs(ours - ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_server_never_reuses_part_of_a_recurrent_state(model_path):
    """Through the OpenAI API: a prompt that shares only part of a slot's cached tokens is read from scratch
    (cached_tokens 0: the recurrent state holds every cached token at once and cannot be cut back), and its answer
    is the one a fresh engine gives. Cutting the KV position back instead (what prefix reuse does for softmax
    attention) would give other logits: checked directly at the end."""
    import openai
    from pymoe.serve.app import BackgroundServer, create_app

    reference = pymoe.load(model_path, n_ctx=256)
    first = reference.tokenizer.encode("Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 123 and then some more words")
    other = first[:8] + reference.tokenizer.encode(" the quick brown fox")
    app = create_app(pymoe.load(model_path, n_ctx=256), parallel=1, max_queue=4, kv="f32")
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        client.completions.create(model="tiny", prompt=first, max_tokens=4, temperature=0)
        r = client.completions.create(model="tiny", prompt=other, max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.choices[0].text == "".join(reference.stream(other, max_tokens=8))

    m = reference.model
    kv = m.new_kv(64)
    m.prefill(np.asarray(first), kv)
    kv.n = 8  # a naive prefix reuse of 8 tokens ...
    cut = m.prefill(np.asarray(other[8:]), kv)[-1]
    kv.clear()
    fresh = m.prefill(np.asarray(other), kv)[-1]
    assert np.abs(cut - fresh).max() > 1e-3 * np.abs(fresh).max()  # ... would be wrong


def test_qwen35_rope_sections_that_leave_pairs_outside_t_h_w_turn_text_as_plain_rope(tiny_model):
    """IMRoPE sectors outside the t/h/w sections (Qwen3-VL's [24, 20, 20]: sector 61 of 64) turn by ggml's 4th
    position, which for text tokens is the token's position (llama-batch.cpp broadcasts a token's position to every
    section), and by t in transformers (apply_interleaved_mrope): for text, plain RoPE either way. Here [1, 1, 1, 1]
    over the tiny file's 8 pairs leaves sectors 3 (pairs 3 and 7) outside: the tables of (p, p, p) positions must be
    those of p (pair 3 turns 0.12 rad by position 50, so sending it to position 0 would fail)."""
    from dataclasses import replace

    from pymoe.gguf.config import REQUIRED, ModelConfig
    from pymoe.gguf.loader import load_gguf
    import pymoe

    m = load_gguf(tiny_model("qwen35moe", "f32"))
    base = m.metadata_getter("x.gguf: ")

    def get(key, default=REQUIRED):
        if key == "qwen35moe.rope.dimension_sections":
            return [1, 1, 1, 1]
        return base(key, default)

    cfg = ModelConfig.from_gguf(get, n_vocab=m.config.n_vocab, tied_output=False, where="x.gguf: ")
    assert cfg.rope_sections == (1, 1, 1, 1) and m.config.rope_sections == (3, 3, 2, 0)
    model = pymoe.load(tiny_model("qwen35moe", "f32"), backend="cpu").model
    model.cfg = replace(model.cfg, rope_sections=cfg.rope_sections)
    p = np.arange(50)
    plain, multi = model.rope_tables(p), model.rope_tables(np.repeat(p[:, None], 3, 1))
    assert np.array_equal(plain[0], multi[0]) and np.array_equal(plain[1], multi[1])


def test_long_context_chunked_prefill_equals_one_chunk_equals_token_by_token(model_path):
    """2,100 tokens through qwen3next (3 Gated DeltaNet layers + 1 gated attention layer): a prefill cut into calls
    of 512 tokens, one call of all of them (the chunked form over 33 blocks of 64), and 2,100 single-token decodes
    (the recurrent form) give the same last-position logits and the same final states, within FORMS_REL of the
    largest value (measured: 1.6e-7 and 3.4e-7 of the logit scale, states 2.1e-7; the decays keep the rounding of
    2,100 steps from adding up)."""
    engine = pymoe.load(model_path)
    m = engine.model
    ids = np.random.default_rng(6).integers(0, engine.config.n_vocab, 2100)
    runs = {}
    for name, chunk in (("chunks of 512", 512), ("one call", 4096)):
        m.chunk, kv = chunk, m.new_kv(2200)
        runs[name] = (m.prefill(ids, kv)[-1], kv)
    kv = m.new_kv(2200)
    for t in ids[:-1]:
        m.decode_one_token(int(t), kv)
    runs["token by token"] = (m.decode_one_token(int(ids[-1]), kv), kv)
    ref_logits, ref_kv = runs["token by token"]
    for name, (logits, kv) in runs.items():
        assert np.abs(logits - ref_logits).max() <= FORMS_REL * np.abs(ref_logits).max(), name
        for layer in (0, 1, 2):
            s, r = kv.recurrent(layer)["ssm"], ref_kv.recurrent(layer)["ssm"]
            assert np.abs(s - r).max() <= FORMS_REL * np.abs(r).max(), (name, layer)


def test_a_file_with_an_mtp_block_runs_its_trunk_and_keeps_the_block(model_path, tmp_path):
    """The article's model ships an MTP (NextN) head: block_count counts it, nextn_predict_layers says so, and its
    tensors (a full-attention block plus nextn.eh_proj/enorm/hnorm/shared_head_norm) follow the trunk, as the
    converter writes them. pymoe runs the 4 trunk layers, gives the same logits as the file without the block
    (bit for bit: same trunk weights), agrees with llama.cpp on the file, and keeps the block's tensors for
    speculative decoding."""
    from pymoe.demo.tinymodel import write_model
    from pymoe.gguf.loader import load_gguf

    path = str(tmp_path / "tiny-qwen3next-mtp.gguf")
    write_model(path, "qwen3next", "tiny", "f32", seed=0, mtp=True)
    m = load_gguf(path)
    assert (m.config.n_layers, m.config.n_nextn) == (4, 1)
    assert {"blk.4.nextn.eh_proj.weight", "blk.4.attn_q.weight", "blk.4.ffn_gate_exps.weight"} <= set(m.mtp_tensors)
    assert not load_gguf(model_path).mtp_tensors
    engine = pymoe.load(path, backend="reference")
    ids = np.random.default_rng(7).integers(0, engine.config.n_vocab, 30).tolist()
    ours = engine.logits(ids)
    assert np.array_equal(ours, pymoe.load(model_path, backend="reference").logits(ids))
    llm = require_llama_cpp().Llama(model_path=path, n_ctx=64, n_threads=2, n_batch=64, verbose=False,
                                    logits_all=True, type_k=0, type_v=0, seed=0)
    llm.eval(ids)
    ref = np.asarray(llm.scores[:30])
    assert np.abs(ours - ref).max() <= EXACT_REL_BOUND * np.abs(ref).max()
