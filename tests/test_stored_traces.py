"""The stored routing traces of bench/traces/ (bench/traces/README.md): they load by name, have the shapes their
sidecars and the README state, split into tune / held-out halves, and carry a trained router's routing, not
uniform routing. Data checks: no oracle, no Numba (the traces were recorded by bench/record_traces.py)."""
import json
import os

import numpy as np
import pytest

from pymoe.errors import PymoeError
from pymoe.experts.trace import Trace, named_traces, split_named, top_share

FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "traces")
# name -> (MoE layers, experts, top-k, requests, tokens): the README's table. code / prose: 8 requests of a
# 256-token prompt + 128 sampled tokens, of which the first comes from the prefill (127 decode rows); the chat:
# 24 turns, 3427 rows (the prefilled new tokens of each turn and its reply); moe64-code: its context is 256, so
# 8 requests of the same prompts' first 128 tokens + 128 sampled tokens.
SHAPES = {"demo-code": (4, 32, 4, 8, 8 * (256 + 127)), "demo-prose": (4, 32, 4, 8, 8 * (256 + 127)),
          "demo-chat": (4, 32, 4, 24, 3427), "moe64-code": (4, 64, 8, 8, 8 * (128 + 127))}


@pytest.fixture(scope="module")
def traces():
    return named_traces(FOLDER)


def counts(tr: Trace, rows=None) -> np.ndarray:
    """int [L, E]: lookups per (layer, expert) over the selected rows."""
    e = tr.experts if rows is None else tr.experts[rows]
    return np.stack([np.bincount(e[:, l].reshape(-1), minlength=tr.n_experts) for l in range(tr.n_layers)])


def test_every_stored_trace_loads_by_name_with_its_stated_shape_and_split(traces):
    assert set(traces) <= set(SHAPES) and {"demo-code", "demo-prose", "demo-chat"} <= set(traces)
    for name, tr in traces.items():
        L, E, K, n_req, n_rows = SHAPES[name]
        assert (tr.n_layers, tr.n_experts, tr.k) == (L, E, K), name
        assert tr.experts.shape == (n_rows, L, K) and int(tr.meta["n_requests"]) == n_req, name
        # top-k picks distinct experts in every row (a recorder that wrote one id twice would show here)
        s = np.sort(tr.experts, axis=-1)
        assert (s[..., 1:] != s[..., :-1]).all(), name
        side = json.load(open(os.path.join(FOLDER, name + ".json")))
        for key in ("command", "model_sha256", "sampling", "split"):
            assert key in side, (name, key)
        tune, held = split_named(tr)
        assert tune.meta["n_requests"] == n_req // 2 and held.meta["n_requests"] == n_req - n_req // 2, name
        assert tune.n_tokens + held.n_tokens == tr.n_tokens, name
        assert int(tune.request.max()) < int(held.request.min()), name  # first half tunes, second half held out


def test_stored_traces_route_like_a_trained_router_not_uniformly(traces):
    """The share of each layer's lookups taken by its hottest 25% of experts. Uniform routing (each row K distinct
    experts drawn at random) gives 25% plus sampling noise: with n = rows x K lookups per layer the counts have a
    relative sd of about sqrt(E / n) (5% at the demo traces' ~12,000 lookups over 32 experts), and the top quarter's
    share of 20 uniform draws of the same shape, computed below, is at most ~27%. Stored: 42-86% per layer (demo
    traces). The bound is the uniform draws' largest share + 10 points: 4x the noise the draws show, and still far
    below every layer measured."""
    rng = np.random.default_rng(0)
    for name, tr in traces.items():
        uniform = max(top_share(counts(Trace(
            np.argsort(rng.random((tr.n_tokens, tr.n_layers, tr.n_experts)), axis=-1)[..., :tr.k],
            tr.weights, tr.phase, tr.request, tr.forward, tr.meta)), 0.25).max() for _ in range(20))
        assert uniform < 0.30, (name, uniform)  # the null itself is near 25%
        share = top_share(counts(tr), 0.25)
        assert (share > uniform + 0.10).all(), (name, share, uniform)


def test_prose_routes_differently_from_code(traces):
    """The demo model on prose vs code: per layer, the total variation distance between the two traces' expert
    distributions against the distance between the two halves (requests 0-3 vs 4-7) of each one alone, which is
    what different files of one kind give. Measured: code vs prose 0.15-0.34 per layer; halves 0.045-0.097. The
    test asks for more than the larger halves' distance in every layer, and 2x it on average over the layers."""
    def tv(a, b):
        a, b = a / a.sum(1, keepdims=True), b / b.sum(1, keepdims=True)
        return 0.5 * np.abs(a - b).sum(1)  # [L]

    code, prose = traces["demo-code"], traces["demo-prose"]
    between = tv(counts(code), counts(prose))
    within = np.maximum(*(tv(counts(t, t.request < 4), counts(t, t.request >= 4)) for t in (code, prose)))
    assert (between > within).all() and between.mean() > 2 * within.mean(), (between, within)


def test_named_traces_refuses_a_trace_without_its_sidecar_or_with_a_bad_split(tmp_path, traces):
    tr = traces["demo-code"]
    path = tmp_path / "x.npz"
    tr.save(str(path))
    with pytest.raises(PymoeError, match="no sidecar"):
        named_traces(str(tmp_path))
    (tmp_path / "x.json").write_text("{split")
    with pytest.raises(PymoeError, match="x.json: not JSON"):
        named_traces(str(tmp_path))
    (tmp_path / "x.json").write_text(json.dumps({"split": {"tune": [0, 1, 2], "heldout": [4, 5, 6, 7]}}))
    with pytest.raises(PymoeError, match="divide the trace's requests"):  # request 3 in neither half
        named_traces(str(tmp_path))
    (tmp_path / "x.json").write_text(json.dumps({"split": {"tune": [0, 1, 2, 3], "heldout": [4, 5, 6, 7]}}))
    assert named_traces(str(tmp_path))["x"].meta["split"]["heldout"] == [4, 5, 6, 7]
