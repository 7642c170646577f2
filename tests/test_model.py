"""The forward pass on its own: a hand-computable MoE block, KV-cache decode == full re-forward, bad prompts."""
import numpy as np
import pytest

import pymoe
from conftest import ARCHS, run_pymoe
from pymoe.backends.cpu import CPUBackend
from pymoe.backends.reference import DenseWeight, ReferenceBackend
from pymoe.gguf.config import LayerPlan
from pymoe.experts.cache import PassThroughCache
from pymoe.errors import PymoeError
from pymoe.backends.reference import route, silu
from pymoe.engine.moe import moe_block
from pymoe.quant import QType
from pymoe.demo.tinymodel import make_config


class FakeExperts:
    """Stands in for the expert cache: expert e's raw F32 gate/up/down rows, and a lookup counter."""

    def __init__(self, gate, up, down):
        self.mats = gate, up, down
        self.looked_up = []

    def lookup(self, layer, ids, phase):
        self.looked_up.append(ids.copy())

    def expert(self, layer, e):
        from pymoe.gguf.loader import ExpertBytes

        g, u, d = (m[e].view(np.uint8) for m in self.mats)
        return ExpertBytes(layer, e, g, u, d)

    def finish(self, layer):
        pass


class FakeLayer:
    def __init__(self, cfg, router):
        self.index, self.cfg, self.plan = 0, cfg, LayerPlan(0, "gqa", "moe")
        self.ffn_gate_inp = DenseWeight(QType.F32, router, router.shape)
        self.expert_types = dict.fromkeys(("gate", "up", "down"), QType.F32)
        self.shared = {}
        self.router_bias = self.expert_bias = self.ffn = None  # gpt-oss's and GLM's extras: none here


@pytest.mark.parametrize("backend", [ReferenceBackend, CPUBackend])
def test_moe_block_by_hand(backend):
    """Diagonal experts (gate = a_e I, up = b_e I, down = c_e I) and a router that ignores everything but x[0] = 1:
    expert e's logit is l_e, so the top-2 and their weights are known, and y = sum_e w_e c_e silu(a_e x) b_e x."""
    D, E = 4, 4
    cfg = make_config("qwen3moe", "tiny")  # K = 2, norm_topk = True
    logits = np.array([0.5, 3.0, -1.0, 2.0], dtype=np.float32)  # top-2: experts 1 and 3
    router = np.zeros((E, D), dtype=np.float32)
    router[:, 0] = logits
    a, b, c = np.array([1.0, 2.0, 3.0, 0.5]), np.array([1.0, -1.0, 2.0, 4.0]), np.array([1.0, 0.5, 1.0, 2.0])
    eye = np.eye(D, dtype=np.float32)
    gate = np.stack([a_ * eye for a_ in a]).astype(np.float32)
    up = np.stack([b_ * eye for b_ in b]).astype(np.float32)
    down = np.stack([c_ * eye for c_ in c]).astype(np.float32)
    x = np.array([[1.0, 0.3, -0.7, 2.0], [1.0, -1.0, 0.0, 0.5]], dtype=np.float32)  # [T=2, D]
    fake = FakeExperts(gate, up, down)

    y, ids, w = moe_block(FakeLayer(cfg, router), x, fake, backend(), "prefill")

    p = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    w1, w3 = p[1] / (p[1] + p[3]), p[3] / (p[1] + p[3])
    want = w1 * c[1] * silu(a[1] * x) * b[1] * x + w3 * c[3] * silu(a[3] * x) * b[3] * x
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    assert ids.tolist() == [[1, 3], [1, 3]]
    np.testing.assert_allclose(w, [[w1, w3], [w1, w3]], rtol=1e-6)
    assert fake.looked_up[0].shape == (2, 2)


def test_route_without_renormalisation():
    ids, w = route(np.array([[0.0, 1.0, 2.0]], dtype=np.float32), k=2, norm_topk=False)
    p = np.exp([0.0, 1.0, 2.0]) / np.exp([0.0, 1.0, 2.0]).sum()
    assert ids.tolist() == [[2, 1]]
    np.testing.assert_allclose(w, [[p[2], p[1]]], rtol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mix", ["f32", "q2_k"])
def test_kv_cache_decode_equals_full_forward(tiny_model, arch, mix):
    m = pymoe.load(tiny_model(arch, mix))
    ids = np.random.default_rng(3).integers(0, m.config.n_vocab, 24)
    full = m.logits(ids)  # [24, V]
    kv = m.model.new_kv(64)
    step = [m.model.prefill(ids[:16], kv)[-1]]
    for t in ids[16:]:
        step.append(m.model.decode_one_token(int(t), kv))
    # the fast path's contract (backends/cpu.py): a token's logits have the same bits whether it is decoded alone or
    # computed in a prefill of many tokens
    np.testing.assert_array_equal(np.stack(step), full[15:])


def test_lookups_are_counted(tiny_model):
    m = pymoe.load(tiny_model("qwen3moe", "f32"))
    assert isinstance(m.cache, PassThroughCache)
    list(m.generate([1, 2, 3], max_tokens=5, stop_at_eos=False))
    cfg = m.config
    s = m.last_stats
    assert s.n_generated == 5 and s.n_decoded == 4
    assert s.decode_lookups == 4 * cfg.n_layers * cfg.n_expert_used
    assert m.cache.stats.lookups["prefill"] == 3 * cfg.n_layers * cfg.n_expert_used


def test_prompt_longer_than_context(tiny_model):
    m = pymoe.load(tiny_model("qwen3moe", "f32"), n_ctx=16)
    with pytest.raises(PymoeError, match="does not fit the context"):
        list(m.generate(list(range(16)), max_tokens=4))
    with pytest.raises(PymoeError, match="empty prompt"):
        list(m.generate([], max_tokens=4))


def test_run_cli_errors(tiny_model):
    path = tiny_model("qwen3moe", "f32")
    for args, text in [(["-p", ""], "empty prompt"), (["-p", "word " * 40, "--ctx", "16"], "does not fit"),
                       (["-p", "hi", "--top-p", "0"], "top-p")]:
        r = run_pymoe("run", path, *args)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr
        assert text in r.stderr.strip().splitlines()[-1]


def test_run_cli_streams_and_reports(tiny_model):
    r = run_pymoe("run", tiny_model("qwen3moe", "q2_k"), "-p", "def forward(self, x):", "-n", "8")
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.startswith("pymoe run:")]
    prompt_line = next(l for l in lines if " tokens = " in l)
    assert "prompt" in prompt_line and "0 reused" in prompt_line and "tok/s" in prompt_line
    assert any("decode expert cache: none (" in l for l in lines)  # no pool: no hit rate to report
    assert any("expert cache: none" in l for l in lines)
