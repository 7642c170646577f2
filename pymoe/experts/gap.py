"""The gap to the optimum, live: the hits Belady would have had on the engine's own recent decode lookups.

What this is: `LiveGap(table)`, kept by the engine's slot cache (cache.py). Decode lookups are gathered in windows of
at most `window` lookups (GAP_WINDOW); a window also closes when a prompt has been read (end_prefill: the warm set
changes the pool outside any lookup) and when a request ends (generate.py). Closing replays the window's keys through
Belady (MIN with bypass, the optimum for these lookups: `BeladyPolicy` in a SlotTable of the same capacity, compiled as
`belady_hits`) pre-filled with the keys resident when the window opened, and adds to three totals: lookups, hits (the
engine's), belady_hits.
`totals()` returns them; a request's share is the difference of two readings (RequestStats.gap).
What this is not: a bound on prefill lookups (they never insert), or exact for a batched decode step, where the
engine serves an expert once per lookup call and counts its later pairs as its first was served; Belady counts each
pair on its own. With one sequence a decode lookup call has one pair per expert, and the two counts agree.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .policies import BeladyPolicy, SlotTable, next_uses

GAP_WINDOW = 4096  # decode lookups per window; the replay (`belady_hits`, compiled) costs well under a microsecond a
# lookup, next to the cache's own bookkeeping


class LiveGap:
    def __init__(self, table: SlotTable, window: int = GAP_WINDOW):
        self.table, self.window = table, int(window)
        self.keys: list[int] = []
        self.hits = 0  # the engine's hits in the open window
        self.start: list[int] = []  # the keys resident when the window opened
        self.total = {"lookups": 0, "hits": 0, "belady_hits": 0}

    def before(self) -> None:
        """Call before a decode lookup's SlotTable.access: the first of a window notes the pool's contents."""
        if not self.keys:
            self.start = list(self.table.slot_of)

    def after(self, key: int, hit: bool) -> None:
        """Call after it, with the engine's verdict for this pair (counted as the cache counts it)."""
        self.keys.append(int(key))
        self.hits += bool(hit)
        if len(self.keys) >= self.window:
            self.close()

    def extend(self, keys: list, hits: int) -> None:
        """after() for a whole lookup call at once (SlotCache._decode_compiled): its pairs' keys, and how many of
        them the engine served from a slot; the window closes if they reach it (the caller makes sure they do not
        before its last pair)."""
        self.keys.extend(keys)
        self.hits += hits
        if len(self.keys) >= self.window:
            self.close()

    def close(self) -> None:
        """Replay the open window through Belady from the same starting contents and add it to the totals."""
        if not self.keys:
            return
        keys, self.keys = self.keys, []
        self.total["lookups"] += len(keys)
        self.total["hits"] += self.hits
        self.total["belady_hits"] += belady_hits(keys, self.start, self.table.capacity)
        self.hits = 0

    def totals(self) -> dict:
        return dict(self.total)


def belady_hits(keys: list, start: list, capacity: int) -> int:
    """The hits of Belady (MIN with bypass, policies.BeladyPolicy) on the lookups `keys` in a SlotTable of `capacity`
    slots pre-filled with `start` (SlotTable.prefill: in order, until full), compiled (`_belady_replay`); its
    reference is that replay itself, `belady_hits_ref` (tests/test_simulate.py holds the two equal)."""
    if not keys or capacity <= 0:
        return 0
    uniq, dense = np.unique(np.asarray(list(start) + list(keys), dtype=np.int64), return_inverse=True)
    dense = dense.astype(np.int64)
    n0 = len(start)
    ids = dense[n0:]  # [n]: each lookup's key as an index into uniq
    return int(_belady_replay(ids, next_uses(ids), dense[:n0], uniq.size, int(capacity)))


def belady_hits_ref(keys: list, start: list, capacity: int) -> int:
    """belady_hits by SlotTable and BeladyPolicy, lookup by lookup."""
    best = SlotTable(capacity, BeladyPolicy(capacity, keys))
    best.prefill(start)
    for t, key in enumerate(keys):
        best.access(key, t)
    return best.hits


@njit(cache=True)
def _belady_replay(ids, nxt, start, n_keys, capacity):
    """ids int64 [n] (dense keys < n_keys), nxt int64 [n] (next position of the same key, n if none), start int64
    [m] (dense keys pre-filled in order while slots are free) -> hits. A max-heap of (next use, key) over residents,
    lazily deleted (an entry is live while it matches the key's next use and the key is resident): the victim is
    the resident used furthest ahead, a miss whose next use is no sooner than it is served without a slot."""
    n = ids.size
    first = np.full(n_keys, n, dtype=np.int64)  # each key's first position (n: never), for the pre-filled keys
    for t in range(n - 1, -1, -1):
        first[ids[t]] = t
    resident = np.zeros(n_keys, dtype=np.bool_)
    cur = np.full(n_keys, -1, dtype=np.int64)  # a resident's next use
    heap_n = np.empty(start.size + n + 1, dtype=np.int64)  # entries: next use ...
    heap_k = np.empty(start.size + n + 1, dtype=np.int64)  # ... and key
    size = h = 0
    for k in start:
        if size >= capacity:
            break
        if not resident[k]:
            resident[k], cur[k] = True, first[k]
            size += 1
            h = _heap_push(heap_n, heap_k, h, first[k], k)
    hits = 0
    for t in range(n):
        k = ids[t]
        if resident[k]:
            hits += 1
            cur[k] = nxt[t]
            h = _heap_push(heap_n, heap_k, h, nxt[t], k)
            continue
        if size >= capacity:
            while not (resident[heap_k[0]] and cur[heap_k[0]] == heap_n[0]):  # stale entries off the top
                h = _heap_pop(heap_n, heap_k, h)
            if nxt[t] >= heap_n[0]:
                continue  # bypass: used no sooner than the furthest resident
            resident[heap_k[0]] = False
            h = _heap_pop(heap_n, heap_k, h)
            size -= 1
        resident[k], cur[k] = True, nxt[t]
        size += 1
        h = _heap_push(heap_n, heap_k, h, nxt[t], k)
    return hits


@njit(cache=True)
def _before(heap_n, heap_k, i, j):
    """Entry i comes out of the heap before entry j: the later next use, then the lower key (BeladyPolicy's order)."""
    return heap_n[i] > heap_n[j] or (heap_n[i] == heap_n[j] and heap_k[i] < heap_k[j])


@njit(cache=True)
def _heap_push(heap_n, heap_k, h, nx, k):
    heap_n[h], heap_k[h] = nx, k
    i = h
    while i > 0:
        parent = (i - 1) // 2
        if not _before(heap_n, heap_k, i, parent):
            break
        heap_n[i], heap_n[parent] = heap_n[parent], heap_n[i]
        heap_k[i], heap_k[parent] = heap_k[parent], heap_k[i]
        i = parent
    return h + 1


@njit(cache=True)
def _heap_pop(heap_n, heap_k, h):
    h -= 1
    heap_n[0], heap_k[0] = heap_n[h], heap_k[h]
    i = 0
    while True:
        top, a, b = i, 2 * i + 1, 2 * i + 2
        if a < h and _before(heap_n, heap_k, a, top):
            top = a
        if b < h and _before(heap_n, heap_k, b, top):
            top = b
        if top == i:
            return h
        heap_n[i], heap_n[top] = heap_n[top], heap_n[i]
        heap_k[i], heap_k[top] = heap_k[top], heap_k[i]
        i = top
