"""Memory in 2 MiB pages for the CPU backend's long-lived copies of weights (the repacked tiles, quant/repack.py).

What this is: `HugeArena().empty((rows, cols))` -> a uint8 array carved out of large chunks that the kernel is asked
to back with transparent huge pages (2 MiB on x86-64: `madvise(MADV_HUGEPAGE)`), one after another, never freed
while the arena or an array from it lives.

Why: a decoded token reads every chosen expert once, ~100 MiB of weights a token for the mid Q4_K_M file, far
more than any cache. In 4 KiB pages that is ~27 000 pages a token, each a miss of the TLB (the L2 TLB of a Zen 4
core covers 12 MiB) and a page-table walk, which in a virtual machine walks two page tables; the hardware
prefetchers stop at every 4 KiB boundary too. In 2 MiB pages the same bytes are ~54 pages. Each repacked matrix
is small (an expert's gate of the mid file: 288 KiB), so allocated on its own (NumPy: `malloc`) it would get 4
KiB pages; NumPy asks for huge pages only for arrays of 4 MiB and more. So the copies are cut from 64 MiB chunks.
Measured (docs/performance.md, round twenty; bench/huge_pages.py: two engines in one process, alternated): decode
of the mid Q4_K_M file on a 2-core Zen 4 VM, 8-bit, 2 threads, 178 / 166 tok/s, the MoE kernel 255 / 261 us a
layer, the arena faster in 15 of 24 rounds.
Where the system does not give huge pages (THP off, `never`; another OS) the chunks are ordinary memory: the same
results, only the speed-up is lost. `PYMOE_HUGE=0`: no arena (each copy its own NumPy array), to compare.
What this is not: the expert cache's slot pool (backends/pool.py), or the model's memory map (the file's own pages,
which the page cache keeps).
"""
from __future__ import annotations

import mmap
import os

import numpy as np

HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 (and of arm64's with 4 KiB base pages)
CHUNK = 64 << 20  # bytes of one chunk: 32 huge pages; a copy larger than this gets a chunk of its own
ALIGN = 64  # each array starts on a cache line
ENABLED = os.environ.get("PYMOE_HUGE", "1") != "0"


class HugeArena:
    """Bump allocation from chunks of anonymous memory advised as huge pages. An array keeps its chunk alive (it
    is a view of it), so a chunk whose arrays are all gone is returned to the system; nothing is ever reused
    within a chunk: what is cut from it here lives as long as the model (weights' repacked copies)."""

    def __init__(self, chunk: int = CHUNK, enabled: bool = ENABLED):
        self.chunk, self.enabled = chunk, enabled
        self._buf, self._off = None, 0  # the current chunk (uint8 [n], starting on a huge-page boundary), its fill
        self.nbytes = 0  # bytes handed out (the arrays' sizes, not counting alignment)
        self.spans = []  # [(first address, end address)] of the chunks made

    def empty(self, shape: tuple) -> np.ndarray:
        """An uninitialised C-contiguous uint8 array of this shape, from the arena (or NumPy's, when disabled)."""
        n = int(np.prod(shape))
        if not self.enabled:
            return np.empty(shape, dtype=np.uint8)
        if self._buf is None or self._off + n > self._buf.size:
            self._buf, self._off = _huge_chunk(max(self.chunk, n)), 0
            self.spans.append((self._buf.ctypes.data, self._buf.ctypes.data + self._buf.size))
        a = self._buf[self._off:self._off + n].reshape(shape)
        self._off += (n + ALIGN - 1) // ALIGN * ALIGN
        self.nbytes += n
        return a

    def holds(self, a: np.ndarray) -> bool:
        """Whether the bytes of array `a` lie in one of this arena's chunks."""
        lo = a.ctypes.data
        return any(c0 <= lo and lo + a.nbytes <= c1 for c0, c1 in self.spans)

    def copy(self, a: np.ndarray) -> np.ndarray:
        """A C-contiguous copy of `a` (any dtype) in the arena."""
        out = self.empty((a.nbytes,)).view(a.dtype).reshape(a.shape)
        out[...] = a
        return out


def _huge_chunk(n: int) -> np.ndarray:
    """uint8 [n] of fresh anonymous memory starting on a 2 MiB boundary, advised as huge pages where the system
    has them. Pages are committed when first written (a chunk's unused tail costs address space only)."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)  # private: shared anonymous memory
    # is shmem, whose huge pages are another switch (shmem_enabled, usually off)
    m = mmap.mmap(-1, n + HUGE_PAGE, flags=flags) if flags else mmap.mmap(-1, n + HUGE_PAGE)  # (+ room to move the
    # start onto a huge-page boundary)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere ordinary pages
        m.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(m, dtype=np.uint8)  # the array keeps the mapping alive
    start = -raw.ctypes.data % HUGE_PAGE
    return raw[start:start + n]
