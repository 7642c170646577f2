"""Numba's CUDA simulator, made several times faster where kernels have barriers. Nothing a kernel computes changes.

What this is: `quicker()`, called once a process knows numba.cuda is the simulator (backends/cuda.py `cuda_module`,
tests/cuda_sim.py). The simulator is how pymoe's CUDA path runs without a GPU: the tests run the real kernels in it,
and `pymoe run --backend cuda` with NUMBA_ENABLE_CUDASIM=1 counts a GPU step's launches, bytes and synchronisations
(backends/device_counts.py). Its cost is Python: one thread per CUDA thread, and barriers that a polling loop
releases. What this is not: a change to Numba's semantics (the barrier below releases exactly when Numba's does) or
anything that runs on a GPU.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np

_done = False


def quicker() -> None:
    """Make Numba's CUDA simulator several times faster on kernels with barriers; nothing a kernel computes changes.

    The simulator runs a thread block as one Python thread per CUDA thread. Two changes, each to the simulator's
    own machinery (numba.cuda.simulator.kernel), none to what a thread computes:
      1. Barriers. Its BlockManager polls the block's threads in a busy loop and releases a barrier when every live
         thread is blocked in it; the poller holds the GIL for up to a switch interval (5 ms) at a time while the
         threads it waits for cannot run. `_Barrier` does the same with a condition variable: released when every
         live thread waits in it (a thread that has returned no longer counts, as in the poller), broken for all
         when one thread raises (the poller's abort), and the first exception raised is re-raised.
      2. A race. The simulator points a function's module-global `cuda` at its fake module while the function runs
         (`kernelapi.swapped_cuda_module`) and puts the real module back when it returns; when the threads of a
         block run one device function of another module than the kernel's, the first to return puts the real
         module back under the others ("module 'numba.cuda' has no attribute 'local'"): rare with the poller,
         frequent once threads take turns faster. Here a module's globals are swapped when the first thread enters
         and back when the last one leaves.
    Measured on the 2-core VM, a 100-block kernel of 32 threads with 7 barriers (reduce.block_sum_rows, every
    mat-vec's reduction): 159 ms a block as Numba ships it, 16 ms with these changes (5 ms of it starting the 32
    threads: a kernel without barriers)."""
    global _done
    from numba import cuda
    from numba.cuda.simulator import kernel as sim_kernel

    if _done or not all(hasattr(sim_kernel, n) for n in ("BlockManager", "BlockThread", "swapped_cuda_module")):
        return  # once a process; and a Numba whose simulator is built otherwise is left as it is
    _done = True

    lock, swapped = threading.Lock(), {}  # id(globals) -> [threads inside, the values to put back]

    @contextmanager
    def swapped_cuda_module(fn, fake_cuda_module):
        glob = fn.__globals__
        with lock:
            entry = swapped.get(id(glob))
            if entry is None:
                orig = {k: v for k, v in glob.items() if v is cuda}
                glob.update({k: fake_cuda_module for k in orig})
                entry = swapped[id(glob)] = [0, orig]
            entry[0] += 1
        try:
            yield
        finally:
            with lock:
                entry[0] -= 1
                if entry[0] == 0:
                    glob.update(entry[1])
                    del swapped[id(glob)]

    class _Barrier:
        """syncthreads for one block: released when every live thread waits in it."""

        def __init__(self, n: int):
            self.cond, self.live, self.waiting, self.generation, self.broken = threading.Condition(), n, 0, 0, False

        def _release(self):
            self.waiting, self.generation = 0, self.generation + 1
            self.cond.notify_all()

        def wait(self):
            with self.cond:
                generation = self.generation
                self.waiting += 1
                if self.waiting == self.live:
                    self._release()
                while generation == self.generation and not self.broken:
                    self.cond.wait()
                if self.broken:
                    raise RuntimeError("abort: another thread of the block raised")

        def leave(self, failed: bool):
            with self.cond:
                self.live -= 1
                if failed:
                    self.broken = True
                    self.cond.notify_all()
                elif self.waiting and self.waiting == self.live:
                    self._release()

    def syncthreads(self):
        self.barrier.wait()

    class BlockManager(sim_kernel.BlockManager):
        def run(self, grid_point, *args):
            points = list(np.ndindex(*self._block_dim))
            barrier, threads = _Barrier(len(points)), []

            def target():
                failed = True
                try:
                    self._f(*args)
                    failed = False
                finally:
                    barrier.leave(failed)

            for block_point in points:
                t = sim_kernel.BlockThread(target, self, grid_point, block_point, self._debug)
                t.barrier = barrier
                threads.append(t)
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            failed = [t for t in threads if t.exception]
            first = [t for t in failed if "abort: another thread" not in str(t.exception[0])] or failed
            if first:
                raise first[0].exception[0].with_traceback(first[0].exception[1])

    sim_kernel.swapped_cuda_module = swapped_cuda_module
    sim_kernel.BlockThread.syncthreads = syncthreads
    sim_kernel.BlockManager = BlockManager
