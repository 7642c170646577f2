"""Switch Numba's CUDA simulator on for a test module, robustly; import this before anything imports numba.cuda.

Numba reads NUMBA_ENABLE_CUDASIM into numba.config when numba is imported, and `numba.cuda` picks the simulator or
the driver when *it* is imported, once per process. So importing this module
  1. sets NUMBA_ENABLE_CUDASIM=1 unless the caller set it (NUMBA_ENABLE_CUDASIM=0 runs the same tests on a GPU);
  2. if numba was already imported by another test module of the same pytest process, calls
     numba.core.config.reload_config(), which re-reads the environment (only if a NUMBA_ variable changed);
  3. imports numba.cuda and checks which mode it is in. If numba.cuda had already been imported in the other mode
     (some other module touched a GPU first), the mode cannot change in this process: the module's tests are then
     skipped (`in_process`) and `fresh_interpreter_test(__file__)` runs the file in a new Python process instead.
"""
import os
import subprocess
import sys

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # before numba.cuda is imported
from numba.core import config as numba_config  # noqa: E402

if "numba.cuda" not in sys.modules:
    numba_config.reload_config()  # numba may have been imported (by another test module) before step 1

import pytest  # noqa: E402
from numba import cuda  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WANT_SIMULATOR = os.environ["NUMBA_ENABLE_CUDASIM"] != "0"
IS_SIMULATOR = "simulator" in cuda.is_available.__module__
IN_PROCESS = WANT_SIMULATOR == IS_SIMULATOR

in_process = pytest.mark.skipif(not IN_PROCESS, reason="numba.cuda was imported in the other mode; "
                                "the file's fresh-interpreter test runs these tests")


def fresh_interpreter_test(path: str):
    """A test that runs the test file `path` in a new Python process, when its tests could not run in this one."""

    @pytest.mark.skipif(IN_PROCESS, reason="the tests above ran in this process")
    def test_this_file_in_a_fresh_interpreter():
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1" if WANT_SIMULATOR else "0")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(path)],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]

    return test_this_file_in_a_fresh_interpreter
