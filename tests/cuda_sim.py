"""Switch Numba's CUDA simulator on for a test module, robustly; import this before anything imports numba.cuda.

Numba reads NUMBA_ENABLE_CUDASIM into numba.config when numba is imported, and `numba.cuda` picks the simulator or
the driver when *it* is imported, once per process. So importing this module
  1. sets NUMBA_ENABLE_CUDASIM=1 unless the caller set it (NUMBA_ENABLE_CUDASIM=0 runs the same tests on a GPU);
  2. if numba was already imported by another test module of the same pytest process, calls
     numba.core.config.reload_config(), which re-reads the environment (only if a NUMBA_ variable changed);
  3. imports numba.cuda and checks which mode it is in (`IN_PROCESS`: the mode the caller wants).
If numba.cuda had already been imported in the other mode (some other module touched a GPU first), the mode cannot
change in this process. A test module then runs its simulator-bound tests in a new Python process instead, and
nothing is reported skipped for it (CI fails on any skip whose reason does not start with "GPU only:"):
  - `@in_process` on a test: in the other mode the test is not collected at all (`__test__ = False`), neither run
    nor reported;
  - at the end of the module, `if not IN_PROCESS: test_this_file_in_a_fresh_interpreter =
    fresh_interpreter_test(__file__)`: the one test that runs the whole file in a fresh interpreter, defined only
    when it is needed (so a normal run has no placeholder test that skips).
"""
import os
import re
import subprocess
import sys

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # before numba.cuda is imported
from numba.core import config as numba_config  # noqa: E402

if "numba.cuda" not in sys.modules:
    numba_config.reload_config()  # numba may have been imported (by another test module) before step 1

from numba import cuda  # noqa: E402


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WANT_SIMULATOR = os.environ["NUMBA_ENABLE_CUDASIM"] != "0"
IS_SIMULATOR = "simulator" in cuda.is_available.__module__
IN_PROCESS = WANT_SIMULATOR == IS_SIMULATOR
if IS_SIMULATOR:
    from pymoe.backends.simulator import quicker  # noqa: E402

    quicker()  # barriers without the simulator's polling loop (pymoe/backends/simulator.py)


def in_process(test):
    """Decorator: `test` needs numba.cuda in the mode this module asked for. Where this process has it in the other
    mode, the test is left out of collection (the file's fresh-interpreter test runs it): not a skip."""
    if not IN_PROCESS:
        test.__test__ = False
    return test


def fresh_interpreter_test(path: str):
    """A test that runs the test file `path` in a new Python process (its tests could not run in this one) and
    passes if that run passed: exit status 0 and at least one test passed (a run that skipped or deselected
    everything proves nothing). With a strict skip audit (CI), the child's own audit fails it on a skip that is
    not `GPU only:`, as the environment is inherited."""

    def test_this_file_in_a_fresh_interpreter():
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1" if WANT_SIMULATOR else "0")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                               os.path.abspath(path)],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
        out = proc.stdout[-6000:] + proc.stderr[-3000:]
        assert proc.returncode == 0, out
        assert passed_count(proc.stdout) > 0, "the fresh interpreter passed no test:\n" + out

    return test_this_file_in_a_fresh_interpreter


def passed_count(pytest_output: str) -> int:
    """N of the "N passed" in the summary line of a pytest run (the last line that has one), 0 if none."""
    for line in reversed(pytest_output.strip().splitlines()):
        m = re.search(r"\b(\d+) passed\b", line)
        if m:
            return int(m.group(1))
    return 0
