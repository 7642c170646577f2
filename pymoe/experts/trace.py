"""Routing traces: which experts every token was routed to, in every layer, in time order (format: docs/trace-files.md).

What this is:
    TraceRecorder(meta)      the engine side: record(layer, ids [T, K], weights [T, K], phase) once per layer per
                             forward, end_forward() to commit those T tokens, start_request(prompt_len) per request;
                             save(path, append=False)
    Trace.load(path)         the analysis side: .experts uint16 [N, L, K], .weights float16 [N, L, K],
                             .phase uint8 [N] (0 prefill, 1 decode, 2 verify: a speculative-decoding forward of
                             several decode positions), .request int32 [N], .forward int32 [N], .meta;
                             .predicted int32 [F, L, P] / .predicted_limit int32 [F, L] (or None): the router
                             lookahead's prefetch requests, when one ran (below);
                             .keys() the global-key access sequence the cache simulator replays
    synthetic_trace(...)     a trace with skewed popularity and temporal locality, for tests and demos
    fitted_trace(heat, ...)  a trace whose per-layer popularity is measured routing counts (routing-heat JSON),
                             with a stated temporal locality; top_share(counts) its per-layer skew
What this is not: a profile (profile.py ranks the pairs of a trace) or a simulator (simulate.py replays one).

One row per token (N rows). A file is a compressed .npz (NumPy zip; `np.load` reads it) holding the five arrays
above and `meta`, a JSON string: {"format": "pymoe-trace", "version": 1, "model", "arch", "n_layers", "n_experts", "k",
"prompt_lengths": [one per request], "n_requests", "n_forwards"}, plus anything else the recorder was given.

With the router lookahead on (`pymoe run --lookahead N --trace`; experts/prefetch.py), the file also holds what it
asked the slot cache to prefetch (SlotCache.prefetch), per forward f (F = n_forwards) and MoE layer l:
    predicted        int32 [F, L, P]  the experts predicted for layer l's lookup in forward f (made after the layer
                                      before), most wanted first, padded with -1 (P: the longest list)
    predicted_limit  int32 [F, L]     the `limit` of that prefetch call (at most this many placed; 0: no limit), or
                                      -1 where no prefetch was asked (prefill forwards, the first MoE layer)
Both arrays are optional: a trace without them (an older file, or no lookahead) loads with None, and still version 1.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np

from pymoe.errors import PymoeError, file_error

FORMAT = "pymoe-trace"
VERSION = 1
PHASES = {"prefill": 0, "decode": 1, "verify": 2}  # verify rows are decode rows too (`rows("decode")`)
SHAPE_KEYS = ("n_layers", "n_experts", "k")  # meta fields that must agree to append
# A trace's layers are the model's MoE layers only: trace layer l is model layer first_moe_layer + l (the optional
# meta field, 0 when absent; glm4moe and deepseek2 lead with dense layers, which route nothing). So L * E is the
# number of experts that exist, and keys, profiles and the simulator need no notion of dense layers.
ARRAYS = ("experts", "weights", "phase", "request", "forward")
PREDICTION_ARRAYS = ("predicted", "predicted_limit")  # optional: only when a lookahead ran


class Trace:
    """A loaded (or built) routing trace. Rows are tokens in the order the engine ran them."""

    def __init__(self, experts, weights, phase, request, forward, meta: dict, predicted=None, predicted_limit=None):
        self.experts = np.asarray(experts, dtype=np.uint16)  # [N, L, K]
        self.weights = np.asarray(weights, dtype=np.float16)  # [N, L, K]
        self.phase = np.asarray(phase, dtype=np.uint8)  # [N]
        self.request = np.asarray(request, dtype=np.int32)  # [N]
        self.forward = np.asarray(forward, dtype=np.int32)  # [N]
        self.meta = dict(meta)
        self.predicted = self.predicted_limit = None  # the lookahead's prefetch requests, when recorded
        if predicted is not None:
            self.predicted = np.asarray(predicted, dtype=np.int32)  # [F, L, P], -1 padded
            self.predicted_limit = np.asarray(predicted_limit, dtype=np.int32)  # [F, L], -1: none asked

    @property
    def n_forwards(self) -> int:
        return int(self.forward.max()) + 1 if self.n_tokens else 0

    def prefetches(self, forward: int, layer: int) -> Optional[tuple[list[int], int]]:
        """(experts most wanted first, limit) the lookahead asked to prefetch before `layer`'s lookup in `forward`,
        or None where it asked nothing (or the trace has no predictions)."""
        if self.predicted is None or self.predicted_limit[forward, layer] < 0:
            return None
        ids = self.predicted[forward, layer]
        return ids[ids >= 0].tolist(), int(self.predicted_limit[forward, layer])

    @property
    def n_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def n_layers(self) -> int:
        return int(self.meta["n_layers"])

    @property
    def n_experts(self) -> int:
        return int(self.meta["n_experts"])

    @property
    def first_moe_layer(self) -> int:
        """The model layer of trace layer 0 (the leading dense layers are not in the trace)."""
        return int(self.meta.get("first_moe_layer", 0))

    @property
    def k(self) -> int:
        return int(self.meta["k"])

    def tokens(self, phase: Optional[str] = None) -> int:
        """How many tokens (rows) one phase has, or all (None / "all")."""
        return int(self.rows(phase).sum())

    def rows(self, phase: Optional[str] = None) -> np.ndarray:
        """bool [N]: the tokens of one phase ("prefill" / "decode", which includes "verify": the positions of
        speculative decoding's verification forwards, engine/speculative.py), or all of them for None / "all"."""
        if phase in (None, "all"):
            return np.ones(self.n_tokens, dtype=bool)
        if phase not in PHASES:
            raise PymoeError(f"unknown phase {phase!r} (choose from prefill, decode, verify, all)")
        if phase == "decode":
            return self.phase >= PHASES["decode"]
        return self.phase == PHASES[phase]

    def keys(self, phase: Optional[str] = None, order: str = "token") -> np.ndarray:
        """int64 [n * L * K]: global keys layer * n_experts + expert of the selected tokens, in time order.
        order="token": token-major, then layer, then k. order="engine": the order the engine's cache sees them, one
        forward at a time, layer by layer, token-major within a layer. The two differ only inside a prefill
        forward of several tokens; for decode (one token per forward) they are the same."""
        return self.lookups(phase, order)[0]

    def lookups(self, phase: Optional[str] = None, order: str = "token") -> tuple[np.ndarray, np.ndarray]:
        """(keys int64 [n * L * K], row int64 [n * L * K]): every lookup's global key and the trace row (token)
        it belongs to, in the given order (see keys())."""
        sel = np.nonzero(self.rows(phase))[0]  # [n] selected rows
        L, K = self.n_layers, self.k
        layer_base = np.arange(L, dtype=np.int64)[None, :, None] * self.n_experts  # [1, L, 1]
        keys = (self.experts[sel].astype(np.int64) + layer_base).reshape(-1)  # [n * L * K], token-major
        rows = np.repeat(sel.astype(np.int64), L * K)  # [n * L * K]
        if order == "engine":
            layer = np.tile(np.repeat(np.arange(L), K), sel.size)  # [n * L * K]
            perm = np.lexsort((np.arange(keys.size), layer, self.forward[rows]))  # by forward, layer, then as is
            keys, rows = keys[perm], rows[perm]
        elif order != "token":
            raise ValueError(f"unknown lookup order {order!r} (token or engine)")
        return keys, rows

    def check(self, where="trace") -> None:
        """Raise PymoeError if the arrays and meta disagree."""
        n = self.n_tokens
        want = (n, self.n_layers, self.k)
        if self.experts.shape != want or self.weights.shape != want:
            raise file_error(where, f"experts/weights have shapes {self.experts.shape}/{self.weights.shape}, "
                                    f"meta says [N, {self.n_layers}, {self.k}]")
        for name in ("phase", "request", "forward"):
            if getattr(self, name).shape != (n,):
                raise file_error(where, f"{name} has shape {getattr(self, name).shape}, expected ({n},)")
        if n and int(self.experts.max()) >= self.n_experts:
            raise file_error(where, f"expert id {int(self.experts.max())} out of range 0..{self.n_experts - 1}")
        if n and int(self.phase.max()) > 2:
            raise file_error(where, "phase must be 0 (prefill), 1 (decode) or 2 (verify)")
        if self.predicted is not None:
            F, L = self.n_forwards, self.n_layers
            p, lim = self.predicted, self.predicted_limit
            if p.ndim != 3 or p.shape[:2] != (F, L) or lim.shape != (F, L):
                raise file_error(where, f"predicted/predicted_limit have shapes {p.shape}/{lim.shape}, expected "
                                        f"[{F}, {L}, P]/[{F}, {L}] (forwards x layers)")
            if p.size and (int(p.min()) < -1 or int(p.max()) >= self.n_experts):
                raise file_error(where, f"predicted expert ids out of range -1..{self.n_experts - 1}")

    def save(self, path, append: bool = False) -> None:
        """Write the trace; append=True adds these rows after an existing trace of the same model and shape."""
        trace = self
        if append and os.path.exists(path):
            trace = concatenate(Trace.load(path), self, where=path)
        write_npz(path, trace)

    @classmethod
    def load(cls, path) -> "Trace":
        if not os.path.exists(path):
            raise file_error(path, "no such file")
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                raise file_error(path, "not a pymoe trace (not a NumPy .npz zip file)")
        try:
            with np.load(path, allow_pickle=False) as z:
                missing = [a for a in (*ARRAYS, "meta") if a not in z.files]
                if missing:
                    raise file_error(path, f"not a pymoe trace (missing {', '.join(missing)})")
                meta = json.loads(str(z["meta"]))
                arrays = {a: z[a] for a in ARRAYS}
                if "predicted" in z.files or "predicted_limit" in z.files:  # optional (older files lack them)
                    arrays.update({a: z[a] for a in PREDICTION_ARRAYS})
        except PymoeError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever np.load / json make of a broken file, it is one line
            raise file_error(path, f"not a pymoe trace ({type(e).__name__}: {e})") from None
        if meta.get("format") != FORMAT:
            raise file_error(path, f"not a pymoe trace (format {meta.get('format')!r})")
        if meta.get("version") != VERSION:
            raise file_error(path, f"unsupported trace version {meta.get('version')} (this pymoe reads {VERSION})")
        if any(k not in meta for k in SHAPE_KEYS):
            raise file_error(path, f"trace meta lacks one of {', '.join(SHAPE_KEYS)}")
        trace = cls(meta=meta, **arrays)
        trace.check(path)
        return trace

    def summary(self) -> str:
        m = self.meta
        n_dec, n_ver = self.tokens("decode"), self.tokens("verify")
        ver = ""
        if n_ver:
            n_fwd = np.unique(self.forward[self.rows("verify")]).size
            ver = f", {n_ver} of them in {n_fwd} speculative verification forwards"
        pred = ""
        if self.predicted is not None:
            pred = f"; lookahead predictions for {int((self.predicted_limit >= 0).sum())} layer-steps"
        return (f"{m.get('model', '?')} ({m.get('arch', '?')}): {self.n_layers} layers x {self.n_experts} experts, "
                f"top-{self.k}; {self.n_tokens} tokens ({self.n_tokens - n_dec} prefill, {n_dec} decode{ver}) in "
                f"{m.get('n_requests', 0)} request(s){pred}")


def write_npz(path, trace: Trace) -> None:
    """Write to a temporary name, then rename: an interrupted save never leaves half a trace."""
    meta = dict(trace.meta, format=FORMAT, version=VERSION)
    tmp = f"{path}.tmp"
    names = ARRAYS + (PREDICTION_ARRAYS if trace.predicted is not None else ())
    with open(tmp, "wb") as f:  # a file object: np.savez would append ".npz" to a name without it
        np.savez_compressed(f, meta=np.array(json.dumps(meta)), **{a: getattr(trace, a) for a in names})
    os.replace(tmp, path)


def concatenate(first: Trace, second: Trace, where="trace") -> Trace:
    """`second`'s rows after `first`'s; request and forward numbers of `second` are shifted to follow on."""
    for key in ("model", "arch", *SHAPE_KEYS, "first_moe_layer"):
        if first.meta.get(key, 0 if key == "first_moe_layer" else None) != second.meta.get(
                key, 0 if key == "first_moe_layer" else None):
            raise file_error(where, f"cannot append: {key} is {first.meta.get(key)!r} in the file, "
                                    f"{second.meta.get(key)!r} in this run")
    n_req = int(first.meta.get("n_requests", 0))
    n_fwd = int(first.meta.get("n_forwards", 0))
    meta = dict(first.meta)
    meta["prompt_lengths"] = list(first.meta.get("prompt_lengths", [])) + list(second.meta.get("prompt_lengths", []))
    meta["n_requests"] = n_req + int(second.meta.get("n_requests", 0))
    meta["n_forwards"] = n_fwd + int(second.meta.get("n_forwards", 0))
    predicted = None
    if first.predicted is not None or second.predicted is not None:  # one without: no prefetch asked (-1)
        parts = [(t.predicted, t.predicted_limit) if t.predicted is not None else
                 (np.full((t.n_forwards, t.n_layers, 0), -1), np.full((t.n_forwards, t.n_layers), -1))
                 for t in (first, second)]
        P = max(p.shape[2] for p, _ in parts)
        predicted = (np.concatenate([np.pad(p, ((0, 0), (0, 0), (0, P - p.shape[2])), constant_values=-1)
                                     for p, _ in parts]), np.concatenate([lim for _, lim in parts]))
    return Trace(np.concatenate([first.experts, second.experts]), np.concatenate([first.weights, second.weights]),
                 np.concatenate([first.phase, second.phase]), np.concatenate([first.request, second.request + n_req]),
                 np.concatenate([first.forward, second.forward + n_fwd]), meta,
                 *(predicted or (None, None)))


class TraceRecorder:
    """Collects routing decisions while the engine runs. `meta` needs n_layers (the MoE layers), n_experts, k (and
    should name model and arch; first_moe_layer when the model leads with dense layers). Per forward:
    record(layer, ...) for the model layers first_moe_layer .. first_moe_layer + L - 1 in order, then
    end_forward()."""

    def __init__(self, meta: dict):
        missing = [k for k in SHAPE_KEYS if k not in meta]
        if missing:
            raise ValueError(f"TraceRecorder meta lacks {', '.join(missing)}")
        self.meta = dict(meta)
        self.n_layers, self.n_experts, self.k = (int(meta[k]) for k in SHAPE_KEYS)
        self.first = int(meta.get("first_moe_layer", 0))  # model layer of trace layer 0
        if self.n_experts > 65536:
            raise ValueError(f"{self.n_experts} experts do not fit the trace's uint16 expert ids")
        self.prompt_lengths: list[int] = []
        self.rows: list[tuple] = []  # per committed forward: (experts [T, L, K], weights [T, L, K], phase code)
        self.request_of_forward: list[int] = []
        self._pending: list[tuple] = []  # this forward's (ids [T, K], weights [T, K]) per layer so far
        self._phase: Optional[str] = None
        self.predictions: list[dict] = []  # per committed forward: {layer: (experts most wanted first, limit)}
        self._predicted: dict = {}  # this forward's so far

    @property
    def n_tokens(self) -> int:
        """Tokens committed so far (rows of the trace)."""
        return sum(e.shape[0] for e, _, _ in self.rows)

    def start_request(self, prompt_len: int) -> None:
        self.prompt_lengths.append(int(prompt_len))

    def record(self, layer: int, ids, weights, phase: str) -> None:
        """The router's choice in model layer `layer` for the T tokens of this forward: ids int [T, K], weights
        float [T, K]."""
        if layer != self.first + len(self._pending):
            raise ValueError(f"trace: layer {layer} recorded out of order (expected {self.first + len(self._pending)})")
        if phase not in PHASES or (self._phase is not None and phase != self._phase):
            raise ValueError(f"trace: bad phase {phase!r} in layer {layer}")
        ids, weights = np.asarray(ids), np.asarray(weights)
        T = ids.shape[0]
        if ids.shape != (T, self.k) or weights.shape != (T, self.k) or (
                self._pending and self._pending[0][0].shape[0] != T):
            raise ValueError(f"trace: layer {layer}: ids {ids.shape} / weights {weights.shape}, expected [T, {self.k}]")
        self._phase = phase
        self._pending.append((ids.astype(np.uint16), weights.astype(np.float16)))

    def predict(self, layer: int, experts, limit: int) -> None:
        """The router lookahead asked the slot cache to prefetch `experts` (ints, most wanted first; at most `limit`
        placed, 0: no limit) for `layer`'s lookup in this forward (experts/prefetch.py, SlotCache.prefetch)."""
        self._predicted[int(layer) - self.first] = ([int(e) for e in experts], int(limit))

    def end_forward(self) -> None:
        """Commit the forward's T tokens as T rows (all L MoE layers must have been recorded)."""
        if not self._pending:
            self._predicted = {}  # a forward that was not traced (nothing routed): its predictions go too
            return
        if len(self._pending) != self.n_layers:
            raise ValueError(f"trace: forward ended after {len(self._pending)} of {self.n_layers} MoE layers")
        if not self.prompt_lengths:  # record() before any start_request(): one request of unknown prompt length
            self.prompt_lengths.append(-1)
        experts = np.stack([ids for ids, _ in self._pending], axis=1)  # [T, L, K]
        weights = np.stack([w for _, w in self._pending], axis=1)  # [T, L, K]
        self.rows.append((experts, weights, PHASES[self._phase]))
        self.request_of_forward.append(len(self.prompt_lengths) - 1)
        self.predictions.append(self._predicted)
        self._pending, self._phase, self._predicted = [], None, {}

    def trace(self) -> Trace:
        """What has been committed so far, as a Trace."""
        L, K = self.n_layers, self.k
        sizes = [e.shape[0] for e, _, _ in self.rows]
        meta = dict(self.meta, prompt_lengths=list(self.prompt_lengths), n_requests=len(self.prompt_lengths),
                    n_forwards=len(self.rows))
        if not self.rows:
            z = np.zeros((0, L, K))
            return Trace(z, z, [], [], [], meta)
        return Trace(np.concatenate([e for e, _, _ in self.rows]), np.concatenate([w for _, w, _ in self.rows]),
                     np.repeat([p for _, _, p in self.rows], sizes), np.repeat(self.request_of_forward, sizes),
                     np.repeat(np.arange(len(self.rows)), sizes), meta, *self._prediction_arrays())

    def _prediction_arrays(self) -> tuple:
        """(predicted int32 [F, L, P], predicted_limit int32 [F, L]) of the committed forwards, or (None, None) when
        no prefetch was ever asked."""
        if not any(self.predictions):
            return None, None
        F, L = len(self.predictions), self.n_layers
        P = max(len(ids) for fwd in self.predictions for ids, _ in fwd.values())
        predicted = np.full((F, L, P), -1, dtype=np.int32)  # [F, L, P]
        limit = np.full((F, L), -1, dtype=np.int32)  # [F, L]
        for f, fwd in enumerate(self.predictions):
            for layer, (ids, lim) in fwd.items():
                predicted[f, layer, :len(ids)] = ids
                limit[f, layer] = lim
        return predicted, limit

    def save(self, path, append: bool = False) -> None:
        self.trace().save(path, append=append)


def synthetic_trace(n_tokens: int, n_layers: int, n_experts: int, k: int, seed: int = 0, zipf: float = 1.1,
                    locality: float = 0.5, prompt_len: int = 0, model: str = "synthetic") -> Trace:
    """A trace with the two structures real routing has (for tests and demos, not a model):
      - skew: per layer, expert popularity ~ 1 / rank^zipf over a random permutation of the experts;
      - temporal locality: each of a token's K choices repeats the previous token's choice in that position with
        probability `locality` (when it is not already taken), else is drawn from the popularity.
    The first `prompt_len` tokens are marked prefill (one forward), the rest decode."""
    rng = np.random.default_rng(seed)
    perms, pop = _synthetic_ranking(rng, n_layers, n_experts, zipf)  # [L, E] rank -> expert; [E] popularity by rank
    experts = np.zeros((n_tokens, n_layers, k), dtype=np.uint16)  # [N, L, K]
    for layer in range(n_layers):
        prev = None
        for t in range(n_tokens):
            chosen: list[int] = []
            draws = iter(perms[layer, rng.choice(n_experts, size=4 * k + 8, p=pop)])
            for j in range(k):
                e = int(prev[j]) if prev is not None and rng.random() < locality else -1
                while e < 0 or e in chosen:
                    e = int(next(draws, rng.integers(n_experts)))
                chosen.append(e)
            experts[t, layer] = prev = chosen
    weights = rng.dirichlet(np.ones(k), size=(n_tokens, n_layers)).astype(np.float16)  # [N, L, K]
    phase = (np.arange(n_tokens) >= prompt_len).astype(np.uint8)  # [N]
    forward = np.maximum(np.arange(n_tokens) - prompt_len + 1, 0) if prompt_len else np.arange(n_tokens)
    meta = {"model": model, "arch": "synthetic", "n_layers": n_layers, "n_experts": n_experts, "k": k,
            "prompt_lengths": [prompt_len], "n_requests": 1, "n_forwards": int(forward.max()) + 1 if n_tokens else 0,
            "zipf": zipf, "locality": locality, "seed": seed}
    return Trace(experts, weights, phase, np.zeros(n_tokens, np.int32), forward, meta)


def synthetic_heat(n_layers: int, n_experts: int, seed: int = 0, zipf: float = 1.1, scale: int = 10**9) -> np.ndarray:
    """int [L, E]: synthetic_trace's popularity (same seed, layers, experts, zipf) as routing counts, scaled to
    `scale` per layer: the profile a field with unlimited routing data would give that process. It knows nothing of
    one trace's draws, as the measured heat knows nothing of a fitted trace's (an in-sample profile does: it counts
    the very lookups it is scored on)."""
    perms, pop = _synthetic_ranking(np.random.default_rng(seed), n_layers, n_experts, zipf)
    heat = np.zeros((n_layers, n_experts), dtype=np.int64)
    for layer in range(n_layers):
        heat[layer, perms[layer]] = np.round(scale * pop).astype(np.int64)
    return heat


def _synthetic_ranking(rng, n_layers: int, n_experts: int, zipf: float):
    """synthetic_trace's first draws from its rng (seeded with its seed): (perms int [L, E], rank -> expert per layer;
    pop float [E], the popularity by rank, 1 / rank^zipf normalised). Shared with synthetic_heat and
    experts/bound.py, which rebuild the same ranking from the seed."""
    perms = np.stack([rng.permutation(n_experts) for _ in range(n_layers)])  # [L, E]
    pop = 1.0 / np.arange(1, n_experts + 1) ** zipf  # [E]
    return perms, pop / pop.sum()


def fitted_trace(heat, n_requests: int, prompt_len: int, decode_len: int, locality: float, window: int,
                 seed: int = 0, layers=None, k: Optional[int] = None, model: str = "fitted") -> Trace:
    """A synthetic trace fitted to measured per-layer routing counts (../shared/data/routing-heat/), with a stated
    temporal locality. heat int [L, E] (decode tokens in which each expert was in its layer's top-k); layers: the
    rows of heat to use (None: all); k: experts per token (default: the measured mean, heat.sum(1) / tokens, which
    the caller knows better: pass it).
    Per layer, independently, each token's k distinct experts are picked one at a time:
      - with probability `locality`, copy the expert of a uniformly chosen lookup among the previous `window`
        tokens' k * window lookups of this layer (of this request) -- a copy of a past lookup has the lookups'
        marginal distribution, so locality adds recency without changing each expert's long-run share;
      - else draw from the layer's popularity: (heat + 1/2) / sum (the 1/2: an expert never seen in the measured
        decode tokens stays possible, rarely);
    a pick already chosen for this token is redrawn (from the popularity after 8 failed copies). Each request
    starts with an empty window: `prompt_len` prefill tokens in one forward, then `decode_len` decode forwards.
    Drawing k distinct experts flattens the hottest ones a little (one token cannot take an expert twice):
    bench/cache_policies.py prints the generated per-layer skew next to the measured one."""
    heat = np.asarray(heat, dtype=np.float64)  # [L_all, E]
    layers = list(range(heat.shape[0])) if layers is None else list(layers)
    heat = heat[layers]  # [L, E]
    L, E = heat.shape
    if k is None:
        raise ValueError("fitted_trace: give k (the model's experts per token)")
    if not 0.0 <= locality <= 1.0 or window < 1:
        raise ValueError(f"fitted_trace: locality must be in [0, 1] and window >= 1, got {locality}, {window}")
    rng = np.random.default_rng(seed)
    pop = (heat + 0.5) / (heat + 0.5).sum(axis=1, keepdims=True)  # [L, E]
    per_req = prompt_len + decode_len
    n = n_requests * per_req
    experts = np.zeros((n, L, k), dtype=np.uint16)  # [N, L, K]
    for layer in range(L):
        draws = iter(rng.choice(E, size=4 * n * k + 64, p=pop[layer]).tolist())
        coin = iter((rng.random(n * k * 2 + 64) < locality).tolist())
        for r in range(n_requests):
            base = r * per_req
            for t in range(base, base + per_req):
                chosen: list[int] = []
                past = experts[max(base, t - window):t, layer].reshape(-1)  # [<= window * K] this request's recent
                for _ in range(k):
                    e = -1
                    if past.size and next(coin):
                        for _try in range(8):
                            e = int(past[rng.integers(past.size)])
                            if e not in chosen:
                                break
                            e = -1
                    while e < 0 or e in chosen:
                        e = next(draws, None)
                        e = int(rng.choice(E, p=pop[layer])) if e is None else e
                    chosen.append(e)
                experts[t, layer] = chosen
    weights = np.full((n, L, k), 1.0 / k, dtype=np.float16)  # [N, L, K]: not modelled
    in_req = np.tile(np.arange(per_req), n_requests)  # [N] position within its request
    phase = (in_req >= prompt_len).astype(np.uint8)  # [N]
    request = np.repeat(np.arange(n_requests), per_req).astype(np.int32)  # [N]
    fwd_in_req = np.maximum(in_req - prompt_len + 1, 0) if prompt_len else in_req  # the prompt is one forward
    forward = request * (decode_len + (1 if prompt_len else 0)) + fwd_in_req  # [N]
    meta = {"model": model, "arch": "synthetic", "n_layers": L, "n_experts": E, "k": k,
            "prompt_lengths": [prompt_len] * n_requests, "n_requests": n_requests,
            "n_forwards": int(forward.max()) + 1 if n else 0, "locality": locality, "window": window,
            "seed": seed, "layers": layers}
    return Trace(experts, weights, phase, request, forward.astype(np.int32), meta)


def top_share(counts, frac: float = 0.1) -> np.ndarray:
    """float [L]: per layer, the share of its lookups taken by its hottest ceil(frac * E) experts (counts int
    [L, E]): the per-layer skew the fitted trace is checked against."""
    c = np.sort(np.asarray(counts, dtype=np.float64), axis=1)[:, ::-1]  # [L, E] hottest first
    top = int(np.ceil(frac * c.shape[1]))
    return c[:, :top].sum(axis=1) / c.sum(axis=1)


# --- stored traces (bench/traces/: NAME.npz beside NAME.json, how it was made and its tune / held-out split) -------

def select_requests(trace: Trace, requests) -> Trace:
    """The rows of the requests whose numbers (trace.request values) are in `requests`, in their original order;
    meta's prompt_lengths and n_requests follow."""
    requests = sorted(int(r) for r in requests)
    keep = np.isin(trace.request, requests)
    meta = dict(trace.meta, n_requests=len(requests))
    lengths = trace.meta.get("prompt_lengths")  # one per request, request r at index r (as the recorder numbers)
    if lengths is not None and len(lengths) == int(trace.meta.get("n_requests", -1)):
        meta["prompt_lengths"] = [lengths[r] for r in requests]
    return Trace(trace.experts[keep], trace.weights[keep], trace.phase[keep], trace.request[keep],
                 trace.forward[keep], meta)


def named_traces(folder: str) -> dict:
    """{name: Trace} of every NAME.npz in `folder` (bench/traces/ in a source checkout), sorted by name. Each needs
    its sidecar NAME.json (how it was made, bench/record_traces.py), whose "split" {"tune": [requests], "heldout":
    [requests]} lands in trace.meta["split"] and its path in trace.meta["sidecar"]; split_named() cuts by it."""
    if not os.path.isdir(folder):
        raise file_error(folder, "no such folder of stored traces")
    out = {}
    for fname in sorted(os.listdir(folder)):
        if not fname.endswith(".npz"):
            continue
        name, path = fname[:-4], os.path.join(folder, fname)
        side = path[:-4] + ".json"
        if not os.path.exists(side):
            raise file_error(path, f"no sidecar {os.path.basename(side)} saying how it was made")
        try:
            with open(side, encoding="utf-8") as f:
                info = json.load(f)
        except ValueError as e:
            raise file_error(side, f"not JSON ({e})") from None
        split = info.get("split") if isinstance(info, dict) else None
        if not isinstance(split, dict) or not split.get("tune") or not split.get("heldout"):
            raise file_error(side, "field split needs non-empty 'tune' and 'heldout' request lists")
        trace = Trace.load(path)
        present = set(np.unique(trace.request).tolist())
        tune, held = set(split["tune"]), set(split["heldout"])
        if tune & held or (tune | held) != present:
            raise file_error(side, f"split: tune and heldout must divide the trace's requests {sorted(present)} "
                                   "between them")
        trace.meta["split"] = {"tune": sorted(tune), "heldout": sorted(held)}
        trace.meta["sidecar"] = side
        out[name] = trace
    return out


def split_named(trace: Trace) -> tuple:
    """(tune Trace, held-out Trace) of a trace from named_traces (its meta["split"])."""
    s = trace.meta["split"]
    return select_requests(trace, s["tune"]), select_requests(trace, s["heldout"])
