"""Packaging: setup.cfg lists every package, and cuda_kernels/ (top of the repository) becomes pymoe.cuda_kernels.

cuda_kernels/ is installed as pymoe.cuda_kernels through setup.cfg's package_dir; setuptools' editable install maps
it the same way, and a checkout run without installing (PYTHONPATH=.) finds it through pymoe/__init__.py. What this
is not: a test of pip (an install needs the network for its build backend).
"""
import configparser
import os
import subprocess
import sys

import pytest

from conftest import ROOT


def setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    packages = cfg.get("options", "packages").split()
    package_dir = dict((s.strip() for s in line.split("=", 1))
                       for line in cfg.get("options", "package_dir").splitlines() if "=" in line)
    return packages, package_dir


def test_setup_cfg_lists_every_package():
    packages, package_dir = setup_cfg()
    roots = {"pymoe": "pymoe", **package_dir}
    on_disk = set()
    for name, folder in roots.items():
        base = os.path.join(ROOT, folder)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if "__init__.py" in filenames:
                rel = os.path.relpath(dirpath, base)
                on_disk.add(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    assert sorted(packages) == sorted(on_disk)
    assert package_dir == {"pymoe.cuda_kernels": "cuda_kernels"}


def test_the_checkout_imports_pymoe_cuda_kernels_from_the_top_folder():
    code = "import pymoe.cuda_kernels as K; print(K.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert os.path.realpath(out.stdout.strip()) == os.path.realpath(os.path.join(ROOT, "cuda_kernels", "__init__.py"))


def test_a_build_puts_cuda_kernels_inside_pymoe(tmp_path):
    """setup.py build_py (what a wheel is made from), with its egg-info kept out of the checkout."""
    pytest.importorskip("setuptools")
    (tmp_path / "egg").mkdir()
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path / "egg"), "build_py",
                    "--build-lib", str(tmp_path / "lib")], cwd=ROOT, capture_output=True, check=True)
    built = tmp_path / "lib" / "pymoe"
    assert sorted(p.name for p in (built / "cuda_kernels").glob("*.py")) == sorted(
        f for f in os.listdir(os.path.join(ROOT, "cuda_kernels")) if f.endswith(".py"))
    assert not (tmp_path / "lib" / "cuda_kernels").exists()
    assert (built / "demo" / "data" / "demo-moe.gguf").exists()
