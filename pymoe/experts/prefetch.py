"""Router lookahead: predict the next MoE layer's experts one layer early, measure how well, and prefetch them.

What this is: `Lookahead(model)`, hooked into the forward pass (engine/model.py `Model.lookahead`). After layer l,
the residual stream x [T, D] is what layer l + 1 starts from; layer l + 1 will route
    rmsnorm(x + attention_{l+1}(x)) * ffn_norm_{l+1}  @ router_{l+1}.T
and the lookahead skips the attention term:
    predicted = top-K' of  rmsnorm(x) * ffn_norm_{l+1} @ router_{l+1}.T      [T, K'] (K' = K unless told)
because the residual stream changes little from one layer to the next (the reference article's prefetch applies
the next layer's router early in the same way). When layer l + 1 routes, its real choice [T, K] is compared:
    precision = |predicted & chosen| / K'     recall = |predicted & chosen| / K      per token, summed per layer
and the predicted experts are prefetched, two ways:
  - into the slot pool (a decode step, with `--cache-slots`: cache.SlotCache.prefetch): the predicted experts that
    are not resident, most-predicted first (count over the T tokens, then rank), at most `budget` per layer per
    forward (default K'), are placed through the cache's own rules -- admission (second-miss; the `--max-inserts`
    cap of the layer they are for, which its own miss promotions then share), the policy's admit and victim -- and
    their bytes copied in at once. On CUDA the copy is queued on the copy stream (backends/cuda.DevicePool.write:
    after the kernels still reading the victim's slot; the compute stream waits for it before reading the slot),
    so it overlaps with layer l + 1's attention, and layer l + 1's lookup hits them: counted "prefetch_hits" (of
    "prefetched" copies). On the CPU backend the pool is the GPU's emulation in RAM (the same accounting; the
    copy is a NumPy copy that buys nothing there). Prefill never prefetches, as its lookups never promote.
  - on the CPU backend, `madvise(MADV_WILLNEED)` on their byte ranges of the memory map, so that the kernel starts
    reading pages that are not in memory (a model larger than RAM) before the layer needs them.
Routing and results are untouched: the lookahead changes only where expert bytes are read from.
Approximations: the attention term is skipped; group-limited routing (DeepSeek-V3) is not applied to the
prediction; the prediction is made after layer l's experts (layer l's output is its input), not right after layer
l's router. With a routing trace on (`--trace`), each prefetch request (the ranked experts and the budget) is
recorded too (trace.TraceRecorder.predict), and `pymoe simulate TRACE --prefetch` replays it through the same rule
(policies.prefetch_ranked). What this is not: a cache policy (a wrong prediction costs a copy and may evict a useful
expert: the budget bounds both).
"""
from __future__ import annotations

import mmap

import numpy as np

from pymoe.backends.reference import rmsnorm

PAGE = mmap.PAGESIZE


class Lookahead:
    def __init__(self, model, k: int = 0, advise: bool = True, promote: bool = True, budget: int = 0):
        """model: engine/model.Model; k: experts predicted per token (0: the model's K); advise: madvise on CPU;
        promote: place predicted experts in the slot pool (when the cache has one), at most `budget` per layer per
        forward (0: k)."""
        cfg = model.cfg
        self.model, self.k = model, int(k or cfg.n_expert_used)
        self.promote, self.budget = promote, int(budget or self.k)
        self.moe = [i for i, layer in enumerate(model.layers) if layer.ffn_gate_inp is not None]
        self.next_moe = {a: b for a, b in zip(self.moe, self.moe[1:])}  # layer -> the next MoE layer
        self.routers = {i: np.asarray(model.file.layer_tensor(i, "ffn_gate_inp.weight").floats(), np.float32)
                        for i in self.moe}  # [E, D] float32, host: a small matrix per layer
        t = model.file.layer_tensor
        self.norms = {i: t(i, f"{cfg.traits.ffn_norm}.weight").floats() for i in self.moe}  # [D] host float32
        self.bias = {i: (model.layers[i].router_bias if model.layers[i].router_bias is not None else 0.0)
                     for i in self.moe}  # gpt-oss's router bias
        self.select_bias = {i: model.layers[i].expert_bias for i in self.moe}  # GLM / DeepSeek-V3: chooses only
        self.predicted: dict = {}  # layer -> [T, K'] predicted for its next call
        L = cfg.n_layers
        self.hits = np.zeros(L, np.int64)  # |predicted & chosen| summed over tokens
        self.n_predicted = np.zeros(L, np.int64)
        self.n_chosen = np.zeros(L, np.int64)
        self.advised_bytes = 0
        self._map = self._file_map(model.file) if advise else None

    @staticmethod
    def _file_map(gguf_model):
        """(the mmap.mmap under the reader's np.memmap, its base address), or None where it is not reachable."""
        data = getattr(gguf_model.reader, "data", None)
        mm = getattr(data, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise"):
            return None
        return mm, int(data.__array_interface__["data"][0]) - int(getattr(data, "offset", 0) or 0)

    def after_layer(self, layer: int, x: np.ndarray, phase: str = "decode") -> None:
        """x [T, D]: the residual stream after `layer`; predict the next MoE layer's experts and prefetch them
        (into slots only in decode)."""
        nxt = self.next_moe.get(layer)
        if nxt is None:
            return
        cfg = self.model.cfg
        h = rmsnorm(np.asarray(x, np.float32), self.norms[nxt], cfg.rms_eps)  # [T, D]
        scores = h @ self.routers[nxt].T + self.bias[nxt]  # [T, E]: the order softmax (or top-K) chooses by
        if cfg.gating == "sigmoid":  # GLM, DeepSeek-V3: sigmoid(logits) + the selection bias choose
            scores = 1.0 / (1.0 + np.exp(-scores))
            if self.select_bias[nxt] is not None:
                scores = scores + self.select_bias[nxt]
        pred = np.argsort(-scores, axis=1, kind="stable")[:, :self.k]  # [T, K']
        self.predicted[nxt] = pred
        if self.promote and phase == "decode":
            ranked = self.ranked(pred)
            self.model.cache.prefetch(nxt, ranked, limit=self.budget)
            if self.model.trace is not None:  # `--trace`: the request, so that `pymoe simulate` can replay it
                self.model.trace.predict(nxt, ranked, self.budget)
        if self._map is not None:
            for e in np.unique(pred).tolist():
                self._advise(nxt, e)

    @staticmethod
    def ranked(pred: np.ndarray) -> list[int]:
        """pred [T, K'] -> its distinct experts, most predicted first: by how many tokens predicted each, then by
        the best rank any token gave it (then by id)."""
        ids, first, n = np.unique(pred.T.reshape(-1), return_index=True, return_counts=True)  # rank-major order
        return ids[np.lexsort((first, -n))].tolist()

    def chosen(self, layer: int, ids: np.ndarray) -> None:
        """The router's real choice at `layer`, ids [T, K]: scored against the prediction made one layer early."""
        pred = self.predicted.pop(layer, None)
        if pred is None or pred.shape[0] != ids.shape[0]:
            return
        for p, c in zip(pred, np.asarray(ids)):
            self.hits[layer] += np.intersect1d(p, c).size
        self.n_predicted[layer] += pred.size
        self.n_chosen[layer] += ids.size

    def _advise(self, layer: int, e: int) -> None:
        mm, base = self._map
        ex = self.model.file.expert(layer, e)
        for part in (ex.gate, ex.up, ex.down):
            start = int(part.__array_interface__["data"][0]) - base
            lo = start - start % PAGE
            mm.madvise(mmap.MADV_WILLNEED, lo, start + part.nbytes - lo)
            self.advised_bytes += part.nbytes

    def per_layer(self) -> list[tuple[int, float, float]]:
        """[(layer, precision, recall)] of the layers predicted (every MoE layer but the first)."""
        return [(i, self.hits[i] / self.n_predicted[i], self.hits[i] / self.n_chosen[i])
                for i in self.moe if self.n_predicted[i]]

    def line(self) -> str:
        rows = self.per_layer()
        if not rows:
            return "router lookahead: nothing predicted yet"
        hits, pred, chosen = (int(a[[i for i, _, _ in rows]].sum()) for a in (self.hits, self.n_predicted,
                                                                               self.n_chosen))
        worst = min(rows, key=lambda r: r[2])
        return (f"router lookahead: top-{self.k} of the next layer's router one layer early: precision "
                f"{100 * hits / pred:.1f}%, recall {100 * hits / chosen:.1f}% over {len(rows)} layers (worst: layer "
                f"{worst[0]}, recall {100 * worst[2]:.1f}%; chance {100 * self.model.cfg.n_expert_used / self.model.cfg.n_expert:.1f}%)"
                + self.prefetch_line()
                + (f"; {self.advised_bytes / 2**20:.1f} MiB of expert bytes advised WILLNEED in all" if self._map
                   else ""))

    def prefetch_line(self) -> str:
        """What the slot prefetch did, from the cache's decode counters ('' with no slot pool or promote off)."""
        c = self.model.cache.stats.counts["decode"]
        if not self.promote or not self.model.cache.n_slots:
            return ""
        return (f"; {c['prefetched']} experts prefetched into slots (at most {self.budget} per layer-step), "
                f"{c['prefetch_hits']} of {c['hits']} decode hits on them")
