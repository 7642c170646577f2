"""The loader: config from metadata, tensor views into the mmap (no copies), one expert's bytes, `pymoe inspect`."""
import numpy as np
import pytest

from conftest import ARCHS, MIXES, run_pymoe
from pymoe.gguf.loader import EXPERT_PROJ, expected_tensors, load_gguf
from pymoe.quant import QType
from pymoe.demo.tinymodel import make_config


@pytest.mark.parametrize("arch", ARCHS)
def test_config_round_trips_through_metadata(tiny_model, arch):
    m = load_gguf(tiny_model(arch, "f32"))
    want = make_config(arch, "tiny", n_vocab=m.config.n_vocab)
    assert m.config == want
    assert set(expected_tensors(m.config)) <= set(m.tensors)


def test_qwen3moe_head_dim_comes_from_key_length(tiny_model):
    cfg = load_gguf(tiny_model("qwen3moe", "f32")).config
    assert cfg.head_dim * cfg.n_head != cfg.n_embd  # the tiny preset makes them differ on purpose
    assert cfg.head_dim == 64 and cfg.norm_topk and cfg.qk_norm == "head"


def test_arch_traits(tiny_model):
    assert load_gguf(tiny_model("qwen2moe")).config.n_ff_shexp == 512
    assert load_gguf(tiny_model("llama")).config.rope_neox is False
    assert load_gguf(tiny_model("olmoe")).config.qk_norm == "full"
    assert load_gguf(tiny_model("llama")).config.tied_output is True


@pytest.mark.parametrize("mix", MIXES)
def test_expert_views_are_the_mmap_not_copies(tiny_model, mix):
    m = load_gguf(tiny_model("qwen3moe", mix))
    cfg = m.config
    for layer in range(cfg.n_layers):
        for e in (0, cfg.n_expert - 1):
            ex = m.expert(layer, e)
            for proj in EXPERT_PROJ:
                view = getattr(ex, proj)
                full = m.layer_tensor(layer, f"ffn_{proj}_exps.weight").data.view(np.uint8)
                assert np.shares_memory(view, m.reader.data)  # a view into the file's memory map
                assert view.flags.c_contiguous  # one expert = one contiguous run of bytes per matrix
                np.testing.assert_array_equal(view, full[e])
    ex = m.expert(0, 0)
    assert ex.gate.shape[0] == cfg.n_ff_exp and ex.down.shape[0] == cfg.n_embd
    assert m.slot_bytes == ex.gate.nbytes + ex.up.nbytes + ex.down.nbytes


def test_q2k_mix_types(tiny_model):
    m = load_gguf(tiny_model("qwen3moe", "q2_k"))
    assert m.expert_types(0) == {"gate": QType.Q2_K, "up": QType.Q2_K, "down": QType.Q3_K}
    assert m.tensor("blk.0.attn_v.weight").qtype == QType.Q4_K
    assert m.tensor("output.weight").qtype == QType.Q6_K
    assert m.tensor("blk.0.ffn_norm.weight").qtype == QType.F32
    assert m.tensor("blk.0.ffn_gate_inp.weight").qtype == QType.F32
    # Q2_K: 84 bytes per 256 weights; an expert's gate is n_ff_exp rows of n_embd weights.
    cfg = m.config
    assert m.expert(0, 0).gate.nbytes == cfg.n_ff_exp * cfg.n_embd // 256 * 84


def test_metadata_strings(tiny_model):
    m = load_gguf(tiny_model("qwen3moe"))
    tokens = m.metadata("tokenizer.ggml.tokens")
    assert len(tokens) == m.config.n_vocab and "<|im_end|>" in tokens
    assert m.metadata("tokenizer.ggml.model") == "gpt2"
    assert "im_start" in m.metadata("tokenizer.chat_template")


def test_inspect_prints_config_types_and_slot_size(tiny_model):
    path = tiny_model("qwen3moe", "q2_k")
    r = run_pymoe("inspect", path)
    assert r.returncode == 0, r.stderr
    m = load_gguf(path)
    assert f"slot size: {m.slot_bytes} bytes" in r.stdout
    for name in ("Q2_K", "Q3_K", "Q4_K", "Q6_K", "F32", "n_expert_used"):
        assert name in r.stdout


def _same_model(a, b):
    """Two GGUFModels of one file: the same metadata, config, tensors (types, shapes, bytes), each a view of its map."""
    assert a.reader.fields.keys() == b.reader.fields.keys()
    for key in a.reader.fields:
        assert a.metadata(key) == b.metadata(key), key
    assert a.config == b.config and a.tensors.keys() == b.tensors.keys()
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert (t.qtype, t.shape, t.data.dtype, t.data.shape) == (u.qtype, u.shape, u.data.dtype, u.data.shape), name
        np.testing.assert_array_equal(t.data, u.data)
        assert np.shares_memory(u.data, b.reader.data)
    for t, u in zip(a.reader.tensors, b.reader.tensors):
        assert (t.name, t.tensor_type, list(t.shape), t.n_bytes, t.data_offset) == \
               (u.name, u.tensor_type, list(u.shape), u.n_bytes, u.data_offset)


def test_the_header_cache_gives_the_parsed_model_back_and_only_for_the_same_file(tiny_model, tmp_path, monkeypatch):
    """pymoe/gguf/header.py: a header that took MIN_PARSE_S to parse is kept (0 here: the tiny file's is too quick to
    be cached by default); the next load of the same file reads it and gives the same model. A rewritten file, a
    broken entry and PYMOE_HEADER_CACHE=0 are parsed by gguf-py again."""
    import os
    import shutil

    from pymoe.gguf import header

    monkeypatch.setenv("PYMOE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "m.gguf")
    shutil.copy(tiny_model("qwen2moe", "q2_k"), path)
    first = load_gguf(path)
    assert not first.reader.from_cache and not os.path.exists(header.cache_entry(path))  # quick: not cached
    monkeypatch.setattr(header, "MIN_PARSE_S", 0.0)
    parsed = load_gguf(path)
    assert not parsed.reader.from_cache and os.path.exists(header.cache_entry(path))
    cached = load_gguf(path)
    assert cached.reader.from_cache
    _same_model(parsed, cached)
    tokens = cached.metadata("tokenizer.ggml.tokens")
    tokens.append("mine")  # the caller's list: the header's stays as it was
    assert cached.metadata("tokenizer.ggml.tokens") == parsed.metadata("tokenizer.ggml.tokens")

    shutil.copy(tiny_model("olmoe", "q2_k"), path)  # another model at the same path
    other = load_gguf(path)
    assert not other.reader.from_cache and other.config.arch == "olmoe"
    assert load_gguf(path).reader.from_cache

    with open(header.cache_entry(path), "wb") as f:  # a broken entry: parsed again and rewritten
        f.write(b"not a pickle")
    assert not load_gguf(path).reader.from_cache
    again = load_gguf(path)
    assert again.reader.from_cache
    _same_model(other, again)

    monkeypatch.setenv("PYMOE_HEADER_CACHE", "0")
    assert not load_gguf(path).reader.from_cache
    os.remove(header.cache_entry(path))
    load_gguf(path)
    assert not os.path.exists(header.cache_entry(path))


def test_the_header_cache_keeps_the_entries_used_last(tiny_model, tmp_path, monkeypatch):
    """MAX_ENTRIES: a write deletes the entries used longest ago (a read counts as a use); entries of files that
    were rewritten or deleted are never reached again and must not pile up."""
    import os
    import shutil

    from pymoe.gguf import header

    monkeypatch.setenv("PYMOE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(header, "MIN_PARSE_S", 0.0)
    monkeypatch.setattr(header, "MAX_ENTRIES", 2)
    paths = [str(tmp_path / f"{i}.gguf") for i in range(3)]
    for p in paths:
        shutil.copy(tiny_model("qwen3moe", "f32"), p)
    load_gguf(paths[0])
    load_gguf(paths[1])
    os.utime(header.cache_entry(paths[0]), (1, 1))  # 0 used long ago, 1 later
    os.utime(header.cache_entry(paths[1]), (2, 2))
    assert load_gguf(paths[0]).reader.from_cache  # a read: 0 is now the one used last
    load_gguf(paths[2])  # a third entry: the one used longest ago (1) goes
    kept = {p for p in paths if os.path.exists(header.cache_entry(p))}
    assert kept == {paths[0], paths[2]} and len(os.listdir(header.cache_dir())) == 2
