"""pymoe/backends/simulator.py: Numba's CUDA simulator with barriers that wait instead of a polling loop, and
module-global swaps counted per module. What a kernel computes and how a failing thread is reported must be Numba's
own: each test below holds one rule of the simulator that the replacement could break."""
from cuda_sim import IN_PROCESS, fresh_interpreter_test, in_process  # first: the simulator on

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402

from pymoe.cuda_kernels.reduce import block_sum_rows  # noqa: E402
from sim_device_functions import mirrored  # noqa: E402

pytestmark = pytest.mark.cuda


@in_process
def test_the_quicker_simulator_is_on():
    from numba.cuda.simulator import kernel as sim_kernel

    from pymoe.backends import simulator

    assert simulator._done and sim_kernel.BlockManager.__module__ == simulator.__name__


@cuda.jit
def _two_sums(x, y):
    """Per block: the sum of x's row and twice it, through reduce.block_sum_rows: a device function of another module
    (its globals are swapped while 32 threads are inside it) with 7 barriers."""
    tid = cuda.threadIdx.x
    acc = cuda.local.array(2, np.float32)
    acc[0] = x[cuda.blockIdx.x, tid]
    acc[1] = 2 * acc[0]
    buf = cuda.shared.array((2, 32), np.float32)
    block_sum_rows(buf, tid, acc, 2)
    if tid == 0:
        y[cuda.blockIdx.x, 0] = acc[0]
        y[cuda.blockIdx.x, 1] = acc[1]


@in_process
def test_barriers_in_another_modules_device_function_give_numpys_sums():
    """60 blocks: every block's two sums (float32 sums of 32 values in a tree: within 32 ulp-scale roundings of
    NumPy's float64 sum, 1e-5 relative)."""
    x = np.random.default_rng(0).random((60, 32), dtype=np.float32)
    y = np.zeros((60, 2), np.float32)
    _two_sums[60, 32](x, y)
    np.testing.assert_allclose(y[:, 0], x.astype(np.float64).sum(1), rtol=1e-5)
    np.testing.assert_allclose(y[:, 1], 2 * x.astype(np.float64).sum(1), rtol=1e-5)


@cuda.jit
def _mirror(y):
    tid = cuda.threadIdx.x
    buf = cuda.shared.array(32, np.float32)
    y[cuda.blockIdx.x, tid] = mirrored(buf, tid)


@in_process
def test_a_device_function_of_another_module_reads_cuda_after_its_barrier():
    """Each thread reads `cuda` inside `mirrored` after a barrier. Numba swaps that module's `cuda` in when the first
    thread enters and back when that thread returns, under the others: an AttributeError ("module 'numba.cuda' has
    no attribute 'blockDim'") unless the swap is counted per module (pymoe/backends/simulator.py)."""
    y = np.zeros((40, 32), np.float32)
    _mirror[40, 32](y)
    np.testing.assert_array_equal(y, np.tile(np.arange(32)[::-1], (40, 1)))


@cuda.jit
def _half_return_early(x):
    tid = cuda.threadIdx.x
    if tid >= 16:
        return  # no longer counted by the barrier below (as in Numba's poller)
    x[tid] = tid
    cuda.syncthreads()
    x[16 + tid] = x[15 - tid]  # written by another thread before the barrier


@in_process
def test_threads_that_returned_do_not_hold_a_barrier():
    x = np.full(32, -1.0)
    _half_return_early[1, 32](x)
    np.testing.assert_array_equal(x, np.r_[np.arange(16), np.arange(16)[::-1]])


@cuda.jit
def _one_thread_fails(x):
    cuda.syncthreads()
    if cuda.threadIdx.x == 3:
        x[1000] = 1  # out of bounds
    cuda.syncthreads()  # the other threads wait here for thread 3, which never comes


@in_process
def test_a_failing_thread_is_reported_with_its_own_error_and_the_block_does_not_hang():
    with pytest.raises(IndexError, match=r"tid=\[3, 0, 0\] ctaid=\[0, 0, 0\]: index 1000 is out of bounds"):
        _one_thread_fails[1, 32](np.zeros(10))


if not IN_PROCESS:
    test_this_file_in_a_fresh_interpreter = fresh_interpreter_test(__file__)
