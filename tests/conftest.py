"""Shared fixtures: tiny GGUF models written once per test session (seconds), never downloaded; and the skip audit.

Skip audit: every skipped or expected-to-fail test is listed at the end of the run (`-ra` in setup.cfg). Where skips
must not hide anything (CI=true, or PYMOE_STRICT_SKIPS=1), the run FAILS on any skip whose reason does not start with
`GPU only:` (tests that need a real GPU, run by scripts/gpu-check) and on any xfail: an oracle that went missing, a
data file that is not there or a quantizer that does not exist can no longer turn into a green run.
"""
import os
import subprocess
import sys
import tempfile

import pytest

from oracle import strict
from pymoe.gguf.config import ARCHS as _CONFIG_ARCHS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every family pymoe runs, from the one registry (pymoe/gguf/config.py ARCHS): a family added there is in every test
# parametrized over these (the llama.cpp oracle, batching, the command matrix, ...) without another list to edit.
ARCHS = tuple(_CONFIG_ARCHS)
MIXES = ("f32", "q2_k")
# pymoe keeps the headers of big GGUF files under ~/.cache/pymoe (pymoe/gguf/header.py); a test run keeps them in a
# temporary folder of its own (its subprocesses inherit it)
os.environ.setdefault("PYMOE_CACHE_DIR", tempfile.mkdtemp(prefix="pymoe-test-cache-"))
MAX_WORKERS = 4  # pytest-xdist workers (`-n auto`): each one makes its own models and compiles its own kernels, so
#                  many cores would mostly add memory


@pytest.hookimpl(optionalhook=True)  # (a pytest-xdist hook: unused without xdist, as on the lent GPU machines)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the README's test command): one worker per core, at most MAX_WORKERS. Most of a cold run is
    Numba compiling kernels (740 of 1238 s, measured on 2 cores: the same run with its kernels cached took 496 s),
    one core a compilation, so two workers on 2 cores took 763 s. Tests go to the workers a file at a time
    (`--dist loadfile`): a module's fixtures (llama.cpp-quantized files) are made once."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores))


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """demo_model(arch, preset, mix) -> path of a random-weight GGUF of that preset of pymoe/demo/tinymodel.py (seed
    0), written on first use and reused."""
    from pymoe.demo.tinymodel import write_model

    root = tmp_path_factory.mktemp("models")
    made = {}

    def make(arch, preset, mix):
        if (arch, preset, mix) not in made:
            path = str(root / f"{preset}-{arch}-{mix}.gguf")
            write_model(path, arch, preset, mix, seed=0)
            made[arch, preset, mix] = path
        return made[arch, preset, mix]

    return make


@pytest.fixture(scope="session")
def tiny_model(demo_model):
    """tiny_model(arch, mix) -> path of a tiny random-weight GGUF, written on first use and reused."""
    return lambda arch="qwen3moe", mix="f32": demo_model(arch, "tiny", mix)


@pytest.fixture(scope="session")
def micro(demo_model):
    """micro(arch, mix, preset) -> path of a random-weight GGUF of the `micro` preset (small enough for the CUDA
    simulator's tests) unless preset says another, written on first use and reused."""
    return lambda arch, mix="f32", preset="micro": demo_model(arch, preset, mix)


@pytest.fixture(autouse=True)
def _simulator_on_one_core(request):
    """Tests marked `cuda` run Numba's CUDA simulator, which runs a kernel as one Python thread per CUDA thread that
    hand over at barriers: on 2 cores those threads fight for the GIL across cores (a convoy), and the real-kernel
    run took 241 s where, with every thread on one core, it takes 80 s (tests/test_cuda_real_kernels_sim.py, a quiet
    2-core machine). So during such a test the calling thread is pinned to one core, and the simulator's threads,
    created by it, inherit that; the pin is lifted after the test (Numba's CPU thread pool, created earlier, keeps its
    own affinity). Not on a GPU (NUMBA_ENABLE_CUDASIM=0) and not where the OS has no affinity call."""
    pin = (request.node.get_closest_marker("cuda") is not None and os.environ.get("NUMBA_ENABLE_CUDASIM") != "0"
           and hasattr(os, "sched_setaffinity"))
    if not pin:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def run_pymoe_here(*args, input=None):
    """`pymoe ARGS` in this process -> an object with returncode, stdout, stderr, like run_pymoe's: pymoe.cli.main
    itself (its one-line errors and exit statuses) with the streams captured by click's CliRunner, but no interpreter
    start and no kernel loading per call (~3 s each), for tests that run the command many times."""
    from types import SimpleNamespace

    from click.testing import CliRunner

    from pymoe.cli import main

    with CliRunner().isolation(input=input) as (out, err, _):
        try:
            main(list(args))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return SimpleNamespace(returncode=code, stdout=out.getvalue().decode(), stderr=err.getvalue().decode())


def run_pymoe(*args, timeout=120):
    """Run `python -m pymoe ARGS` in a subprocess -> CompletedProcess (text)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "pymoe", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT, stdin=subprocess.DEVNULL)  # nothing piped: as from a terminal


# --- the skip audit -------------------------------------------------------------------------------------------------
ALLOWED_SKIP_PREFIX = "GPU only:"
_not_run: list = []  # [(nodeid, "skipped" | "xfailed", reason)]


def _reason(report) -> str:
    if hasattr(report, "wasxfail"):
        return report.wasxfail
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_runtest_logreport(report):
    if report.skipped:
        _not_run.append((report.nodeid, "xfailed" if hasattr(report, "wasxfail") else "skipped", _reason(report)))


def _disallowed():
    return [(n, kind, why) for n, kind, why in _not_run if kind == "xfailed" or not why.startswith(ALLOWED_SKIP_PREFIX)]


def pytest_terminal_summary(terminalreporter):
    if not (strict() or os.environ.get("PYMOE_STRICT_SKIPS") == "1"):
        return
    bad = _disallowed()
    terminalreporter.write_line(f"skip audit: {len(_not_run)} not run, {len(_not_run) - len(bad)} allowed "
                                f"({ALLOWED_SKIP_PREFIX!r}), {len(bad)} not allowed")
    for nodeid, kind, why in bad:
        terminalreporter.write_line(f"skip audit: NOT ALLOWED {kind} {nodeid}: {why}")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if (strict() or os.environ.get("PYMOE_STRICT_SKIPS") == "1") and _disallowed() and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
