"""The GGUF fuzzer's CI run: a seeded subset of bench/fuzz_gguf.py's mutants, every outcome one line or valid.

The full run (10,000+ mutants of every base file, docs/testing.md) is a script; this is its short version: the same
mutator and classifier on CI_BASES (five families and formats, a file llama.cpp's quantizer wrote, the demo model).
A mutant that gives a traceback, runs out of memory, hangs or crashes fails the test, with the line to replay it.
"""
import os
import sys

import pytest

from conftest import ROOT, run_pymoe_here

sys.path.insert(0, os.path.join(ROOT, "bench"))
import fuzz_gguf  # noqa: E402

N_CI = 300  # mutants per CI run (~35 s on 2 cores; the full runs in docs/testing.md have 10,000); the seed is fixed, so a failure replays exactly


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return fuzz_gguf.make_bases(str(tmp_path_factory.mktemp("fuzz-bases")), fuzz_gguf.CI_BASES)


@pytest.fixture(scope="module")
def results(bases):
    return fuzz_gguf.fuzz(bases, seed=1, n=N_CI, stages=("inspect", "load", "run"), jobs=2, progress=False)


def test_the_ci_bases_are_all_there(bases):
    # A missing base (llama.cpp's quantizer unavailable) would quietly shrink what the test covers.
    assert sorted(bases) == sorted(fuzz_gguf.CI_BASES)


def test_every_mutant_is_valid_or_one_line(results):
    bad = [r for r in results if r["outcome"] in fuzz_gguf.BAD]
    assert not bad, fuzz_gguf.summary(results, seed=1, replay="--bases ci")


def test_the_mutants_reach_the_checks(results):
    # The fuzzer must really break files: most mutants end in a one-line error, from each stage's checks, and every
    # base gets its share. (A mutator that only changed bytes nobody reads would pass the test above.)
    outcomes = [r["outcome"] for r in results]
    assert outcomes.count("error") > 0.6 * len(results)
    assert outcomes.count("valid") > 0  # some corruptions are harmless (a weight's byte, an optional key)
    assert {r["stage"] for r in results if r["outcome"] == "error"} >= {"inspect", "load"}
    assert {r["base"] for r in results} == set(fuzz_gguf.CI_BASES)


def test_the_classifier_sees_a_traceback(bases, monkeypatch):
    # The harness itself: an exception that is not a PymoeError is a traceback, not an "error".
    import pymoe.gguf.inspect

    def broken(path, show_tensors=False):
        raise KeyError("boom")

    monkeypatch.setattr(pymoe.gguf.inspect, "describe_model", broken)
    r = fuzz_gguf.try_file(bases["demo"], ("inspect",))
    assert r["outcome"] == "traceback" and "KeyError" in r["detail"]


@pytest.mark.parametrize("command", ["inspect", "run"])
def test_the_cli_gives_one_line_for_fuzzed_files(bases, results, tmp_path, command):
    # The in-process outcome is what the command line shows: for failing mutants, one line and exit status 2.
    picked = [r for r in results if r["outcome"] == "error" and r["stage"] == ("inspect" if command == "inspect"
                                                                                  else "load")][:3]
    assert picked
    layouts = {n: fuzz_gguf.Layout(p) for n, p in bases.items()}
    contents = {n: open(p, "rb").read() for n, p in bases.items()}
    for r in picked:
        name, data, what = fuzz_gguf.mutant(bases, layouts, contents, 1, r["index"])
        path = tmp_path / f"m{r['index']}.gguf"
        path.write_bytes(data)
        args = ("inspect", str(path)) if command == "inspect" else ("run", str(path), "-p", "Hi", "-n", "2")
        out = run_pymoe_here(*args)  # pymoe.cli.main itself, its exit status and streams
        err = out.stderr.strip()
        assert out.returncode == 2, (what, out.returncode, err[-2000:])
        assert "Traceback" not in err, (what, err[-2000:])
        last = err.splitlines()[-1]  # (`pymoe run` logs its start-up lines to stderr before it fails)
        assert last.startswith("pymoe: error: ") and str(path) in last, (what, err)
        assert all(line.startswith("pymoe run: ") for line in err.splitlines()[:-1]), (what, err)
