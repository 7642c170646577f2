"""Router lookahead: predict the next MoE layer's experts one layer early, measure how well, and prefetch them.

What this is: `Lookahead(model)`, hooked into the forward pass (engine/model.py `Model.lookahead`). After layer l,
the residual stream x [T, D] is what layer l + 1 starts from; layer l + 1 will route
    rmsnorm(x + attention_{l+1}(x)) * ffn_norm_{l+1}  @ router_{l+1}.T
and the lookahead skips the attention term:
    predicted = top-K' of  rmsnorm(x) * ffn_norm_{l+1} @ router_{l+1}.T      [T, K'] (K' = K unless told)
because the residual stream changes little from one layer to the next (the reference article's prefetch applies
the next layer's router early in the same way). When layer l + 1 routes, its real choice [T, K] is compared:
    precision = |predicted & chosen| / K'     recall = |predicted & chosen| / K      per token, summed per layer
and the predicted experts are prefetched: on the CPU, `madvise(MADV_WILLNEED)` on their byte ranges of the memory
map, so that the kernel starts reading pages that are not in memory (a model larger than RAM) before the layer
needs them. Routing and results are untouched: the lookahead only reads.
Approximations: the attention term is skipped; group-limited routing (DeepSeek-V3) is not applied to the
prediction. What this is not: a GPU prefetch (starting the predicted experts' promotion on the copy stream is the
next step), or a cache policy.
"""
from __future__ import annotations

import mmap

import numpy as np

from pymoe.backends.reference import rmsnorm

PAGE = mmap.PAGESIZE


class Lookahead:
    def __init__(self, model, k: int = 0, advise: bool = True):
        """model: engine/model.Model; k: experts predicted per token (0: the model's K); advise: madvise on CPU."""
        cfg = model.cfg
        self.model, self.k = model, int(k or cfg.n_expert_used)
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

    def after_layer(self, layer: int, x: np.ndarray) -> None:
        """x [T, D]: the residual stream after `layer`; predict the next MoE layer's experts and prefetch them."""
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
        if self._map is not None:
            for e in np.unique(pred).tolist():
                self._advise(nxt, e)

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
                + (f"; {self.advised_bytes / 2**20:.1f} MiB of expert bytes advised WILLNEED in all" if self._map
                   else ""))
