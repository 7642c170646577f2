"""The fewest misses any online cache policy can expect on a generated trace: a lower bound beside Belady's.

Belady's optimum knows every future lookup. An online policy knows only the past, so on a trace drawn at random it
cannot match Belady: some of what comes next is a coin flip. How far it must stay from Belady is a property of the
trace's generator, not of any policy, and for the two generators of trace.py (`synthetic_trace`, `fitted_trace`)
it can be computed, because we know the process that drew each token's experts.

The argument, per decode token t (L layers, K experts each, a pool of C slots):
  - when token t starts, the pool holds some set S of at most C keys (layer, expert), a function of the past only;
  - each of the K distinct picks of layer l that is not in S is a miss (a miss admitted for one pick cannot serve
    another pick of the same layer and token: they are distinct; and evictions during the token only add misses);
  - so, given the past h, E[misses of token t | h] >= K L - sum over (l, e) in S of p_t(l, e), where p_t(l, e) =
    P(expert e is among layer l's picks at token t | h);
  - no set does better than the C keys of largest p_t: E[misses | h] >= K L - (sum of the C largest p_t) =: b_t(h).
The layers of both generators are independent, so p_t(l, e) is the same given the whole past or given layer l's
past, and it does not change while token t runs through the layers before l.
Summed over the decode tokens of the realized trace, B = sum_t b_t(h_t) is what any online policy's misses exceed in
expectation, step by step: misses - B is a sum of per-token terms each >= 0 in conditional expectation, so on a
long trace a policy's misses fall short of B only by chance (of the order of sqrt(sum_t Var_t), reported as `sd`).
B holds for every online policy, with or without bypass, pre-fill or profile: it lets a policy reload its whole pool
for free before every token.

p_t is estimated by drawing token t again `samples` times from the generator's own rule given the trace's past
(`_synthetic_counts`, `_fitted_counts` mirror trace.py's loops). The noise of that estimate can only lower B: the
sum of the C largest noisy estimates exceeds the true sum of the C largest in expectation, so the bound stays a
bound (tests/test_bound.py also checks the estimates against the realized picks).

For a trace of a trained model (the demo's) there is no such bound: the process is the model and its sampler, and
an online engine may even run the next token's routers ahead (prefetch.py); the bound is for the generated traces.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from .trace import Trace, _synthetic_ranking


@dataclass
class Bound:
    """B over a trace's decode tokens at one pool size: `misses` (expected, the bound) and `sd` (the square root of
    the summed per-token variances of the best set's misses: the scale of a policy's chance shortfall below B)."""
    slots: int
    misses: float
    sd: float
    lookups: int


@njit(cache=True)
def _draw_from(cdf, u):
    # the index i with cdf[i - 1] <= u < cdf[i] (numpy's Generator.choice(p=...) draws by the same inverse cdf)
    i = np.searchsorted(cdf, u, side="right")
    return min(i, cdf.size - 1)


@njit(cache=True)
def _taken(chosen, j, e):
    # whether e is no expert yet (-1) or among the token's first j picks chosen[:j]
    if e < 0:
        return True
    for i in range(j):
        if chosen[i] == e:
            return True
    return False


@njit(cache=True)
def _synthetic_counts(prev, cdf, perm, locality, k, samples, seed):
    """int [E]: in how many of `samples` draws of one token of trace.synthetic_trace each expert is picked, given
    the previous token's picks `prev` [K] (empty: the first token). cdf [E]: the popularity's cumulative sum by
    rank; perm [E]: rank -> expert of this layer. The rule of synthetic_trace: pick j repeats prev[j] with
    probability `locality` when not already chosen, else takes the next of 4K + 8 popularity draws (then uniform)
    not yet chosen."""
    np.random.seed(seed)
    E = perm.size
    counts = np.zeros(E, np.int64)
    chosen = np.empty(k, np.int64)
    for _ in range(samples):
        n_draws = 0
        for j in range(k):
            e = -1
            if prev.size and np.random.random() < locality:
                e = prev[j]
            while _taken(chosen, j, e):
                if n_draws < 4 * k + 8:
                    e = perm[_draw_from(cdf, np.random.random())]
                    n_draws += 1
                else:
                    e = np.random.randint(E)
            chosen[j] = e
            counts[e] += 1
    return counts


@njit(cache=True)
def _fitted_counts(past, cdf, locality, k, samples, seed):
    """int [E]: as _synthetic_counts, for trace.fitted_trace: `past` [M] the request's last `window` tokens'
    picks of this layer (empty at its first token); cdf [E] the layer's popularity. The rule: with probability
    `locality` (when there is a past) up to 8 tries to copy a uniformly chosen past lookup not yet chosen, else (or
    after 8 failures) popularity draws until one is not yet chosen."""
    np.random.seed(seed)
    E = cdf.size
    counts = np.zeros(E, np.int64)
    chosen = np.empty(k, np.int64)
    for _ in range(samples):
        for j in range(k):
            e = -1
            if past.size and np.random.random() < locality:
                for _try in range(8):
                    e = past[np.random.randint(past.size)]
                    if not _taken(chosen, j, e):
                        break
                    e = -1
            while _taken(chosen, j, e):
                e = _draw_from(cdf, np.random.random())
            chosen[j] = e
            counts[e] += 1
    return counts


def _cdf(p) -> np.ndarray:
    c = np.cumsum(np.asarray(p, dtype=np.float64))
    return c / c[-1]


def pick_probabilities(trace: Trace, heat=None, samples: int = 4000, seed: int = 0):
    """(rows int [T], p float [T, L, E]): for each decode token of a generated trace, P(expert e is among layer l's
    picks | the trace before it), estimated from `samples` draws of that token by the generator's rule. The trace's
    meta says which generator made it; a fitted trace needs the heat [L_all, E] it was fitted to."""
    meta = trace.meta
    L, E, K = trace.n_layers, trace.n_experts, int(meta["k"])
    rows = np.flatnonzero(trace.phase >= 1)  # decode tokens
    p = np.zeros((rows.size, L, E))
    if "zipf" in meta:  # synthetic_trace: its permutations are the first draws of its rng
        perms, pop = _synthetic_ranking(np.random.default_rng(meta["seed"]), L, E, meta["zipf"])  # [L, E], [E]
        cdf = _cdf(pop)
        for i, t in enumerate(rows):
            for l in range(L):
                prev = trace.experts[t - 1, l].astype(np.int64) if t > 0 else np.zeros(0, np.int64)
                c = _synthetic_counts(prev, cdf, perms[l], float(meta["locality"]), K, samples,
                                      seed + 7919 * i + l)
                p[i, l] = c / samples
    elif "window" in meta:  # fitted_trace
        if heat is None:
            raise ValueError("pick_probabilities: a fitted trace needs the heat it was fitted to")
        heat = np.asarray(heat, dtype=np.float64)
        layers = meta.get("layers") or list(range(heat.shape[0]))
        cdfs = [_cdf(heat[layer] + 0.5) for layer in layers]
        window = int(meta["window"])
        starts = {}  # request -> its first row
        for t in range(trace.n_tokens):
            starts.setdefault(int(trace.request[t]), t)
        for i, t in enumerate(rows):
            base = starts[int(trace.request[t])]
            for l in range(L):
                past = trace.experts[max(base, t - window):t, l].reshape(-1).astype(np.int64)
                c = _fitted_counts(past, cdfs[l], float(meta["locality"]), K, samples, seed + 7919 * i + l)
                p[i, l] = c / samples
    else:
        raise ValueError("pick_probabilities: the trace was not made by synthetic_trace or fitted_trace "
                         "(its meta has neither zipf nor window)")
    return rows, p


def online_bound(p, slots: int, k: int) -> Bound:
    """B (module docstring) at a pool of `slots` keys, from pick_probabilities' p [T, L, E]."""
    T, L, E = p.shape
    flat = p.reshape(T, L * E)
    order = np.argsort(-flat, axis=1, kind="stable")  # [T, L E] likeliest first
    top = np.take_along_axis(flat, order[:, :slots], axis=1)  # [T, C] the C likeliest keys of each token
    misses = float((k * L - top.sum(axis=1)).sum())
    # the best set's misses per token: a sum over the layers (independent) of the picks outside it; a layer's K
    # picks are drawn without repeats, so their count's variance is at most the independent sum p (1 - p) of the
    # keys outside the set
    outside = np.take_along_axis(flat, order[:, slots:], axis=1)  # [T, L E - C]
    sd = float(np.sqrt((outside * (1 - outside)).sum()))
    return Bound(slots, misses, sd, T * L * k)
