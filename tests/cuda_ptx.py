"""Compile kernels to PTX for a real GPU, which the simulator cannot check: the shared set-up of the kernel test files
that do it (test_cuda_kernels.py, test_cuda_batch_step.py, test_cuda_ragged_attention.py).

Each such file has a compile function, run in a fresh interpreter without the simulator (`python tests/cuda_ptx.py
FILE FUNCTION`, which imports the file and calls the function), and counts the "ptx ok:" lines it prints, one per
kernel compiled:
  - `ptx_test(function, kernels, doc)`: the test, `test_... = ptx_test(compile_..., N, "...")` in the file;
    skipped ("GPU only:") where no CUDA toolkit (libnvvm) is installed or the child finds the toolchain unusable;
  - `ptx_target()`: in the child, first in the compile function: device functions compile for sm_75 with no device
    present, and False (after a "ptx unavailable:" line) where the toolchain itself fails on a trivial kernel;
  - `compile_kernel(kernel, signature)`: in the child, compiles one kernel and prints its "ptx ok:" line.
What this is not: the simulator switch (tests/cuda_sim.py, imported first by every CUDA test file).
"""
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nvvm_home():
    """A CUDA toolkit directory with libnvvm (CUDA_HOME, CUDA_PATH, /usr/local/cuda*), or None."""
    for home in [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")] + sorted(glob.glob("/usr/local/cuda*")):
        if home and glob.glob(os.path.join(home, "nvvm", "lib*", "libnvvm.so*")) + glob.glob(
                os.path.join(home, "lib*", "libnvvm.so*")):
            return home
    return None


needs_nvvm = pytest.mark.skipif(nvvm_home() is None, reason="GPU only: no CUDA toolkit (libnvvm) to compile PTX "
                                "with here (scripts/gpu-check runs the kernel tests on a GPU machine)")


def ptx_target() -> bool:
    """In the child (numba.cuda not the simulator): compile for compute capability 7.5 whatever the machine (device
    functions are compiled for the current device's, and there may be no device), then compile a trivial kernel.
    -> True where the toolchain works (libnvvm for built-in numba.cuda, also NVRTC for numba-cuda); else prints
    "ptx unavailable: ..." and -> False (the failure is the environment's, reported by the test as a skip)."""
    import types as pytypes

    import numba.cuda.dispatcher as dispatcher
    from numba import cuda, types as nt

    dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=(7, 5))

    def trivial(y):
        y[0] = 1.0

    try:
        cuda.compile_ptx(trivial, (nt.Array(nt.float32, 1, "C"),), cc=(7, 5))
    except Exception as e:  # noqa: BLE001 -- any failure here is the environment's, reported as a skip
        print(f"ptx unavailable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return False
    return True


def compile_kernel(kernel, signature: tuple) -> None:
    """In the child, after ptx_target(): compile the @cuda.jit `kernel` with the argument types `signature` for
    sm_75 and print "ptx ok: NAME" (an error here fails the child, and so the test)."""
    from numba import cuda

    cuda.compile_ptx(kernel.py_func, signature, cc=(7, 5))
    print("ptx ok:", kernel.py_func.__name__, flush=True)


def ptx_test(function, kernels: int, doc: str):
    """A test that runs the compile `function` of a test file in a fresh interpreter without the simulator, with the
    toolkit nvvm_home() found, and passes if it compiled `kernels` kernels (its "ptx ok:" lines). It fails where the
    child failed, and is skipped ("GPU only:") where there is no toolkit or the child found the toolchain unusable
    (`ptx_target`). doc: what it checks (the test's docstring)."""
    path, name = function.__code__.co_filename, function.__name__

    @needs_nvvm
    def test_compiles_for_a_real_gpu():
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", CUDA_HOME=nvvm_home(),
                   PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), path, name], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        if "ptx unavailable:" in proc.stdout:
            pytest.skip("GPU only: " + proc.stdout.strip().splitlines()[-1])
        assert proc.stdout.count("ptx ok:") == kernels

    test_compiles_for_a_real_gpu.__doc__ = doc
    return test_compiles_for_a_real_gpu


if __name__ == "__main__":  # the child: python tests/cuda_ptx.py FILE FUNCTION
    import importlib.util

    spec = importlib.util.spec_from_file_location("ptx_child", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    getattr(module, sys.argv[2])()
