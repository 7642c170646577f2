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
    return llama_cpp
