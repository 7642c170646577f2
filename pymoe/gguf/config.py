"""`ModelConfig`: everything the forward pass needs to know about a model, read only from GGUF metadata.

What this is: one frozen dataclass, built by `ModelConfig.from_gguf(fields)`, plus `ARCHS`, the table of what differs
between the supported MoE architectures (one row each; no `if arch == ...` scattered through the model code), and
the layer plan (`ModelConfig.layer_plan()`): per layer, which attention block and which feed-forward block run
there. The loader adds each MoE layer's expert layout (types and slot layout, from its tensors: gguf/loader.py).
What this is not: a reader of tensors (loader.py) or a place for defaults invented by pymoe: every number comes from
a metadata key written by llama.cpp's `convert_hf_to_gguf.py`, or from the arch default llama.cpp itself applies.

Metadata keys are `{arch}.<name>`, e.g. `qwen3moe.block_count`; `general.architecture` names the arch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Callable, Optional

import numpy as np

from pymoe.errors import PymoeError

# The most layers a file may declare. The largest MoE models have under 100; this bound only keeps a corrupt
# block_count (2**64 - 1 in a fuzzed file) from driving a loop that builds the layer plan before any tensor is checked.
MAX_LAYERS = 4096


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_number(v) -> bool:
    return _is_int(v) or isinstance(v, (float, np.floating))


def _short(value) -> str:
    """A metadata value for an error line: at most ~60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# What a metadata value must be, by kind: the test, and its words for the error line. One table for every reader of
# metadata (ModelConfig.from_gguf, engine/tokenizer.py): a fuzzed or broken file must never reach int() / float()
# with a string, an inf or a 2**64 (bench/fuzz_gguf.py).
KINDS = {
    "count": (lambda v: _is_int(v) and 0 <= v < 2**31, "an integer in 0..2^31-1"),  # products of two fit in int64
    "int": (_is_int, "an integer"),
    "real": (lambda v: _is_number(v) and math.isfinite(v), "a finite number"),
    "flag": (lambda v: isinstance(v, (bool, np.bool_)) or _is_int(v), "a boolean"),
    "text": (lambda v: isinstance(v, str), "a string"),
}


def checked(key: str, value, kind: str, item: Optional[str] = None, where: str = ""):
    """`value` when it is of `kind` (a KINDS name, or "list" of `item` values), else a one-line PymoeError naming
    the key: `m.gguf: qwen3moe.context_length = inf is not an integer in 0..2^31-1`."""
    if kind == "list":
        test, words = KINDS[item]
        ok, what = isinstance(value, list) and all(test(v) for v in value), f"a list, each item {words}"
    else:
        test, what = KINDS[kind]
        ok = test(value)
    if not ok:
        raise PymoeError(f"{where}{key} = {_short(value)} is not {what}")
    return value


@dataclass(frozen=True)
class ArchTraits:
    """What one architecture does differently. Mirrors the arch's branch in llama.cpp's llama-model.cpp."""

    rope_neox: bool  # NEOX rotates pairs (i, i + d/2); "normal" (llama) rotates adjacent pairs (2i, 2i + 1)
    qk_norm: Optional[str]  # None | "head" (RMSNorm over each head's d) | "full" (over the whole q / k projection)
    qkv_bias: bool  # attn_q/k/v carry a bias
    shared_expert: bool  # ffn_*_shexp tensors (a shared expert every token uses)
    norm_topk: bool  # renormalise the k routing weights to sum to 1 (default when no metadata key says otherwise)
    ff_key: str  # metadata key of one routed expert's hidden size
    shared_gate: bool = True  # the shared expert is scaled by sigmoid(x . ffn_gate_inp_shexp) (qwen2moe); else by 1
    gating: str = "softmax"  # router probabilities: "softmax" over the E logits, or "sigmoid" of each (llama.cpp's
    #                          expert_gating_func default for the arch; the metadata key overrides it; "": no
    #                          default, the file must have the key, dots1)
    expert_bias: bool = False  # exp_probs_b.bias: a per-expert bias added to the probabilities for the top-K choice
    #                            only (DeepSeek-V3 style "aux-loss-free" balancing); the weights stay unbiased
    ffn_norm: str = "ffn_norm"  # name of the pre-FFN RMSNorm tensor (GLM: post_attention_norm)
    qk_norm_optional: bool = False  # q/k norms (per head) when the file has them (GLM-4.5 355B yes, -Air no)
    expert_bias_optional: bool = False  # exp_probs_b only when the file has it (DeepSeek-V3 yes, V2 no)
    attn_out_bias: bool = False  # attn_output.bias (gpt-oss)
    attn_sinks: bool = False  # attn_sinks.weight: one learned logit per head that joins every softmax (gpt-oss)
    swa_pattern: int = 0  # sliding-window layers: layer i uses the window when i % n < n - 1 (gpt-oss: 2, the even
    #                       layers); 0: none. llama.cpp's set_swa_pattern; attention.sliding_window is the window
    router_bias: bool = False  # ffn_gate_inp.bias added to the router logits (gpt-oss)
    expert_ffn: str = "swiglu"  # "swiglu": down(silu(gate) * up); "swiglu_oai": gpt-oss's clamped variant with
    #                             per-expert biases (reference.swiglu_oai)
    hybrid: bool = False  # Gated DeltaNet layers ("gdn") between gated full-attention layers ("gated"), qwen3next
    gdn_tiled: bool = False  # qwen35moe: v head h reads q/k head h % n_k (the converter reorders V heads to
    #                          tiled order) and beta, alpha are two tensors (ssm_beta, ssm_alpha); qwen3next: h // r
    #                          (grouped) and one ssm_ba tensor, grouped by q/k head
    rope_sections: bool = False  # qwen35moe: rope.dimension_sections (interleaved multi-section RoPE, IMRoPE)
    mla: bool = False  # DeepSeek's multi-head latent attention ("mla" in the layer plan, engine/mla.py)


ARCHS: dict[str, ArchTraits] = {
    # Qwen3-MoE: q/k RMSNorm per head, head_dim from attention.key_length (need not be n_embd / n_head).
    "qwen3moe": ArchTraits(rope_neox=True, qk_norm="head", qkv_bias=False, shared_expert=False, norm_topk=True,
                           ff_key="expert_feed_forward_length"),
    # Qwen1.5/2-MoE: q/k/v biases, a shared expert gated by sigmoid(x · ffn_gate_inp_shexp), no renormalisation.
    "qwen2moe": ArchTraits(rope_neox=True, qk_norm=None, qkv_bias=True, shared_expert=True, norm_topk=False,
                           ff_key="expert_feed_forward_length"),
    # Mixtral is stored as arch "llama" with experts; llama.cpp's converter permuted Q/K for normal (non-NEOX) RoPE.
    "llama": ArchTraits(rope_neox=False, qk_norm=None, qkv_bias=False, shared_expert=False, norm_topk=True,
                        ff_key="feed_forward_length"),
    # OLMoE: q/k RMSNorm over the whole projection (not per head), no renormalisation of routing weights.
    "olmoe": ArchTraits(rope_neox=True, qk_norm="full", qkv_bias=False, shared_expert=False, norm_topk=False,
                        ff_key="feed_forward_length"),
    # GLM-4.5 / 4.5-Air: leading dense layers (leading_dense_block_count), then sigmoid routing with a selection
    # bias, weights renormalised and scaled (expert_weights_scale), an ungated shared expert; q/k/v biases, partial
    # NEOX RoPE (rope.dimension_count = half the head), the pre-FFN norm named post_attention_norm; NextN (MTP)
    # layers at the end of block_count, which the trunk does not run (llama.cpp: n_layer = block_count - nextn).
    "glm4moe": ArchTraits(rope_neox=True, qk_norm=None, qkv_bias=True, shared_expert=True, norm_topk=True,
                          ff_key="expert_feed_forward_length", shared_gate=False, gating="sigmoid", expert_bias=True,
                          ffn_norm="post_attention_norm", qk_norm_optional=True),
    # gpt-oss: attention with q/k/v/output biases and per-head sinks, every other layer a 128-token sliding window,
    # YaRN RoPE (factor 32 over 4096 positions); the router has a bias, picks the top K logits and softmaxes only
    # those ("softmax_weight"); the experts have biases and the clamped SwiGLU of OpenAI (alpha 1.702, limit 7).
    "gpt-oss": ArchTraits(rope_neox=True, qk_norm=None, qkv_bias=True, shared_expert=False, norm_topk=False,
                          ff_key="expert_feed_forward_length", gating="softmax_weight",
                          ffn_norm="post_attention_norm", attn_out_bias=True, attn_sinks=True, swa_pattern=2,
                          router_bias=True, expert_ffn="swiglu_oai"),
}
# Qwen3-Next (the reference article's family): 3 of every 4 layers are Gated DeltaNet (linear attention with a
# recurrent state: attn_qkv -> short causal conv -> L2-normed q, k -> the gated delta rule -> gated RMSNorm ->
# ssm_out), the 4th full attention with an output gate (attn_q is twice as wide: query and gate per head), per-head
# q/k norms, partial NEOX RoPE (a quarter of the head); 512 experts top-10 renormalised, a sigmoid-gated shared
# expert. The converter writes norm weights as 1 + w (Qwen3-Next's RMSNorm is zero-centred), A as -exp(A_log).
ARCHS["qwen3next"] = ArchTraits(rope_neox=True, qk_norm="head", qkv_bias=False, shared_expert=True,
                                norm_topk=True, ff_key="expert_feed_forward_length",
                                ffn_norm="post_attention_norm", hybrid=True)
# DeepSeek-V2/V3 (and GLM-4.7-Flash, Kimi-K2 style files): MLA attention over a compressed KV (one KV "head" of
# kv_lora_rank + rope dims, values kv_lora_rank wide, the per-head up-projections attn_k_b / attn_v_b absorbed into
# q and the output), normal-style RoPE on the rope part only, YaRN with DeepSeek's mscale; leading dense layers,
# softmax (V2) or sigmoid + selection bias (V3) routing, optionally limited to the best expert groups; an ungated
# shared expert.
ARCHS["deepseek2"] = ArchTraits(rope_neox=False, qk_norm=None, qkv_bias=False, shared_expert=True, norm_topk=False,
                                ff_key="expert_feed_forward_length", shared_gate=False, expert_bias=True, mla=True,
                                expert_bias_optional=True)
# Qwen3.5-MoE: Qwen3-Next's layers, with the V heads of Gated DeltaNet in tiled order, beta and alpha as two
# projections, and IMRoPE (for text every section sees the same position: plain NEOX RoPE when the sections cover
# every rotated pair, which the converter's default [11, 11, 10, 0] does).
ARCHS["qwen35moe"] = replace(ARCHS["qwen3next"], gdn_tiled=True, rope_sections=True)
# dots.llm1 (rednote, llama.cpp's dots1.cpp): Qwen3's attention (per-head q/k RMSNorm before NEOX RoPE over the whole
# head, no biases, attention.key_length need not be n_embd / n_head), DeepSeek-V3's MoE: leading dense layers, sigmoid
# routing with a selection bias (exp_probs_b, optional in llama.cpp) and optional expert groups, weights renormalised
# where expert_weights_norm says and scaled by expert_weights_scale, an ungated shared expert expert_shared_count x
# n_ff_exp wide (there is no expert_shared_feed_forward_length key). llama.cpp has no default gating for dots1 (a file
# without expert_gating_func aborts in build_moe_ffn), so the key is required: gating "" below.
ARCHS["dots1"] = ArchTraits(rope_neox=True, qk_norm="head", qkv_bias=False, shared_expert=True, norm_topk=False,
                            ff_key="expert_feed_forward_length", shared_gate=False, gating="", expert_bias=True,
                            expert_bias_optional=True)
# Qwen3-VL-MoE's language model (Qwen3-VL-30B-A3B, 235B-A22B): qwen3moe's layers with IMRoPE
# (rope.dimension_sections, [24, 20, 20] over 64 pairs) and n_deepstack_layers: an image's rows carry, beside their
# input embedding, one more embedding per deepstack layer, added to the hidden state after layers 0 .. n - 1
# (llama.cpp src/models/qwen3vlmoe.cpp; transformers Qwen3VLMoeTextModel._deepstack_process).
ARCHS["qwen3vlmoe"] = replace(ARCHS["qwen3moe"], rope_sections=True)
GATING_FUNCS = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}  # {arch}.expert_gating_func: llama.cpp's
#                                                                     llama_expert_gating_func_type


@dataclass(frozen=True)
class LayerPlan:
    """What one layer is. The forward pass (engine/model.py) runs the block each kind names; nothing assumes that
    layer 0 speaks for the others.

    attention: "gqa": softmax attention with RoPE over a KV cache (grouped-query; q/k norms and q/k/v biases as
               the arch says; a sliding window where `window` says); "gated": the same with a sigmoid output gate
               (qwen3next's full-attention layers); "gdn": Gated DeltaNet, linear attention with a recurrent state
               (qwen3next, engine/deltanet.py); "mla": multi-head latent attention over a compressed KV cache
               (DeepSeek, engine/mla.py).
    ffn:       "moe": routed experts; "moe+shared": routed experts plus a shared expert (sigmoid-gated: qwen2moe;
               ungated: GLM); "dense": a SwiGLU MLP, ffn_gate/ffn_up/ffn_down (GLM's and DeepSeek's leading
               layers).
    experts:   the MoE layer's expert layout (gguf/loader.ExpertLayout: types, byte layout in a slot), filled in by
               the loader from the tensors; None in the metadata-only plan and for layers without experts."""

    index: int
    attention: str
    ffn: str
    experts: Optional[object] = None
    window: int = 0  # sliding-window attention: a query sees the last `window` positions (0: all of them)


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    name: str
    n_layers: int  # {arch}.block_count
    n_embd: int  # {arch}.embedding_length: D, the residual width
    n_vocab: int  # rows of token_embd (or {arch}.vocab_size)
    n_ctx_train: int  # {arch}.context_length
    n_head: int  # {arch}.attention.head_count
    n_head_kv: int  # {arch}.attention.head_count_kv (GQA: n_head % n_head_kv == 0)
    head_dim: int  # {arch}.attention.key_length, default n_embd // n_head
    head_dim_v: int  # {arch}.attention.value_length, default head_dim
    n_expert: int  # {arch}.expert_count: E
    n_expert_used: int  # {arch}.expert_used_count: K
    n_ff_exp: int  # one routed expert's hidden size
    n_ff_shexp: int  # the shared expert's hidden size (0: none)
    rms_eps: float  # {arch}.attention.layer_norm_rms_epsilon
    rope_freq_base: float  # {arch}.rope.freq_base, default 10000
    rope_dim: int  # {arch}.rope.dimension_count, default head_dim
    rope_neox: bool
    qk_norm: Optional[str]
    qkv_bias: bool
    norm_topk: bool  # {arch}.expert_weights_norm when present, else the arch default
    tied_output: bool  # no output.weight: the output head reuses token_embd
    gating: str = "softmax"  # {arch}.expert_gating_func (1 softmax, 2 sigmoid), else the arch default
    expert_bias: bool = False  # the MoE layers have exp_probs_b (traits.expert_bias; unless the file lacks an
    #                            optional one: gguf/loader.GGUFModel)
    expert_weights_scale: float = 1.0  # {arch}.expert_weights_scale: routing weights are multiplied by it
    n_dense_lead: int = 0  # {arch}.leading_dense_block_count: the first layers are dense MLPs
    n_ff: int = 0  # {arch}.feed_forward_length: the dense layers' hidden size (0: no dense layer)
    n_nextn: int = 0  # {arch}.nextn_predict_layers: MTP blocks after the trunk (not run by the forward pass)
    n_swa: int = 0  # {arch}.attention.sliding_window: positions a sliding-window layer sees (its own included)
    rope_scaling: str = "none"  # {arch}.rope.scaling.type: none | linear | yarn
    rope_scale: float = 1.0  # {arch}.rope.scaling.factor (positions are divided by it: freq_scale = 1 / factor)
    rope_ctx_orig: int = 0  # {arch}.rope.scaling.original_context_length (YaRN), default context_length
    # Gated DeltaNet (qwen3next), llama.cpp's names: ssm.conv_kernel, ssm.state_size (head size of q and k),
    # ssm.group_count (q/k heads), ssm.time_step_rank (v heads), ssm.inner_size (v heads x v head size)
    ssm_conv: int = 0
    ssm_state: int = 0
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    ssm_inner: int = 0
    rope_sections: tuple = ()  # {arch}.rope.dimension_sections (t, h, w, e) where the arch has IMRoPE (qwen35moe,
    #                            qwen3vlmoe)
    n_deepstack: int = 0  # {arch}.n_deepstack_layers (qwen3vlmoe): image rows add one embedding after each of the
    #                       first n layers (engine/model.Model.forward)
    recurrent: tuple = ()  # per layer: True where the layer is Gated DeltaNet ({arch}.attention.recurrent_layers,
    #                        else every layer but each full_attention_interval-th)
    # MLA (deepseek2): attention.q_lora_rank (0: one q projection), attention.kv_lora_rank, the uncompressed head
    # sizes attention.key_length_mla (nope + rope) and value_length_mla; head_dim / head_dim_v above are those of
    # the compressed cache (kv_lora_rank + rope, kv_lora_rank), n_head_kv is 1
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    head_dim_mla: int = 0
    head_dim_v_mla: int = 0
    yarn_log_mul: float = 0.0  # rope.scaling.yarn_log_multiplier / 0.1 (the converter stores 0.1 mscale_all_dim)
    n_expert_groups: int = 0  # expert_group_count: experts in groups, the top K chosen from the best groups only
    n_group_used: int = 0  # expert_group_used_count

    @property
    def traits(self) -> ArchTraits:
        return ARCHS[self.arch]

    @property
    def has_shared_expert(self) -> bool:
        return self.n_ff_shexp > 0

    def layer_plan(self) -> tuple[LayerPlan, ...]:
        """The per-layer plan from the metadata alone: GQA attention everywhere; the first n_dense_lead layers a
        dense MLP, the others an MoE block (with the shared expert where the arch has one)."""
        moe = "moe+shared" if self.has_shared_expert else "moe"
        n = self.traits.swa_pattern

        def attention(i):
            if self.traits.mla:
                return "mla"
            if self.traits.hybrid:
                return "gdn" if self.recurrent[i] else "gated"
            return "gqa"
        return tuple(LayerPlan(i, attention(i), "dense" if i < self.n_dense_lead else moe,
                               window=self.n_swa if n and i % n < n - 1 else 0) for i in range(self.n_layers))

    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep keys and values per position (Gated DeltaNet layers keep a fixed-size state
        instead): engine/kv.KVCache holds rows for these only."""
        return tuple(p.index for p in self.layer_plan() if p.attention != "gdn")

    @property
    def kv_v_width(self) -> int:
        """Values per KV head the cache stores for V: head_dim_v, or 0 for MLA, whose V is the first kv_lora_rank
        values of its K row ([c | k_pe]), read from there as llama.cpp does."""
        return 0 if self.traits.mla else self.head_dim_v

    def kv_values_per_token(self) -> int:
        """K and V values one token adds to the cache over all layers (MLA: the compressed row only)."""
        return len(self.kv_layers()) * self.n_head_kv * (self.head_dim + self.kv_v_width)

    @property
    def has_recurrent_state(self) -> bool:
        """A layer keeps state that cannot be cut back to an earlier position (no prefix reuse from the middle)."""
        return any(self.recurrent)

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.n_dense_lead

    @property
    def moe_layers(self) -> range:
        return range(self.n_dense_lead, self.n_layers)

    def describe(self) -> list[tuple[str, object]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def from_gguf(cls, get: Callable[[str, object], object], n_vocab: int, tied_output: bool, where: str = "") -> "ModelConfig":
        """Build from metadata. `get(key, default)` returns a field's value; `default=REQUIRED` makes it mandatory
        (the getter raises a PymoeError naming the key). `where` prefixes error messages (the file name)."""
        arch = get("general.architecture", REQUIRED)
        if not isinstance(arch, str) or arch not in ARCHS:
            raise PymoeError(f"{where}unsupported architecture {_short(arch)} (pymoe runs {', '.join(ARCHS)})")
        t = ARCHS[arch]

        def key(name, default=REQUIRED):
            return get(f"{arch}.{name}", default)

        def typed(name, default, kind, item=None):  # a value of the wrong type or range: one line naming the key
            value = key(name, default)
            if value is default and default is not REQUIRED:
                return value  # pymoe's own default (or None): trusted
            return checked(f"{arch}.{name}", value, kind, item, where)

        def count(name, default=REQUIRED):
            return int(typed(name, default, "count"))

        def real(name, default=REQUIRED):
            return float(typed(name, default, "real"))

        def flag(name, default=REQUIRED):
            return bool(typed(name, default, "flag"))

        def text(name, default=REQUIRED):
            return typed(name, default, "text")

        def counts(name, default=REQUIRED):  # (a list's length is bounded by the file: loader._Reader)
            return typed(name, default, "list", "count")

        def flags(name, default=REQUIRED):
            return typed(name, default, "list", "flag")

        n_embd, n_head = count("embedding_length"), count("attention.head_count")
        if n_head == 0:
            raise PymoeError(f"{where}{arch}.attention.head_count must be > 0")
        if count("block_count") > MAX_LAYERS:
            raise PymoeError(f"{where}{arch}.block_count = {count('block_count')} is more than {MAX_LAYERS} layers")
        n_expert = count("expert_count", 0)
        if n_expert == 0:
            raise PymoeError(f"{where}'{arch}' model has no experts ({arch}.expert_count is absent or 0): "
                             "pymoe runs Mixture-of-Experts models only")
        head_dim = count("attention.key_length", n_embd // n_head)
        n_ff_exp = count(t.ff_key)
        n_nextn = count("nextn_predict_layers", 0)
        gating_id = key("expert_gating_func", None if t.gating else REQUIRED)
        if gating_id is not None and (not _is_int(gating_id) or int(gating_id) not in GATING_FUNCS):
            raise PymoeError(f"{where}{arch}.expert_gating_func = {gating_id} is not supported "
                             f"(pymoe: {', '.join(f'{k} {v}' for k, v in GATING_FUNCS.items())})")
        shexp_default = n_ff_exp * count("expert_shared_count", 1)  # llama.cpp: n_ff_exp * n_expert_shared
        n_dense_lead = count("leading_dense_block_count", 0)
        mrope = {}
        if t.rope_sections:
            sections = (list(counts("rope.dimension_sections")) + [0] * 4)[:4]  # t, h, w, e
            # ggml's IMRoPE: pair i is in sector i % sum(sections); sectors 3j + s (s = 0, 1, 2) below 3 sections[s]
            # rotate by the t, h, w position, the others (Qwen3-VL's [24, 20, 20]: sector 61 of 64) by the t
            # position as transformers' apply_interleaved_mrope leaves them (engine/model.imrope_axes)
            if sum(sections[:3]) <= 0:
                raise PymoeError(f"{where}{arch}.rope.dimension_sections {sections} has no t, h or w section")
            mrope = dict(rope_sections=tuple(sections), n_deepstack=count("n_deepstack_layers", 0))
        hybrid = {}
        if t.hybrid:
            n_all = count("block_count")
            recurrent = flags("attention.recurrent_layers", None)
            if recurrent is None:
                interval = count("full_attention_interval", 4)
                if interval == 0:
                    raise PymoeError(f"{where}{arch}.full_attention_interval must be > 0")
                recurrent = [(i + 1) % interval != 0 for i in range(n_all)]
            hybrid = dict(ssm_conv=count("ssm.conv_kernel"), ssm_state=count("ssm.state_size"),
                          ssm_k_heads=count("ssm.group_count"), ssm_v_heads=count("ssm.time_step_rank"),
                          ssm_inner=count("ssm.inner_size"),
                          recurrent=tuple(bool(r) for r in recurrent)[:n_all - n_nextn])
        mla = {}
        if t.mla:
            mla = dict(q_lora_rank=count("attention.q_lora_rank", 0), kv_lora_rank=count("attention.kv_lora_rank"),
                       head_dim_mla=count("attention.key_length_mla"),
                       head_dim_v_mla=count("attention.value_length_mla"),
                       yarn_log_mul=real("rope.scaling.yarn_log_multiplier", 0.0) / 0.1)
        cfg = cls(
            **hybrid, **mla, **mrope,
            n_expert_groups=count("expert_group_count", 0), n_group_used=count("expert_group_used_count", 0),
            arch=arch,
            name=str(get("general.name", "") or ""),
            n_layers=count("block_count") - n_nextn,
            n_embd=n_embd,
            n_vocab=count("vocab_size", n_vocab),
            n_ctx_train=count("context_length"),
            n_head=n_head,
            n_head_kv=count("attention.head_count_kv", n_head),
            head_dim=head_dim,
            head_dim_v=count("attention.value_length", head_dim),
            n_expert=n_expert,
            n_expert_used=count("expert_used_count"),
            n_ff_exp=n_ff_exp,
            n_ff_shexp=count("expert_shared_feed_forward_length", shexp_default) if t.shared_expert else 0,
            rms_eps=real("attention.layer_norm_rms_epsilon"),
            rope_freq_base=real("rope.freq_base", 10000.0),
            rope_dim=count("rope.dimension_count", head_dim),
            rope_neox=t.rope_neox,
            qk_norm=t.qk_norm,
            qkv_bias=t.qkv_bias,
            norm_topk=flag("expert_weights_norm", t.norm_topk),
            tied_output=tied_output,
            gating=GATING_FUNCS[int(gating_id)] if gating_id is not None else t.gating,
            expert_weights_scale=real("expert_weights_scale", 1.0),
            expert_bias=t.expert_bias,
            n_dense_lead=n_dense_lead,
            n_ff=count("feed_forward_length", 0) if n_dense_lead else 0,  # only dense layers use it
            n_nextn=n_nextn,
            n_swa=count("attention.sliding_window", 0) if t.swa_pattern else 0,
            rope_scaling=text("rope.scaling.type", "none"),
            rope_scale=real("rope.scaling.factor", 1.0) or 1.0,
            rope_ctx_orig=count("rope.scaling.original_context_length", count("context_length"))
            if text("rope.scaling.type", "none") == "yarn" else 0,  # only YaRN reads it
        )
        cfg.validate(where)
        return cfg

    def validate(self, where: str = "") -> None:
        """Relations the forward pass relies on; a file that breaks one gets a one-line error, not a wrong answer."""
        a = self.arch
        checks = [
            (self.n_layers > 0, f"{a}.block_count must be > the {self.n_nextn} MTP layers"),
            (self.n_embd > 0 and self.head_dim > 0, f"{a}.embedding_length and attention.key_length must be > 0"),
            (self.n_ctx_train > 0, f"{a}.context_length must be > 0"),
            (self.rms_eps > 0 and self.rope_freq_base > 0 and self.rope_scale > 0,
             f"{a}: layer_norm_rms_epsilon ({self.rms_eps}), rope.freq_base ({self.rope_freq_base}) and "
             f"rope.scaling.factor ({self.rope_scale}) must be > 0"),
            (self.n_head > 0 and self.n_head_kv > 0, f"{a}.attention.head_count(_kv) must be > 0"),
            (self.n_deepstack <= self.n_layers,
             f"{a}.n_deepstack_layers ({self.n_deepstack}) is more than the {self.n_layers} layers"),
            (self.n_head_kv > 0 and self.n_head % self.n_head_kv == 0,
             f"{a}.attention.head_count ({self.n_head}) is not a multiple of head_count_kv ({self.n_head_kv})"),
            (0 < self.n_expert_used <= self.n_expert,
             f"{a}.expert_used_count ({self.n_expert_used}) must be in 1..expert_count ({self.n_expert})"),
            (self.n_ff_exp > 0, f"{a}.{self.traits.ff_key} must be > 0"),
            (0 < self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0,
             f"{a}.rope.dimension_count ({self.rope_dim}) must be even and <= the head size ({self.head_dim})"),
            (self.n_vocab > 0, "the vocabulary is empty"),
            (0 <= self.n_dense_lead < self.n_layers,
             f"{a}.leading_dense_block_count ({self.n_dense_lead}) leaves no MoE layer of {self.n_layers}"),
            (self.n_dense_lead == 0 or self.n_ff > 0, f"{a}.feed_forward_length must be > 0 for the dense layers"),
            (self.rope_scaling in ("none", "linear", "yarn"),
             f"{a}.rope.scaling.type '{self.rope_scaling}' is not supported (none, linear, yarn)"),
            (not self.traits.swa_pattern or self.n_swa > 0, f"{a}.attention.sliding_window must be > 0"),
            (self.n_expert_groups <= 1 or (self.n_expert % self.n_expert_groups == 0
                                           and 0 < self.n_group_used <= self.n_expert_groups),
             f"{a}.expert_group_count ({self.n_expert_groups}) / expert_group_used_count ({self.n_group_used}) do "
             f"not fit {self.n_expert} experts"),
            (not self.traits.mla or (self.n_head_kv == 1 and self.head_dim == self.kv_lora_rank + self.rope_dim
                                     and self.head_dim_v == self.kv_lora_rank
                                     and self.rope_dim < self.head_dim_mla),
             f"{a}: the MLA shapes do not fit (key_length {self.head_dim} must be kv_lora_rank {self.kv_lora_rank} + "
             f"rope {self.rope_dim}, value_length {self.head_dim_v} = kv_lora_rank, head_count_kv 1)"),
            (not self.traits.hybrid or (len(self.recurrent) == self.n_layers and self.ssm_k_heads > 0
                                        and self.ssm_v_heads > 0 and self.ssm_conv > 0 and self.ssm_state > 0
                                        and self.ssm_v_heads % self.ssm_k_heads == 0
                                        and self.ssm_inner % self.ssm_v_heads == 0),
             f"{a}: the Gated DeltaNet shapes do not fit (ssm.group_count {self.ssm_k_heads}, ssm.time_step_rank "
             f"{self.ssm_v_heads}, ssm.inner_size {self.ssm_inner}, {len(self.recurrent)} recurrent-layer flags for "
             f"{self.n_layers} layers)"),
        ]
        for ok, what in checks:
            if not ok:
                raise PymoeError(f"{where}{what}")


class _Required:
    def __repr__(self):
        return "REQUIRED"


REQUIRED = _Required()
