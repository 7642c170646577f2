"""The forward pass of an MoE model, on any backend: embeddings -> the layer plan, block by block -> logits.

What this is: `Model(gguf_model, backend, cache)` with
    prefill(tokens, kv)          T prompt tokens at once (mat-mat kernels), fills the KV cache, returns logits [T, V]
    decode_one_token(token, kv)  one token (mat-vec kernels), returns logits [V]
both built on one `forward(tokens, kv, phase)`, which applies the file's layer plan (gguf/config.LayerPlan):
    x = x + ATTENTION[layer.plan.attention]( rmsnorm(x) * attn_norm )     engine/attention.py
    x = x + FFN[layer.plan.ffn]( rmsnorm(x) * ffn_norm )                   engine/moe.py (MoE, or a dense MLP)
What this is not: the arithmetic (the backend's primitives: backends/protocol.py, backends/reference.py holds the
math in NumPy), a tokenizer, sampler or generation loop (generate.py), or a cache (experts/cache.py).

It computes what llama.cpp computes on the same file (the oracle in tests/test_model_vs_llamacpp.py).
Shapes: T new tokens, D n_embd, V n_vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pymoe.backends.reference import ExpertFFN, rope_scaling, rope_tables
from pymoe.errors import PymoeError
from pymoe.gguf.loader import EXPERT_PROJ
from pymoe.gguf.config import LayerPlan, ModelConfig
from .attention import ATTENTION, HOST_ATTENTION
from .deltanet import gdn_weights
from .mla import mla_weights
from .kv import KVCache, segments
from .moe import FFN

DEVICE_STEP_ATTENTION = ("gqa", "gated", "gdn", "mla")  # the attention kinds a device step runs (backends/cuda.py)


def _delta(kv) -> int:
    """rope position - storage index at the cache's end (nonzero after an image: engine/multimodal.py)."""
    f = getattr(kv, "pos_delta", None)
    return f() if f is not None else 0


def imrope_axes(sections: tuple, n_pairs: int) -> np.ndarray:
    """ggml's interleaved M-RoPE (GGML_ROPE_TYPE_IMROPE, ggml_mrope_cache_init): pair i is in sector
    i % sum(sections); sector s turns by the h position when s % 3 == 1 and s < 3 sections[1], by w when
    s % 3 == 2 and s < 3 sections[2], by t otherwise (0, 1, 2 = t, h, w). ggml turns the pairs outside the three
    sections (Qwen3-VL's [24, 20, 20]: sector 61 of 64) by a 4th position, the token's position for text and 0 for
    image rows (mtmd_image_tokens_get_decoder_pos: "unused for now"); transformers' apply_interleaved_mrope leaves
    them on t, which pymoe follows: the same for text, and for image rows one pair whose angle, p * base^(-61/64),
    is below 5e-4 radians for p < 1000 at Qwen3-VL's base 5e6."""
    total = max(1, sum(sections))
    axes = np.zeros(n_pairs, dtype=np.int64)
    for i in range(n_pairs):
        s = i % total
        axes[i] = 1 if s % 3 == 1 and s < 3 * sections[1] else 2 if s % 3 == 2 and s < 3 * sections[2] else 0
    return axes


@dataclass
class Layer:
    """One transformer block's weights, prepared for a backend. Names are the GGUF tensor names."""

    index: int
    cfg: ModelConfig
    plan: LayerPlan  # which blocks run here, and the expert layout of an MoE layer
    attn_norm: np.ndarray
    attn_q: object
    attn_k: object
    attn_v: object
    attn_output: object
    bias: dict  # q/k/v -> float32 vector (qwen2moe), else empty
    q_norm: object  # float32 [Dh] or [H * Dh] or None
    k_norm: object
    ffn_norm: np.ndarray
    ffn_gate_inp: object  # the router [E, D] (None in a dense layer)
    shared: dict  # the shared expert: gate/up/down DenseWeight (+ gate_inp float32 [D]: qwen2moe); else empty
    dense: dict = None  # a dense layer's MLP: gate/up/down DenseWeight
    expert_bias: object = None  # exp_probs_b float32 [E]: added to the probabilities to choose the top K (GLM, V3)
    out_bias: object = None  # attn_output.bias float32 [D] (gpt-oss)
    sinks: object = None  # attn_sinks float32 [H] (gpt-oss)
    router_bias: object = None  # ffn_gate_inp.bias float32 [E] (gpt-oss)
    ffn: object = None  # reference.ExpertFFN: the experts' activation and biases (gpt-oss); None: plain SwiGLU
    gdn: dict = None  # a Gated DeltaNet layer's weights (engine/deltanet.py); its attn_q/k/v/output are None
    mla: dict = None  # an MLA layer's weights (engine/mla.py); its attn_q/k/v/output are None

    @property
    def expert_types(self) -> dict:
        """gate/up/down -> qtype of this layer's 3-D expert tensors."""
        return self.plan.experts.types


class Model:
    def __init__(self, gguf_model, backend, cache, progress: bool = False):
        self.file = gguf_model
        self.cfg: ModelConfig = gguf_model.config
        self.backend = backend
        self.cache = cache
        self.trace = None  # a trace.TraceRecorder, when routing is being recorded (`pymoe run --trace`)
        self.chunk = 512  # most prompt tokens per forward call (prefill)
        self.last_experts = 0  # distinct (layer, expert) pairs the last forward routed to, while `count_experts`
        self.count_experts = False  # set by speculation (engine/speculative.py), whose telemetry reports them
        self.hidden_taps: dict = {}  # id(kv) -> f(first position, hidden [T, D] after the output norm): the MTP
        # drafters (engine/mtp.py) of the sequences that have one, called by every forward of that KV cache
        self.lookahead = None  # experts/prefetch.Lookahead, when set (`pymoe run --lookahead`)
        cfg, b, t = self.cfg, backend, gguf_model.tensor
        self.token_embd = t("token_embd.weight")  # rows read on demand, dequantized one token at a time
        self.output_norm = b.vector(t("output_norm.weight"))
        self.output = b.dense(t("token_embd.weight") if cfg.tied_output else t("output.weight"))
        from tqdm import tqdm

        self.plan = gguf_model.layer_plan()  # [L] gguf/config.LayerPlan
        # Attention kinds without device kernels run on the backend's host side (CUDA: its CPU backend) with a
        # host KV cache, their weights in host memory; the experts of those layers still go through the device.
        self.host_attention = any(self.attends_on_host(p) for p in self.plan)
        bar = tqdm(self.plan, desc="loading", unit="layer", disable=None if progress else True, leave=False)  # TTY only
        self.layers = [self.layer_for(p) for p in bar]
        # The device decode step (backends/cuda.py `begin_step`, version 3): the families whose every block has
        # device primitives; the embedding's raw rows go to the device for it (the output's, when tied)
        self.step_on_device = self.device_step_possible()
        if self.step_on_device:
            self.token_embd_dev = self.output if cfg.tied_output else b.dense(self.token_embd)
            b.keep_on_device([self.output_norm] + [v for la in self.layers for v in (la.attn_norm, la.ffn_norm)]
                             + [la.shared["gate_inp"] for la in self.layers if "gate_inp" in la.shared]
                             + [la.expert_bias for la in self.layers if la.expert_bias is not None]
                             + [v for la in self.layers for v in (la.sinks, la.out_bias, la.router_bias)
                                if v is not None]  # gpt-oss's, and its experts' biases:
                             + [la.ffn.bias[p] for la in self.layers if la.ffn is not None for p in EXPERT_PROJ]
                             + [v for la in self.layers if la.mla for k, v in la.mla.items()
                                if isinstance(v, np.ndarray) and k not in ("k_b", "v_b")]  # MLA's norms (k_b and
                             # v_b: the host form's floats; the device reads their stored rows, engine/mla.py)
                             + [la.gdn[n] for la in self.layers if la.gdn for n in ("conv", "dt", "a", "norm")])

    def device_step_possible(self) -> bool:
        """Whether a decode step can run on the device from token id to token (a backend with `begin_step`, and
        only blocks it has device primitives for: GQA attention, with or without a sliding window and sinks, gated
        attention and Gated DeltaNet (qwen3next, qwen35moe), MLA (engine/mla.py); MoE layers routed by a softmax,
        by sigmoids (with the choice bias, with or without expert groups) or by gpt-oss's top-K-then-softmax of the
        logits plus a router bias, with or without a shared expert (gated or not), their experts plain SwiGLU or
        gpt-oss's (biases, clamped SwiGLU); dense MLP layers). Other families keep version 2 (docs/expert-cache.md
        "On the GPU")."""
        b, cfg = self.backend, self.cfg
        if not getattr(b, "device_step", False) or self.host_attention:
            return False
        if cfg.gating not in ("softmax", "sigmoid", "softmax_weight"):
            return False
        if cfg.gating == "softmax_weight" and cfg.n_expert_groups > 1:  # (no family routes so)
            return False
        return all(la.plan.attention in DEVICE_STEP_ATTENTION
                   and (la.router_bias is None or cfg.gating == "softmax_weight")
                   and (la.ffn is None or la.ffn.activation == "swiglu_oai") for la in self.layers)

    def _device_step(self, tokens: np.ndarray, kv, phase: str, media) -> bool:
        """This forward is a device step: one decode token of one sequence in the backend's device KV cache, with
        nothing that needs each layer's routing on the host as it happens (a trace, the lookahead) and an expert
        cache it can serve (`_cache_allows_step`); an MTP drafter's tap (`hidden_taps`) gets the step's normed last
        hidden states, which come back with its ids (`_end_device_step`). Speculation's expert count comes from the
        routing ids the step brings back (`_end_device_step`). Several tokens in decode: speculation's verify
        forward, a device step of T rows where `verify_on_device` allows it."""
        b = self.backend
        if not (self.step_on_device and phase == "decode" and media is None and b.step_ready()
                and b.owns(kv) and self.trace is None and self.lookahead is None):
            return False
        if tokens.size > 1 and not self.verify_on_device(tokens.size):
            return False
        return self._cache_allows_step()

    def verify_on_device(self, T: int) -> bool:
        """A verify forward of T positions (the last token and its drafts, engine/speculative.py) runs as one device
        step (backends/cuda.py `begin_step` with T rows): every layer a kind the device step runs (GQA and gated
        attention; MLA, engine/mla.mla_device over the T rows: cache rows, absorbed queries, causal attention over
        the compressed cache, values; Gated DeltaNet, engine/deltanet.gdn_device: the conv and the rule over the T
        rows in order), every miss read over PCIe (the cache's lookups follow the step: one synchronisation), and
        rows that fit the step's buffers (`verify_fits`). Its rollback is speculation's `kv.n = p0 + 1 + accepted`:
        the rejected rows' K/V (MLA: compressed rows) stay in the device cache past kv.n, where no query reads them
        (each query attends to rows 0 .. its own position) and the next forward writes its rows before it attends;
        a recurrent state goes back to its device snapshot taken before the forward and redoes the kept rows as
        another device step (`DeviceKVCache.snapshot_recurrent`, engine/speculative.py)."""
        b = self.backend
        return (all(la.plan.attention in DEVICE_STEP_ATTENTION for la in self.layers)
                and self._misses_all_over_pcie() and getattr(b, "verify_fits", lambda T: False)(T))

    def steps_on_device(self, kv) -> bool:
        """A decode token of the sequence in kv would run as a device step now (`_device_step`): the server runs
        such slots' decode tokens as one batched device step where it can (engine/device_batch.py), else one step
        per sequence (serve/scheduler.py), the others in one batched forward."""
        return self._device_step(np.zeros(1, np.int64), kv, "decode", None)

    def device_draw(self, sampler, kv):
        """The sampler's next draw, handed to the device step of kv's next decode token so the drawn id comes back
        in the step's one copy (engine/sampler.Sampler.device_draw, backends/cuda.py `begin_step`), or None: the
        token does not run as a device step, or the draw is not one the device makes (the sampler draws as usual)."""
        if not self.steps_on_device(kv):
            return None
        return sampler.device_draw(self.backend.can_sample)

    def _cache_allows_step(self) -> bool:
        """An expert cache the device step can serve: a SlotCache, or none on a GPU (every expert over PCIe)."""
        cache = self.cache
        return hasattr(cache, "residency") or getattr(cache, "miss_path", None) == "spill"

    def _misses_all_over_pcie(self) -> bool:
        """No decode miss goes to the CPU (pcie_frac 1, a slot for every expert, or no pool): the cache's lookups
        can follow the step. Otherwise each MoE layer's lookup is made inside it (one more synchronisation per MoE
        layer: the routing ids and the layer's input come to the host, the CPU computes its "cpu" misses)."""
        cache = self.cache
        return not hasattr(cache, "residency") or cache.pcie_frac >= 1.0 or cache.n_slots >= cache.n_total

    def backend_for(self, i: int):
        """The backend layer i runs on: the model's, or, with several devices (backends/multi_device.py), the one
        holding layer i's range."""
        for_layer = getattr(self.backend, "for_layer", None)
        return self.backend if for_layer is None else for_layer(i)

    def attention_backend(self, plan: LayerPlan):
        """The backend a layer's attention runs on: the layer's, or its host side for kinds the device lacks."""
        b = self.backend_for(plan.index)
        return getattr(b, "host_backend", b) if self.attends_on_host(plan) else b

    def attends_on_host(self, plan: LayerPlan) -> bool:
        """The layer's attention kind has no device kernels on this backend: attention.HOST_ATTENTION, less the kinds
        the backend runs itself (`device_attention_kinds`: CUDA's MLA)."""
        return (plan.attention in HOST_ATTENTION
                and plan.attention not in getattr(self.backend, "device_attention_kinds", ()))

    def layer_for(self, plan: LayerPlan) -> Layer:
        """The weights of the layer `plan` describes, prepared for the backend (the MTP block is built this way
        too: engine/mtp.py)."""
        cfg, b, i = self.cfg, self.attention_backend(plan), plan.index  # b: the attention's weights; bf: the FFN's
        bf = self.backend_for(i)
        lt = lambda name: self.file.layer_tensor(i, name)  # noqa: E731
        bias = {p: b.vector(lt(f"attn_{p}.bias")) for p in "qkv"} if cfg.qkv_bias else {}
        gdn = plan.attention == "gdn"
        norms = ((b.vector(lt("attn_q_norm.weight")), b.vector(lt("attn_k_norm.weight"))) if cfg.qk_norm and not gdn
                 else (None, None))
        shared, dense = {}, None
        if plan.ffn == "moe+shared":
            shared = {p: bf.dense(lt(f"ffn_{p}_shexp.weight")) for p in ("gate", "up", "down")}
            if cfg.traits.shared_gate:
                shared["gate_inp"] = bf.vector(lt("ffn_gate_inp_shexp.weight"))
        if plan.ffn == "dense":
            dense = {p: bf.dense(lt(f"ffn_{p}.weight")) for p in ("gate", "up", "down")}
        moe = plan.ffn != "dense"
        tr = cfg.traits
        vec = lambda name: lt(name).floats()  # noqa: E731  small tensors as float32 on the host (any stored type)
        ffn = None
        if moe and tr.expert_ffn != "swiglu":
            ffn = ExpertFFN(tr.expert_ffn, {p: vec(f"ffn_{p}_exps.bias") for p in ("gate", "up", "down")})
        mla = plan.attention == "mla"
        attn = (None,) * 4 if gdn or mla else tuple(b.dense(lt(f"attn_{p}.weight")) for p in ("q", "k", "v", "output"))
        return Layer(
            index=i, cfg=cfg, plan=plan, attn_norm=bf.vector(lt("attn_norm.weight")),
            attn_q=attn[0], attn_k=attn[1], attn_v=attn[2], attn_output=attn[3],
            bias=bias, q_norm=norms[0], k_norm=norms[1], ffn_norm=bf.vector(lt(f"{cfg.traits.ffn_norm}.weight")),
            ffn_gate_inp=bf.dense(lt("ffn_gate_inp.weight")) if moe else None, shared=shared, dense=dense,
            expert_bias=vec("exp_probs_b.bias") if moe and cfg.expert_bias else None,
            out_bias=b.vector(lt("attn_output.bias")) if tr.attn_out_bias else None,
            sinks=vec("attn_sinks.weight") if tr.attn_sinks else None,
            router_bias=vec("ffn_gate_inp.bias") if moe and tr.router_bias else None,
            ffn=ffn,
            gdn=gdn_weights(b, lt, vec, tr.gdn_tiled) if gdn else None,
            mla=mla_weights(b, lt, cfg) if mla else None,
        )

    # --- the pieces -----------------------------------------------------------------------------------------
    def rope_tables(self, positions: np.ndarray) -> tuple:
        """RoPE's cos, sin [T, rope_dim / 2] of these positions, with the file's context scaling (YaRN: gpt-oss).
        positions [T], or [T, 3] (t, h, w) for M-RoPE: rows of an image prompt (engine/multimodal.py)."""
        c = self.cfg
        scaling = rope_scaling(c)  # (DeepSeek's yarn_log_multiplier: reference.rope_scaling)
        if positions.ndim == 1:
            return rope_tables(c.rope_dim, c.rope_freq_base, positions, scaling)
        if not c.rope_sections:
            raise PymoeError(f"{c.arch}: multi-axis (image) positions need rope.dimension_sections (M-RoPE)")
        tables = [rope_tables(c.rope_dim, c.rope_freq_base, positions[:, a], scaling) for a in range(3)]
        axis = imrope_axes(c.rope_sections, c.rope_dim // 2)  # [rope_dim / 2] which of t, h, w turns pair i
        pick = lambda k: np.stack([tables[a][k] for a in range(3)])[axis, :, np.arange(axis.size)].T  # noqa: E731
        return pick(0), pick(1)

    def embed(self, tokens: np.ndarray, table=None) -> np.ndarray:
        """token ids [T] -> float32 [T, D]: only the rows used are dequantized (table: another embedding tensor of
        the same shape, the MTP block's own when it has one)."""
        from pymoe import quant

        t = self.token_embd if table is None else table
        if t.qtype == quant.QType.F32:
            return np.asarray(t.data, dtype=np.float32)[tokens]
        rows = t.rows()[tokens]  # [T, row_bytes], a copy
        fmt = quant.get_format(t.qtype)
        x = np.empty((rows.shape[0], rows.shape[1] // fmt.type_size * fmt.block_size), dtype=np.float32)  # [T, D]
        fmt.decode_block(rows.reshape(-1), x.reshape(-1))  # quant.dequantize's compiled twin, the same bits
        # (tests/test_dequant.py): ~1 us for a decode step's row where the NumPy form takes ~30
        return x

    def attention_block(self, layer: Layer, x: np.ndarray, kv, layer_i: int, rope=None) -> np.ndarray:
        """The layer's attention block on x [T, D] (attn-normed) -> [T, D]. kv: one sequence's cache (x: its next T
        tokens), or a list of N caches (x: N rows, row j the next token of sequence j: engine/batch.py); the block
        projects all rows at once and attends per sequence (engine/attention.py). rope: (cos, sin) of each row's
        position (kv.n .. kv.n + T - 1; with N caches each one's kv.n), computed once per forward call (None: here)."""
        kvs = kv if isinstance(kv, list) else list(kv) if isinstance(kv, tuple) else [kv]  # (a Seqs stays one)
        if rope is None:
            rope = self.rope_tables(self.positions(kvs, x.shape[0]))
        return ATTENTION[layer.plan.attention](self.attention_backend(layer.plan), layer, x, kvs, layer_i, rope)

    @staticmethod
    def positions(kvs: list, T: int) -> np.ndarray:
        """The positions of a block's T rows: kv.n .. kv.n + T - 1 for one cache, [kv_j.n] for N (one row each),
        kv_j.n .. kv_j.n + counts[j] - 1 for each of N (engine/kv.py `Seqs`)."""
        if len(kvs) == 1:
            return np.arange(kvs[0].n, kvs[0].n + T) + _delta(kvs[0])
        return np.concatenate([np.arange(kv.n, kv.n + rows.stop - rows.start) + _delta(kv)
                               for kv, rows in segments(kvs, T)])

    # --- the forward pass -------------------------------------------------------------------------------------
    def forward(self, tokens, kv: KVCache, phase: str, media=None, draw=None) -> np.ndarray:
        """tokens [T] appended at kv.n -> logits float32 [T, V]; advances kv.n by T. media: this call's slice of a
        prompt's images (engine/multimodal.PromptMedia): embedding rows that replace the image pad tokens' rows and
        each row's (t, h, w) M-RoPE position. draw: the sampler's random draw for a device step to make
        (`device_draw`)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        cfg = self.cfg
        if tokens.size == 0:
            raise PymoeError("empty prompt: nothing to run the model on")
        if kv.n + tokens.size > kv.n_ctx:
            raise PymoeError(f"context full: {kv.n} + {tokens.size} tokens exceed the context of {kv.n_ctx}")
        if tokens.min() < 0 or tokens.max() >= cfg.n_vocab:
            raise PymoeError(f"token id out of range 0..{cfg.n_vocab - 1}")
        self.backend.share_cpu()  # this call's threads: a fair share of a busy machine (backends/threads.py)
        if getattr(self.backend, "counts", None) is not None:  # a device backend's cost (backends/device_counts.py)
            self.backend.counts.forward(phase, tokens.size)
        step = self._device_step(tokens, kv, phase, media)
        if step:  # the token id goes to the device, and the step stays there until its token comes back
            table = getattr(self.cache, "step_table", None)  # SlotCache: its residency table (force_spill masks)
            tok = self.backend.begin_step(tokens, kv.n + _delta(kv), table() if table else None,
                                          inline=not self._misses_all_over_pcie(), row=kv.n, draw=draw)
            x = self.backend.embed(self.token_embd_dev, tok)  # [T, D] on the device (T > 1: a verify step)
        else:
            x = self.embed(tokens)  # [T, D]
        plus = self.backend.add if step else np.add  # the residual adds (on the device in a device step)
        norm = self.backend.rmsnorm
        if media is None:
            rope = self.rope_tables(np.arange(kv.n, kv.n + tokens.size) + _delta(kv))  # for all layers
        else:
            D = x.shape[1]  # image rows: the projector's output in place of the pad token's row; deepstack
            x[media.rows] = media.embeddings[:, :D]  # (qwen3vlmoe): one more D-wide part per deepstack layer
            rope = self.rope_tables(media.positions)  # [T, 3] -> for all layers
        self.last_experts = 0
        for i, layer in enumerate(self.layers):
            x = plus(x, self.attention_block(layer, norm(x, layer.attn_norm, cfg.rms_eps), kv, i, rope))
            h = norm(x, layer.ffn_norm, cfg.rms_eps)
            y, ids, w = FFN[layer.plan.ffn](layer, h, self.cache, self.backend_for(i), phase)
            x = plus(x, y)
            if media is not None and i < cfg.n_deepstack and media.rows.size:  # llama.cpp qwen3vlmoe.cpp
                x[media.rows] += media.embeddings[:, (i + 1) * x.shape[1]:(i + 2) * x.shape[1]]  # "deepstack_out"
            if self.lookahead is not None:  # experts/prefetch.Lookahead: score layer i's guess, guess the next
                if ids is not None:
                    self.lookahead.chosen(i, ids)
                self.lookahead.after_layer(i, x, phase)
            if self.count_experts and ids is not None and not step:  # (a step's: from its ids at its end)
                self.last_experts += np.unique(ids).size
            if self.trace is not None and ids is not None:  # a decode forward of several positions: speculation's
                self.trace.record(i, ids, w, "verify" if phase == "decode" and tokens.size > 1 else phase)
        if step:
            return self._end_device_step(x, kv, phase)
        if self.step_on_device and phase == "prefill" and self._misses_all_over_pcie():  # what the prompt placed in
            self.backend.sync_table(getattr(self.cache, "residency", None))  # slots: on the device before a step
        if self.step_on_device and phase == "prefill" and self.backend.owns(kv):  # a recurrent state the prompt
            self.backend.state_to_device(kv)  # left on the host (Gated DeltaNet): on the device before a step
        if self.trace is not None:
            self.trace.end_forward()
        kv.n += tokens.size
        if media is not None and media.next_position - kv.n != _delta(kv):  # the text after an image goes on
            kv.shifts.append((kv.n, int(media.next_position - kv.n)))  # from max(rows, cols) past its start
        x = norm(x, self.output_norm, cfg.rms_eps)
        tap = self.hidden_taps.get(id(kv))
        if tap is not None:  # an MTP drafter reads this sequence's normed last hidden states (engine/mtp.py)
            tap(kv.n - tokens.size, x)
        return self.backend.linear(self.output, x)  # [T, V]

    def _end_device_step(self, x, kv, phase: str):
        """The end of a device step: output norm, logits and greedy argmax (of each row) on the device; the token
        ids and the routing ids come back together; then the expert cache's lookups of this step, layer by layer in
        the order the host-side forward makes them (a verify step's: each layer's [T, K] ids at once, as version 2's
        verify forward looks them up), so every counter and promotion is the one version 2 makes (the experts were
        read where the residency table of the step's start said; promotions land before the next step)."""
        inline = self.backend.lookups_in_step
        x = self.backend.rmsnorm(x, self.output_norm, self.cfg.rms_eps)
        tap = self.hidden_taps.get(id(kv))  # an MTP drafter's: the normed rows x [T, D] come back in the same sync
        token, ids, logits = self.backend.end_step(self.backend.linear(self.output, x),  # [T, V] on the device
                                                   hidden=x if tap is not None else None)
        if tap is not None:
            tap(kv.n, logits.hidden)
        K = self.cfg.n_expert_used
        if self.count_experts:  # speculation's steps: the distinct experts each MoE layer read
            self.last_experts = sum(np.unique(row).size for row in ids)
        if not inline and phase == "decode":  # the step's lookups in one call (SlotCache: one compiled call)
            self.cache.lookup_step(list(self.cfg.moe_layers), np.stack([np.asarray(row).reshape(-1, K) for row in ids]))
        elif not inline:  # (inline: each layer's lookup was made inside the step, engine/moe.py)
            for m, layer in enumerate(self.cfg.moe_layers):
                self.cache.lookup(layer, ids[m].reshape(-1, K).astype(np.int64), phase)  # [T, K]
                self.cache.finish(layer)
        kv.n += len(logits)
        return logits

    def prefill(self, tokens, kv: KVCache, media=None) -> np.ndarray:
        """tokens [T] -> logits [T, V], in forward calls of at most `self.chunk` tokens (`--chunk`): the chunk is
        the unit of prefill's expert traffic (each expert missing from the cache is streamed once per chunk) and
        bounds the activation buffers. Each query's result does not depend on how the prompt is cut."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if hasattr(media, "at"):  # a whole prompt's PromptMedia: positions from where this cache stands
            media = media.at(kv)
        if tokens.size <= self.chunk:
            return self.forward(tokens, kv, "prefill", media)
        if kv.n + tokens.size > kv.n_ctx:  # checked for the whole prompt before any chunk fills the cache
            raise PymoeError(f"context full: {kv.n} + {tokens.size} tokens exceed the context of {kv.n_ctx}")
        return np.concatenate([self.forward(tokens[i:i + self.chunk], kv, "prefill",
                                            None if media is None else media.slice(i, i + self.chunk))
                               for i in range(0, tokens.size, self.chunk)])  # [T, V]

    def decode_one_token(self, token: int, kv: KVCache, draw=None) -> np.ndarray:
        return self.forward([token], kv, "decode", draw=draw)[0]

    def new_kv(self, n_ctx=None) -> KVCache:
        """A KV cache for a new sequence: the backend's own when it has one free (CUDA: in device memory, so that
        attention runs there), else a host one."""
        n_ctx = n_ctx or self.cfg.n_ctx_train
        if self.host_attention:  # some layers attend on the host: one host cache for all of them
            return KVCache(self.cfg, n_ctx)
        return self.backend.new_kv(n_ctx) or KVCache(self.cfg, n_ctx)
