"""The llama.cpp oracle (llama-cpp-python), imported inside each test that needs it, never at module level.

Why per test: a module-level `importorskip` made every test of the file vanish with the oracle, those that need no
oracle too. Why strict: in CI (CI=true, or PYMOE_REQUIRE_ORACLE=1) a missing or wrongly pinned oracle FAILS the
tests that need it instead of skipping them, so the suite can never go green without its oracle. The version is
pinned in setup.cfg's `test` extra; this module reads the pin from there, so there is one place to change it.
"""
import configparser
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def strict() -> bool:
    """True where a missing oracle must fail, not skip: CI, or PYMOE_REQUIRE_ORACLE=1."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes") or os.environ.get("PYMOE_REQUIRE_ORACLE") == "1"


def pinned_version() -> str:
    """The llama-cpp-python version pinned in setup.cfg's `test` extra (`llama-cpp-python==X.Y.Z`)."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    for line in cfg["options.extras_require"]["test"].split():
        if line.startswith("llama-cpp-python=="):
            return line.split("==", 1)[1]
    raise AssertionError("setup.cfg's test extra does not pin llama-cpp-python with ==")


def _plain_cpu_kernels(llama_cpp) -> None:
    """Every Llama(...) of the tests loads its weights without ggml's extra CPU buffer types (the AMX and repacked
    layouts: llama.cpp's `--no-repack`), so the oracle multiplies with ggml's plain CPU kernels. Why: on a CPU that
    reports AMX inside a VM that does not enable the AMX tile state (this project's machines), ggml's AMX matmul dies
    with SIGILL (`tilezero`, in ggml_backend_amx_mul_mat) and takes the whole pytest process with it; it is hit by
    Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K/IQ4_XS weights in batches, e.g. the demo model's Q4_K and Q6_K tensors."""
    lib = llama_cpp.llama_cpp
    if getattr(lib, "_pymoe_plain_cpu", False):
        return
    default = lib.llama_model_default_params

    def params_without_extra_bufts():
        params = default()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = params_without_extra_bufts
    lib._pymoe_plain_cpu = True


def require_llama_cpp():
    """-> the llama_cpp module at the pinned version; skip (fail in CI) when it is missing or another version."""
    try:
        import llama_cpp
    except ImportError as e:
        why = f"oracle missing: llama-cpp-python is not importable ({e}); pip install -e '.[test]'"
        if strict():
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    want = pinned_version()
    if llama_cpp.__version__ != want:
        why = f"oracle version: llama-cpp-python {llama_cpp.__version__} installed, setup.cfg pins {want}"
        if strict():
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    _plain_cpu_kernels(llama_cpp)
    return llama_cpp
