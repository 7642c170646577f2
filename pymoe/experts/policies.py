"""Expert-cache replacement policies and the slot table that applies them: the one copy of this logic.

What this is: the bookkeeping of a pool of `capacity` slots holding experts, shared by the engine's slot cache and
the simulator (pymoe/experts/simulate.py), so a simulated hit rate is the engine's hit rate by construction.
    key  = layer * n_experts + expert           a global expert id (int), the unit of caching
    t    = position of this lookup in the access sequence (0, 1, 2, ...; only Belady reads it)
`SlotTable(capacity, policy).access(key, t) -> (hit, slot, evicted)` is one lookup:
    hit   -> the policy hears `on_hit`; the key stays in its slot
    miss  -> the policy hears `on_use` (every miss is a use, whether it takes a slot or not: a prefill lookup, one
             refused by admission control); then, if the lookup may insert and admission control lets it, the
             policy is asked `admit(key, t)`; if it refuses, the miss is served without a slot (slot None);
             otherwise the key takes a free slot, or the slot of `victim(t)` (which is evicted: `on_evict`),
             and the policy hears `on_insert`.
So every lookup reaches the policy's record of use (on_hit or on_use): LFU's counts and LFRU's scores count them all.
`WarmSet(WarmRule(n, m), n_experts)` is the warm decode set: at the end of a prompt, the experts of its last n
tokens are placed in slots (`SlotTable.place`), at most m of them, so decode starts warm.
What this is not: memory. Slots are numbers; copying expert bytes into slot `s` is the cache's job (cache.py).

The policies (`POLICIES`, built with `make_policy(name, capacity, profile_keys, future)`):
    static      the profile's top `capacity` keys and nothing else, never evicted (`admit` refuses the rest).
    lru         evict the least recently used key.
    lfru        evict the key with the lowest use count decayed with a half-life of H lookups (4 x the capacity):
                between LRU (H -> 0) and LFU (H -> infinity); `LFRUPolicy` states the formula.
    lfu         evict the least frequently used key; ties go to the least recently used. Counts are kept for every
                key ever looked up, resident or not ("perfect LFU"): an expert that was hot, evicted and comes back
                keeps its history. Counts never decay, so LFU adapts slowly when the hot set drifts.
    pinned-lru  the profile's top `pinned_frac * capacity` keys (default half) are pinned once resident (never
                evicted); the other slots run LRU.
    llamacpp    llama.cpp's expert cache as issue 48 describes it: a recency class (used within the last token) is
                kept; the rest by a use count decayed with a 128-token half-life; a miss below the victim's count is
                served without a slot (the CPU's share). Counts time in tokens (TOKEN_CLOCK_POLICIES).
    window      the lowest score = a prior from the profile's ranking (if there is one) + the key's uses weighted
                by age in tokens (WindowPolicy); a miss scored below 1.25 x the victim is served without a slot.
                Counts time in tokens (TOKEN_CLOCK_POLICIES).
    cooc        (the default) window's score plus a bonus for the experts the token a layer just routed makes likelier
                at that layer's next token than their base rate, from next-token co-occurrence counted online
                (CoocPolicy; LAYER_POLICIES: built with n_experts and k).
    duel        set dueling: cooc and llamacpp each run alone in a shadow pool (keys only) over the same lookups;
                each miss's admit and victim go to whichever shadow has been missing less (a decayed count,
                DuelPolicy), asked of that policy ranking the real residents (cooc's two rankings: _TwinCooc).
    reuse       cooc's score plus each key's reuse-distance hazard: from the histogram of its past gaps between uses
                (pooled per layer and count class while it has few), the chance it is used again within a few tokens
                given the tokens since its last use (ReusePolicy; LAYER_POLICIES).
    duel-reuse  duel with reuse in place of cooc (DuelReusePolicy): the lowest held-out misses on the fixed split.
    arc, s3fifo, s3fifo-c7, lirs   ARC; S3-FIFO (s3fifo-c7: counters capped at 7, tuned); a LIRS-style
                reuse-distance policy. docs/expert-cache.md, "Baselines" and "Against Belady".
    belady      MIN, the offline optimum: needs the whole future access sequence, so simulation only. This is the
                *bypass* variant: on a miss with a full pool, the incoming key is admitted only if its next use is
                sooner than the furthest next use among residents (which is then evicted); otherwise it is served
                without a slot. With bypass allowed (as `static` and `pinned-lru` do), it has the most hits of any
                policy from the same starting contents; `BeladyPolicy(..., bypass=False)` is classic demand-paging
                MIN, optimal among policies that always admit (lru, lfu).
Each access costs O(1) (OrderedDict) or O(log n) amortised (heaps with lazy deletion): traces have 10^5..10^6
lookups. Memory is O(slots + keys seen): LFU's and LFRU's heaps are rebuilt from their residents once stale entries
make them longer than HEAP_SLACK x the residents (`_compact`), so a pool that rarely evicts does not grow them by one
entry per hit.
"""
from __future__ import annotations

import bisect
import heapq
import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from pymoe.experts import compiled_cooc as cc
from pymoe.experts.compiled_cooc import _cooc_lifts  # CoocPolicy's per-token arithmetic (compiled)


HEAP_SLACK = 4  # a lazy-deletion heap is rebuilt from its live entries when longer than this x (residents + 1):
# the rebuild costs O(residents) and comes after at least (HEAP_SLACK - 1) x residents pushes, so each push pays O(1)
# amortised for it, and the heap never holds more than HEAP_SLACK x (residents + 1) entries.


class Policy:
    """Base class: counts resident keys. Subclasses call super().on_insert / on_evict."""

    name = "policy"

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.size = 0  # resident keys

    @property
    def full(self) -> bool:
        return self.size >= self.capacity

    def on_hit(self, key: int, t: int) -> None:
        pass

    def on_use(self, key: int, t: int) -> None:
        """A use of a key that is not resident: every miss (before admission control and admit()), and (through
        on_place) a placement outside a lookup."""

    def on_place(self, key: int, t: int) -> None:
        """A placement outside a lookup (SlotTable.place, SlotTable.prefetch: just before their admit()): a use, as
        on_use says, for every policy but those that tell lookups apart from placements (CoocPolicy)."""
        self.on_use(key, t)

    def admit(self, key: int, t: int) -> bool:
        """Called once per miss that may take a slot, before any eviction: may the key take a slot?"""
        return True

    def victim(self, t: int) -> int:
        """The resident key to evict (only called when the pool is full and admit() said yes)."""
        raise NotImplementedError

    def on_insert(self, key: int, t: Optional[int]) -> None:
        """`t` is None for keys placed by SlotTable.prefill before the first lookup."""
        self.size += 1

    def on_evict(self, key: int) -> None:
        self.size -= 1


class StaticPolicy(Policy):
    """Only the profile's top `capacity` keys may be resident; nothing is ever evicted."""

    name = "static"

    def __init__(self, capacity: int, profile_keys: Sequence[int]):
        super().__init__(capacity)
        self.allowed = set(int(k) for k in list(profile_keys)[:capacity])

    def admit(self, key: int, t: int) -> bool:
        return key in self.allowed and not self.full

    def victim(self, t: int) -> int:
        raise RuntimeError("static policy never evicts")


class LRUPolicy(Policy):
    """Least recently used: an OrderedDict in recency order, oldest first."""

    name = "lru"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.order: OrderedDict[int, None] = OrderedDict()

    def on_hit(self, key: int, t: int) -> None:
        self.order.move_to_end(key)

    def victim(self, t: int) -> int:
        return next(iter(self.order))

    def on_insert(self, key: int, t: Optional[int]) -> None:
        super().on_insert(key, t)
        self.order[key] = None

    def on_evict(self, key: int) -> None:
        super().on_evict(key)
        del self.order[key]


class LFUPolicy(Policy):
    """Least frequently used, ties to the least recently used; counts of every key ever seen (never reset).

    A min-heap of (count, last_use, key) over residents; entries go stale when a key is used again (its count and
    last use change) or evicted, and are skipped when they reach the top (lazy deletion) or dropped when the heap is
    rebuilt from the residents (`_compact`, once it is HEAP_SLACK x longer than they are). `last_use` is an internal
    clock of events, so prefilled keys (t=None) are ordered too: the first prefilled is the oldest.
    """

    name = "lfu"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.count: dict[int, int] = {}  # key -> lookups so far (all keys ever seen)
        self.last: dict[int, int] = {}  # resident key -> clock of its last use
        self.heap: list[tuple[int, int, int]] = []
        self.clock = 0

    def _touch(self, key: int) -> None:
        self.clock += 1
        self.last[key] = self.clock
        heapq.heappush(self.heap, (self.count.get(key, 0), self.clock, key))
        if len(self.heap) > HEAP_SLACK * (self.size + 1):
            self._compact()

    def _compact(self) -> None:
        """Drop the stale entries: one (count, last use, key) per resident, the entries victim() would accept."""
        self.heap = [(self.count.get(k, 0), last, k) for k, last in self.last.items()]
        heapq.heapify(self.heap)

    def on_hit(self, key: int, t: int) -> None:
        self.count[key] = self.count.get(key, 0) + 1
        self._touch(key)

    def on_use(self, key: int, t: int) -> None:
        self.count[key] = self.count.get(key, 0) + 1  # the miss is a use too, admitted or not

    def victim(self, t: int) -> int:
        while True:
            count, clock, key = self.heap[0]
            if self.last.get(key) == clock and self.count.get(key, 0) == count:
                return key
            heapq.heappop(self.heap)  # stale

    def on_insert(self, key: int, t: Optional[int]) -> None:
        super().on_insert(key, t)
        self._touch(key)

    def on_evict(self, key: int) -> None:
        super().on_evict(key)
        del self.last[key]


LFRU_HALF_LIFE = 4  # x the capacity, in lookups. Measured (docs/expert-cache.md, bench/cache_policies.py): on the
# demo trace 4x beats 1x, 2x, 8x, 16x, 64x at 10/25/50% coverage but for 8x-16x at 10%; on a synthetic 512-expert
# trace with strong locality 1x is best (LRU-like) and 4x within 0.6 points of it at 25/50%, 5 points below at 10%.


class LFRUPolicy(Policy):
    """Frequency with a half-life (LFRU): evict the resident key whose decayed use count is lowest,
        score(k, now) = sum over the uses u of k of 2^(-(now - t_u) / H)
    with time counted in uses (every lookup, and each placement outside one) and H = `half_life` (default
    LFRU_HALF_LIFE x the capacity). H -> 0 is LRU, H -> infinity is LFU; in between, a once-hot expert fades
    instead of squatting (LFU's weakness) and a burst of one-off experts does not flush the hot set (LRU's).
    Scores of every key ever seen are kept, as LFU keeps its counts.

    The score changes with `now`, but the order of two keys does not: score(k, now) = 2^(v_k - now / H) with
    v_k = log2(score at k's last use) + t_last / H, which changes only when k is used. So residents sit in a min-heap
    of v with lazy deletion (compacted, HEAP_SLACK), like LFU's counts. A use at time t:
    v = t / H + log2(2^(v_old - t / H) + 1).
    """

    name = "lfru"

    def __init__(self, capacity: int, half_life: Optional[float] = None):
        super().__init__(capacity)
        self.h = float(half_life) if half_life else float(LFRU_HALF_LIFE * max(capacity, 1))
        self.v: dict[int, float] = {}  # key -> log2(decayed count at its last use) + (last use) / H
        self.heap: list[tuple[float, int]] = []  # (v, key) of residents, stale entries skipped
        self.resident: set[int] = set()
        self.clock = 0  # uses seen: every lookup (hit or miss), every placement from a profile, warm set or prefetch

    def _use(self, key: int) -> None:
        self.clock += 1
        now = self.clock / self.h
        old = self.v.get(key)
        self.v[key] = now + (math.log2(2.0 ** (old - now) + 1.0) if old is not None else 0.0)

    def _push(self, key: int) -> None:
        heapq.heappush(self.heap, (self.v[key], key))
        if len(self.heap) > HEAP_SLACK * (self.size + 1):  # rebuilt: one (v, key) per resident (LFUPolicy._compact)
            self.heap = [(self.v[k], k) for k in self.resident]
            heapq.heapify(self.heap)

    def on_hit(self, key: int, t: int) -> None:
        self._use(key)
        self._push(key)

    def on_use(self, key: int, t: int) -> None:
        self._use(key)  # the miss is a use too, admitted or not

    def victim(self, t: int) -> int:
        while True:
            v, key = self.heap[0]
            if key in self.resident and self.v[key] == v:
                return key
            heapq.heappop(self.heap)  # stale

    def on_insert(self, key: int, t: Optional[int]) -> None:
        super().on_insert(key, t)
        self.resident.add(key)
        if t is None:  # placed from a profile, not looked up: counts as one use now
            self._use(key)
        self._push(key)

    def on_evict(self, key: int) -> None:
        super().on_evict(key)
        self.resident.discard(key)


class PinnedLRUPolicy(LRUPolicy):
    """The profile's top `pinned_frac * capacity` keys are never evicted once resident; LRU over the others."""

    name = "pinned-lru"

    def __init__(self, capacity: int, profile_keys: Sequence[int], pinned_frac: float = 0.5):
        super().__init__(capacity)
        if not 0.0 <= pinned_frac <= 1.0:
            raise ValueError(f"pinned_frac must be in [0, 1], got {pinned_frac}")
        self.n_pinned = int(pinned_frac * capacity)
        self.pinned = set(int(k) for k in list(profile_keys)[:self.n_pinned])

    def on_hit(self, key: int, t: int) -> None:
        if key not in self.pinned:
            super().on_hit(key, t)

    def admit(self, key: int, t: int) -> bool:
        return not (self.full and not self.order)  # full of pinned keys: nothing can be evicted

    def on_insert(self, key: int, t: Optional[int]) -> None:
        if key in self.pinned:
            Policy.on_insert(self, key, t)  # counted, but outside the LRU order: never a victim
        else:
            super().on_insert(key, t)

    def on_evict(self, key: int) -> None:
        super().on_evict(key)  # victim() only returns unpinned keys


LLAMACPP_HALF_LIFE_TOKENS = 128  # the half-life of llamacpp's decayed frequency, in tokens (the policy it follows)


class LlamaCppPolicy(LFRUPolicy):
    """The GPU expert cache policy of llama.cpp's expert-cache work as its description states it (docs/expert-cache.md,
    "Baselines" cites what was read): two classes and a CPU share of the misses.
      recency class   a resident used within the last token (the last `lookups_per_token` uses) is never evicted;
      frequency class the others, ranked by their use count decayed with a half-life of 128 tokens (LFRUPolicy's
                      score with H = 128 x lookups_per_token uses); the lowest goes (ties: lowest key).
      CPU share       a miss is admitted only if its own decayed count (this use included) is at least the victim's;
                      otherwise it is served without a slot (on the GPU engine: computed on the CPU).
    `lookups_per_token`: lookups one token makes into this pool (top-k x MoE layers for a global pool, top-k for one
    layer's); without it, the capacity stands in (one token of 16 lookups into 16 slots fills them)."""

    name = "llamacpp"

    def __init__(self, capacity: int, lookups_per_token: Optional[int] = None):
        self.per_token = max(1, int(lookups_per_token or capacity or 1))
        super().__init__(capacity, half_life=LLAMACPP_HALF_LIFE_TOKENS * self.per_token)
        self.last: dict[int, int] = {}  # key -> clock of its last use

    def _use(self, key: int) -> None:
        super()._use(key)
        self.last[key] = self.clock

    def _victim(self) -> Optional[int]:
        """The lowest-scored resident outside the recency class, or None if every resident is in it."""
        held, found = [], None
        while self.heap:
            v, key = self.heap[0]
            if key not in self.resident or self.v[key] != v:
                heapq.heappop(self.heap)  # stale
            elif self.clock - self.last.get(key, -self.per_token) < self.per_token:
                held.append(heapq.heappop(self.heap))  # used within the last token: protected
            else:
                found = key
                break
        for item in held:
            heapq.heappush(self.heap, item)
        return found

    def admit(self, key: int, t: int) -> bool:
        if not self.full:
            return True
        victim = self._victim()
        self._chosen = (self.clock, victim)  # victim() follows at once (SlotTable._insert): no second search
        return victim is not None and self.v[key] >= self.v[victim]

    def victim(self, t: int) -> int:
        chosen = getattr(self, "_chosen", None)
        if chosen is not None and chosen[0] == self.clock and chosen[1] in self.resident:
            return chosen[1]
        return self._victim()


WINDOW_EDGES = (1, 4, 16, math.inf)  # tokens: a use weighs WINDOW_WEIGHTS[i] until it is WINDOW_EDGES[i] tokens old
WINDOW_WEIGHTS = (2.0, 1.0, 0.1, 0.01)  # (then the next weight; 0.01 forever: a use count, the memory without a profile)
WINDOW_PRIOR = 4.0  # the profile's hottest key's prior, in uses; the key of rank r: WINDOW_PRIOR / (1 + r / capacity)
WINDOW_ADMIT = 1.25  # a miss takes a slot only if its score is >= this x the victim's (payback admission)
# All four chosen on the tune traces only (docs/expert-cache.md, "Against Belady": the lowest mean misses / Belady's
# over their 18 cells with the profile and without one; edges 1-2 / 4-8 / 16-64 tokens, weights, a fourth edge at
# 64 / 256 / 1024 tokens or never, prior 0-8 and its shape, admission 0.5-1.5)


def check_window(edges: Sequence[float], weights: Sequence[float]) -> None:
    """A window's shape (WindowPolicy's and the cooc policies'): edges in tokens, increasing and positive, one weight
    per edge; else ValueError naming both."""
    if len(edges) != len(weights) or not edges or list(edges) != sorted(edges) or min(edges) <= 0:
        raise ValueError(f"window: edges must be increasing, positive, one per weight; got {edges}, {weights}")


class WindowPolicy(Policy):
    """Expected use soon, from three things Belady exploits and an online cache can see: the profile's stable hot set
    (a prior), the last few tokens' uses (short-range reuse: an expert a token used is likely used by the next ones),
    and admission by payback (a miss whose score is below the victim's is served without a slot: it would be evicted
    before it paid for its copy).
        score(k, now) = prior(k) + sum over the uses u of k of w(age of u)
        prior(k)      = `prior` / (1 + rank(k) / capacity) for the profile's keys (rank 0: hottest), else 0
        w(a)          = weights[i] for edges[i-1] < a <= edges[i] tokens, 0 beyond edges[-1] (which may be
                        math.inf: that weight never expires, a plain use count)
    The victim is the resident with the lowest score (ties: the least recently used, then the lowest key); a miss
    takes a slot only if its score (this use included) is >= `admit` x the victim's. Time is counted in uses, a token
    being `lookups_per_token` of them (TOKEN_CLOCK_POLICIES), as LlamaCppPolicy counts.

    A score changes only when its key is used (+ weights[0]) or one of its uses crosses an edge (- the step to the next
    weight), so each use schedules one event per edge in a FIFO per edge (the events of one edge come due in the
    order of their uses); residents sit in a min-heap of (score, last use, key) with lazy deletion, compacted as
    LFU's (HEAP_SLACK). Memory: the scores and last uses of every key seen (O(experts)), the heap O(slots), the
    FIFOs the uses of the last (finite) edges[-1] tokens (len(edges) x edges[-1] x lookups_per_token entries at most:
    16 tokens by default). The never-expiring count makes a long run LFU-like (after 100 uses a key's count weighs as
    much as 1 token-old use): the traces here are up to ~2000 tokens long; a decayed count is the change for longer."""

    name = "window"

    def __init__(self, capacity: int, profile_keys: Optional[Sequence[int]] = None,
                 lookups_per_token: Optional[int] = None, edges: Sequence[float] = WINDOW_EDGES,
                 weights: Sequence[float] = WINDOW_WEIGHTS, prior: float = WINDOW_PRIOR, admit: float = WINDOW_ADMIT):
        super().__init__(capacity)
        check_window(edges, weights)
        self.per_token = max(1, int(lookups_per_token or capacity or 1))
        finite = [e for e in edges if e != math.inf]  # an infinite last edge: that weight never expires (no FIFO)
        self.edges = [max(1, int(round(e * self.per_token))) for e in finite]  # in uses
        self.w0 = float(weights[0])
        self.drop = [float(weights[i]) - (float(weights[i + 1]) if i + 1 < len(weights) else 0.0)
                     for i in range(len(finite))]  # the score's change when a use crosses edge i
        self.admit_ratio = float(admit)
        self.score: dict[int, float] = {}  # key -> prior + weighted uses (every key seen or ranked)
        self.last: dict[int, int] = {}  # key -> clock of its last use (every key seen)
        if profile_keys is not None and prior > 0:
            scale = max(int(capacity), 1)
            for rank, key in enumerate(profile_keys):
                self.score[int(key)] = prior / (1.0 + rank / scale)
        self.due: list[deque] = [deque() for _ in self.edges]  # per edge: (clock it is crossed, key), oldest first
        self.heap: list[tuple[float, int, int]] = []  # (score, last use, key) of residents, stale entries skipped
        self.resident: set[int] = set()
        self.clock = 0

    def _push(self, key: int) -> None:
        heapq.heappush(self.heap, (self.score[key], self.last.get(key, 0), key))
        if len(self.heap) > HEAP_SLACK * (self.size + 1):  # rebuilt from the residents (LFUPolicy._compact)
            self.heap = [(self.score[k], self.last.get(k, 0), k) for k in self.resident]
            heapq.heapify(self.heap)

    def _use(self, key: int) -> None:
        self.clock += 1
        for q, drop in zip(self.due, self.drop):  # the uses that crossed an edge by now
            while q and q[0][0] <= self.clock:
                _, k = q.popleft()
                self.score[k] -= drop
                if k in self.resident and k != key:
                    self._push(k)
        self.score[key] = self.score.get(key, 0.0) + self.w0
        self.last[key] = self.clock
        for q, edge in zip(self.due, self.edges):
            q.append((self.clock + edge, key))

    def on_hit(self, key: int, t: int) -> None:
        self._use(key)
        self._push(key)

    def on_use(self, key: int, t: int) -> None:
        self._use(key)  # a miss is a use, admitted or not

    def victim(self, t: int) -> int:
        while True:
            score, last, key = self.heap[0]
            if key in self.resident and self.score[key] == score and self.last.get(key, 0) == last:
                return key
            heapq.heappop(self.heap)  # stale

    def admit(self, key: int, t: int) -> bool:
        if not self.full:
            return True
        return self.score.get(key, 0.0) >= self.admit_ratio * self.score[self.victim(t)]

    def on_insert(self, key: int, t: Optional[int]) -> None:
        super().on_insert(key, t)
        self.resident.add(key)
        self.score.setdefault(key, 0.0)  # placed at start-up: its prior only (not a use)
        self._push(key)

    def on_evict(self, key: int) -> None:
        super().on_evict(key)
        self.resident.discard(key)


COOC_WEIGHT = 4.0  # the bonus per unit of lift (a lift of 0.5 weighs as one use within the last token)
COOC_TOP = 2  # x k: the experts of a layer that get a bonus for its next token, the largest lifts
# Both chosen on the tune traces only (docs/expert-cache.md, "Against Belady": weight 1 / 2 / 4 / 6 / 8, top 1 / 2 / 4
# x k, mean / sum / noisy-or of the rows, with and without the lift over the base rate), WindowPolicy's four kept.


class CoocPolicy(WindowPolicy):
    """WindowPolicy plus what one token's experts say about the next token's: a learned next-token co-occurrence.
    Per layer it counts, online, which experts follow which from one token to the next (every lookup, prefill
    included), and once a layer has routed a token it bonuses the experts that token makes likelier at that layer's
    next turn, until that turn comes:
        T[a, e]   tokens at which expert a was used and expert e at the layer's next token (per layer, [E, E])
        n[a]      tokens at which a was used and a next token followed (per layer, [E])
        P(e | a)  = T[a, e] / n[a];   p(e) = 1 - prod over the experts a of the token just routed of (1 - P(e | a))
        q(e)      = k x n[e] / sum(n): e's base rate, the chance a token uses it
        lift(e)   = max(p(e) - q(e), 0): what the last token says beyond e's own frequency (the prior and the use
                    counts hold that already: on routing with no structure between tokens, the lift is near 0)
        bonus     `weight` x lift(e) for the COOC_TOP x k experts of largest lift (ties: the lower expert), added to
                  WindowPolicy's score; the layer's bonuses are replaced when it routes its next token
    P(a | a) is the expert's own chance to come back next token, which the window's recency weight assumes alike
    for every key. The victim, ties and payback admission are WindowPolicy's, on the score with the bonus.
    Tokens are cut from the uses: a key's layer is key // n_experts, and a layer's uses come k to a token (a lookup
    call of T rows makes T x k of them, row by row: trace.Trace.lookups, order "engine"). Placements outside a lookup
    (the warm set, the lookahead's prefetch: on_place) are uses for the window, not tokens. In a batched decode step
    the rows of one call are several sequences' tokens, counted as if consecutive. Memory: [E, E] float32 per layer
    seen (48 layers x 512 experts: 50 MB), besides WindowPolicy's. Without n_experts or k it is WindowPolicy."""

    name = "cooc"

    def __init__(self, capacity: int, profile_keys: Optional[Sequence[int]] = None,
                 lookups_per_token: Optional[int] = None, n_experts: Optional[int] = None, k: Optional[int] = None,
                 weight: float = COOC_WEIGHT, top: int = COOC_TOP, **window):
        super().__init__(capacity, profile_keys, lookups_per_token, **window)
        self.n_experts, self.k = (int(n_experts), int(k)) if n_experts and k else (None, None)
        self.weight = float(weight)
        self.top = max(1, int(top * (self.k or 1)))
        self.token: dict[int, list] = {}  # layer -> the experts of its token being routed (fewer than k so far)
        self.prev: dict[int, np.ndarray] = {}  # layer -> the experts of its last token
        self.follows: dict[int, np.ndarray] = {}  # layer -> T, float32 [E, E]
        self.followed: dict[int, np.ndarray] = {}  # layer -> n, float32 [E]
        self.bonus: dict[int, dict[int, float]] = {}  # layer -> {key: its bonus in the score}

    def on_hit(self, key: int, t: int) -> None:
        super().on_hit(key, t)
        self._route(key)

    def on_use(self, key: int, t: int) -> None:
        super().on_use(key, t)
        self._route(key)

    def on_place(self, key: int, t: int) -> None:
        WindowPolicy.on_use(self, key, t)  # a use for the window, not a token's routing

    def _route(self, key: int) -> None:
        """One lookup's expert joins its layer's token; the k-th closes the token (_next_token)."""
        if self.n_experts is None:
            return
        layer, expert = divmod(key, self.n_experts)
        token = self.token.setdefault(layer, [])
        token.append(expert)
        if len(token) == self.k:
            self.token[layer] = []
            self._next_token(layer, np.asarray(token, dtype=np.int64))  # [k]

    def _next_token(self, layer: int, now: np.ndarray) -> None:
        """Count the transitions from the layer's last token to `now` (experts int [k]), then bonus the experts `now`
        makes likelier at the layer's next token (the class docstring's formulas; _cooc_lifts, compiled: the
        engine pays this once per layer and token)."""
        E = self.n_experts
        T = self.follows.get(layer)
        if T is None:
            T = self.follows[layer] = np.zeros((E, E), dtype=np.float32)  # [E, E]
            self.followed[layer] = np.zeros(E, dtype=np.float32)  # [E]
        prev = self.prev.get(layer)
        self.prev[layer] = now
        best, lift = _cooc_lifts(T, self.followed[layer], _NO_EXPERTS if prev is None else prev, now, self.k,
                                 self.top)  # [<= top] experts of positive lift, largest first; their lifts
        new = {layer * E + int(e): self.weight * float(v) for e, v in zip(best.tolist(), lift.tolist())}
        old = self.bonus.get(layer, {})
        for key in old.keys() | new.keys():
            change = new.get(key, 0.0) - old.get(key, 0.0)
            if change:
                self.score[key] = self.score.get(key, 0.0) + change
                if key in self.resident:
                    self._push(key)
        self.bonus[layer] = new


_NO_EXPERTS = np.zeros(0, dtype=np.int64)


def _cooc_lifts_ref(T, n, prev, now, k, top):
    """_cooc_lifts in NumPy (CoocPolicy's arithmetic as it was first written; the compiled form is checked against
    it bit for bit)."""
    if prev.size:
        T[np.ix_(prev, now)] += 1.0
        n[prev] += 1.0
    p_next = T[now] / np.maximum(n[now], 1.0)[:, None]  # [k, E]: P(e | a) for each a of this token
    p = 1.0 - np.prod(1.0 - p_next.astype(np.float64), axis=0)  # [E]
    q = k * n / max(float(n.sum()), 1.0)  # [E]: base rates
    lift = np.maximum(p - q, 0.0)  # [E]
    best = np.argsort(-lift, kind="stable")[:top]
    best = best[lift[best] > 0.0]
    return best, lift[best]


class CompiledCoocPolicy(Policy):
    """CoocPolicy's rule (the same arguments, the same decisions) on arrays, each call of the Policy protocol one
    compiled `_event` (experts/compiled_cooc.py, whose docstring lays the arrays out): what the registry runs as
    `cooc`. CoocPolicy above stays the readable reference (tests/test_compiled_cooc.py: equal answers to every call,
    equal scores to the bit). Memory: O(keys seen) for the scores, [E + 1, E] float32 per layer seen, the heap
    HEAP_SLACK x (slots + 1) entries allocated up front, a ring per edge of the uses of its last edge's span."""

    name = "cooc"

    def __init__(self, capacity: int, profile_keys: Optional[Sequence[int]] = None,
                 lookups_per_token: Optional[int] = None, n_experts: Optional[int] = None, k: Optional[int] = None,
                 weight: float = COOC_WEIGHT, top: int = COOC_TOP, edges: Sequence[float] = WINDOW_EDGES,
                 weights: Sequence[float] = WINDOW_WEIGHTS, prior: float = WINDOW_PRIOR, admit: float = WINDOW_ADMIT):
        super().__init__(capacity)
        check_window(edges, weights)
        self.per_token = max(1, int(lookups_per_token or capacity or 1))
        finite = [e for e in edges if e != math.inf]
        uses = [max(1, int(round(e * self.per_token))) for e in finite]  # each edge in uses
        drop = [float(weights[i]) - (float(weights[i + 1]) if i + 1 < len(weights) else 0.0)
                for i in range(len(finite))]
        E, K = (int(n_experts), int(k)) if n_experts and k else (0, 0)
        n_top = max(1, int(top * (K or 1)))
        self.E, self.width = E, max(K, n_top) + 1
        self.meta = np.zeros(cc.M_RING + 3 * len(uses), dtype=np.int64)  # compiled_cooc's M_* fields
        self.meta[[cc.M_CAP, cc.M_EDGES, cc.M_E, cc.M_K, cc.M_TOP, cc.M_SLACK]] = (capacity, len(uses), E, K, n_top,
                                                                              HEAP_SLACK)
        for i, u in enumerate(uses):
            self.meta[cc.M_RING + 3 * i] = u
        self.fpar = np.array([float(weights[0]), float(admit), float(weight), *drop], dtype=np.float64)
        self.fifo = np.zeros((len(uses), max(uses, default=0) + 1, 2), dtype=np.int64)  # at most `edge` pending
        self.res = np.zeros(max(int(capacity), 1), dtype=np.int64)
        self.heap = np.zeros((HEAP_SLACK * (max(int(capacity), 0) + 1) + 1, 3), dtype=np.float64)
        self.sc = np.zeros(0, dtype=np.float64)
        self.kv = np.zeros((0, 3), dtype=np.int64)
        self.T = np.zeros((0, E + 1, max(E, 1)), dtype=np.float32)
        self.lay = np.zeros((0, 3, self.width), dtype=np.int64)
        self.bval = np.zeros((0, self.width), dtype=np.float64)
        if profile_keys is not None and prior > 0:
            keys = [int(key) for key in profile_keys]
            if keys:
                self._grow(max(keys))
            scale = max(int(capacity), 1)
            for rank, key in enumerate(keys):
                self.sc[key] = prior / (1.0 + rank / scale)
        self._grow(0)

    def make_room(self, n_keys: int) -> None:
        """Room for keys below n_keys before a compiled caller writes them (SlotCache's compiled lookups)."""
        if n_keys > self.n_keys:
            self._grow(n_keys - 1)

    def _grow(self, key: int) -> None:
        """Room for keys up to `key` (and, with layers, for its layer's counts): arrays doubled, zero-filled."""
        nk = self.sc.shape[0]
        if key < nk:
            return
        if self.E:  # whole layers, so a key's layer has its counts
            need = (key // self.E + 1) * self.E
            new = max(need, 2 * nk)
            new = (new + self.E - 1) // self.E * self.E
        else:
            new = max(key + 1, 2 * nk, 64)
        self.sc = np.concatenate([self.sc, np.zeros(new - nk)])
        self.kv = np.concatenate([self.kv, np.zeros((new - nk, 3), dtype=np.int64)])
        if self.E:
            add = new // self.E - self.T.shape[0]
            self.T = np.concatenate([self.T, np.zeros((add, self.E + 1, self.E), dtype=np.float32)])
            self.lay = np.concatenate([self.lay, np.zeros((add, 3, self.width), dtype=np.int64)])
            self.bval = np.concatenate([self.bval, np.zeros((add, self.width), dtype=np.float64)])
        self.state = (self.sc, self.kv, self.res, self.heap, self.fifo, self.meta, self.fpar, self.T, self.lay,
                      self.bval)  # cc.event's arguments, in its order (one tuple: a call unpacks it at once)
        self.n_keys = new

    def _do(self, key: int, op: int) -> int:
        if key >= self.n_keys:
            self._grow(key)
        return cc.event(*self.state, key, op)

    def on_hit(self, key: int, t: int) -> None:
        self._do(key, cc.HIT)

    def on_use(self, key: int, t: int) -> None:
        self._do(key, cc.USE)

    def on_place(self, key: int, t: int) -> None:
        self._do(key, cc.PLACE)

    def admit(self, key: int, t: int) -> bool:
        return bool(self._do(key, cc.ADMIT))

    def victim(self, t: int) -> int:
        return int(self._do(0, cc.VICTIM))

    def on_insert(self, key: int, t: Optional[int]) -> None:
        super().on_insert(key, t)
        self._do(key, cc.INSERT)

    def on_evict(self, key: int) -> None:
        super().on_evict(key)
        self._do(key, cc.EVICT)

    def score(self, key: int) -> float:
        """The key's score now (0 for a key never seen): what CoocPolicy.score[key] holds."""
        return float(self.sc[key]) if key < self.sc.shape[0] else 0.0


REUSE_GAPS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # tokens: the gap histogram's bin edges (the last bin: > 64)
REUSE_HORIZON = 4  # tokens: "used soon" is a next use within this many tokens of the key's present age
REUSE_WEIGHT = 4.0  # the term of a key sure to be used soon, in uses (WindowPolicy's score units), in a small pool ...
REUSE_FADE = 2.0  # ... of up to this many tokens' lookups; in a larger one the weight is x REUSE_FADE / its tokens
REUSE_SMOOTH = 4.0  # pseudo-gaps of its group's pooled histogram added to each key's own
# All chosen on the tune traces only (docs/expert-cache.md, "Reuse-distance hazard: `reuse`").


class ReusePolicy(CoocPolicy):
    """CoocPolicy plus each key's own reuse-distance hazard: the chance, given the tokens since the key's last use,
    that it is used again within the next `horizon` tokens, learned online from the key's past gaps between uses.
    Belady evicts the resident used furthest in the future; an online cache can estimate how soon that is per key from
    the distribution of its reuse distances (an expert back every other token, one used in bursts, one used once in a
    long while) and its age:
        h[k, j]    the uses of k whose gap since k's previous use fell in bin j (edges `gaps` tokens; last: beyond)
        g[G, j]    the same pooled over a group G = (layer, count class: the bit length of k's number of gaps so
                   far), so a key with few gaps borrows the shape of keys as often used as it: h'[k] = h[k] +
                   `smooth` x g[G(k)] / sum(g[G(k)])
        i          the bin of k's age (tokens since its last use, a in (gaps[i-1], gaps[i]] -> bin i; 0 when used now)
        soon(k)    = sum of h'[k, j] over the bins j >= i whose lower edge is < the lower edge of bin i + `horizon`
                     / sum of h'[k, j] over j >= i          (P(next use within the horizon | no use for a tokens))
        score      CoocPolicy's score + w x soon(k),  w = `weight` x min(1, `fade` / (capacity / lookups per token))
    The weight fades in pools that hold more than `fade` tokens' lookups: there the residents at the margin are
    judged over many tokens, which the prior and the use count already rank (on the tune traces the full weight
    raised misses at 50% coverage). The victim, ties and payback admission are WindowPolicy's, on this score.
    soon(k) is recomputed when k is used and when its age crosses an edge (one event per edge per use, in a FIFO per
    edge, as WindowPolicy's; an event whose use is no longer the key's last is skipped); a change of the pooled
    histogram reaches a key's term at its next recomputation. Memory: len(gaps) + 1 counts per key seen and per group
    (layers x log2 of the lookups: O(experts)), the FIFOs the uses of the last gaps[-1] tokens (64), besides
    CoocPolicy's."""

    name = "reuse"

    def __init__(self, capacity: int, profile_keys: Optional[Sequence[int]] = None,
                 lookups_per_token: Optional[int] = None, n_experts: Optional[int] = None, k: Optional[int] = None,
                 gaps: Sequence[float] = REUSE_GAPS, horizon: float = REUSE_HORIZON, weight: float = REUSE_WEIGHT,
                 fade: float = REUSE_FADE, smooth: float = REUSE_SMOOTH, **cooc):
        super().__init__(capacity, profile_keys, lookups_per_token, n_experts, k, **cooc)
        if not gaps or list(gaps) != sorted(gaps) or min(gaps) <= 0:
            raise ValueError(f"reuse: gaps must be increasing and positive; got {gaps}")
        self.gap_uses = [max(1, int(round(g * self.per_token))) for g in gaps]  # bin edges in uses
        lower = (0.0,) + tuple(float(g) for g in gaps)  # [bins] each bin's lower edge, in tokens
        self.reach = [max(j for j in range(len(lower)) if lower[j] < lower[i] + horizon) for i in range(len(lower))]
        self.reuse_weight = float(weight) * min(1.0, fade * self.per_token / max(capacity, 1))
        self.smooth = float(smooth)
        self.hist: dict[int, list] = {}  # key -> [bins] its gaps' counts
        self.pooled: dict[tuple, list] = {}  # (layer, count class) -> [bins] gaps' counts
        self.term: dict[int, float] = {}  # key -> w x soon(k) as it stands in the score
        self.gap_due: list[deque] = [deque() for _ in self.gap_uses]  # per edge: (clock crossed, key, use clock)

    def _group(self, key: int, own: list) -> tuple[int, int]:
        """The pooled histogram a key shares: its layer's and count class's (the bit length of its gaps so far)."""
        return (key // self.n_experts if self.n_experts else 0), int(sum(own)).bit_length()

    def _soon(self, key: int, i: int) -> float:
        """P(k's next use within the horizon | its age in bin i), from its smoothed gap histogram (0 without data)."""
        nb = len(self.gap_uses) + 1
        own = self.hist.get(key, [0.0] * nb)
        pool = self.pooled.get(self._group(key, own))
        h = own[i:] if pool is None else [own[j] + self.smooth * pool[j] / sum(pool) for j in range(i, nb)]
        alive = sum(h)
        return sum(h[:self.reach[i] - i + 1]) / alive if alive > 0 else 0.0

    def _set_term(self, key: int, i: int) -> None:
        new = self.reuse_weight * self._soon(key, i)
        change = new - self.term.get(key, 0.0)
        if change:
            self.term[key] = new
            self.score[key] = self.score.get(key, 0.0) + change

    def _use(self, key: int) -> None:
        prev = self.last.get(key)
        super()._use(key)  # the clock, the window's events and the use
        now = self.clock
        for i, q in enumerate(self.gap_due):  # keys whose age crossed edge i by now: bin i + 1
            while q and q[0][0] <= now:
                _, k, used = q.popleft()
                if self.last.get(k) == used and k != key:
                    self._set_term(k, i + 1)
                    if k in self.resident:
                        self._push(k)
        if prev is not None:  # the gap since the key's previous use, into its histogram and its group's
            j = bisect.bisect_left(self.gap_uses, now - prev)
            nb = len(self.gap_uses) + 1
            own = self.hist.setdefault(key, [0.0] * nb)
            self.pooled.setdefault(self._group(key, own), [0.0] * nb)[j] += 1.0
            own[j] += 1.0
        self._set_term(key, 0)
        for q, edge in zip(self.gap_due, self.gap_uses):
            q.append((now + edge, key, now))


DUEL_HALF_LIFE = 16  # tokens: the half-life of the decayed miss difference between the two shadows
DUEL_BY_LAYER = False  # True: one difference per layer, the missing key's layer's decides; False: one for the pool
DUEL_DECODE_ONLY = True  # the difference counts only lookups that may take a slot (after a miss reached admit())
# All three chosen on the tune traces only (docs/expert-cache.md, "Against Belady", "Set dueling").


class _Shadow:
    """A pool of `policy.capacity` keys run by `policy` alone over the lookups a DuelPolicy hears: resident keys only
    (a set, no bytes), so its misses are the misses that policy would have had. `look` is a lookup (-> hit?),
    `insert` the slot decision SlotTable._insert makes for an admitted miss."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.keys: set[int] = set()

    def look(self, key: int, t: int) -> bool:
        if key in self.keys:
            self.policy.on_hit(key, t)
            return True
        self.policy.on_use(key, t)
        return False

    def insert(self, key: int, t: Optional[int]) -> None:
        p = self.policy
        if key in self.keys or p.capacity == 0 or (t is not None and not p.admit(key, t)):
            return
        if p.full:
            gone = p.victim(t)
            self.keys.discard(gone)
            p.on_evict(gone)
        self.keys.add(key)
        p.on_insert(key, t)


class _Either:
    """`key in` either of two sets: what CoocPolicy's updates ask of `resident` (push the key if it is ranked)."""

    def __init__(self, a: set, b: set):
        self.a, self.b = a, b

    def __contains__(self, key) -> bool:
        return key in self.a or key in self.b


class _TwinCooc(CoocPolicy):
    """One CoocPolicy's scores, each use counted once, ranking two pools (sides): 0 the real pool's residents, 1 a
    shadow pool's. Each side has its own residents and heap (compacted as WindowPolicy's); a score that changes is
    pushed into the heap of each side that holds the key. `look` is one lookup's use (as on_hit / on_use: the window's
    use, the key's push, the layer's routing), `place` a placement's (the window's use); `admit`, `victim`, `insert`,
    `evict` take the side. The same decisions as two CoocPolicy instances hearing the same lookups, at one's cost."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sides = (([], set()), ([], set()))  # (heap of (score, last use, key), residents) per side
        self.resident = _Either(self.sides[0][1], self.sides[1][1])

    def _push(self, key: int) -> None:
        for heap, res in self.sides:
            if key in res:
                heapq.heappush(heap, (self.score[key], self.last.get(key, 0), key))
                if len(heap) > HEAP_SLACK * (len(res) + 1):  # rebuilt from the side's residents (LFUPolicy._compact)
                    heap[:] = [(self.score[k], self.last.get(k, 0), k) for k in res]
                    heapq.heapify(heap)

    def look(self, key: int, t: int) -> None:
        self._use(key)
        self._push(key)
        self._route(key)

    def place(self, key: int, t: int) -> None:
        self._use(key)
        self._push(key)

    def side_victim(self, side: int) -> int:
        heap, res = self.sides[side]
        while True:
            score, last, key = heap[0]
            if key in res and self.score[key] == score and self.last.get(key, 0) == last:
                return key
            heapq.heappop(heap)  # stale

    def side_admit(self, side: int, key: int) -> bool:
        res = self.sides[side][1]
        return len(res) < self.capacity or self.score.get(key, 0.0) >= self.admit_ratio * self.score[
            self.side_victim(side)]

    def side_insert(self, side: int, key: int) -> None:
        heap, res = self.sides[side]
        res.add(key)
        self.score.setdefault(key, 0.0)  # placed at start-up: its prior only (not a use)
        heapq.heappush(heap, (self.score[key], self.last.get(key, 0), key))
        if len(heap) > HEAP_SLACK * (len(res) + 1):
            heap[:] = [(self.score[k], self.last.get(k, 0), k) for k in res]
            heapq.heapify(heap)

    def side_evict(self, side: int, key: int) -> None:
        self.sides[side][1].discard(key)


class _TwinReuse(_TwinCooc, ReusePolicy):
    """_TwinCooc's two rankings on ReusePolicy's scores (the hazard term included): what `duel-reuse` duels with."""


class DuelPolicy(Policy):
    """Set dueling between `cooc` (CoocPolicy) and `llamacpp` (LlamaCppPolicy): follow whichever has been missing less.
    Each policy runs alone in a shadow pool of the same size (its resident keys only, no bytes: its misses are that
    policy's misses), and each also ranks the real pool's residents (it hears the real insertions and evictions), so
    either can answer admit and victim for the real pool at any moment. cooc's two rankings share one set of scores
    (`_TwinCooc`: each use counted once); llamacpp's are two LlamaCppPolicy instances (`_Shadow` for the shadow's).
    One number decides: d = sum over lookups i of (llamacpp's shadow missed_i - cooc's shadow missed_i) x
    2^(-(now - i) / H), H = `half_life` tokens (DUEL_HALF_LIFE; a token = `lookups_per_token` lookups), over the
    lookups that may take a slot (`decode_only`, DUEL_DECODE_ONLY: those after a miss that reached admit(), i.e.
    decode, not prefill; all lookups without it; the misses of both kinds are counted in `misses`). A miss's admit
    and victim are cooc's ranking's while d >= 0 (ties go to cooc, the default's), llamacpp's while d < 0. With
    `by_layer` (and n_experts) there is one d per layer, updated by its own lookups, and the missing key's layer's
    decides.
    A shadow is told a lookup may take a slot as the real pool is: a miss takes one in the shadows only if the real
    pool asks admit() for it (SlotTable: not on a prefill lookup, not when admission control refuses), and a lookup
    the real pool hits takes one in a shadow that misses it if the last real miss reached admit() (decode, not
    prefill). Placements (on_place, then admit) are placed in the shadows as in the pool. Memory: cooc's plus a
    second heap, two llamacpp's, the shadows' key sets (O(slots)) and d (one float, or one per layer); time per
    lookup: cooc's, two llamacpp's, plus O(1)."""

    name = "duel"
    twin = _TwinCooc  # the scores that rank for cooc's side (DuelReusePolicy: ReusePolicy's)

    def __init__(self, capacity: int, profile_keys: Optional[Sequence[int]] = None,
                 lookups_per_token: Optional[int] = None, n_experts: Optional[int] = None, k: Optional[int] = None,
                 half_life: float = DUEL_HALF_LIFE, by_layer: bool = DUEL_BY_LAYER,
                 decode_only: bool = DUEL_DECODE_ONLY):
        super().__init__(capacity)
        self.decode_only = bool(decode_only)
        self.cooc = self.twin(capacity, profile_keys, lookups_per_token, n_experts, k)  # side 0 real, 1 shadow
        self.llama = LlamaCppPolicy(capacity, lookups_per_token)  # over the real residents
        self.shadow = _Shadow(LlamaCppPolicy(capacity, lookups_per_token))  # llamacpp alone
        self.n_experts = int(n_experts) if by_layer and n_experts and k else None
        per_token = int(k) if self.n_experts else max(1, int(lookups_per_token or capacity or 1))  # into one d
        self.decay = 2.0 ** (-1.0 / (float(half_life) * per_token))  # per lookup; half_life inf: 1, a plain count
        self.d: dict[int, float] = {}  # layer (0 for the whole pool) -> decayed (llamacpp's misses - cooc's)
        self.pending: Optional[int] = None  # the key of the last miss or placement, until admit() or the next lookup
        self.inserting = False  # did the last real miss reach admit()?
        self.misses = [0, 0]  # the shadows' misses so far (cooc, llamacpp): for reports and tests
        self._leader = 0  # who admit() last asked (0 cooc, 1 llamacpp): victim() asks it too

    def _group(self, key: int) -> int:
        return key // self.n_experts if self.n_experts else 0

    def following(self, key: int = 0) -> int:
        """0 while cooc decides for `key`'s group, 1 while llamacpp does."""
        return 1 if self.d.get(self._group(key), 0.0) < 0.0 else 0

    def _lookup(self, key: int, t: int) -> tuple[bool, bool]:
        """The shadows' lookup -> (did cooc's miss, did llamacpp's); the decayed difference moves."""
        if self.pending is not None:  # the last miss did not reach admit(): a prefill lookup or a refused one
            self.inserting, self.pending = False, None
        self.cooc.look(key, t)  # the one use of cooc's scores, for both its rankings
        a, b = key not in self.cooc.sides[1][1], not self.shadow.look(key, t)
        self.misses[0] += a
        self.misses[1] += b
        if self.inserting or not self.decode_only:
            g = self._group(key)
            self.d[g] = self.d.get(g, 0.0) * self.decay + (b - a)
        return a, b

    def _shadow_insert(self, key: int, t: Optional[int], cooc: bool = True, llama: bool = True) -> None:
        """An admitted miss (t None: a start-up placement) in the shadows: each its own admit and victim."""
        res = self.cooc.sides[1][1]
        if cooc and key not in res and self.capacity and (t is None or self.cooc.side_admit(1, key)):
            if len(res) >= self.capacity:
                self.cooc.side_evict(1, self.cooc.side_victim(1))
            self.cooc.side_insert(1, key)
        if llama:
            self.shadow.insert(key, t)

    def on_hit(self, key: int, t: int) -> None:
        self.llama.on_hit(key, t)
        a, b = self._lookup(key, t)
        if (a or b) and self.inserting:
            self._shadow_insert(key, t, a, b)

    def on_use(self, key: int, t: int) -> None:
        self.llama.on_use(key, t)
        self._lookup(key, t)
        self.pending = key

    def on_place(self, key: int, t: int) -> None:
        self.llama.on_place(key, t)
        self.cooc.place(key, t)
        if key not in self.shadow.keys:
            self.shadow.policy.on_place(key, t)
        self.pending = key

    def admit(self, key: int, t: int) -> bool:
        if self.pending == key:
            self.inserting, self.pending = True, None
            self._shadow_insert(key, t)
        self._leader = self.following(key)
        return self.llama.admit(key, t) if self._leader else self.cooc.side_admit(0, key)

    def victim(self, t: int) -> int:
        return self.llama.victim(t) if self._leader else self.cooc.side_victim(0)  # admit() chose just before

    def on_insert(self, key: int, t: Optional[int]) -> None:
        super().on_insert(key, t)
        self.llama.on_insert(key, t)
        self.cooc.side_insert(0, key)
        if t is None:  # placed at start-up (SlotTable.prefill): the shadows start with the same keys
            self._shadow_insert(key, None)

    def on_evict(self, key: int) -> None:
        super().on_evict(key)
        self.llama.on_evict(key)
        self.cooc.side_evict(0, key)


class DuelReusePolicy(DuelPolicy):
    """DuelPolicy with `reuse` (ReusePolicy) in place of `cooc`: set dueling between reuse and llamacpp."""

    name = "duel-reuse"
    twin = _TwinReuse


class ARCPolicy(Policy):
    """ARC (Megiddo & Modha, FAST 2003): residents in T1 (seen once lately) and T2 (seen at least twice), ghosts of
    the recently evicted in B1 and B2 (keys only, at most `capacity` each), and a target size p for T1 that a ghost
    hit moves: a hit in B1 (evicted from T1 too early) grows p by max(1, |B2| / |B1|), a hit in B2 shrinks it by
    max(1, |B1| / |B2|). Victim: T1's oldest if |T1| > p (or = p and the miss was a B2 ghost), else T2's oldest.
    A miss refused a slot still moves p (it is a use: on_use)."""

    name = "arc"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.t1: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.p = 0.0
        self.pending: Optional[int] = None  # the missing key on_use saw last, and which ghost list held it
        self.ghost = 0  # 1: B1, 2: B2, 0: neither

    def on_hit(self, key: int, t: int) -> None:
        if key in self.t1:
            del self.t1[key]
        else:
            del self.t2[key]
        self.t2[key] = None

    def on_use(self, key: int, t: int) -> None:
        self.pending, self.ghost = key, 0
        if key in self.b1:
            self.p = min(float(self.capacity), self.p + max(1.0, len(self.b2) / len(self.b1)))
            self.ghost = 1
        elif key in self.b2:
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
            self.ghost = 2

    def victim(self, t: int) -> int:
        in_b2 = self.pending is not None and self.ghost == 2
        if self.t1 and (len(self.t1) > self.p or (in_b2 and len(self.t1) == self.p) or not self.t2):
            return next(iter(self.t1))
        return next(iter(self.t2))

    def on_insert(self, key: int, t: Optional[int]) -> None:
        super().on_insert(key, t)
        ghost = self.ghost if key == self.pending else 0
        if ghost:
            (self.b1 if ghost == 1 else self.b2).pop(key, None)
            self.t2[key] = None
        else:
            self.t1[key] = None
        self.pending, self.ghost = None, 0

    def on_evict(self, key: int) -> None:
        super().on_evict(key)
        if key in self.t1:
            del self.t1[key]
            ghosts = self.b1
        else:
            del self.t2[key]
            ghosts = self.b2
        ghosts[key] = None
        while len(ghosts) > self.capacity:
            ghosts.popitem(last=False)


S3FIFO_SMALL = 0.1  # the small queue's share of the slots: the S3-FIFO paper's default (Yang et al., SOSP 2023)
S3FIFO_MAX_FREQ = 3  # the paper's 2-bit counters
S3FIFO_TUNED_MAX_FREQ = 7  # s3fifo-c7: chosen on the tune traces (docs/expert-cache.md, "Against Belady": small share
# 0.05 / 0.1 / 0.2 / 0.3 / 0.5 x counter cap 1 / 3 / 7 x ghost 1x / 4x the slots; 0.1, 7, 1x had the lowest mean
# misses / Belady's there, 1.875 against the paper's 1.898)


class S3FIFOPolicy(Policy):
    """S3-FIFO (Yang et al., SOSP 2023): three FIFO queues. New keys enter the small queue S (10% of the slots),
    keys in the ghost queue G (recently evicted from S, keys only, at most `capacity`) enter the main queue M.
    A hit sets the key's counter to min(counter + 1, max_freq) (3, the paper's) and moves nothing. To free a slot: if S holds at least its
    share, its oldest key moves to M if it was hit while in S (counter > 0, reset to 0), else is evicted into G;
    otherwise M's oldest is reinserted at M's head with its counter decremented while it is > 0, else evicted."""

    name = "s3fifo"

    def __init__(self, capacity: int, small: float = S3FIFO_SMALL, max_freq: int = S3FIFO_MAX_FREQ):
        super().__init__(capacity)
        self.small_cap = max(1, int(round(small * capacity)))
        self.max_freq = int(max_freq)
        self.s: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.m: OrderedDict[int, None] = OrderedDict()
        self.g: OrderedDict[int, None] = OrderedDict()
        self.freq: dict[int, int] = {}  # resident key -> counter (0..3)

    def on_hit(self, key: int, t: int) -> None:
        self.freq[key] = min(self.freq[key] + 1, self.max_freq)

    def victim(self, t: int) -> int:
        while True:
            if self.s and (len(self.s) >= self.small_cap or not self.m):
                key = next(iter(self.s))
                if self.freq[key] > 0:
                    del self.s[key]
                    self.freq[key] = 0
                    self.m[key] = None
                    continue
                return key
            key = next(iter(self.m))
            if self.freq[key] > 0:
                self.freq[key] -= 1
                self.m.move_to_end(key)
                continue
            return key

    def on_insert(self, key: int, t: Optional[int]) -> None:
        super().on_insert(key, t)
        self.freq[key] = 0
        if self.g.pop(key, False) is None or t is None:  # a ghost, or placed from a profile (presumed hot)
            self.m[key] = None
        else:
            self.s[key] = None

    def on_evict(self, key: int) -> None:
        super().on_evict(key)
        del self.freq[key]
        if key in self.s:
            del self.s[key]
            self.g[key] = None
            if len(self.g) > self.capacity:
                self.g.popitem(last=False)
        else:
            del self.m[key]


class S3FIFOC7Policy(S3FIFOPolicy):
    """S3-FIFO with counters capped at 7 instead of 3 (S3FIFO_TUNED_MAX_FREQ): a key hit often survives more passes
    of the main queue's second chance. The one setting the tune traces chose (docs/expert-cache.md, "Against
    Belady")."""

    name = "s3fifo-c7"

    def __init__(self, capacity: int):
        super().__init__(capacity, max_freq=S3FIFO_TUNED_MAX_FREQ)


class LIRSPolicy(Policy):
    """A LIRS-style reuse-distance policy (after Jiang & Zhang, SIGMETRICS 2002): each key's reuse distance is
    estimated as max(its recency, its last inter-reference recency (IRR)), both counted in uses (every lookup and
    placement), and the resident with the largest estimate is evicted. A key used once so far has IRR infinity
    (LIRS's HIR class: evicted first, oldest first); a key's IRR is remembered after it is evicted, as LIRS's
    stack keeps non-resident keys. Since max over keys of max(a, b) = max(max a, max b), the victim is the LRU key
    if its recency is at least the largest IRR among residents, else the resident with the largest IRR (a heap with
    lazy deletion, compacted as LFU's is). Not LIRS itself: no LIR/HIR split of the slots, no stack pruning."""

    name = "lirs"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.order: OrderedDict[int, None] = OrderedDict()  # residents, least recently used first
        self.last: dict[int, int] = {}  # key -> clock of its last use (every key seen)
        self.irr: dict[int, float] = {}  # key -> uses between its last two uses (inf: used once)
        self.heap: list[tuple[float, int]] = []  # (-irr, key) of residents, stale entries skipped
        self.clock = 0

    def _use(self, key: int) -> None:
        self.clock += 1
        prev = self.last.get(key)
        self.irr[key] = math.inf if prev is None else float(self.clock - prev)
        self.last[key] = self.clock

    def _push(self, key: int) -> None:
        heapq.heappush(self.heap, (-self.irr[key], key))
        if len(self.heap) > HEAP_SLACK * (self.size + 1):
            self.heap = [(-self.irr[k], k) for k in self.order]
            heapq.heapify(self.heap)

    def on_hit(self, key: int, t: int) -> None:
        self._use(key)
        self.order.move_to_end(key)
        self._push(key)

    def on_use(self, key: int, t: int) -> None:
        self._use(key)

    def victim(self, t: int) -> int:
        while True:
            neg, key = self.heap[0]
            if key in self.order and self.irr[key] == -neg:
                break
            heapq.heappop(self.heap)  # stale
        oldest = next(iter(self.order))
        return oldest if self.clock - self.last[oldest] >= -neg else key

    def on_insert(self, key: int, t: Optional[int]) -> None:
        super().on_insert(key, t)
        if t is None:  # placed from a profile: one use now
            self._use(key)
        self.order[key] = None
        self._push(key)

    def on_evict(self, key: int) -> None:
        super().on_evict(key)
        del self.order[key]


def next_uses(keys: np.ndarray) -> np.ndarray:
    """keys int [N] -> int64 [N]: the next position after t with the same key, N if none."""
    keys = np.asarray(keys, dtype=np.int64).reshape(-1)  # [N]
    n = keys.size
    order = np.argsort(keys, kind="stable")  # positions grouped by key, in time order within a key
    nxt = np.full(n, n, dtype=np.int64)  # [N]
    same = keys[order[1:]] == keys[order[:-1]]  # [N-1]: consecutive in `order` and the same key
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


class NextUse:
    """For an access sequence keys [N]: next[t] = the next position after t with the same key (N if none), and the
    first position of each key. Built once per trace, shared by every Belady table (one per layer in a per-layer
    pool), all of which read global positions t."""

    def __init__(self, keys: np.ndarray):
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)  # [N]
        n = keys.size
        nxt = next_uses(keys)  # [N]
        self.n = n
        self.keys = keys
        self.seq = keys.tolist()  # Python lists: indexing them per access is several times faster than NumPy's
        self.next = nxt.tolist()
        self._first: Optional[dict[int, int]] = None

    def first(self, key: int) -> int:
        """The first position of `key`, N if it never occurs (for keys placed before the first lookup)."""
        if self._first is None:
            uniq, idx = np.unique(self.keys, return_index=True)
            self._first = dict(zip(uniq.tolist(), idx.tolist()))
        return self._first.get(key, self.n)


class BeladyPolicy(Policy):
    """MIN: evict the resident key whose next use is furthest away (never used again = infinitely far).

    A max-heap of (-next_use, key) over residents, with lazy deletion (an entry is current if it matches
    `self.nxt[key]`). `t` must be the position of this lookup in `future`: it is checked.
    bypass=True (the default, and what `make_policy("belady", ...)` builds): a miss whose next use is no sooner than
    every resident's is served without a slot.
    """

    name = "belady"

    def __init__(self, capacity: int, future, bypass: bool = True):
        super().__init__(capacity)
        self.future = future if isinstance(future, NextUse) else NextUse(future)
        self.bypass = bypass
        self.nxt: dict[int, int] = {}  # resident key -> position of its next use
        self.heap: list[tuple[int, int]] = []

    def _next_after(self, key: int, t: int) -> int:
        if self.future.seq[t] != key:
            raise ValueError(f"belady: lookup of key {key} at t={t} is out of step with the future sequence")
        return self.future.next[t]

    def _set_next(self, key: int, nxt: int) -> None:
        self.nxt[key] = nxt
        heapq.heappush(self.heap, (-nxt, key))

    def _furthest(self) -> tuple[int, int]:
        """(next use, key) of the resident key used furthest in the future."""
        while True:
            neg, key = self.heap[0]
            if self.nxt.get(key) == -neg:
                return -neg, key
            heapq.heappop(self.heap)  # stale

    def on_hit(self, key: int, t: int) -> None:
        self._set_next(key, self._next_after(key, t))

    def admit(self, key: int, t: int) -> bool:
        nxt = self._next_after(key, t)
        return not (self.bypass and self.full and nxt >= self._furthest()[0])

    def victim(self, t: int) -> int:
        return self._furthest()[1]

    def on_insert(self, key: int, t: Optional[int]) -> None:
        super().on_insert(key, t)
        self._set_next(key, self.future.first(key) if t is None else self._next_after(key, t))

    def on_evict(self, key: int) -> None:
        super().on_evict(key)
        del self.nxt[key]


DEFAULT_POLICY = "cooc"  # what `pymoe run` and the planner use unless told otherwise; chosen by measurement:
# docs/expert-cache.md, "Against Belady" (misses / Belady's on a fixed tune / held-out split: on the tune traces cooc's
# misses are at or below window's in every cell, mean 1.589 against 1.619)

# The registry: every name here is replayed by `pymoe simulate` (by default) and bench/cache_policies.py, and, unless
# it is offline, offered to `pymoe run --policy`. Adding a policy is a class above and one line here
# (docs/expert-cache.md, "Adding a cache policy").
POLICIES = {
    "static": StaticPolicy,
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "lfru": LFRUPolicy,
    "pinned-lru": PinnedLRUPolicy,
    "llamacpp": LlamaCppPolicy,
    "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy,
    "s3fifo-c7": S3FIFOC7Policy,
    "lirs": LIRSPolicy,
    "window": WindowPolicy,
    "cooc": CompiledCoocPolicy,  # CoocPolicy's decisions, compiled
    "duel": DuelPolicy,
    "reuse": ReusePolicy,
    "duel-reuse": DuelReusePolicy,
    "belady": BeladyPolicy,
}
PROFILE_POLICIES = ("static", "pinned-lru")  # built from a profile's ranking (`profile_keys`)
OFFLINE_POLICIES = ("belady",)  # built from the whole future access sequence: simulation only
TOKEN_CLOCK_POLICIES = ("llamacpp", "window", "cooc", "duel", "reuse", "duel-reuse")  # count time in tokens:
# built with lookups per token
PRIOR_POLICIES = ("window", "cooc", "duel", "reuse", "duel-reuse")  # take a profile's ranking if there is one
# (`profile_keys`), run without
LAYER_POLICIES = ("cooc", "duel", "reuse", "duel-reuse")  # read a key's layer and cut its uses into tokens: built
# with `n_experts` and `k`


ENGINE_POLICIES = tuple(name for name in POLICIES if name not in OFFLINE_POLICIES)  # what the engine can run


def check_engine_policy(name: str) -> str:
    """`name` if the engine's slot cache can run it, else a one-line PymoeError naming --policy and the choices."""
    from pymoe.errors import PymoeError

    if name in OFFLINE_POLICIES:
        raise PymoeError(f"--policy {name} needs the future: it exists in `pymoe simulate` only (choose from "
                         f"{', '.join(ENGINE_POLICIES)})")
    if name not in ENGINE_POLICIES:
        raise PymoeError(f"--policy must be one of {', '.join(ENGINE_POLICIES)}, got {name!r}")
    return name


def make_policy(name: str, capacity: int, profile_keys: Optional[Sequence[int]] = None, future=None,
                pinned_frac: float = 0.5, lookups_per_token: Optional[int] = None, n_experts: Optional[int] = None,
                k: Optional[int] = None) -> Policy:
    """Build a policy by name. static and pinned-lru need `profile_keys` (global keys, hottest first); belady needs
    `future` (the whole access sequence as keys, or a NextUse built from it); the policies that count in tokens
    (TOKEN_CLOCK_POLICIES) take `lookups_per_token`, the lookups one token makes into this pool; those that take a
    profile if there is one (PRIOR_POLICIES) get `profile_keys` or None; those that read layers and tokens
    (LAYER_POLICIES) get `n_experts` (key // n_experts is the layer) and `k` (experts per token per layer)."""
    if name not in POLICIES:
        raise ValueError(f"unknown cache policy {name!r} (choose from {', '.join(POLICIES)})")
    if name in PROFILE_POLICIES:
        if profile_keys is None:
            raise ValueError(f"the {name} policy needs an expert profile")
        return POLICIES[name](capacity, profile_keys, **({"pinned_frac": pinned_frac} if name == "pinned-lru" else {}))
    if name in OFFLINE_POLICIES:
        if future is None:
            raise ValueError(f"the {name} policy needs the future access sequence (simulation only)")
        return POLICIES[name](capacity, future)
    kwargs = {"lookups_per_token": lookups_per_token} if name in TOKEN_CLOCK_POLICIES else {}
    if name in PRIOR_POLICIES:
        kwargs["profile_keys"] = profile_keys
    if name in LAYER_POLICIES:
        kwargs.update(n_experts=n_experts, k=k)
    return POLICIES[name](capacity, **kwargs)


@dataclass(frozen=True)
class Admission:
    """Which misses may take a slot at all, before the policy is asked (admission control):
        second_miss   only a key that missed recently already: a refused miss is remembered among the last
                      `capacity` refused keys (a FIFO, TinyLFU's "doorkeeper" idea), and the key's next miss while
                      it is remembered takes a slot. One-off experts are served without a slot and evict nothing.
        max_inserts   at most this many insertions per layer per step (one lookup call: a layer of one forward),
                      0 = no cap (llama.cpp's --moe-expert-cache-inserts; 2 was its best)"""

    second_miss: bool = False
    max_inserts: int = 0

    def __str__(self) -> str:
        parts = (["second-miss"] if self.second_miss else []) + (
            [f"max {self.max_inserts} inserts per layer-step"] if self.max_inserts else [])
        return ", ".join(parts) or "every miss"


ADMIT = ("all", "second-miss")


def make_admission(admit: str = "all", max_inserts: int = 0) -> Admission:
    """`--admit` and `--max-inserts` -> an Admission, or a one-line PymoeError."""
    from pymoe.errors import PymoeError

    if admit not in ADMIT:
        raise PymoeError(f"--admit must be one of {', '.join(ADMIT)}, got {admit!r}")
    if max_inserts < 0:
        raise PymoeError(f"--max-inserts must be >= 0 (0: no cap), got {max_inserts}")
    return Admission(second_miss=admit == "second-miss", max_inserts=int(max_inserts))


class SlotTable:
    """`capacity` numbered slots, the keys resident in them, and the policy that decides who stays.

    Counters: lookups, hits, evictions (since construction). Slots are handed out lowest number first.
    `admission` filters misses before the policy hears of them (`Admission`); `access(..., step=s)` names the
    layer-step a lookup belongs to, for the per-step insert cap.
    """

    def __init__(self, capacity: int, policy: Policy, admission: Admission = Admission()):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = int(capacity)
        self.policy = policy
        self.admission = admission
        self.missed: OrderedDict = OrderedDict()  # the last `capacity` refused keys, oldest first (second_miss)
        self._step, self._inserts = None, 0  # the current layer-step and its insertions (max_inserts)
        self.slot_of: dict[int, int] = {}  # resident key -> slot
        self.slot_arr: Optional[np.ndarray] = None  # slot_of as int64 [keys] (-1: not resident), once slot_array()
        # is asked for: then kept in step with slot_of (SlotCache's compiled decode lookups read and update it)
        self.free = list(range(self.capacity - 1, -1, -1))  # free slots; pop() gives the lowest
        self.lookups = self.hits = self.evictions = 0

    def _admitted(self, key: int, step) -> bool:
        """Admission control, before the policy: the per-step cap, then the second-miss rule."""
        a = self.admission
        if step != self._step:
            self._step, self._inserts = step, 0
        if a.max_inserts and self._inserts >= a.max_inserts:
            return False
        if a.second_miss:
            if self.missed.pop(key, False) is False:  # not seen lately: remember it, refuse it
                self.missed[key] = True
                if len(self.missed) > self.capacity:
                    self.missed.popitem(last=False)
                return False
        return True

    @property
    def n_resident(self) -> int:
        return len(self.slot_of)

    def slot_array(self, n_keys: int) -> np.ndarray:
        """slot_of as an array over keys < n_keys at least (int64, -1: not resident), kept in step with slot_of
        from now on (`_mirror`); compiled code that changes it (compiled_cooc.decode_step) changes slot_of too."""
        if self.slot_arr is None or self.slot_arr.size < n_keys:
            grown = 2 * (0 if self.slot_arr is None else self.slot_arr.size)
            size = max(n_keys, 1 + max(self.slot_of, default=-1), grown)
            arr = np.full(size, -1, dtype=np.int64)
            for key, slot in self.slot_of.items():
                arr[key] = slot
            self.slot_arr = arr
        return self.slot_arr

    def _mirror(self, key: int, slot: int) -> None:
        if self.slot_arr is not None:
            if key >= self.slot_arr.size:
                self.slot_array(key + 1)
            self.slot_arr[key] = slot

    def resident(self, key: int) -> Optional[int]:
        return self.slot_of.get(key)

    def prefill(self, keys: Sequence[int]) -> int:
        """Place keys (hottest first, e.g. a profile's ranking) into free slots in that order until full; keys
        already resident are skipped. The policy hears them coldest first, so that for recency-based policies the
        hottest prefilled key counts as the most recently used. Returns how many were placed."""
        placed = []
        for key in keys:
            if not self.free:
                break
            key = int(key)
            if key not in self.slot_of:
                self.slot_of[key] = self.free.pop()
                self._mirror(key, self.slot_of[key])
                placed.append(key)
        for key in reversed(placed):
            self.policy.on_insert(key, None)
        return len(placed)

    def access(self, key: int, t: int, insert: bool = True, step=None) -> tuple[bool, Optional[int], Optional[int]]:
        """One lookup of `key` at position t -> (hit, slot the key now occupies or None, evicted key or None).

        insert=False: a miss is served without a slot and the policy is not asked for one (the engine's rule for
        prefill lookups, which would otherwise flush the decode working set); it still hears the use (on_use), as a
        hit refreshes it.
        step: the layer-step of the lookup (any hashable; a new value starts a new insert count)."""
        self.lookups += 1
        slot = self.slot_of.get(key)
        if slot is not None:
            self.hits += 1
            self.policy.on_hit(key, t)
            return True, slot, None
        self.policy.on_use(key, t)  # a miss is a use, whether it takes a slot or not
        if not insert or self.capacity == 0 or not self._admitted(key, step) or not self.policy.admit(key, t):
            return False, None, None
        self._inserts += 1
        return (False, *self._insert(key, t))

    def place(self, key: int, t: int) -> Optional[tuple[int, Optional[int]]]:
        """Insert a key outside a lookup (the warm decode set, `WarmSet`) -> (slot, evicted key or None), or None if
        it is resident already or the policy refuses it (`admit`, asked as for a miss at position t: static keeps its
        set, Belady its optimum). Admission control is not applied (the warm set has its own budget), and nothing
        is counted as a lookup."""
        if key in self.slot_of or self.capacity == 0:
            return None
        self.policy.on_place(key, t)
        if not self.policy.admit(key, t):
            return None
        return self._insert(key, t)

    def prefetch(self, key: int, t: int, step=None) -> Optional[tuple[int, Optional[int]]]:
        """Insert a key predicted to be looked up at layer-step `step` (the router lookahead, experts/prefetch.py) as
        that step's miss would be, only earlier -> (slot, evicted key or None), or None: resident already, or refused.
        Admission as for a miss: the insertion counts against `step`'s cap (max_inserts), shared with the step's own
        miss promotions; under second_miss only a key the rule would admit at its next miss (one in the recent-miss
        FIFO) is taken, and a refused prediction is *not* remembered (a prediction is not a miss). Then the policy's
        admit and victim. Not counted as a lookup: the lookup comes when the layer routes."""
        a = self.admission
        if key in self.slot_of or self.capacity == 0:
            return None
        if step != self._step:
            self._step, self._inserts = step, 0
        if (a.max_inserts and self._inserts >= a.max_inserts) or (a.second_miss and key not in self.missed):
            return None
        self.policy.on_place(key, t)
        if not self.policy.admit(key, t):
            return None
        self.missed.pop(key, None)
        self._inserts += 1
        return self._insert(key, t)

    def _insert(self, key: int, t: int) -> tuple[int, Optional[int]]:
        """Give `key` a free slot, or the policy's victim's -> (slot, evicted key or None)."""
        evicted = None
        if self.free:
            slot = self.free.pop()
        else:
            evicted = self.policy.victim(t)
            slot = self.slot_of.pop(evicted)
            self._mirror(evicted, -1)
            self.policy.on_evict(evicted)
            self.evictions += 1
        self.slot_of[key] = slot
        self._mirror(key, slot)
        self.policy.on_insert(key, t)
        return slot, evicted


def fill_order(layers: Sequence[int], n_experts: int) -> list[int]:
    """The keys a pool is filled with at start-up after a profile's (all of them without one), in this order:
    layer-interleaved by expert index, expert 0 of each of `layers` (the MoE layers), then expert 1, and so on. So
    slots never sit empty: with room for every expert the pool holds them all, and a smaller pool holds the same
    number of experts of every layer (within one), the lowest-numbered first (an arbitrary but stated choice: without
    a profile nothing says which experts are hot). The engine (SlotCache.fill) and the simulator (simulate.make_tables)
    both fill by `start_keys`."""
    return [layer * n_experts + e for e in range(n_experts) for layer in layers]


def start_keys(profile_keys: Optional[Sequence[int]], layers: Sequence[int], n_experts: int) -> list[int]:
    """What SlotTable.prefill is given at start-up, hottest first: the profile's keys of `layers` in rank order (none
    without a profile; a profile may rank pairs of dense layers, which have no experts), then fill_order's; prefill
    skips those already placed and stops when the pool is full."""
    moe = set(layers)
    head = [int(k) for k in profile_keys if int(k) // n_experts in moe] if profile_keys is not None else []
    return head + fill_order(layers, n_experts)


def prefetch_ranked(table_of, keys, step, tick, limit: int = 0):
    """The router lookahead's prefetch, the one copy the engine's slot cache (SlotCache.prefetch) and the simulator
    both run: for keys predicted for the lookup at layer-step `step`, most wanted first, in that order, until
    `limit` are placed (0: no limit), each key ticks the clock (t = tick()) and goes to SlotTable.prefetch of its
    table (table_of(key)). Yields (key, slot, evicted key or None) for each placed key, as it is placed."""
    n = 0
    for key in keys:
        if limit and n >= limit:
            break
        got = table_of(key).prefetch(int(key), tick(), step=step)
        if got is None:
            continue
        n += 1
        yield (int(key), *got)


@dataclass(frozen=True)
class WarmRule:
    """The warm decode set (`--warm-set N --warm-inserts M`): when a request's prompt has been read, copy into the
    pool the experts its last `tokens` prompt tokens used, at most `max_inserts` of them (0: as many as the pool
    holds). Prefill lookups never insert (a prompt chunk would flush the decode working set), so without this the
    first decode tokens miss on experts the prompt's last tokens just used."""

    tokens: int = 0
    max_inserts: int = 0

    def __bool__(self) -> bool:
        return self.tokens > 0

    def __str__(self) -> str:
        if not self.tokens:
            return "off"
        cap = f", at most {self.max_inserts} copies" if self.max_inserts else ""
        return f"the last {self.tokens} prompt tokens' experts{cap}"


def make_warm_rule(tokens: int = 0, max_inserts: int = 0) -> WarmRule:
    """`--warm-set` and `--warm-inserts` -> a WarmRule, or a one-line PymoeError."""
    from pymoe.errors import PymoeError

    if tokens < 0 or max_inserts < 0:
        raise PymoeError(f"--warm-set and --warm-inserts must be >= 0 (0: off / no cap), got {tokens}, {max_inserts}")
    return WarmRule(int(tokens), int(max_inserts))


class WarmSet:
    """The warm decode set's rule, the one copy the engine's slot cache and the simulator both run.

    see(key, token, t): one prefill lookup (key = layer * n_experts + expert), `token` anything that names its prompt
    token (equal for the pairs of one token), t its position in the access sequence. Per layer, the pairs of the
    last `rule.tokens` tokens are kept. apply(table_of) at the end of a prompt, with table_of(key) -> the SlotTable
    that key belongs to (one for a global pool, its layer's for a per-layer pool):
        rank    the kept pairs, most recent token first, then layer 0, 1, ..., then the router's order;
                a key keeps its best rank (its latest use; t = that use's position)
        choose  in rank order, the keys not resident, at most `rule.max_inserts` (0: no cap) and at most its
                table's capacity per table (more would evict keys this very warm-up placed)
        place   the chosen, lowest rank first (SlotTable.place: the policy's admit and victim), so the best ranked
                lands last: the most recently used for LRU
    then the kept pairs are dropped (the next prompt starts afresh). -> [(key, slot, evicted key or None)]."""

    def __init__(self, rule: WarmRule, n_experts: int):
        self.rule, self.n_experts = rule, int(n_experts)
        self.recent: dict[int, deque] = {}  # layer -> deque of (token, [keys], [t]) of its last rule.tokens tokens

    def see(self, key: int, token, t: int) -> None:
        layer = key // self.n_experts
        rows = self.recent.get(layer)
        if rows is None:
            rows = self.recent[layer] = deque(maxlen=self.rule.tokens)
        if not rows or rows[-1][0] != token:
            rows.append((token, [], []))
        rows[-1][1].append(key)
        rows[-1][2].append(t)

    def ranked(self) -> list[tuple[int, int]]:
        """[(key, t)] of the kept pairs in rank order (see the class), each key once."""
        out, seen = [], set()
        layers = sorted(self.recent)
        for back in range(1, self.rule.tokens + 1):  # 1: the last prompt token
            for layer in layers:
                rows = self.recent[layer]
                if back <= len(rows):
                    _, keys, ts = rows[-back]
                    for key, t in zip(keys, ts):
                        if key not in seen:
                            seen.add(key)
                            out.append((key, t))
        return out

    def apply(self, table_of) -> list[tuple[int, int, Optional[int]]]:
        chosen, per_table = [], {}
        for key, t in self.ranked():
            if self.rule.max_inserts and len(chosen) >= self.rule.max_inserts:
                break
            table = table_of(key)
            n = per_table.get(id(table), 0)
            if table.resident(key) is not None or n >= table.capacity:
                continue
            per_table[id(table)] = n + 1
            chosen.append((key, t, table))
        self.recent = {}
        placed = []
        for key, t, table in reversed(chosen):
            got = table.place(key, t)
            if got is not None:
                placed.append((key, *got))
        return placed
