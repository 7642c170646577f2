"""Shared fixtures: tiny GGUF models written once per test session (seconds), never downloaded."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = ("qwen3moe", "qwen2moe", "llama", "olmoe")
MIXES = ("f32", "q2_k")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch, mix) -> path of a tiny random-weight GGUF, written on first use and reused."""
    from pymoe.tinymodel import write_model

    root = tmp_path_factory.mktemp("models")
    made = {}

    def make(arch="qwen3moe", mix="f32"):
        if (arch, mix) not in made:
            path = str(root / f"tiny-{arch}-{mix}.gguf")
            write_model(path, arch, "tiny", mix, seed=0)
            made[arch, mix] = path
        return made[arch, mix]

    return make


def run_pymoe(*args, timeout=120):
    """Run `python -m pymoe ARGS` in a subprocess -> CompletedProcess (text)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "pymoe", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)
