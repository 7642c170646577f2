"""Every user-facing command on a tiny file of each family (conftest.ARCHS), as a new user runs them; the one-line
usage errors; the inconsistent files that must be named in one line.

The matrix runs in this process (conftest.run_pymoe_here: pymoe.cli.main with click's runner; a server in a thread
for serve and bench), so a family's kernels compile once: ~20 s for all nine families on 2 cores with the kernels
cached (measured before dots1, the tenth). glm4moe, deepseek2 and dots1 lead with a dense layer: the commands that
used to assume every layer has experts (probe, run --trace, the slot limits) are the point of the matrix.
"""
import json
import os

import httpx
import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

import pymoe
from conftest import ARCHS, run_pymoe, run_pymoe_here
from pymoe.demo.tinymodel import copy_metadata, make_config, write_model
from pymoe.errors import PymoeError
from pymoe.experts.trace import Trace
from pymoe.gguf.loader import load_gguf
from pymoe.serve.app import BackgroundServer, create_app
from pymoe.tools import build_profile_main


def ok(r, what):
    assert r.returncode == 0, f"{what}: exit {r.returncode}\n{r.stderr[-2000:]}"
    assert "Traceback" not in r.stderr, f"{what}:\n{r.stderr[-2000:]}"
    return r


@pytest.mark.parametrize("arch", ARCHS)
def test_every_command_on_every_family(arch, tiny_model, tmp_path):
    path = tiny_model(arch, "f32")
    cfg = load_gguf(path).config
    n_moe = len(cfg.moe_layers)
    n_total = n_moe * cfg.n_expert  # the experts that exist: dense layers have none

    r = ok(run_pymoe_here("inspect", path), "inspect")
    assert cfg.arch in r.stdout

    ok(run_pymoe_here("run", path, "-p", "def f(x):", "-n", "4", "--temp", "0"), "run")

    trace = str(tmp_path / "t.npz")
    r = ok(run_pymoe_here("run", path, "-p", "def f(x):", "-n", "4", "--temp", "0", "--trace", trace), "run --trace")
    t = Trace.load(trace)
    assert (t.n_layers, t.first_moe_layer, t.n_experts) == (n_moe, cfg.moe_layers.start, cfg.n_expert)
    assert t.tokens("decode") == 3 and t.tokens("prefill") > 0

    profile = str(tmp_path / "p.bin")
    build_profile_main([trace, "-o", profile])

    slots = max(1, n_total // 4)
    r = ok(run_pymoe_here("run", path, "-p", "def f(x):", "-n", "4", "--temp", "0", "--cache-slots", str(slots),
                          "--profile", profile), "run --cache-slots --profile")
    assert f"{slots} slots" in r.stderr and f"of {n_total} experts)" in r.stderr, r.stderr
    assert "pre-filled" in r.stderr
    r = run_pymoe_here("run", path, "-p", "x", "-n", "1", "--cache-slots", str(n_total + 1))
    assert r.returncode == 2 and f"1..{n_total}" in r.stderr, r.stderr  # no slot for an expert that does not exist

    r = ok(run_pymoe_here("chat", path, "-n", "3", "--temp", "0", input="hello\n/stats\n/quit\n"), "chat")
    assert "generated" in r.stderr

    r = ok(run_pymoe_here("probe", path, "--backend", "cpu", "--repeats", "1"), "probe")
    assert "CPU expert rate" in r.stdout and "pcie_frac 0" in r.stdout

    r = ok(run_pymoe_here("simulate", trace, "--policy", "lru,belady"), "simulate")
    assert f"{n_moe} layers x {cfg.n_expert} experts" in r.stdout + r.stderr
    ok(run_pymoe_here("plan", path, "--trace", trace), "plan --trace")
    ok(run_pymoe_here("plan", path, "--profile", profile), "plan --profile")

    with BackgroundServer(create_app(pymoe.load(path, n_ctx=256), kv="f32")) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
        status = httpx.get(srv.url + "/v1/status", timeout=10)
        assert status.status_code == 200 and status.json()["n_ctx"] == 256
        out = str(tmp_path / "bench.json")
        ok(run_pymoe_here("bench", "--url", srv.url, "--gen", "3", "--requests", "1", "--concurrency", "1",
                          "--overload", "0", "--out", out), "bench")
        assert json.load(open(out))


@pytest.mark.parametrize("arch", [a for a in ARCHS if make_config(a).n_dense_lead])
def test_micro_files_of_the_dense_lead_families_have_a_moe_layer(arch, tmp_path):
    """The micro preset (one layer elsewhere) gives these families their dense layer and one MoE layer."""
    path = str(tmp_path / f"micro-{arch}.gguf")
    write_model(path, arch, "micro", "f32")
    cfg = load_gguf(path).config
    assert cfg.n_layers == 2 and len(cfg.moe_layers) == 1 and cfg == make_config(arch, "micro", cfg.n_vocab)
    engine = pymoe.load(path)
    assert len(list(engine.generate("hi", max_tokens=2, temperature=0))) >= 1


# --- usage errors: one line naming the problem, exit 2 ---------------------------------------------------------------

@pytest.mark.parametrize("args,named", [
    (("-n", "-5", "-p", "hi"), "'-n' / '--n-predict': -5"),
    (("--temp", "abc", "-p", "hi"), "'--temp': 'abc' is not a valid number"),
    (("--top-p", "2", "-p", "hi"), "'--top-p'"),
    (("-t", "0", "-p", "hi"), "'-t' / '--threads'"),
    (("--cache-slots", "0", "-p", "hi"), "'--cache-slots'"),
    (("--pcie-frac", "1.5", "-p", "hi"), "'--pcie-frac'"),
    (("--no-such-option",), "No such option '--no-such-option'"),
])
def test_usage_errors_are_one_line_naming_the_option(args, named, tiny_model):
    r = run_pymoe_here("run", tiny_model("qwen3moe", "f32"), *args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and named in lines[0], r.stderr
    assert lines[0].startswith("pymoe: error: ") and r.stdout == ""  # nothing loaded, no prompt echoed


def test_a_missing_model_is_named_before_the_prompt(tmp_path):
    missing = str(tmp_path / "missing.gguf")
    r = run_pymoe("run", missing)  # a subprocess with nothing on stdin, as a new user types it
    assert r.returncode == 2 and r.stderr.strip() == f"pymoe: error: {missing}: no such file", r.stderr
    for cmd in ("chat", "serve", "probe", "inspect"):
        r = run_pymoe_here(cmd, missing)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"pymoe: error: {missing}: no such file"], \
            (cmd, r.stderr)


# --- inconsistent files --------------------------------------------------------------------------------------------

def copy_gguf(src, dst, change=None, rename=None, drop_block=None):
    """src -> dst with metadata `change`d (copy_metadata's), tensors renamed ({old: new}), or with block_count one
    below the blocks present (drop_block=True: the key says one block fewer, every tensor kept)."""
    r = GGUFReader(src)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    change = dict(change or {})
    if drop_block:
        change[f"{arch}.block_count"] = int(r.fields[f"{arch}.block_count"].parts[-1][0]) - 1
    w = GGUFWriter(dst, arch)
    copy_metadata(r, w, change=change)
    for key, value in change.items():
        if key not in r.fields:  # a key the file lacks: added (the special token ids are uint32)
            w.add_uint32(key, value)
    for t in r.tensors:
        name = (rename or {}).get(t.name, t.name)
        data = np.array(t.data)
        if t.tensor_type.name == "F32":
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        else:
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.uint8), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return dst


def test_blocks_beyond_block_count_are_refused(tiny_model, tmp_path):
    """llama.cpp refuses a file whose tensors the metadata does not account for ("wrong number of tensors");
    pymoe ran such a file on the blocks block_count names, silently."""
    bad = copy_gguf(tiny_model("glm4moe", "f32"), str(tmp_path / "short.gguf"), drop_block=True)
    with pytest.raises(PymoeError, match=r"tensor blk\.2\..* is in block 2, but glm4moe\.block_count is 2"):
        load_gguf(bad)


def test_dots1_without_a_gating_function_is_named(tiny_model, tmp_path):
    """llama.cpp's dots1 reads expert_gating_func as optional but has no default (its graph aborts without it), so
    pymoe requires the key for dots1 rather than guess; the tiny file, with it, routes by sigmoid with the file's
    selection bias and a shared expert expert_shared_count x n_ff_exp wide (no key of its own)."""
    src = tiny_model("dots1", "f32")
    cfg = load_gguf(src).config
    assert (cfg.gating, cfg.expert_bias, cfg.qk_norm, cfg.n_dense_lead) == ("sigmoid", True, "head", 1)
    assert cfg.n_ff_shexp == 2 * cfg.n_ff_exp and cfg.layer_plan()[0].ffn == "dense"
    bad = copy_gguf(src, str(tmp_path / "no-gating.gguf"), change={"dots1.expert_gating_func": None})
    r = run_pymoe_here("run", bad, "-p", "hi")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "dots1.expert_gating_func" in lines[0], r.stderr


def test_a_tensor_under_an_unknown_name_is_refused(tiny_model, tmp_path):
    """A renamed output.weight used to leave the model on its tied embedding without a word."""
    bad = copy_gguf(tiny_model("qwen3moe", "f32"), str(tmp_path / "renamed.gguf"),
                    rename={"output.weight": "output_head.weight"})
    with pytest.raises(PymoeError, match="tensor output_head.weight is not one that this qwen3moe model has"):
        load_gguf(bad)
    r = run_pymoe_here("run", bad, "-p", "hi")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("key", ["eos", "padding"])
def test_special_ids_beyond_the_vocabulary_are_named(key, tiny_model, tmp_path):
    """llama.cpp warns "bad special token" and ignores the id; so does pymoe, in one line at load."""
    src = tiny_model("qwen3moe", "f32")
    n_vocab = load_gguf(src).config.n_vocab
    bad = copy_gguf(src, str(tmp_path / f"bad-{key}.gguf"), change={f"tokenizer.ggml.{key}_token_id": n_vocab + 5})
    r = ok(run_pymoe_here("run", bad, "-p", "hi", "-n", "2"), "run")
    warnings = [line for line in r.stderr.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and f"tokenizer.ggml.{key}_token_id {n_vocab + 5} is not a token" in warnings[0], \
        r.stderr
    assert os.path.basename(bad) in warnings[0]
