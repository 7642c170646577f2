"""GGUF file -> `ModelConfig` + named tensor views into the memory map. Validation with one-line errors.

What this is: the only place pymoe opens a model file. It uses gguf-py's `GGUFReader` (the official reader, which
memory-maps the file; header.py keeps what it parsed of a big header for the next load of the same file), builds
the `ModelConfig` from metadata, checks every tensor the architecture needs (present, right shape, a type pymoe can
compute with, inside the file), and hands out views. Nothing is copied: expert
tensors stay in the page cache / mmap until a kernel reads them, which is what expert offloading is built on.
What this is not: the forward pass, or a tokenizer (tokenizer.py reads the `tokenizer.ggml.*` keys itself).

Two facts about GGUF that this module hides from the rest of pymoe:
  - GGUF stores shapes in GGML order (ne0 = the contiguous axis first); `Tensor.shape` here is NumPy order
    (rows last-but-one, contiguous columns last), e.g. attn_q is (n_head * head_dim, n_embd).
  - quantized tensors come back from GGUFReader as raw uint8 rows of blocks; floats as float32/float16 arrays.
    `Tensor.rows()` gives every type as `uint8 [rows, row_bytes]`, the form the quant kernels take.

Expert tensors are 3-D, `blk.N.ffn_{gate,up,down}_exps.weight` with shape (n_expert, rows, cols), expert index
slowest: one expert's bytes are one contiguous run in each of the three, and `GGUFModel.expert(layer, e)` returns
those three runs: the unit the expert cache moves around ("one slot"). The types of those runs can change from layer
to layer (llama.cpp's _M mixes: ffn_down Q4_K in some layers, Q6_K in others), so each layer has its own
`ExpertLayout` (`GGUFModel.expert_layout(layer)`) and a slot is sized for the largest (`GGUFModel.slot_bytes`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from pymoe import quant
from .config import REQUIRED, LayerPlan, ModelConfig
from .header import open_header
from pymoe.errors import PymoeError

EXPERT_PROJ = ("gate", "up", "down")


@dataclass(frozen=True)
class Tensor:
    name: str
    qtype: quant.QType
    shape: tuple  # NumPy order, e.g. (E, rows, cols) for experts, (rows, cols) for matrices, (n,) for vectors
    data: np.ndarray  # the view GGUFReader made into the memory map (no copy)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def rows(self) -> np.ndarray:
        """uint8 [rows, row_bytes] (for a 3-D tensor: [E * rows, row_bytes]); a view, not a copy."""
        raw = self.data.view(np.uint8)
        return raw.reshape(-1, raw.shape[-1])

    def floats(self) -> np.ndarray:
        """float32 copy in NumPy shape (reference dequantization): for small tensors (norms, router, biases)."""
        if self.qtype == quant.QType.F32:
            return np.array(self.data, dtype=np.float32).reshape(self.shape)
        return quant.dequantize(self.rows(), self.qtype).reshape(self.shape)


@dataclass(frozen=True)
class ExpertBytes:
    """One expert of one layer: its gate, up and down matrices as raw rows, views into the mmap."""

    layer: int
    expert: int
    gate: np.ndarray  # uint8 [n_ff_exp, row_bytes(n_embd)]
    up: np.ndarray  # uint8 [n_ff_exp, row_bytes(n_embd)]
    down: np.ndarray  # uint8 [n_embd, row_bytes(n_ff_exp)]
    # Where these bytes are, as the expert cache decided for this call: "host" (the mmap; no cache), "slot" (a slot
    # of the pool, index `slot`), or a miss path: "spill" / "cpu" (decode) or "staged" (prefill). See cache.py.
    where: str = "host"
    slot: int = -1

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes


@dataclass(frozen=True)
class ExpertLayout:
    """How one expert of one layer sits in a cache slot: gate | up | down, back to back, each exactly as stored in
    that layer's tensors. Layers of one file may differ (types, hence row bytes); a slot holds any of them."""

    types: dict  # proj -> quant.QType of the layer's ffn_{proj}_exps tensor
    parts: tuple  # ((proj, byte offset in the slot, (rows, row_bytes)), ...) in EXPERT_PROJ order

    @property
    def nbytes(self) -> int:
        """Bytes of one expert of this layer (the slot prefix it fills)."""
        proj, off, (rows, row_bytes) = self.parts[-1]
        return off + rows * row_bytes


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple]:
    """Every tensor the architecture needs, name -> NumPy-order shape, named exactly as llama.cpp names them.

    `output.weight` is listed only for untied models. Used by the loader to validate a file and by the tiny-model
    writer to create one, so the two can never disagree.
    """
    D, E, F = cfg.n_embd, cfg.n_expert, cfg.n_ff_exp
    q_dim, k_dim, v_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim, cfg.n_head_kv * cfg.head_dim_v
    o_dim = cfg.n_head * cfg.head_dim_v
    shapes = {"token_embd.weight": (cfg.n_vocab, D), "output_norm.weight": (D,)}
    if not cfg.tied_output:
        shapes["output.weight"] = (cfg.n_vocab, D)
    for plan in cfg.layer_plan():
        b = f"blk.{plan.index}."
        shapes[b + "attn_norm.weight"] = (D,)  # (the order of the tiny files' random draws: keep it)
        if plan.attention == "gdn":  # Gated DeltaNet (qwen3next): conv_dim = 2 key_dim + value_dim channels
            key_dim, value_dim = cfg.ssm_k_heads * cfg.ssm_state, cfg.ssm_inner
            shapes.update({
                b + "attn_qkv.weight": (2 * key_dim + value_dim, D),
                b + "attn_gate.weight": (value_dim, D),  # z, the output gate
                b + "ssm_conv1d.weight": (2 * key_dim + value_dim, cfg.ssm_conv),
                b + "ssm_dt.bias": (cfg.ssm_v_heads,),
                b + "ssm_a": (cfg.ssm_v_heads,),  # -exp(A_log), per v head
                **({b + "ssm_beta.weight": (cfg.ssm_v_heads, D), b + "ssm_alpha.weight": (cfg.ssm_v_heads, D)}
                   if cfg.traits.gdn_tiled else  # qwen35moe: two projections; qwen3next: one, grouped by q/k head
                   {b + "ssm_ba.weight": (2 * cfg.ssm_v_heads, D)}),
                b + "ssm_norm.weight": (cfg.ssm_inner // cfg.ssm_v_heads,),
                b + "ssm_out.weight": (D, value_dim),
            })
        elif plan.attention == "mla":  # DeepSeek: q (optionally through a low-rank q_a), the compressed kv_a, and
            H, C, R = cfg.n_head, cfg.kv_lora_rank, cfg.rope_dim  # the per-head k/v up-projections (absorbed)
            q_shapes = ({b + "attn_q_a.weight": (cfg.q_lora_rank, D), b + "attn_q_a_norm.weight": (cfg.q_lora_rank,),
                         b + "attn_q_b.weight": (H * cfg.head_dim_mla, cfg.q_lora_rank)} if cfg.q_lora_rank
                        else {b + "attn_q.weight": (H * cfg.head_dim_mla, D)})
            shapes.update({
                **q_shapes,
                b + "attn_kv_a_mqa.weight": (C + R, D),
                b + "attn_kv_a_norm.weight": (C,),
                b + "attn_k_b.weight": (H, C, cfg.head_dim_mla - R),  # ne {nope, C, H}
                b + "attn_v_b.weight": (H, cfg.head_dim_v_mla, C),  # ne {C, dv, H}
                b + "attn_output.weight": (D, H * cfg.head_dim_v_mla),
            })
        else:  # softmax attention; "gated" (qwen3next): attn_q holds a query and a gate per head
            shapes.update({
                b + "attn_q.weight": (q_dim * (2 if plan.attention == "gated" else 1), D),
                b + "attn_k.weight": (k_dim, D),
                b + "attn_v.weight": (v_dim, D),
                b + "attn_output.weight": (D, o_dim),
            })
        shapes[b + f"{cfg.traits.ffn_norm}.weight"] = (D,)
        if plan.ffn == "dense":
            shapes.update({b + "ffn_gate.weight": (cfg.n_ff, D), b + "ffn_up.weight": (cfg.n_ff, D),
                           b + "ffn_down.weight": (D, cfg.n_ff)})
        else:
            shapes.update({
                b + "ffn_gate_inp.weight": (E, D),  # the router
                b + "ffn_gate_exps.weight": (E, F, D),
                b + "ffn_up_exps.weight": (E, F, D),
                b + "ffn_down_exps.weight": (E, D, F),
            })
            if cfg.expert_bias:
                shapes[b + "exp_probs_b.bias"] = (E,)
            if cfg.traits.router_bias:
                shapes[b + "ffn_gate_inp.bias"] = (E,)
            if cfg.traits.expert_ffn == "swiglu_oai":  # gpt-oss: a bias per expert after each product
                shapes.update({b + "ffn_gate_exps.bias": (E, F), b + "ffn_up_exps.bias": (E, F),
                               b + "ffn_down_exps.bias": (E, D)})
        if cfg.traits.attn_out_bias:
            shapes[b + "attn_output.bias"] = (D,)
        if cfg.traits.attn_sinks:
            shapes[b + "attn_sinks.weight"] = (cfg.n_head,)
        if cfg.qkv_bias:
            shapes.update({b + "attn_q.bias": (q_dim,), b + "attn_k.bias": (k_dim,), b + "attn_v.bias": (v_dim,)})
        if cfg.qk_norm == "head" and plan.attention != "gdn":
            shapes.update({b + "attn_q_norm.weight": (cfg.head_dim,), b + "attn_k_norm.weight": (cfg.head_dim,)})
        elif cfg.qk_norm == "full":
            shapes.update({b + "attn_q_norm.weight": (q_dim,), b + "attn_k_norm.weight": (k_dim,)})
        if plan.ffn == "moe+shared":
            S = cfg.n_ff_shexp
            if cfg.traits.shared_gate:
                shapes[b + "ffn_gate_inp_shexp.weight"] = (D,)
            shapes.update({
                b + "ffn_gate_shexp.weight": (S, D),
                b + "ffn_up_shexp.weight": (S, D),
                b + "ffn_down_shexp.weight": (D, S),
            })
    return shapes


def expected_mtp_tensors(cfg: ModelConfig) -> dict[str, tuple]:
    """The NextN (MTP) block the converters append after the trunk (qwen3next: conversion/qwen.py _QwenMtpMixin;
    llama.cpp's load_block_mtp), name -> NumPy-order shape: a full-attention trunk block as layer n_layers, plus
    nextn.eh_proj [D, 2D] (the embedding and the last hidden state, concatenated, back to D), nextn.enorm,
    nextn.hnorm, nextn.shared_head_norm. (Optional, not listed: nextn.embed_tokens and nextn.shared_head_head, the
    block's own embedding and head; engine/mtp.py uses the trunk's when they are absent.)"""
    L, D = cfg.n_layers, cfg.n_embd
    bigger = replace(cfg, n_layers=L + 1, recurrent=tuple(cfg.recurrent) + (False,) if cfg.recurrent else ())
    b = f"blk.{L}."
    shapes = {name: shape for name, shape in expected_tensors(bigger).items() if name.startswith(b)}
    shapes.update({b + "nextn.eh_proj.weight": (D, 2 * D), b + "nextn.enorm.weight": (D,),
                   b + "nextn.hnorm.weight": (D,), b + "nextn.shared_head_norm.weight": (D,)})
    return shapes


# MTP companion files (`GGUFModel.attach_mtp`): metadata keys that may differ from the model's (the companion says
# "one more block, and it is an MTP block"; its name and file type are its own)
_COMPANION_OWN_KEYS = ("general.name", "general.file_type", "general.quantization_version", "general.type")


class GGUFModel:
    """An opened, validated GGUF MoE model: `.config`, `.tensors` (name -> Tensor), `.metadata(key)`, `.expert()`."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        _check_file(self.path)
        # gguf-py's parse of the header, or what it found last time for this very file (header.py)
        self.reader = open_header(self.path, _open_reader, _field_value)
        where = f"{self.path}: "
        self.tensors: dict[str, Tensor] = {}
        self._expert_views: dict[int, dict] = {}  # layer -> proj -> uint8 [E, rows, row_bytes] (see expert())
        self._experts: dict[tuple, ExpertBytes] = {}  # (layer, e) -> its ExpertBytes, made on first use
        for t in self.reader.tensors:
            self.tensors[t.name] = Tensor(t.name, t.tensor_type, tuple(int(n) for n in reversed(t.shape)), t.data)
        embd = self.tensors.get("token_embd.weight")
        if embd is None and any(".nextn." in n for n in self.tensors) and all(n.startswith("blk.") for n in
                                                                              self.tensors):
            raise PymoeError(f"{where}an MTP companion file (only an MTP block's tensors), not a model: pass the "
                             f"model, and this file as --spec mtp:{self.path}")
        if embd is None and self.metadata("general.architecture") == "clip":
            raise PymoeError(f"{where}an mmproj file (a multimodal model's vision tower), not a model: pass the "
                             f"model, and this file as --mmproj {self.path}")
        if embd is None:
            raise PymoeError(f"{where}missing tensor token_embd.weight")
        self.config = ModelConfig.from_gguf(self.metadata_getter(where), n_vocab=embd.shape[0],
                                            tied_output="output.weight" not in self.tensors, where=where)
        if self.config.traits.qk_norm_optional and "blk.0.attn_q_norm.weight" in self.tensors:
            self.config = replace(self.config, qk_norm="head")  # llama.cpp: optional tensors, used when present
        first_moe = self.config.n_dense_lead
        if self.config.traits.expert_bias_optional and f"blk.{first_moe}.exp_probs_b.bias" not in self.tensors:
            self.config = replace(self.config, expert_bias=False)
        self._validate_tensors(where)

    # --- metadata -------------------------------------------------------------------------------------------
    def metadata(self, key: str, default=None):
        """A metadata value as a Python scalar, str or list; `default` when absent."""
        # Strings are decoded by _field_value, not by gguf-py's contents() (which raises on bytes that are not
        # UTF-8): a broken byte becomes U+FFFD, as llama.cpp's tokenizer and template code would carry it along.
        value = self.reader.fields.get(key)
        if value is None:
            return default
        return list(value) if isinstance(value, list) else value  # the caller's own list (the header keeps its own)

    def metadata_getter(self, where: str):
        def get(key, default=REQUIRED):
            value = self.metadata(key, None)
            if value is None:
                if default is REQUIRED:
                    raise PymoeError(f"{where}missing metadata key {key}")
                return default
            return value
        return get

    # --- tensors --------------------------------------------------------------------------------------------
    def _validate_tensors(self, where: str) -> None:
        file_size = os.path.getsize(self.path)
        expected = expected_tensors(self.config)
        for name, shape in expected.items():
            t = self.tensors[name] = expected_tensor(self.tensors, name, shape, where)
            if t.qtype not in quant.FORMATS:
                raise PymoeError(f"{where}tensor {name} has type {t.qtype.name}, which pymoe does not support "
                                 f"(supported: {', '.join(q.name for q in quant.FORMATS)})")
        self._refuse_unknown_tensors(where, expected)  # after the missing ones: a renamed tensor is named missing
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > file_size:
                raise PymoeError(f"{where}truncated: tensor {t.name} ends at byte {t.data_offset + t.n_bytes} "
                                 f"but the file has {file_size} bytes")

    def _refuse_unknown_tensors(self, where: str, expected: dict) -> None:
        """Every tensor in the file must be one the metadata accounts for, as llama.cpp's loader demands ("wrong
        number of tensors"): a block beyond block_count, or a tensor under a name this architecture does not have
        (a renamed output.weight would otherwise leave the model silently on its tied embedding), is refused in one
        line. The NextN/MTP blocks after the trunk are checked where they are used (engine/mtp.py)."""
        cfg, arch = self.config, self.config.arch
        n_blocks = cfg.n_layers + cfg.n_nextn  # what {arch}.block_count says
        for name in self.tensors:
            if name in expected:
                continue
            parts = name.split(".")
            block = int(parts[1]) if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() else None
            if block is not None and cfg.n_layers <= block < n_blocks:
                continue  # an MTP block
            if block is not None and block >= n_blocks:
                raise PymoeError(f"{where}tensor {name} is in block {block}, but {arch}.block_count is {n_blocks} "
                                 f"(blocks 0..{n_blocks - 1}): the metadata and the tensors disagree")
            raise PymoeError(f"{where}tensor {name} is not one that this {arch} model has (by its metadata); "
                             "llama.cpp refuses such a file too (wrong number of tensors)")

    def tensor(self, name: str) -> Tensor:
        return self.tensors[name]

    @property
    def mtp_tensors(self) -> dict:
        """The NextN/MTP block(s) after the trunk (blk.n_layers and up): loaded with the file, not run by the
        forward pass; run by `--spec mtp` (engine/mtp.py, docs/speculative.md). Empty for a file without them."""
        first = self.config.n_layers
        return {n: t for n, t in self.tensors.items()
                if n.startswith("blk.") and int(n.split(".")[1]) >= first}

    def mtp_plan(self) -> Optional[LayerPlan]:
        """The plan of the first MTP block (layer n_layers), or None without one: a full-attention trunk block (the
        trunk's attention kind: "gated" for the hybrids, "mla" for DeepSeek) over the routed experts (and the shared
        expert where the trunk has one), run by engine/mtp.py as a speculative-decoding drafter."""
        cfg, L = self.config, self.config.n_layers
        if not cfg.n_nextn or f"blk.{L}.nextn.eh_proj.weight" not in self.tensors:
            return None
        attention = "mla" if cfg.traits.mla else "gated" if cfg.traits.hybrid else "gqa"
        return LayerPlan(L, attention, "moe+shared" if cfg.has_shared_expert else "moe", self.expert_layout(L))

    def attach_mtp(self, path: str | os.PathLike) -> None:
        """Take the MTP (nextn) block from a companion GGUF: `pymoe run --spec mtp:FILE`, or FILE = the model's path
        with .gguf -> .mtp.gguf when the model has no block of its own (engine/speculative.make_speculator).

        Why a second file: llama.cpp refuses a file with more tensors than its architecture loads ("wrong number of
        tensors"), and it loads MTP blocks only for qwen3next / qwen35moe / glm4moe / deepseek2; a head trained for
        another arch (the demo model's: pymoe/demo/train_mtp.py) would make the model file unloadable there. The
        companion is the model's metadata with block_count + 1 and nextn_predict_layers 1 (tokenizer included), and
        only the block's tensors, blk.{n_layers}.*. Refused in one line: another architecture, a hyperparameter or a
        vocabulary that differs, a missing, extra or misshapen tensor."""
        path = str(path)
        where = f"{path}: "
        cfg = self.config
        if cfg.n_nextn:
            raise PymoeError(f"{self.path}: has an MTP block of its own; --spec mtp uses it (no companion file)")
        r = _open_reader(path)
        field = lambda key: _field_value(r, key)  # noqa: E731
        arch = field("general.architecture")
        if arch != cfg.arch:
            raise PymoeError(f"{where}an MTP companion for arch {arch!r}, but {self.path} is {cfg.arch!r}")
        want = {f"{arch}.block_count": cfg.n_layers + 1, f"{arch}.nextn_predict_layers": 1}
        for key, value in want.items():
            if field(key) != value:
                raise PymoeError(f"{where}{key} is {field(key)}, but an MTP companion of {self.path} must have "
                                 f"{value}")
        for key in sorted(set(self.reader.fields) | set(r.fields)):
            if key.startswith("GGUF.") or key in want or key in _COMPANION_OWN_KEYS:
                continue
            if field(key) != self.metadata(key):
                raise PymoeError(f"{where}metadata {key} differs from {self.path}'s: the head was made for another "
                                 "model")
        shapes = expected_mtp_tensors(cfg)
        L = cfg.n_layers
        optional = {f"blk.{L}.nextn.embed_tokens.weight": (cfg.n_vocab, cfg.n_embd),
                    f"blk.{L}.nextn.shared_head_head.weight": (cfg.n_vocab, cfg.n_embd)}
        file_size = os.path.getsize(path)
        tensors = {}
        for t in r.tensors:
            shape = tuple(int(n) for n in reversed(t.shape))
            want_shape = shapes.get(t.name, optional.get(t.name))
            if want_shape is None:
                raise PymoeError(f"{where}tensor {t.name} is not part of an MTP block after layer {L - 1}")
            if not _fits(shape, want_shape):
                raise PymoeError(f"{where}tensor {t.name} has shape {list(shape)} but the model implies "
                                 f"{list(want_shape)} (NumPy order)")
            if t.tensor_type not in quant.FORMATS:
                raise PymoeError(f"{where}tensor {t.name} has type {t.tensor_type.name}, which pymoe does not "
                                 "support")
            if t.data_offset + t.n_bytes > file_size:
                raise PymoeError(f"{where}truncated: tensor {t.name} ends at byte {t.data_offset + t.n_bytes} "
                                 f"but the file has {file_size} bytes")
            tensors[t.name] = _squeezed(Tensor(t.name, t.tensor_type, shape, t.data), want_shape)
        for name in shapes:
            if name not in tensors:
                raise PymoeError(f"{where}missing tensor {name}")
        self.tensors.update(tensors)
        self.config = replace(cfg, n_nextn=1)
        self.mtp_path, self._mtp_reader = path, r  # the reader owns the memory map the tensors view

    def get(self, name: str) -> Optional[Tensor]:
        return self.tensors.get(name)

    def layer_tensor(self, layer: int, name: str) -> Tensor:
        """`layer_tensor(3, "attn_q.weight")` -> blk.3.attn_q.weight."""
        return self.tensors[f"blk.{layer}.{name}"]

    def expert(self, layer: int, e: int) -> ExpertBytes:
        """The raw bytes of expert `e` of `layer`: three contiguous row blocks, views into the mmap (no copy). Made
        once per (layer, expert) and kept (frozen, so shared safely): decode asks for K of them per layer and token,
        and making one costs ~5 us of interpreter. At most n_layers * n_expert small objects (a few hundred bytes
        each: ~10 MB for 48 layers of 512 experts)."""
        ex = self._experts.get((layer, e))
        if ex is None:
            ex = self._experts[(layer, e)] = ExpertBytes(
                layer, e, **{proj: raw[e] for proj, raw in self._expert_tensors(layer).items()})
        return ex

    def _expert_tensors(self, layer: int) -> dict:
        """proj -> uint8 [E, rows, row_bytes] of one layer, as plain ndarray views of the mmap, made once: slicing
        a plain view costs a fraction of slicing np.memmap, and this runs K times per layer per decoded token."""
        if layer not in self._expert_views:
            self._expert_views[layer] = {
                proj: np.asarray(self.layer_tensor(layer, f"ffn_{proj}_exps.weight").data).view(np.uint8)
                for proj in EXPERT_PROJ}
        return self._expert_views[layer]

    def expert_types(self, layer: int = 0) -> dict[str, quant.QType]:
        """proj -> qtype of the experts of `layer` (types may change from layer to layer)."""
        return {p: self.layer_tensor(layer, f"ffn_{p}_exps.weight").qtype for p in EXPERT_PROJ}

    def expert_layout(self, layer: int) -> ExpertLayout:
        """The byte layout of one expert of `layer` in a cache slot: its own types and row sizes."""
        parts, off = [], 0
        for proj, raw in self._expert_tensors(layer).items():
            shape = tuple(int(n) for n in raw.shape[1:])  # (rows, row_bytes) of one expert
            parts.append((proj, off, shape))
            off += shape[0] * shape[1]
        return ExpertLayout(self.expert_types(layer), tuple(parts))

    def layer_plan(self) -> list[LayerPlan]:
        """ModelConfig.layer_plan() with each MoE layer's expert layout (types and slot layout) from its tensors."""
        return [replace(p, experts=self.expert_layout(p.index) if p.ffn.startswith("moe") else None)
                for p in self.config.layer_plan()]

    def expert_layouts(self) -> list[Optional[ExpertLayout]]:
        """expert_layout(i) of every layer, in layer order; None for a layer without experts (a dense one)."""
        return [self.expert_layout(i) if self.config.is_moe_layer(i) else None for i in range(self.config.n_layers)]

    @property
    def slot_bytes(self) -> int:
        """Bytes of the largest single expert (gate + up + down) over all layers: the size of one cache slot."""
        return max(lay.nbytes for lay in self.expert_layouts() if lay is not None)

    @property
    def expert_bytes_total(self) -> int:
        return sum(self.layer_tensor(i, f"ffn_{p}_exps.weight").nbytes
                   for i in self.config.moe_layers for p in EXPERT_PROJ)


def expected_tensor(tensors: dict, name: str, shape: tuple, where: str) -> Tensor:
    """The tensor `name` of `tensors` as the metadata says it must be: present, of `shape` (NumPy order) or fitting it
    (`_fits`, then squeezed to it); else a one-line error naming the file (`where`) and the tensor. The model loader
    and the mmproj loader (vision/mmproj.py) check their tensors with it."""
    t = tensors.get(name)
    if t is None:
        raise PymoeError(f"{where}missing tensor {name}")
    if t.shape != shape:
        if not _fits(t.shape, shape):
            raise PymoeError(f"{where}tensor {name} has shape {list(t.shape)} but the metadata implies "
                             f"{list(shape)} (NumPy order)")
        t = _squeezed(t, shape)
    return t


def _fits(have: tuple, want: tuple) -> bool:
    """llama.cpp's rule (llama_model_loader::check_tensor_dims): a tensor fits the expected dimensions if they
    match and every dimension past them, in GGML order (ne[i] for i >= len(want)), is 1. convert_hf_to_gguf.py
    writes qwen2moe's ffn_gate_inp_shexp as ne [n_embd, 1]. In NumPy order the extra dimensions lead."""
    extra = len(have) - len(want)
    return extra >= 0 and tuple(have[extra:]) == tuple(want) and all(n == 1 for n in have[:extra])


def _squeezed(t: Tensor, shape: tuple) -> Tensor:
    """The tensor with its size-1 extra dimensions dropped: `shape`, and data of that rank (a view, no copy). The
    data's last axis stays what GGUFReader made it: elements for float types, bytes of a row for quantized ones."""
    data = t.data.reshape(tuple(shape[:-1]) + (t.data.shape[-1],))
    return Tensor(t.name, t.qtype, tuple(shape), data)


class UnknownTensorType(ValueError):
    """A tensor's GGML type id is not one gguf-py (with pymoe.quant.ggml_types) knows: no block size, no layout."""

    def __init__(self, type_id: int, tensor: str):
        super().__init__(f"unsupported tensor type {type_id} in {tensor}")


class CorruptHeader(ValueError):
    """A header value that cannot be right, found before the reader acts on it (the message says where)."""


GGML_MAX_DIMS = 4  # ggml.h: a tensor has at most 4 dimensions


class _Reader(GGUFReader):
    """GGUFReader that checks every size it reads against the file before it loops or allocates with it.

    gguf-py trusts the header: a read past the end of the file gives a short (or empty) view rather than an error,
    so an array length of 2**62 makes its per-element loop run ~forever on empty reads, and an unknown tensor type id
    surfaces as a bare ValueError with no tensor name. This subclass overrides the reader's own steps (it parses
    nothing itself) and raises `CorruptHeader` / `UnknownTensorType`, which `_open_reader` turns into one line:
      - `_get`: a read that runs past the end of the file is an error (the root of every "loop on empty reads");
      - `_get_field_parts`: an array's length times its smallest element must fit in the bytes left, and its
        element type must be one GGUF defines, before the loop over its elements;
      - `_build_fields` / `_build_tensor_info`: the key / tensor counts must fit in the bytes left;
      - `_get_tensor_info_field`: at most 4 dims, before the reader reads that many;
      - `_build_tensors`: per tensor, before any view is made: a known type id, no zero dim, an element count that
        is a whole number of blocks, data inside the file, aligned, and no two tensors overlapping (offsets are
        Python ints: no int64 overflow).
    The last complete metadata key is kept (`_after`) so an error says where in the header it happened.
    """

    _after = "the header"

    def _get(self, offset, dtype, count=1, override_order=None):
        """gguf-py's _get, bounds checked, on a plain ndarray view of the memory map: slicing np.memmap runs Python
        code per view (`__array_finalize__`), and a 151936-token vocabulary's header is ~1.4 M views (seconds of a
        load); the views are of the same bytes, read-only as the map."""
        count, itemsize = int(count), np.dtype(dtype).itemsize
        if count < 0 or offset + itemsize * count > len(self.data):
            raise CorruptHeader(f"{self._where(offset)}: a value runs past the end of the file")
        plain = self.__dict__.get("_plain")
        if plain is None or plain[1] is not self.data:
            plain = self._plain = (self.data.view(np.ndarray), self.data)
        arr = plain[0][offset:offset + itemsize * count].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _where(self, offset) -> str:
        return f"corrupt or truncated header at byte {offset} (after {self._after})"

    def _push_field(self, field, skip_sum=False):
        self._after = f"key {field.name}"
        return super()._push_field(field, skip_sum)

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type == GGUFValueType.ARRAY:
            item_type, length = int(self._get(orig_offs, np.uint32)[0]), int(self._get(orig_offs + 4, np.uint64)[0])
            if item_type not in _MIN_VALUE_BYTES:
                raise CorruptHeader(f"{self._where(orig_offs)}: array of unknown value type {item_type}")
            if item_type == GGUFValueType.ARRAY:  # gguf.cpp: "nested arrays are not supported"
                raise CorruptHeader(f"{self._where(orig_offs)}: an array of arrays (llama.cpp refuses them too)")
            if length * _MIN_VALUE_BYTES[item_type] > len(self.data) - orig_offs - 12:
                raise CorruptHeader(f"{self._where(orig_offs)}: an array of {length} values cannot fit in the file")
        elif raw_type not in _MIN_VALUE_BYTES:
            raise CorruptHeader(f"{self._where(orig_offs)}: unknown value type {int(raw_type)}")
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_fields(self, offs, count):
        if int(count) * 13 > len(self.data) - offs:  # key length 8 + value type 4 + at least 1 byte of value
            raise CorruptHeader(f"{self._where(offs)}: {int(count)} metadata keys cannot fit in the file")
        return super()._build_fields(offs, count)

    def _build_tensor_info(self, offs, count):
        if int(count) * 24 > len(self.data) - offs:  # name length 8 + n_dims 4 + type 4 + offset 8
            raise CorruptHeader(f"{self._where(offs)}: {int(count)} tensors cannot fit in the file")
        return super()._build_tensor_info(offs, count)

    def _get_tensor_info_field(self, orig_offs):
        n_dims = int(self._get(orig_offs + 8 + int(self._get(orig_offs, np.uint64)[0]), np.uint32)[0])
        if n_dims > GGML_MAX_DIMS:  # before the reader reads that many dims
            raise CorruptHeader(f"{self._where(orig_offs)}: a tensor with {n_dims} dimensions (GGUF allows "
                                f"{GGML_MAX_DIMS})")
        field = super()._get_tensor_info_field(orig_offs)
        self._after = f"the info of tensor {field.name}"
        return field

    def _build_tensors(self, start_offs, fields):
        known = {int(t) for t in GGML_QUANT_SIZES}
        spans = []  # (start, end, name) of each tensor's data
        for field in fields:  # parts: name length, name, n_dims, dims, type id, offset
            name = bytes(field.parts[1]).decode("utf-8", errors="replace")
            type_id = int(field.parts[4][0])
            if type_id not in known:
                raise UnknownTensorType(type_id, name)
            dims = [int(d) for d in field.parts[3]]
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
            n = int(np.prod(dims, dtype=object)) if dims else 1
            if any(d == 0 for d in dims) or dims[0] % block:
                raise CorruptHeader(f"tensor {name}: dimensions {dims} (a row of {dims[0] if dims else 0} values is "
                                    f"not a whole number of {block}-value blocks, or a dimension is 0)")
            start, end = start_offs + int(field.parts[5][0]), start_offs + int(field.parts[5][0]) + n // block * type_size
            if start % self.alignment:
                raise CorruptHeader(f"tensor {name}: data offset {start - start_offs} is not a multiple of the "
                                    f"alignment {self.alignment}")
            spans.append((start, end, name))
            if end > len(self.data):
                raise CorruptHeader(f"truncated: tensor {name} ends at byte {end} but the file has {len(self.data)} "
                                    "bytes")
        spans.sort()
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            if start < end:  # (llama.cpp's gguf.cpp is stricter: each tensor right after the previous one, padded)
                raise CorruptHeader(f"tensors {first} and {second} overlap (bytes {start}..{end})")
        return super()._build_tensors(start_offs, fields)


# Smallest encoded size of one value of each GGUF value type (a string: its 8-byte length; an array: type + length).
_MIN_VALUE_BYTES = {int(t): np.dtype(d).itemsize for t, d in GGUFReader.gguf_scalar_to_np.items()}
_MIN_VALUE_BYTES.update({int(GGUFValueType.STRING): 8, int(GGUFValueType.ARRAY): 12})


def _field_value(r: GGUFReader, key: str):
    """A metadata value of reader `r` as a Python scalar, str or list (strings decoded as GGUFModel.metadata
    decodes them), None when absent."""
    field = r.fields.get(key)
    if field is None:
        return None
    text = lambda part: bytes(part).decode("utf-8", errors="replace")  # noqa: E731
    if field.types and field.types[0] == GGUFValueType.ARRAY:
        if len(field.types) > 1 and field.types[1] == GGUFValueType.STRING:
            return [text(field.parts[i]) for i in field.data]
        return field.contents()
    if field.types and field.types[0] == GGUFValueType.STRING:
        return text(field.parts[-1])
    return field.contents()


def _check_file(path: str) -> None:
    """One-line errors for a path that is no GGUF file: missing, a folder, too short, the wrong magic."""
    if not os.path.exists(path):
        raise PymoeError(f"{path}: no such file")
    if os.path.isdir(path):
        raise PymoeError(f"{path}: is a directory, not a GGUF file")
    size = os.path.getsize(path)
    if size < 8:
        raise PymoeError(f"{path}: not a GGUF file (only {size} bytes)")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise PymoeError(f"{path}: not a GGUF file (bad magic)")


def _open_reader(path: str) -> GGUFReader:
    """GGUFReader with its failures turned into one-line errors naming the file."""
    _check_file(path)
    try:
        return _Reader(path, "r")
    except PermissionError:
        raise PymoeError(f"{path}: permission denied") from None
    except (UnknownTensorType, CorruptHeader) as e:
        raise PymoeError(f"{path}: {e}") from None
    except (ValueError, IndexError, KeyError, OverflowError, MemoryError, UnicodeDecodeError) as e:
        # A header that runs past the end of the file shows up as a short read, i.e. a reshape/index error.
        raise PymoeError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None


def load_gguf(path) -> GGUFModel:
    return GGUFModel(path)
