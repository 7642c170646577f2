"""`cooc`, the default cache policy, compiled: CoocPolicy's decisions at a fraction of its cost per lookup.

What this is: the kernels of policies.CompiledCoocPolicy, the policy the engine and the simulator run under the name
`cooc` (policies.POLICIES), and CoocPolicy's per-token arithmetic (`_cooc_lifts`), which both share. Its rule is
CoocPolicy's (policies.py: WindowPolicy's windowed use counts, prior and payback admission, plus the next-token
co-occurrence bonus), which stays beside it as the readable reference: tests/test_compiled_cooc.py holds this one
to it decision by decision (every hit, slot and victim) on traces with and without a profile, placements, admission
control and prefetch. The engine pays a policy on every lookup, 384 of them a token on a 48-layer top-8 model, so
the interpreter's dicts, deques and heapq were most of `cooc`'s cost (bench/policy_cost.py; docs/expert-cache.md,
"Default: `cooc`").
How: the same state as CoocPolicy's, in arrays, and one compiled call per event (`event`):
    sc    float64 [NK]        a key's score (prior + windowed uses + bonus); NK grows with the keys seen
    kv    int64 [NK, 3]       a key's last use (the use clock), resident flag, place in `res`
    res   int64 [capacity]    the resident keys (unordered; swap-removed)
    heap  float64 [HCAP, 3]   a min-heap of (score, last use, key) entries of residents, lazily deleted: an entry is
                              live while it matches the key's present score and last use (CoocPolicy's heapq, and its
                              rebuild from the residents past HEAP_SLACK x (residents + 1) entries). Keys are unique,
                              so the live minimum, the victim, does not depend on the heap's layout.
    fifo  int64 [edges, RING, 2]  per window edge, a ring of (clock the use crosses it, key), oldest first
    meta  int64 [..]          counters and sizes (the M_* offsets below)
    fpar  float64 [..]        the first weight, admission ratio, bonus weight, then the score's drop at each edge
    T     float32 [NL, E + 1, E]  per layer, CoocPolicy's transition counts T [E, E], then its row counts n [E]
    lay   int64 [NL, 3, W]    per layer: the token being routed, the last token, the bonused keys (count in col 0)
    bval  float64 [NL, W]     per layer: the bonuses now in the scores, beside lay's keys
What it is not: a new rule. A change of rule is made in CoocPolicy first, then here, and the equality test says
whether the two still agree.
"""
from __future__ import annotations

import numpy as np
from numba import njit


# meta's fields
M_CLOCK, M_HEAP, M_SIZE, M_CAP, M_EDGES, M_E, M_K, M_TOP, M_SLACK = range(9)
M_RING = 9  # then, per edge i: its length in uses at M_RING + 3i, the ring's head at + 1, its entries at + 2
# fpar's fields
F_W0, F_ADMIT, F_WEIGHT, F_DROP = 0, 1, 2, 3  # F_DROP + i: the score's drop when a use crosses edge i
# _event's operations
HIT, USE, PLACE, ADMIT, VICTIM, INSERT, EVICT = range(7)


@njit(cache=True)
def _cooc_lifts(T, n, prev, now, k, top):
    """CoocPolicy's arithmetic for one layer and token, in the float32 / float64 steps of its NumPy form
    (_cooc_lifts_ref, tests/test_policies.py): count prev -> now into T float32 [E, E] and n float32 [E] (prev, now:
    a token's distinct experts, int64 [k]; prev empty at a layer's first token), then
        p(e) = 1 - prod over a in now of (1 - T[a, e] / max(n[a], 1))   (the quotient float32, the rest float64)
        q(e) = k n[e] / max(sum(n), 1)                                  (float32)
    -> (the experts of the `top` largest lift = max(p - q, 0), ties to the lower expert, those of lift > 0 only,
    int64; their lifts, float64)."""
    E = n.size
    for a in prev:
        for e in now:
            T[a, e] += np.float32(1.0)
        n[a] += np.float32(1.0)
    total = 0.0
    for e in range(E):
        total += n[e]  # whole counts: exact in either order while the sum is below 2^24
    total32 = np.float32(max(total, 1.0))
    lift = np.empty(E, dtype=np.float64)
    for e in range(E):
        keep = 1.0
        for a in now:
            keep *= 1.0 - np.float64(T[a, e] / max(n[a], np.float32(1.0)))
        q = np.float32(np.float32(k) * n[e]) / total32
        lift[e] = max((1.0 - keep) - np.float64(q), 0.0)
    order = np.empty(min(top, E), dtype=np.int64)  # the `top` largest positive lifts, largest first, ties to the
    m = 0  # lower expert (a stable sort's order), picked one scan of E at a time (top is 2k)
    while m < order.size:
        best = -1
        for e in range(E):
            if lift[e] > 0.0 and (best < 0 or lift[e] > lift[best]):
                best = e
        if best < 0:
            break
        order[m] = best
        lift[best] = -lift[best]  # taken: negated, it is out of the next scans
        m += 1
    for j in range(m):
        lift[order[j]] = -lift[order[j]]
    return order[:m], lift[order[:m]]



@njit(cache=True)
def _less(heap, i, j):
    """Entry i of the heap orders before entry j: (score, last use, key), as Python compares the tuples."""
    for c in range(3):
        if heap[i, c] != heap[j, c]:
            return heap[i, c] < heap[j, c]
    return False


@njit(cache=True)
def _swap(heap, i, j):
    for c in range(3):
        heap[i, c], heap[j, c] = heap[j, c], heap[i, c]


@njit(cache=True)
def _sift_down(heap, n, i):
    while True:
        low, a, b = i, 2 * i + 1, 2 * i + 2
        if a < n and _less(heap, a, low):
            low = a
        if b < n and _less(heap, b, low):
            low = b
        if low == i:
            return
        _swap(heap, i, low)
        i = low


@njit(cache=True)
def _push(sc, kv, res, heap, meta, key):
    """A live entry for resident `key`; past HEAP_SLACK x (residents + 1) entries, the heap is rebuilt from the
    residents (CoocPolicy's _push)."""
    n = meta[M_HEAP]
    heap[n, 0], heap[n, 1], heap[n, 2] = sc[key], kv[key, 0], key
    i = n
    while i > 0:
        parent = (i - 1) // 2
        if not _less(heap, i, parent):
            break
        _swap(heap, i, parent)
        i = parent
    n += 1
    size = meta[M_SIZE]
    if n > meta[M_SLACK] * (size + 1):
        for j in range(size):
            k = res[j]
            heap[j, 0], heap[j, 1], heap[j, 2] = sc[k], kv[k, 0], k
        n = size
        for j in range(n // 2 - 1, -1, -1):
            _sift_down(heap, n, j)
    meta[M_HEAP] = n


@njit(cache=True)
def _victim(sc, kv, heap, meta):
    """The resident of lowest (score, last use, key): the heap's top once stale entries are popped."""
    while True:
        key = np.int64(heap[0, 2])
        if kv[key, 1] == 1 and sc[key] == heap[0, 0] and kv[key, 0] == heap[0, 1]:
            return key
        n = meta[M_HEAP] - 1  # stale: pop it
        _swap(heap, 0, n)
        meta[M_HEAP] = n
        _sift_down(heap, n, 0)


@njit(cache=True)
def _use(sc, kv, res, heap, fifo, meta, fpar, key):
    """WindowPolicy._use: the clock moves; uses that crossed an edge lower their keys' scores (a resident other than
    `key` re-pushed); `key` gains the first weight and schedules its crossings."""
    clock = meta[M_CLOCK] + 1
    meta[M_CLOCK] = clock
    ring = fifo.shape[1]
    for i in range(meta[M_EDGES]):
        at = M_RING + 3 * i
        while meta[at + 2] > 0 and fifo[i, meta[at + 1], 0] <= clock:
            k = fifo[i, meta[at + 1], 1]
            meta[at + 1] = (meta[at + 1] + 1) % ring
            meta[at + 2] -= 1
            sc[k] -= fpar[F_DROP + i]
            if kv[k, 1] == 1 and k != key:
                _push(sc, kv, res, heap, meta, k)
    sc[key] += fpar[F_W0]
    kv[key, 0] = clock
    for i in range(meta[M_EDGES]):
        at = M_RING + 3 * i
        tail = (meta[at + 1] + meta[at + 2]) % ring
        fifo[i, tail, 0], fifo[i, tail, 1] = clock + meta[at], key
        meta[at + 2] += 1


@njit(cache=True)
def _route(sc, kv, res, heap, meta, fpar, T, lay, bval, key):
    """CoocPolicy._route and _next_token: the k-th lookup of a layer closes its token; count the transitions from the
    layer's last token, then replace the layer's bonuses by those the token gives (_cooc_lifts)."""
    E, k = meta[M_E], meta[M_K]
    layer, expert = key // E, key % E
    tok = lay[layer, 0]
    tok[0] += 1
    tok[tok[0]] = expert
    if tok[0] < k:
        return
    tok[0] = 0
    now = tok[1:k + 1].copy()
    prev = lay[layer, 1]
    best, lift = _cooc_lifts(T[layer, :E], T[layer, E], prev[1:prev[0] + 1], now, k, meta[M_TOP])
    prev[0] = k
    prev[1:k + 1] = now
    keys, old = lay[layer, 2], bval[layer]
    m = keys[0]
    weight = fpar[F_WEIGHT]
    for j in range(best.size):  # the new bonuses, each against the key's old one (0 if it had none)
        g = layer * E + best[j]
        new = weight * lift[j]
        was = 0.0
        for i in range(m):
            if keys[1 + i] == g:
                was = old[i]
        change = new - was
        if change != 0.0:
            sc[g] += change
            if kv[g, 1] == 1:
                _push(sc, kv, res, heap, meta, g)
    for i in range(m):  # the old bonuses no new one replaced
        g = keys[1 + i]
        kept = False
        for j in range(best.size):
            if layer * E + best[j] == g:
                kept = True
        if not kept and old[i] != 0.0:
            sc[g] -= old[i]
            if kv[g, 1] == 1:
                _push(sc, kv, res, heap, meta, g)
    keys[0] = best.size
    for j in range(best.size):
        keys[1 + j] = layer * E + best[j]
        old[j] = weight * lift[j]


@njit(cache=True)
def event(sc, kv, res, heap, fifo, meta, fpar, T, lay, bval, key, op):
    """One of the Policy protocol's calls (op: HIT, USE, PLACE, ADMIT, VICTIM, INSERT, EVICT) -> admit's answer (1/0),
    victim's key, else 0. The callers' order (SlotTable) is CoocPolicy's: a hit; a miss's use, then admit, victim
    and evict, insert."""
    routed = meta[M_E] > 0
    if op == HIT:
        _use(sc, kv, res, heap, fifo, meta, fpar, key)
        _push(sc, kv, res, heap, meta, key)
        if routed:
            _route(sc, kv, res, heap, meta, fpar, T, lay, bval, key)
    elif op == USE:
        _use(sc, kv, res, heap, fifo, meta, fpar, key)
        if routed:
            _route(sc, kv, res, heap, meta, fpar, T, lay, bval, key)
    elif op == PLACE:  # a use for the window, not a token's routing
        _use(sc, kv, res, heap, fifo, meta, fpar, key)
    elif op == ADMIT:
        if meta[M_SIZE] < meta[M_CAP]:
            return 1
        return 1 if sc[key] >= fpar[F_ADMIT] * sc[_victim(sc, kv, heap, meta)] else 0
    elif op == VICTIM:
        return _victim(sc, kv, heap, meta)
    elif op == INSERT:
        kv[key, 1], kv[key, 2] = 1, meta[M_SIZE]
        res[meta[M_SIZE]] = key
        meta[M_SIZE] += 1
        _push(sc, kv, res, heap, meta, key)
    elif op == EVICT:
        kv[key, 1] = 0
        last = meta[M_SIZE] - 1
        moved = res[last]
        res[kv[key, 2]] = moved
        kv[moved, 2] = kv[key, 2]
        meta[M_SIZE] = last
    return 0


# decode_step's per-call record, `rec` int64 [..]: fixed fields, then its lists
R_HITS, R_PROMOTED, R_SERVED, R_INSERTS, R_FRESH, R_LIST = range(6)  # R_LIST on: T x 4 row counts, n x 3, n x 3, n
# the row counts per row: lookups' paths (hits, spill, cpu), then evictions (= promotions in a full pool)
C_HITS, C_SPILL, C_CPU, C_EVICTED = range(4)


@njit(cache=True)
def _decode_layer(sc, kv, res, heap, fifo, meta, fpar, T, lay, bval, slot_arr, residency, heat, ids, layer,
                  max_inserts, miss, forced, where_of, slot_of_e, rec, o):
    """One decode lookup call of SlotCache.lookup (ids int64 [Tr, K]: its rows' experts of `layer`, token order)
    through the slot table and this policy, pair by pair as SlotTable.access(key, t, insert=True) and
    SlotCache.lookup's loop decide, for a full pool (no free slot) without second-miss admission, prefetch, or a
    live-gap window closing within it (SlotCache._compiled_covers checks those).
    In and out: slot_arr int64 [keys] (SlotTable.slot_arr: key -> slot or -1); residency int32 [L, E]; heat int64
    [L, E] (SlotCache.heat: each pair of a layer < L counted); miss float64 [2] (pcie_frac, the error diffusion's
    credit: SlotCache._miss_path); where_of / slot_of_e int64 [E] scratch, -1 on entry and again on return.
    forced: bool [L, E] (this forward's forced-spill mask) or [0, 0].
    rec[o:] int64, the R_* fields: rec[o + R_INSERTS] this step's inserts so far, in and out; rec[o + R_FRESH] 1 in
    if the table's insert count belongs to an earlier step, 0 out once a miss reached admission control, which then
    counts from 0 (SlotTable._admitted). Then it receives, from rec[o + R_LIST]: per row the C_* counts; the
    promotions in pair order (key, slot, evicted key); each expert served, at its first pair (expert, where: 0 its
    slot, 1 spill, 2 cpu; the slot or -1); every pair's key."""
    E = where_of.size
    Tr, K = ids.shape
    n = Tr * K
    rows = o + R_LIST
    promos = rows + 4 * Tr
    served = promos + 3 * n
    keys_at = served + 3 * n
    rec[o + R_HITS] = rec[o + R_PROMOTED] = rec[o + R_SERVED] = 0
    counting = heat.shape[0] > layer
    rec[rows:promos] = 0
    for t in range(Tr):
        for j in range(K):
            e = ids[t, j]
            key = layer * E + e
            rec[keys_at + t * K + j] = key
            if counting:
                heat[layer, e] += 1
            slot = slot_arr[key]
            hit = slot >= 0
            _use(sc, kv, res, heap, fifo, meta, fpar, key)
            if hit:
                _push(sc, kv, res, heap, meta, key)
            if meta[M_E] > 0:
                _route(sc, kv, res, heap, meta, fpar, T, lay, bval, key)
            if hit:
                rec[o + R_HITS] += 1
            elif rec[o + R_FRESH]:  # SlotTable._admitted: a new step's insert count starts at its first miss
                rec[o + R_FRESH], rec[o + R_INSERTS] = 0, 0
            if not hit and not (max_inserts > 0 and rec[o + R_INSERTS] >= max_inserts):
                victim = _victim(sc, kv, heap, meta)
                if sc[key] >= fpar[F_ADMIT] * sc[victim]:  # payback admission, then the same victim goes
                    rec[o + R_INSERTS] += 1
                    slot = slot_arr[victim]
                    slot_arr[victim] = -1
                    event(sc, kv, res, heap, fifo, meta, fpar, T, lay, bval, victim, EVICT)
                    slot_arr[key] = slot
                    event(sc, kv, res, heap, fifo, meta, fpar, T, lay, bval, key, INSERT)
                    residency[victim // E, victim % E] = -1
                    residency[layer, e] = slot
                    at = promos + 3 * rec[o + R_PROMOTED]
                    rec[at], rec[at + 1], rec[at + 2] = key, slot, victim
                    rec[o + R_PROMOTED] += 1
                    rec[rows + 4 * t + C_EVICTED] += 1
            if where_of[e] < 0:  # the first pair of this call to choose e decides how e is served
                if hit and not (forced.shape[0] > 0 and forced[layer, e]):
                    where_of[e], slot_of_e[e] = 0, slot
                elif hit:
                    where_of[e] = 1  # force_spill(): this hit is read over PCIe
                else:
                    miss[1] += miss[0]
                    if miss[1] >= 1.0 - 1e-9:
                        miss[1] -= 1.0
                        where_of[e] = 1
                    else:
                        where_of[e] = 2
                at = served + 3 * rec[o + R_SERVED]
                rec[at], rec[at + 1], rec[at + 2] = e, where_of[e], slot_of_e[e]
                rec[o + R_SERVED] += 1
            rec[rows + 4 * t + where_of[e]] += 1  # C_HITS, C_SPILL or C_CPU
    for i in range(rec[o + R_SERVED]):
        e = rec[served + 3 * i]
        where_of[e] = slot_of_e[e] = -1


@njit(cache=True)
def decode_step(sc, kv, res, heap, fifo, meta, fpar, T, lay, bval, slot_arr, residency, heat, ids, layers,
                max_inserts, miss, forced, where_of, slot_of_e, rec):
    """A whole decode step's lookup calls (SlotCache.lookup_step): ids int64 [M, Tr, K], the M MoE layers' routing in
    layer order (layers int64 [M]), each as a call of its own (its own insert-cap step, served paths, record), one
    after another: layer m's record at rec[m x (R_LIST + 4 Tr + 7 n):], its rec[R_FRESH] set to 1 by the caller
    (every call is a new step). heat: SlotCache.heat, counted here."""
    M, Tr, K = ids.shape
    size = R_LIST + 4 * Tr + 7 * Tr * K
    for m in range(M):
        _decode_layer(sc, kv, res, heap, fifo, meta, fpar, T, lay, bval, slot_arr, residency, heat, ids[m],
                      layers[m], max_inserts, miss, forced, where_of, slot_of_e, rec, m * size)
