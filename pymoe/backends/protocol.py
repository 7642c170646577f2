"""The backend contract: everything the model code asks of a backend, in one place.

The forward pass (engine/model.py, engine/moe.py) is written once, over these primitives; a backend brings the
arithmetic and the memory, never model math of its own. Three backends implement it:
    reference  backends/reference.py  plain NumPy, the readable twin; what the others are tested against
    cpu        backends/cpu.py        compiled (Numba): fused quantized kernels, integer activations
    cuda       backends/cuda.py       Numba CUDA kernels; dense weights and the slot pool in device memory
A device backend may also run a whole decode step on the device (version 3, backends/cuda.py): it then has
`device_step` True and the methods the engine calls for it -- `step_ready`, `owns(kv)`, `begin_step`, `embed`,
`moe_on_device` (route + routed and shared experts of one MoE layer), `mlp_on_device` (a dense layer's MLP),
`end_step`, `sync_table`, `keep_on_device` -- and its primitives take and return device arrays during the step
(engine/model.py `Model.device_step_possible`; docs/expert-cache.md "The decode step on the device"). It may
also run an MLA or Gated DeltaNet block of T rows of one sequence on the device (`mla_on_device(kv)`,
`gdn_on_device(kv)`: engine/mla.mla_device, engine/deltanet.gdn_device). Host backends have none of these and the
forward never asks them.
`typing.Protocol` checks nothing at run time: tests/test_backends.py holds every backend to this list, and each
primitive to the reference's results.

Arrays are float32 NumPy arrays on the host unless said otherwise. Shapes: T tokens of this call, C / R a weight's
columns / rows, H query heads, G KV heads, Dh / Dv key / value head size, S keys (cached + new), E experts of a layer,
K used per token, D n_embd.
"""
from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Backend(Protocol):
    name: str
    threads: int

    # --- set-up -----------------------------------------------------------------------------------------------------
    def warm_up(self, qtypes, progress: bool = False) -> None:
        """Compile (or load from a cache) the kernels these tensor types need, now, not in the first request."""

    def warm_up_experts(self, expert_types: dict) -> None:
        """The same for the expert kernel of one {gate, up, down: qtype} combination (one per distinct layout)."""

    def share_cpu(self) -> None:
        """Before each forward call: how many threads it may use (the CPU backend: the cores other processes leave
        free, backends/threads.py; the others: nothing to do)."""

    def dense(self, t) -> object:
        """A 2-D GGUF tensor (gguf/loader.Tensor) -> a weight `linear` can multiply with (the backend's own form:
        a view into the memory map on the host, raw rows in device memory on a GPU)."""

    def vector(self, t) -> np.ndarray:
        """A 1-D float tensor (norm weight, bias, gate) -> float32 [n] on the host."""

    def new_pool(self, n_slots: int, slot_bytes: int, layouts: list):
        """The expert cache's slot memory: backends/pool.HostPool or a subclass (`DevicePool` on a GPU)."""

    def new_kv(self, n_ctx: int) -> Optional[object]:
        """A KV cache of the backend's own (the CUDA one in device memory) for a new sequence, or None: then the
        engine gives the sequence a host KV cache (engine/kv.py)."""

    # --- where arrays live ----------------------------------------------------------------------------------------------
    # A primitive answers where its input is: a host array in, a host array out; a backend's device array in, a device
    # array out. Host backends never move anything. A primitive may work in place on its input: the blocks never
    # reuse an input after passing it on.
    def to_device(self, x: np.ndarray) -> object:
        """x [T, C] (host) -> the backend's working memory (CUDA: device memory), at the start of a block."""

    def to_host(self, a) -> np.ndarray:
        """-> a float32 host array (a no-op for host arrays)."""

    def add(self, a, vec: np.ndarray) -> object:
        """a [T, n] + vec [n] (a bias)."""

    def view(self, a, shape: tuple) -> object:
        """a reshaped (contiguous; no copy): [T, H * Dh] -> [T, H, Dh]."""

    def split_gate(self, qg, Dh: int) -> tuple:
        """Gated attention's q projection [T, H 2 Dh] (per head the query, then the output gate) -> q, gate
        [T, H Dh] (qwen3next, qwen35moe)."""

    def gate_output(self, out, gate) -> object:
        """out [T, n] * sigmoid(gate [T, n]): gated attention's output gate."""

    def kv_write(self, kv, layer: int, p0: int, k, v) -> None:
        """k [T, G, Dh], v [T, G, Dv] into the KV cache (engine/kv.py, or the backend's own) at positions p0..;
        v None for a cache whose V is part of K (MLA: engine/kv.KVCache.v_in_k)."""

    def kv_read(self, kv, layer: int, S: int) -> tuple:
        """The first S cached positions of `layer`: (k [S, G, Dh], v [S, G, Dv]), where the cache keeps them."""

    # --- arithmetic ---------------------------------------------------------------------------------------------------
    def linear(self, w, x: np.ndarray) -> np.ndarray:
        """x [T, C] @ W.T -> [T, R] for a weight made by `dense`."""

    def linear_many(self, ws: list, x: np.ndarray) -> list:
        """[linear(w, x) for w in ws] (q, k and v of a layer: a backend may prepare x once for all of them)."""

    def linear_raw(self, raw, qtype, x: np.ndarray) -> np.ndarray:
        """x [T, C] @ W.T -> [T, R] for W stored as `raw`: GGUF rows of `qtype` (uint8 [R, row_bytes], or float32
        [R, C] for F32), e.g. one expert's matrix from a slot or the memory map."""

    def rmsnorm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """x [..., n] / sqrt(mean(x^2) + eps) * w [n]."""

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> np.ndarray:
        """x [T, heads, Dh] with the first 2 * cos.shape[1] dims of each head rotated; cos, sin [T, rope_dim / 2]."""

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, p0: int, window: int = 0,
                  sinks=None) -> np.ndarray:
        """Causal GQA attention of q [T, H, Dh] (positions p0..) over k [S, G, Dh], v [S, G, Dv] -> [T, H * Dv].
        window > 0: each query sees only the last `window` positions (gpt-oss's sliding layers); sinks float32 [H]:
        one extra logit per head in the softmax's denominator (gpt-oss). reference.attention is the math."""

    def route(self, logits: np.ndarray, k: int, norm_topk: bool) -> tuple:
        """Router logits [T, E] -> (ids int64 [T, K], weights float32 [T, K]): softmax, top-K highest first (ties to
        the lower id), renormalised over the K when norm_topk."""

    def moe_experts(self, experts: dict, expert_types: dict, x: np.ndarray, ids: np.ndarray,
                    w: np.ndarray, ffn=None) -> np.ndarray:
        """The routed experts of one layer: experts {e: ExpertBytes} (each routed e once; its bytes wherever the
        expert cache says: a slot, the memory map, tagged with `where`), x [T, D], ids [T, K], w [T, K]
        -> y [T, D] = sum_k w[t, k] * down(silu(gate(x[t])) * up(x[t])) of expert ids[t, k].
        ffn (reference.ExpertFFN, gpt-oss): per-expert biases after each product and swiglu_oai instead of SwiGLU."""


PRIMITIVES = [name for name in Backend.__dict__ if not name.startswith("_") and callable(Backend.__dict__[name])]


class HostRecurrent:
    """A sequence's recurrent state kept on the host, for a KV cache class to take in (engine/kv.KVCache, and
    backends/multi_device.MultiKV, which keeps it on the host across several devices)."""

    def recurrent(self, layer: int, **shapes) -> dict:
        """The state a recurrent layer carries from call to call (Gated DeltaNet: conv [K - 1, C] and ssm
        [H, dv, dk]), float32 zeros on first use; name -> shape as keyword arguments. Unlike K and V it cannot be
        cut back to an earlier position: `clear()` is the only way back (prefix reuse checks
        `ModelConfig.has_recurrent_state`)."""
        states = self.__dict__.setdefault("_recurrent", {})
        if layer not in states:
            states[layer] = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
        return states[layer]

    def save_recurrent(self) -> dict:
        """A copy of every recurrent layer's state, to go back to with `restore_recurrent` (speculative decoding
        rolls back rejected drafts this way: engine/speculative.py)."""
        return {layer: {name: a.copy() for name, a in st.items()} for layer, st in self.__dict__.get("_recurrent",
                                                                                                      {}).items()}

    def restore_recurrent(self, saved: dict) -> None:
        states = self.__dict__.setdefault("_recurrent", {})
        states.clear()
        states.update({layer: {name: a.copy() for name, a in st.items()} for layer, st in saved.items()})
