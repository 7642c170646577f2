"""Trace -> profile -> `pymoe run --profile`: the round trip on a tiny model, and what pre-filling buys."""
import os
import subprocess
import sys

import pymoe
from conftest import ROOT, run_pymoe_here
from pymoe.experts.profile import Profile
from pymoe.experts.trace import Trace

PROMPTS = ["def forward(self, x): return x", "class Foo:\n    pass", "for i in range(10): print(i)"]


def test_trace_profile_run_round_trip(tiny_model, tmp_path):
    model = tiny_model("qwen3moe", "q2_k")
    trace_path, profile_path = str(tmp_path / "routing.npz"), str(tmp_path / "expert-profile.bin")
    for i, prompt in enumerate(PROMPTS):  # three runs appended into one trace
        r = run_pymoe_here("run", model, "-p", prompt, "-n", "12", "--trace", trace_path)
        assert r.returncode == 0, r.stderr
        assert f"trace {trace_path}:" in r.stderr and ("appended" if i else "written") in r.stderr
    trace = Trace.load(trace_path)
    cfg = pymoe.load(model).config
    assert trace.experts.shape[1:] == (cfg.n_layers, cfg.n_expert_used)
    assert len(trace.meta["prompt_lengths"]) == 3

    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "build-profile"), trace_path, "-o", profile_path,
                        "--slots", "4"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    assert f"profile {profile_path}: {cfg.n_layers * cfg.n_expert} ranked pairs, built for 4 slots" in r.stdout

    r = run_pymoe_here("run", model, "-p", PROMPTS[0], "-n", "12", "--cache-slots", "4", "--profile", profile_path)
    assert r.returncode == 0, r.stderr
    assert "pre-filled 4 of 4 slots from the profile" in r.stderr and "slot " in r.stderr and "verified" in r.stderr


def test_profile_prefill_raises_first_tokens_hit_rate(tiny_model, tmp_path):
    """Over the first decode tokens, a cache pre-filled with the profile hits more than an empty one (which must
    first miss on every expert it then keeps)."""
    model = tiny_model("qwen3moe", "q2_k")
    engine = pymoe.load(model)
    recorder = engine.record_trace()
    for prompt in PROMPTS:
        list(engine.generate(prompt, max_tokens=16, stop_at_eos=False))
    profile = Profile.from_trace(recorder.trace())

    def first_tokens_hit_rate(**options):
        e = pymoe.load(model, cache_slots=4, policy="lru", **options)
        list(e.generate(PROMPTS[1], max_tokens=8, stop_at_eos=False))
        return e.cache.stats.hit_rate("decode")

    empty, prefilled = first_tokens_hit_rate(), first_tokens_hit_rate(profile=profile)
    assert prefilled > empty, (prefilled, empty)
