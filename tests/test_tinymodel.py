"""tools/make-tiny-model: deterministic files that llama.cpp (llama-cpp-python) loads and runs, all archs and mixes."""
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

from oracle import require_llama_cpp

from conftest import ARCHS, MIXES, ROOT
from pymoe.gguf.loader import load_gguf


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mix", MIXES)
def test_llama_cpp_loads_and_runs(tiny_model, arch, mix):
    llama_cpp = require_llama_cpp()
    path = tiny_model(arch, mix)
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=2, verbose=False, logits_all=True,
                          type_k=0, type_v=0)
    assert llm.n_vocab() == load_gguf(path).config.n_vocab
    ids = llm.tokenize(b"def forward(self, x): return x", add_bos=False, special=True)
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids)])
    assert np.isfinite(logits).all() and logits.std() > 0.1


def test_deterministic_and_cli(tmp_path, tiny_model):
    out = tmp_path / "again.gguf"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make-tiny-model"), "-o", str(out),
                        "--arch", "qwen3moe", "--quant", "q2_k"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout
    assert sha(out) == sha(tiny_model("qwen3moe", "q2_k"))


def test_routing_is_skewed(tiny_model):
    """The router's built-in popularity makes some experts win far more often than uniform routing would."""
    m = load_gguf(tiny_model("qwen3moe", "f32"))
    cfg = m.config
    emb = np.asarray(m.tensor("token_embd.weight").data, dtype=np.float32)  # [V, D]
    x = emb / np.sqrt((emb**2).mean(-1, keepdims=True))
    router = np.asarray(m.tensor("blk.0.ffn_gate_inp.weight").data, dtype=np.float32)  # [E, D]
    top = np.argsort(-(x @ router.T), axis=1)[:, : cfg.n_expert_used]  # [V, K]
    counts = np.bincount(top.ravel(), minlength=cfg.n_expert)
    share_top_quarter = np.sort(counts)[::-1][: cfg.n_expert // 4].sum() / counts.sum()
    assert share_top_quarter > 0.5, counts


def test_parallel_quantization_writes_the_same_bytes(tiny_model, tmp_path):
    """--jobs N quantizes tensors in N processes; the file is byte-identical to the one-process file."""
    from pymoe.demo.tinymodel import write_model

    write_model(str(tmp_path / "j2.gguf"), "qwen2moe", "tiny", "q2_k", seed=0, jobs=2)
    assert sha(tmp_path / "j2.gguf") == sha(tiny_model("qwen2moe", "q2_k"))
