"""backends/arena.py: the CPU backend's repacked copies cut from chunks advised as 2 MiB pages.

What this checks: the arrays an arena hands out are C-contiguous, start on a cache line, never overlap, keep their
bytes; a chunk starts on a huge-page boundary and (Linux) its mapping carries the kernel's huge-page advice (the
`hg` flag of /proc/self/smaps: the advice given, whether or not the system then finds free 2 MiB pages, which is
not deterministic); the CPU backend's dense tiles and an expert's repacked matrices come from its arena and give the
products of plain arrays (the bits: tests/test_repack.py); PYMOE_HUGE=0's arena hands out plain NumPy arrays.
"""
import mmap
import sys

import numpy as np
import pytest

from pymoe.backends import arena as arena_mod
from pymoe.backends.arena import ALIGN, HUGE_PAGE, HugeArena


def _vma_flags(address: int) -> list:
    """The VmFlags of the mapping of this process that holds `address` (Linux: /proc/self/smaps)."""
    flags, inside = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: lo-hi perms ...
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    return flags


def test_arena_arrays_are_aligned_disjoint_and_keep_their_bytes():
    a = HugeArena(chunk=1 << 20)
    shapes = [(3, 1000), (1, 1), (8, 8192), (130, 1030), (2, 600000)]  # the last one larger than a chunk
    arrays = [a.empty(s) for s in shapes]
    for s, x in zip(shapes, arrays):
        assert x.shape == s and x.dtype == np.uint8 and x.flags.c_contiguous and x.flags.writeable
        assert x.ctypes.data % ALIGN == 0
    spans = sorted((x.ctypes.data, x.ctypes.data + x.nbytes) for x in arrays)
    assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:])), "arena arrays overlap"
    for i, x in enumerate(arrays):
        x[...] = i + 1
    for i, x in enumerate(arrays):
        assert (x == i + 1).all()
        assert a.holds(x)
    assert a.nbytes == sum(x.nbytes for x in arrays)
    assert not a.holds(np.empty(100, np.uint8))


def test_a_chunk_starts_on_a_huge_page_and_is_advised_as_huge_pages():
    a = HugeArena()
    x = a.empty((4, 4096))
    assert x.ctypes.data % HUGE_PAGE == 0  # the first array of a chunk: the chunk's start
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("huge-page advice is Linux's")
    flags = _vma_flags(x.ctypes.data)
    assert flags is not None, "the arena's chunk is not a mapping of its own"
    assert "hg" in flags, f"the chunk's mapping lacks the huge-page advice: VmFlags {flags}"
    assert "sh" not in flags  # private: shared anonymous memory (shmem) has its own huge-page switch, usually off


def test_disabled_arena_gives_plain_arrays(monkeypatch):
    a = HugeArena(enabled=False)
    x = a.empty((8, 100))
    assert x.base is None and x.shape == (8, 100) and x.dtype == np.uint8 and a.nbytes == 0
    monkeypatch.setenv("PYMOE_HUGE", "0")
    import importlib

    fresh = importlib.reload(arena_mod)
    try:
        assert fresh.ENABLED is False and fresh.HugeArena().enabled is False
    finally:
        monkeypatch.delenv("PYMOE_HUGE")
        importlib.reload(arena_mod)


def test_cpu_backend_repacked_copies_live_in_its_arena(tiny_model, monkeypatch):
    """The dense weights' tiles (repacked at load), a routed expert's (on first use) and the rows of a dense weight
    without tiles (the F32 router) are arena arrays, and the model computes the same logits as with the tiles plain
    NumPy arrays and the router read in the memory map."""
    import pymoe
    import pymoe.backends.cpu as cpu

    path = tiny_model("qwen3moe", "q2_k")
    eng = pymoe.load(path, backend="cpu", backend_options={"act_bits": 8})
    b, layer = eng.model.backend, eng.model.layers[0]
    assert b._arena.enabled and b._arena.nbytes > 0
    assert layer.attn_q.tiles is not None and b._arena.holds(layer.attn_q.tiles)
    ex = eng.model.cache.expert(0, 0)
    row = b.expert_row(ex, tuple(layer.expert_types[p] for p in ("gate", "up", "down")), eng.config.n_embd)
    mats = b._rows[id(ex)][1]  # its repacked gate, up, down (None: a type without a layout)
    assert any(m is not None for m in mats)
    for m, address in zip(mats, row[3:]):
        if m is not None:
            assert b._arena.holds(m) and m.ctypes.data == address
    router = layer.ffn_gate_inp  # F32, no tiles: its rows copied into the arena
    assert router.tiles is None and b._arena.holds(router.raw)
    assert router.raw.dtype == np.float32 and router.raw.shape == router.shape
    got = eng.model.prefill([1, 2, 3, 4, 5], eng.model.new_kv(64))  # [5, V]
    got_decode = eng.model.decode_one_token(6, eng.model.new_kv(64))

    monkeypatch.setattr(cpu, "HugeArena", lambda: HugeArena(enabled=False))
    plain = pymoe.load(path, backend="cpu", backend_options={"act_bits": 8})
    assert plain.model.layers[0].attn_q.tiles.base is None  # its own NumPy array
    assert not b._arena.holds(plain.model.layers[0].ffn_gate_inp.raw)  # a view of the memory map
    want = plain.model.prefill([1, 2, 3, 4, 5], plain.model.new_kv(64))
    np.testing.assert_array_equal(got, want)  # the same bytes, wherever they live: the same bits
    np.testing.assert_array_equal(got_decode, plain.model.decode_one_token(6, plain.model.new_kv(64)))
