"""The user's side of the CLI (issue "The user's side"): `pymoe chat` driven through a pseudo-terminal (pexpect)
as a person types, llama.cpp's flag names, prompts from files and standard input, the tools as installed commands,
and logs without progress-bar fragments when not on a terminal."""
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import run_pymoe_here as run_pymoe  # the real CLI in-process: ~3 s less per call than a subprocess

pexpect = pytest.importorskip("pexpect", reason="pexpect is in the test extra")
BIN = os.path.dirname(sys.executable)


def test_chat_two_turns_an_interrupt_and_stats():
    """On the demo model: a turn that runs to its end, a turn stopped by Ctrl-C (the program goes on), /stats with
    the telemetry of the stopped reply, /system, then /quit."""
    # SIGINT back to its default in the child: a shell starts a background job with SIGINT ignored, Python keeps an
    # ignored SIGINT ignored, and then Ctrl-C would reach nothing (a suite run as `cmd &` failed here that way).
    child = pexpect.spawn(sys.executable, ["-m", "pymoe", "chat", "-n", "300", "-c", "4096", "--temp", "0"],
                          encoding="utf-8", timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        child.expect("commands: /system")
        child.expect("> ")
        child.sendline("def add(a, b):")
        child.expect("> ")  # the first reply ran to its end (300 tokens at most)
        first = child.before
        assert len(first.strip()) > 20
        child.sendline("class Stack:")
        child.expect("class Stack:")  # the terminal's echo of what was typed
        child.expect(r"\w")  # the reply has started
        child.sendintr()  # Ctrl-C: stops the reply, not the program
        child.expect(r"\[stopped\]")
        child.expect("> ")
        child.sendline("/stats")
        child.expect(r"prompt \d+ tokens = 0 reused \+ \d+ read in \d+ ms, (\d+) generated")
        assert int(child.match.group(1)) < 300  # the interrupted reply, not the first one
        child.expect("> ")
        child.sendline("/system You write Python.")
        child.expect("system message set")
        child.expect("> ")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_llama_cpp_flag_names(tiny_model, tmp_path):
    model = tiny_model("qwen3moe", "f32")
    r = run_pymoe("run", "-m", model, "-c", "64", "-t", "1", "-p", "hello", "-n", "4", "--temp", "0")
    assert r.returncode == 0, r.stderr
    for flag in (["-ngl", "99"], ["--n-cpu-moe", "4"], ["-ot", "exps=CPU"]):
        r = run_pymoe("run", model, "-p", "hi", *flag)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "--cache-slots" in r.stderr, r.stderr
    r = run_pymoe("run", "-m", model, "-c", "1024", "-p", "hi", "-n", "2")  # trained on 512
    assert r.returncode == 0 and "warning: context 1024 is beyond the 512 positions" in r.stderr
    r = run_pymoe("serve", "-m", str(tmp_path / "missing.gguf"), "-np", "2", "-c", "128")
    assert r.returncode == 2 and "missing.gguf" in r.stderr and "Traceback" not in r.stderr


def test_act_bits_option(tiny_model):
    """--act-bits picks the CPU backend's activation width; greedy text at 8 bits is the 16-bit text on this model
    only if the rounding does not flip a choice, so the check is the width the engine reports and a one-line error
    where the backend has no integer path."""
    import pymoe

    model = tiny_model("qwen3moe", "q2_k")
    r = run_pymoe("run", model, "-p", "hello", "-n", "4", "--temp", "0", "--backend", "cpu", "--act-bits", "8")
    assert r.returncode == 0, r.stderr
    assert pymoe.load(model, backend="cpu", act_bits=8).backend.act_bits == 8  # the default, 16, runs everywhere
    r = run_pymoe("run", model, "-p", "hi", "--backend", "reference", "--act-bits", "8")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith("(use --backend cpu)"), r.stderr
    r = run_pymoe("run", model, "-p", "hi", "--act-bits", "4")
    assert r.returncode == 2 and "--act-bits" in r.stderr


def test_prompt_from_a_file_and_from_stdin(tiny_model, tmp_path):
    model = tiny_model("qwen3moe", "f32")
    want = run_pymoe("run", model, "-p", "the cat sat", "-n", "6", "--temp", "0")
    (tmp_path / "p.txt").write_text("the cat sat", encoding="utf-8")
    from_file = run_pymoe("run", model, "-f", str(tmp_path / "p.txt"), "-n", "6", "--temp", "0")
    from_stdin = subprocess.run([sys.executable, "-m", "pymoe", "run", model, "-n", "6", "--temp", "0"],
                                input="the cat sat", capture_output=True, text=True, timeout=120)
    assert want.returncode == from_file.returncode == from_stdin.returncode == 0, from_stdin.stderr
    assert want.stdout == from_file.stdout == from_stdin.stdout
    r = run_pymoe("run", model, "-f", str(tmp_path / "nope.txt"))
    assert r.returncode == 2 and "nope.txt" in r.stderr and "Traceback" not in r.stderr


def test_tools_are_installed_commands(tmp_path):
    """The install puts the tools on the venv's PATH: no activation, no sys.path games."""
    for name in ("pymoe-build-profile", "pymoe-make-tiny-model", "pymoe-make-draft-model"):
        r = subprocess.run([os.path.join(BIN, name), "--help"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "usage:" in r.stdout, (name, r.stderr)
    r = subprocess.run([os.path.join(BIN, "pymoe-make-tiny-model"), "-o", str(tmp_path / "t.gguf"), "--arch",
                        "olmoe"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "wrote" in r.stdout, r.stderr


def test_no_progress_bar_fragments_off_a_terminal(tiny_model):
    r = run_pymoe("run", tiny_model("qwen3moe", "f32"), "-p", "hello", "-n", "4")
    assert r.returncode == 0 and "\r" not in r.stderr and "loading:" not in r.stderr, r.stderr


def test_server_sampling_defaults_apply_to_requests_that_leave_them_out(tiny_model):
    """`pymoe serve --temp 0 ...`: a request without temperature samples greedily (the API's default is 1); one that
    sets it keeps its own value."""
    from pymoe.serve.schemas import CompletionRequest

    bare = CompletionRequest(prompt="x")
    own = CompletionRequest(prompt="x", temperature=0.5, top_k=3)
    defaults = {"temperature": 0.0, "top_k": 7, "seed": 11}
    assert (bare.sampling().temperature, bare.sampling(defaults).temperature) == (1.0, 0.0)
    assert bare.sampling(defaults).top_k == 7 and bare.sampling(defaults).seed == 11
    assert (own.sampling(defaults).temperature, own.sampling(defaults).top_k) == (0.5, 3)
    r = run_pymoe("serve", "-m", tiny_model("qwen3moe", "f32"), "--temp", "abc")
    assert r.returncode == 2 and "--temp" in r.stderr and "Traceback" not in r.stderr


def test_server_uses_its_sampling_defaults_end_to_end(tiny_model):
    import openai

    import pymoe
    from pymoe.serve.app import BackgroundServer, create_app

    path = tiny_model("qwen3moe", "f32")
    want = "".join(pymoe.load(path, n_ctx=256).stream("the cat", max_tokens=12))  # greedy
    app = create_app(pymoe.load(path, n_ctx=256), kv="f32", sampling_defaults={"temperature": 0.0})
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        texts = [client.completions.create(model="tiny", prompt="the cat", max_tokens=12).choices[0].text
                 for _ in range(2)]  # no temperature in the request: the server's 0, not the API's 1
    assert texts == [want, want]


def test_run_with_a_grammar_or_a_json_schema(tmp_path):
    """llama.cpp's --grammar / --grammar-file / -j: the demo model (trained on Python code) writes inside them."""
    r = run_pymoe("run", "-p", "answer: ", "-n", "30", "--temp", "0.8", "--grammar", 'root ::= ("yes" | "no") "."')
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") in ("answer: yes.", "answer: no."), r.stdout
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, '
                      '"required": ["n"], "additionalProperties": false}')
    r = run_pymoe("run", "-p", "x = ", "-n", "30", "--temp", "0", "--json-schema-file", str(schema))
    assert r.returncode == 0, r.stderr
    value = json.loads(r.stdout[len("x = "):])
    assert list(value) == ["n"] and value["n"] in range(10), r.stdout
    for bad in (["--grammar", "root := 1"], ["-j", "{", "--grammar", "root ::= [a]"], ["--grammar-file", "/nope"]):
        r = run_pymoe("run", "-p", "x", *bad)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()[-1]) < 200 and "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("pymoe: error: --"), r.stderr


def test_serve_with_no_model_serves_the_demo():
    """`pymoe serve` alone serves the embedded demo model, as `pymoe run` and `pymoe chat` run it."""
    import socket
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "pymoe", "serve", "--port", str(port)], stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "pymoe serve did not start"
                time.sleep(0.2)
        from pymoe import demo
        assert [m["id"] for m in models["data"]] == [os.path.basename(demo.demo_model())], models
    finally:
        proc.terminate()
        err = proc.communicate(timeout=30)[1]
    assert "no model given: serving the demo model" in err, err
