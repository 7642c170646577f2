"""Write small random-weight MoE GGUF files of every supported architecture (tests, benchmarks, teaching).

What this is: `write_model(path, arch, preset, quant)` builds a `ModelConfig`, makes random weights shaped by
`loader.expected_tensors` (the very table the loader validates against), quantizes them with pymoe's own quantizers
and writes them with gguf-py's `GGUFWriter`, together with a small byte-level BPE tokenizer trained on the fly with
`tokenizers`, and a ChatML chat template. llama.cpp loads every file written here (tests/test_tinymodel.py).
What this is not: a trained model. The weights are noise with two deliberate structures:
  - every token embedding shares one common direction `m`, and each router row carries `m` scaled by a
    per-expert "popularity", so routing is skewed (some experts are chosen far more often), as in real MoEs;
  - weights are scaled 1/sqrt(fan_in) so activations stay O(1) through the layers and logits are well spread.

Quant mixes:
  - "f32": every tensor F32.
  - "q2_k": llama.cpp's `Q2_K` file type mix: Q2_K gate/up experts (and attn_q/k, attn_output's siblings,
    token_embd), Q3_K down experts and attn_output, Q4_K attn_v, Q6_K output, F32 norms, router and biases.
    A matrix whose rows are not a multiple of 256 values falls back to Q4_0 (llama.cpp falls back too).
  - "q2_0": llama.cpp's `Q2_0` file type (LLAMA_FTYPE_MOSTLY_Q2_0, what `llama_model_quantize` writes from an F32
    file, pinned by tests/test_q2_0_model.py): Q2_0 experts and every other matrix (attn_q/k/v/output, the shared
    expert), except Q6_K output (token_embd too when the output is tied to it), Q4_K token_embd, Q8_0 attn_k and
    attn_v in models of exactly 8 experts (llama.cpp's rule, true of the tiny preset), F32 norms, router and biases.
    Rows that are not whole blocks take llama.cpp's fallback (Q2_0 -> Q4_0, Q4_K -> Q5_0, Q6_K -> Q8_0), then F32
    where llama.cpp would take F16 (no preset has such rows).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
from gguf import ExpertGatingFuncType, GGUFWriter, LlamaFileType, RopeScalingType, TokenType

from pymoe import quant
from pymoe.quant.ggml_types import LLAMA_FTYPE_MOSTLY_Q2_0
from pymoe.gguf.config import ARCHS, ModelConfig
from pymoe.gguf.loader import expected_mtp_tensors, expected_tensors

Q = quant.QType

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|endoftext|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A few kilobytes of mixed text the tiny tokenizer is trained on: prose, code, digits, whitespace, non-Latin
# scripts and emoji, so that the tokenizer tests have multi-byte merges to get right.
TOKENIZER_CORPUS = """\
An MoE token touches only k of E experts per layer. The expert cache keeps the most used experts in VRAM,
and the rest stay memory-mapped in pinned host RAM. A miss is served over PCIe, on the CPU, or by promotion.
def forward(self, tokens, kv_cache):
    for layer in range(self.n_layers):
        x = x + attention(rmsnorm(x), kv_cache[layer])
        x = x + moe_block(rmsnorm(x))
    return logits(x)

    indented    text with   runs of spaces\tand\ttabs
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 123 2048 65536 3.14159 1e-6 0x1F 2026-11-29
The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX! don't, won't, it's, we're, they've.
混合专家模型只激活少数专家。缓存命中率决定吞吐量。
Смесь экспертов: кэш экспертов в видеопамяти. Ελληνικά κείμενα. العربية نص. हिन्दी पाठ.
emoji: 🚀 🧠 ✨ 👩‍💻 🇯🇵 ❤️ 😀😀😀
{"role": "user", "content": "hello"} <tag attr="x">text</tag> [1, 2, 3] (a + b) * c / d - e % f
"""


@dataclass(frozen=True)
class Preset:
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int = 0
    n_ctx: int = 512
    n_vocab: int = 512  # target size of the trained BPE vocabulary (specials + 256 bytes + merges)
    pad_vocab: bool = False  # pad the trained vocabulary to exactly n_vocab with [PAD{i}] tokens (`padded_vocab`)


PRESETS: dict[str, Preset] = {
    # tests: seconds to write, every row length a multiple of 256 so the Q2_K mix is exercised everywhere.
    "tiny": Preset(n_layers=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=8, n_expert_used=2,
                   n_ff_exp=256, n_ff_shexp=512),
    # benchmarks: ~430 MB at the Q2_K mix, qwen3moe-shaped (the CPU speed issue compares it with llama.cpp).
    "mid": Preset(n_layers=12, n_embd=1024, n_head=16, n_head_kv=4, head_dim=64, n_expert=64, n_expert_used=8,
                  n_ff_exp=512, n_ctx=4096, n_vocab=2048),
    # the real CUDA kernels in Numba's CUDA simulator (tests/test_cuda_real_kernels_sim.py), where every output row
    # of a mat-vec is a thread block of 32 Python threads: as few rows as a legal model allows. The vocabulary is
    # the byte alphabet, the specials and 5 merges (the output projection, vocab x hidden, dominates the cost);
    # rows of 32 values take Q4_0 in the q2_k mix.
    "micro": Preset(n_layers=1, n_embd=32, n_head=2, n_head_kv=1, head_dim=16, n_expert=4, n_expert_used=2,
                    n_ff_exp=32, n_ff_shexp=32, n_ctx=256, n_vocab=264),
    # a real family's shapes: Qwen3-30B-A3B's config.json (qwen3moe; ~30.5 B weights, ~17 GB at Q4_K_M), its padded
    # vocabulary of 151936 rows included (the output head is 311 M weights of a token's ~3.3 B). Written only
    # through `write_random_quantized` (random quantized blocks, no float weights: an F32 source would be 122 GB),
    # then requantized by llama.cpp's quantizer (bench/real_shape.py make).
    "qwen3-30b-a3b": Preset(n_layers=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_expert=128,
                            n_expert_used=8, n_ff_exp=768, n_ctx=40960, n_vocab=151936, pad_vocab=True),
}

# Per-arch tweaks of a preset, so that the tiny files exercise what each arch does differently.
ARCH_TWEAKS = {
    # head_dim * n_head (512) != n_embd (256): qwen3moe's attention.key_length is really read.
    "qwen3moe": dict(n_head=8, head_dim=64),
    "qwen2moe": dict(),
    "llama": dict(),
    "olmoe": dict(n_head_kv=4),  # OLMoE has no GQA; llama.cpp sizes its k_norm as n_embd
    "glm4moe": dict(n_layers=3),  # one dense layer, then two MoE layers
    "gpt-oss": dict(n_head=8, head_dim=64, n_layers=3),  # q width 512 != n_embd, as gpt-oss (64 x 64 vs 2880)
    "qwen3next": dict(n_layers=4),  # three Gated DeltaNet layers, then one gated full-attention layer
    "qwen35moe": dict(n_layers=4),
    "qwen3vlmoe": dict(n_head=8, head_dim=64, n_layers=3),  # qwen3moe's, and a layer after the 2 deepstack ones
    "deepseek2": dict(n_layers=3),  # one dense layer, then two MLA + MoE layers
    # one dense layer, then two MoE layers; no GQA, as dots.llm1 (32 q and 32 kv heads); head_dim * n_head (512)
    # != n_embd (256), so that attention.key_length is really read
    "dots1": dict(n_layers=3, n_head=8, n_head_kv=8, head_dim=64),
}
# no GQA for olmoe, as above (the tiny tweaks are for the tiny shapes); glm4moe, deepseek2 and dots1 lead with a
# dense layer, so their micro files have two: the dense one, then one MoE layer
MICRO_ARCH_TWEAKS = {"olmoe": dict(n_head_kv=2), "glm4moe": dict(n_layers=2), "deepseek2": dict(n_layers=2),
                     "dots1": dict(n_layers=2, n_head_kv=2),
                     "qwen3vlmoe": dict(n_layers=3),  # its 2 deepstack layers, then one more (as the tiny file)
                     # three Gated DeltaNet layers, then gated full attention: both attention kinds (as the tiny file)
                     "qwen3next": dict(n_layers=4), "qwen35moe": dict(n_layers=4)}
TIED_OUTPUT = {"qwen3moe": False, "qwen2moe": False, "llama": True, "olmoe": False, "glm4moe": False,
               "gpt-oss": False, "qwen3next": False, "qwen35moe": False, "deepseek2": False,
               "dots1": False, "qwen3vlmoe": False}  # llama.cpp
#                                                                                  requires olmoe's output
ROPE_BASE = {"qwen3moe": 1_000_000.0, "qwen2moe": 1_000_000.0, "llama": 1_000_000.0, "olmoe": 10_000.0,
             "glm4moe": 1_000_000.0, "gpt-oss": 150_000.0, "qwen3next": 10_000_000.0, "qwen35moe": 10_000_000.0,
             "deepseek2": 10_000.0, "dots1": 10_000_000.0, "qwen3vlmoe": 5_000_000.0}
# What GLM-4.5-Air's config.json gives llama.cpp's converter (conversion/glm.py Glm4MoeModel), at tiny size:
# first_k_dense_replace 1, routed_scaling_factor 2.5, norm_topk_prob true, partial_rotary_factor 0.5, n_shared_experts 1
# (here 2, so the shared expert is n_ff_shexp = 2 x n_ff_exp wide), intermediate_size (the dense MLP) 2 x n_ff_shexp.
GLM = dict(n_dense_lead=1, expert_weights_scale=2.5, gating="sigmoid", rope_fraction=0.5, dense_ff_factor=2)
# gpt-oss-20b's config.json at tiny size: sliding_window 128 -> 8 (so that the window cuts within a test's 50
# tokens), YaRN factor 32 over 4096 original positions -> factor 4 over 128 (the ramp then covers middle pairs).
GPT_OSS = dict(n_swa=8, rope_scaling="yarn", rope_scale=4.0, rope_ctx_orig=128)
# Qwen3-Next-80B-A3B's config.json at tiny size: linear_conv_kernel_dim 4, linear_key_head_dim 128 -> 32,
# linear_value_head_dim 128 -> 32, linear_num_key_heads 16 -> 2, linear_num_value_heads 32 -> 4 (two v heads per
# q/k head, as there), full_attention_interval 4, partial_rotary_factor 0.25.
QWEN3NEXT = dict(ssm_conv=4, ssm_state=32, ssm_k_heads=2, ssm_v_heads=4, ssm_inner=4 * 32, interval=4,
                 rope_fraction=0.25)
# DeepSeek-V3's config.json at tiny size: q_lora_rank 1536 -> 128, kv_lora_rank 512 -> 96, qk_rope_head_dim 64 -> 32,
# qk_nope_head_dim 128 -> 32, v_head_dim 128 -> 32 (the cached K row, 96 + 32, and V row, 96, whole Q8_0 blocks, so
# llama.cpp's q8_0 KV cache takes them as it takes DeepSeek's 576 and 512), n_group 8 -> 4 (topk_group 4 -> 2), scoring_func sigmoid with
# e_score_correction_bias, routed_scaling_factor 2.5, norm_topk_prob, first_k_dense_replace 3 -> 1, one shared expert;
# YaRN factor 40 over 4096 (mscale_all_dim 1) -> 4 over 128 with mscale_all_dim 0.707 (so that it matters).
DEEPSEEK2_CONFIG = dict(n_head_kv=1, head_dim=96 + 32, head_dim_v=96, rope_dim=32, q_lora_rank=128, kv_lora_rank=96,
                        head_dim_mla=32 + 32, head_dim_v_mla=32, n_expert_groups=4, n_group_used=2,
                        gating="sigmoid", expert_weights_scale=2.5, norm_topk=True, n_dense_lead=1, n_ff=512,
                        n_ff_shexp=256, rope_scaling="yarn", rope_scale=4.0, rope_ctx_orig=128,
                        yarn_log_mul=float(np.float32(0.0707)) / 0.1)  # what a reader gets back from the f32 key
# DeepSeek-V2-Lite's config.json (the 16B file people run on one GPU) differs from V3's: q_lora_rank null (one q
# projection, attn_q, and no attention.q_lora_rank key), scoring_func softmax with no e_score_correction_bias,
# n_group 1 / topk_group 1 (no group limit), routed_scaling_factor 1.0, norm_topk_prob false (the converter then
# writes no expert_weights_norm key), 2 shared experts, 27 layers. llama.cpp tells a Lite file by its 26 or 27
# layers (deepseek2.cpp `is_lite`, which skips the q_lora_rank key), so the tiny Lite file keeps 27.
DEEPSEEK2_LITE = dict(n_layers=27, q_lora_rank=0, gating="softmax", expert_bias=False, n_expert_groups=1,
                      n_group_used=1, expert_weights_scale=1.0, norm_topk=False)
# dots.llm1's config.json as conversion/dots1.py Dots1Model reads it, at tiny size: first_k_dense_replace 1,
# routed_scaling_factor 2.5, norm_topk_prob true, n_shared_experts 2 (the shared expert 2 x n_ff_exp wide: the tiny
# preset's n_ff_shexp; the micro preset's is 1 x), scoring_func sigmoid (base.py writes expert_gating_func 2, which
# llama.cpp's dots1 graph needs; transformers' Dots1 router: router_logits.sigmoid()) with e_score_correction_bias
# (exp_probs_b), rope_theta 1e7; n_group 1 / topk_group 1 (transformers' defaults, written as base.py writes any it
# finds: one group is no group limit, as an absent key is); intermediate_size (the dense MLP) 2 x the shared
# expert's width.
DOTS1 = dict(n_dense_lead=1, expert_weights_scale=2.5, norm_topk=True, n_expert_groups=1, n_group_used=1,
             gating="sigmoid", dense_ff_factor=2)
# Qwen3-VL-30B-A3B's text_config at tiny size: mrope_section [24, 20, 20] over 64 pairs -> [12, 10, 10] over 32 (the
# last sector, 31, in none of the three, as 61 is there), 3 deepstack_visual_indexes -> 2 (the tiny tower's two
# blocks: pymoe/demo/tinyvision.TINY_DEEPSTACK).
QWEN3VL = dict(rope_sections=(12, 10, 10, 0), n_deepstack=2)
VARIANTS = {"deepseek2": {"lite": DEEPSEEK2_LITE}}  # make-tiny-model --variant
QUANT_MIXES = ("f32", "q2_k", "q2_0")


def make_config(arch: str, preset: str = "tiny", n_vocab: int = 512, variant: str = "") -> ModelConfig:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r} (choose from {', '.join(ARCHS)})")
    if variant and variant not in VARIANTS.get(arch, {}):
        raise ValueError(f"{arch} has no variant {variant!r} (variants: {', '.join(VARIANTS.get(arch, {})) or 'none'})")
    p = PRESETS[preset]
    if preset == "tiny":
        p = replace(p, **ARCH_TWEAKS[arch])
    elif preset == "micro":
        p = replace(p, **MICRO_ARCH_TWEAKS.get(arch, {}))
    t = ARCHS[arch]
    glm = arch == "glm4moe"
    kw = dict(
        arch=arch, name=f"pymoe-{preset}-{arch}", n_layers=p.n_layers, n_embd=p.n_embd, n_vocab=n_vocab,
        n_ctx_train=p.n_ctx, n_head=p.n_head, n_head_kv=p.n_head_kv, head_dim=p.head_dim, head_dim_v=p.head_dim,
        n_expert=p.n_expert, n_expert_used=p.n_expert_used, n_ff_exp=p.n_ff_exp,
        n_ff_shexp=p.n_ff_shexp if t.shared_expert else 0, rms_eps=float(np.float32(1e-6)), rope_freq_base=ROPE_BASE[arch],
        rope_dim=int(p.head_dim * {"glm4moe": GLM, "qwen3next": QWEN3NEXT, "qwen35moe": QWEN3NEXT}.get(
            arch, {}).get("rope_fraction", 1)),
        rope_neox=t.rope_neox,
        qk_norm=t.qk_norm, qkv_bias=t.qkv_bias, norm_topk=t.norm_topk,
        tied_output=TIED_OUTPUT[arch] if preset == "tiny" else False, gating=t.gating,
        expert_weights_scale=GLM["expert_weights_scale"] if glm else 1.0, expert_bias=t.expert_bias,
        n_dense_lead=GLM["n_dense_lead"] if glm else 0,
        n_ff=GLM["dense_ff_factor"] * p.n_ff_shexp if glm else 0,
        **({k: v for k, v in GPT_OSS.items()} if arch == "gpt-oss" else {}),
        **(qwen3next_fields(p) if arch in ("qwen3next", "qwen35moe") else {}),
        # conversion/qwen.py _Qwen35MRopeMixin: the default [11, 11, 10, 0], scaled to the tiny rope's 8 pairs
        # (every pair a text position)
        rope_sections=(3, 3, 2, 0) if arch == "qwen35moe" else QWEN3VL["rope_sections"] if arch == "qwen3vlmoe" else (),
        n_deepstack=QWEN3VL["n_deepstack"] if arch == "qwen3vlmoe" else 0,
    )
    if arch == "deepseek2":
        kw.update(DEEPSEEK2_CONFIG)
    if arch == "dots1":
        kw.update({k: v for k, v in DOTS1.items() if k != "dense_ff_factor"},
                  n_ff=DOTS1["dense_ff_factor"] * p.n_ff_shexp)
    kw.update(VARIANTS.get(arch, {}).get(variant, {}))
    return ModelConfig(**kw)


def qwen3next_fields(p: Preset) -> dict:
    n = QWEN3NEXT
    return dict(ssm_conv=n["ssm_conv"], ssm_state=n["ssm_state"], ssm_k_heads=n["ssm_k_heads"],
                ssm_v_heads=n["ssm_v_heads"], ssm_inner=n["ssm_inner"],
                recurrent=tuple((i + 1) % n["interval"] != 0 for i in range(p.n_layers)))


# --- tokenizer ---------------------------------------------------------------------------------------------------

def train_tokenizer(vocab_size: int = 512, corpus: str = TOKENIZER_CORPUS, split_regex: Optional[str] = None,
                    texts=None):
    """A byte-level BPE (GPT-2 byte alphabet, so every byte has a token) -> (tokens, token_types, merges).

    `split_regex`: pre-tokenize with this regex (e.g. tokenizer.QWEN2_REGEX, the one the file's `tokenizer.ggml.pre`
    names, so training and inference split text alike) instead of the GPT-2 regex built into ByteLevel.
    `texts`: an iterable of strings to train on instead of the lines of `corpus`.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_regex is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus.splitlines(keepends=True) if texts is None else texts, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    types = [int(TokenType.CONTROL if t in SPECIAL_TOKENS else TokenType.NORMAL) for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, types, merges


# --- weights -----------------------------------------------------------------------------------------------------

def quant_type(name: str, shape: tuple, mix: str, cfg: Optional[ModelConfig] = None) -> quant.QType:
    """The GGML type a tensor gets in a quant mix (see the module docstring). `cfg` (expert count, tied output) is
    read by the q2_0 mix only, which follows llama.cpp's rules for those."""
    if mix == "f32" or len(shape) == 1 or name.endswith("ffn_gate_inp.weight") or name.endswith(".bias"):
        return Q.F32
    if mix == "q2_0":
        return q2_0_mix_type(name, shape, cfg)
    if mix != "q2_k":
        raise ValueError(f"unknown quant mix {mix!r} (choose from {', '.join(QUANT_MIXES)})")
    if "ffn_down" in name or name.endswith("attn_output.weight"):
        qtype = Q.Q3_K
    elif name.endswith("attn_v.weight"):
        qtype = Q.Q4_K
    elif name == "output.weight":
        qtype = Q.Q6_K
    else:
        qtype = Q.Q2_K
    if shape[-1] % 256:
        qtype = Q.Q4_0 if shape[-1] % 32 == 0 else Q.F32
    return qtype


# llama.cpp's tensor_type_fallback (src/llama-quant.cpp): the type a matrix takes when its rows are not whole blocks
Q2_0_MIX_FALLBACK = {Q.Q2_0: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}


def q2_0_mix_type(name: str, shape: tuple, cfg: Optional[ModelConfig]) -> quant.QType:
    """The type of a matrix in llama.cpp's Q2_0 file type (llama_tensor_get_type_impl for LLAMA_FTYPE_MOSTLY_Q2_0)."""
    tied = cfg is not None and cfg.tied_output
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        qtype = Q.Q6_K  # the output head keeps 6 bits in every K / low-bit file type
    elif name == "token_embd.weight":
        qtype = Q.Q4_K  # llama.cpp: TQ1_0, TQ2_0 and Q2_0 files store the embeddings in Q4_K
    elif cfg is not None and cfg.n_expert == 8 and (name.endswith("attn_k.weight") or name.endswith("attn_v.weight")):
        qtype = Q.Q8_0  # "for the 8-expert model, bumping this to Q8_0 trades just ~128MB" (Mixtral rule)
    else:
        qtype = Q.Q2_0
    if shape[-1] % quant.get_format(qtype).block_size:
        qtype = Q2_0_MIX_FALLBACK.get(qtype, qtype)
    if shape[-1] % quant.get_format(qtype).block_size:
        qtype = Q.F32  # llama.cpp: F16
    return qtype


def random_tensor(name: str, shape: tuple, cfg: ModelConfig, rng: np.random.Generator, common: np.ndarray,
                  popularity: np.ndarray) -> np.ndarray:
    """float32 weights of one tensor. `common` [D] is the shared embedding direction; `popularity` [L, E]."""
    base = name.rsplit(".", 1)[0].split(".")[-1]  # e.g. "attn_q", "ffn_gate_exps"
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith(".bias"):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name == "token_embd.weight":
        # A tied output head reuses these rows: scaled down so its logits have a spread of ~2, like an untied
        # head's (full-size rows give logits of std ~18 and magnify every rounding difference by as much).
        scale = 0.1 if cfg.tied_output else 1.0
        return (scale * (rng.standard_normal(shape) + 1.5 * common)).astype(np.float32)  # [V, D]
    if base == "ffn_gate_inp":
        layer = int(name.split(".")[1])
        w = rng.standard_normal(shape) / np.sqrt(shape[-1])  # [E, D]
        w += 3.0 * popularity[layer][:, None] * common[None, :] / np.linalg.norm(common)
        return w.astype(np.float32)
    if name.endswith(".ssm_a"):  # -exp(A_log), A_log ~ N(0, 0.5): decays e^g between ~0.2 and ~0.9 per token
        return (-np.exp(0.5 * rng.standard_normal(shape))).astype(np.float32)
    if base == "ssm_conv1d":  # [C, K]: taps of the order of 1/sqrt(K)
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    if cfg.arch == "gpt-oss" and base in ("ffn_gate_exps", "ffn_up_exps"):
        # pre-activations of std ~4, so that swiglu_oai's clamp at +-7 really cuts some of them (~8%)
        return (4.0 * rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    if base == "attn_sinks":  # gpt-oss: learned logits of the order of the scores
        return rng.standard_normal(shape).astype(np.float32)
    if base == "ffn_gate_inp_shexp":
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)  # [..., rows, cols]


def write_model(path: str, arch: str = "qwen3moe", preset: str = "tiny", mix: str = "f32", seed: int = 0,
                progress: bool = False, jobs: int = 1, mtp: bool = False, variant: str = "") -> ModelConfig:
    """Write a random-weight MoE GGUF; returns its config. Deterministic for a given (arch, preset, mix, seed),
    whatever `jobs` (processes quantizing tensors side by side; the random draws stay in this process, in order).
    mtp: append a NextN/MTP block (block_count + 1, nextn_predict_layers 1) after the trunk, drawn after every trunk
    tensor, so the trunk's weights are those of the file without it."""
    from tqdm import tqdm

    if preset in LARGE_PRESETS:
        raise ValueError(f"preset {preset!r} is written by write_random_quantized (bench/real_shape.py make): its "
                         "float weights would not fit")
    p = PRESETS[preset]
    tokens, types, merges = train_tokenizer(p.n_vocab)
    cfg = make_config(arch, preset, n_vocab=len(tokens), variant=variant)
    rng = np.random.default_rng(seed)
    common = rng.standard_normal(cfg.n_embd)  # [D]
    # Zipf-like popularity per (layer, expert), in a random order per layer.
    ranks = np.argsort(rng.random((cfg.n_layers, cfg.n_expert)), axis=1)
    popularity = (1.0 / (1.0 + ranks)) - 1.0 / cfg.n_expert  # [L, E]

    shapes = expected_tensors(cfg)
    extra = expected_mtp_tensors(cfg) if mtp else {}
    if mtp:  # the MTP block's router draws from the popularity table like a layer of its own
        popularity = np.concatenate([popularity, popularity[-1:]])
    weights = ((name, random_tensor(name, shape, cfg, rng, common, popularity))
               for name, shape in tqdm({**shapes, **extra}.items(), desc=f"writing {path}", unit="tensor",
                                       disable=None if progress else True))
    write_gguf(path, cfg, tokens, types, merges, mix, weights, jobs=jobs, extra_shapes=extra)
    return cfg


# --- real shapes: random quantized blocks, written without float weights -------------------------------------------

LARGE_PRESETS = ("qwen3-30b-a3b",)  # written by write_random_quantized only (write_model's float weights won't fit)


def padded_vocab(tokens: list, types: list, n_vocab: int) -> tuple:
    """The trained vocabulary padded to n_vocab rows with `[PAD{i}]` tokens of type UNUSED, as llama.cpp's
    convert_hf_to_gguf.py pads a vocabulary whose config.json counts more rows than its tokenizer has ids (Qwen3:
    151669 ids in 151936 rows). -> (tokens, types)."""
    if len(tokens) > n_vocab:
        raise ValueError(f"the trained vocabulary has {len(tokens)} tokens, more than n_vocab {n_vocab}")
    pad = range(len(tokens), n_vocab)
    return tokens + [f"[PAD{i}]" for i in pad], types + [int(TokenType.UNUSED)] * len(pad)


def random_q2_k(shape: tuple, seed) -> np.ndarray:
    """Random Q2_K blocks for a float matrix of `shape` ([..., rows, cols], cols a multiple of 256) -> uint8
    [..., rows, cols / 256 * 84], with weights of mean 0 and std ~1/sqrt(cols), as random_tensor draws them.

    Q2_K block (84 bytes / 256 weights): scales[16] | qs[64] | d fp16 | dmin fp16; weight = d*(sc & 15)*q -
    dmin*(sc >> 4) for a 2-bit q. Here each sub-block's scale byte is s | s << 4 (s uniform in 1..15) and
    dmin = 1.5 d, so every weight is d*s*(q - 1.5): mean 0, std d * rms(s) * rms(q - 1.5) = d * 9.09 * 1.118.
    `seed`: anything np.random.default_rng takes; the bytes depend on it alone (so tensors can be drawn in any
    process, in any order)."""
    fmt = quant.get_format(Q.Q2_K)
    *lead, cols = shape
    if cols % fmt.block_size:
        raise ValueError(f"random_q2_k: {cols} columns are not whole 256-blocks")
    rng = np.random.default_rng(seed)
    n_blocks = int(np.prod(lead, dtype=np.int64)) * (cols // fmt.block_size)
    blocks = np.empty((n_blocks, fmt.type_size), np.uint8)  # [blocks, 84]
    s = rng.integers(1, 16, size=(n_blocks, 16), dtype=np.uint8)  # [blocks, 16] sub-block scales
    blocks[:, :16] = s | (s << 4)
    blocks[:, 16:80] = rng.integers(0, 256, size=(n_blocks, 64), dtype=np.uint8)  # 4 codes per byte
    rms_s = np.sqrt(np.mean(np.arange(1, 16) ** 2))  # 9.09
    rms_q = np.sqrt(np.mean((np.arange(4) - 1.5) ** 2))  # 1.118
    d = np.float16(1.0 / (np.sqrt(cols) * rms_s * rms_q))
    blocks[:, 80:82] = np.frombuffer(d.tobytes(), np.uint8)
    blocks[:, 82:84] = np.frombuffer(np.float16(1.5 * np.float32(d)).tobytes(), np.uint8)
    return blocks.reshape(*lead, cols // fmt.block_size * fmt.type_size)


def write_random_quantized(path: str, preset: str, arch: str = "qwen3moe", seed: int = 0, jobs: int = 1,
                           progress: bool = False, n_layers: Optional[int] = None) -> ModelConfig:
    """Write a GGUF of a preset's shapes whose matrices are random Q2_K blocks (`random_q2_k`) and whose norms and
    routers are random_tensor's F32 values: a source for llama.cpp's quantizer (bench/real_shape.py requantizes it
    to Q4_K_M) at sizes where float weights would not fit on disk or in memory. The vocabulary is the tiny trained
    one, padded to the preset's n_vocab when it asks (`padded_vocab`). Tensors are drawn by `jobs` processes, each
    from its own seed (seed, tensor index), and written in order one at a time by gguf-py's writer (at most 2 * jobs
    in memory), so the file is the same for any `jobs`. The file type says Q2_K (what the big matrices are).
    n_layers: fewer layers than the preset's (the first of a file `write_repeated_layers` completes)."""
    from collections import deque
    from concurrent.futures import ProcessPoolExecutor
    from tqdm import tqdm

    p = PRESETS[preset]
    tokens, types, merges = train_tokenizer(min(p.n_vocab, 512))
    if p.pad_vocab:
        tokens, types = padded_vocab(tokens, types, p.n_vocab)
    cfg = make_config(arch, preset, n_vocab=len(tokens))
    if n_layers is not None:
        cfg = replace(cfg, n_layers=n_layers)
    rng = np.random.default_rng(seed)
    common = rng.standard_normal(cfg.n_embd)  # [D]
    ranks = np.argsort(rng.random((cfg.n_layers, cfg.n_expert)), axis=1)
    popularity = (1.0 / (1.0 + ranks)) - 1.0 / cfg.n_expert  # [L, E], as write_model's

    shapes = expected_tensors(cfg)
    floats = {name: len(shape) == 1 or name.endswith("ffn_gate_inp.weight") for name, shape in shapes.items()}
    w = GGUFWriter(path, cfg.arch)
    _write_metadata(w, cfg, tokens, types, merges, "q2_k")
    fmt = quant.get_format(Q.Q2_K)
    for name, shape in shapes.items():
        if floats[name]:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            byte_shape = (*shape[:-1], shape[-1] // fmt.block_size * fmt.type_size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=Q.Q2_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = sum(int(np.prod(s)) for s in shapes.values())
    bar = tqdm(total=total, desc=f"writing {path}", unit="weight", unit_scale=True, disable=None if progress else True)
    with ProcessPoolExecutor(max(1, jobs)) as pool:
        pending = deque()

        def flush_one():
            name, data = pending.popleft()
            w.write_tensor_data(data if isinstance(data, np.ndarray) else data.result())
            bar.update(int(np.prod(shapes[name])))

        for i, (name, shape) in enumerate(shapes.items()):
            if floats[name]:  # small: drawn here, in order, from the one generator
                pending.append((name, random_tensor(name, shape, cfg, rng, common, popularity)))
            elif jobs <= 1:
                pending.append((name, random_q2_k(shape, (seed, i))))
            else:
                pending.append((name, pool.submit(random_q2_k, shape, (seed, i))))
            if len(pending) >= 2 * max(1, jobs):
                flush_one()
        while pending:
            flush_one()
    bar.close()
    w.close()
    return cfg


def _quantized(weights, mix: str, jobs: int, cfg: Optional[ModelConfig] = None):
    """(name, float32 values) -> (name, shape, qtype, what to write), in order; quantized by `jobs` processes, at
    most 2 * jobs tensors in flight (so the float tensors of a large preset are never all in memory at once)."""
    from collections import deque
    from concurrent.futures import ProcessPoolExecutor

    if jobs <= 1:
        for name, values in weights:
            qtype = quant_type(name, values.shape, mix, cfg)
            yield name, values.shape, qtype, values if qtype == Q.F32 else quant.quantize(values, qtype)
        return
    def done(item):  # (name, shape, qtype, float values or a future of the quantized bytes) -> what to write
        name, shape, qtype, data = item
        return name, shape, qtype, data if qtype == Q.F32 else data.result()

    with ProcessPoolExecutor(jobs) as pool:
        pending = deque()
        for name, values in weights:
            qtype = quant_type(name, values.shape, mix, cfg)
            pending.append((name, values.shape, qtype,
                            values if qtype == Q.F32 else pool.submit(quant.quantize, values, qtype)))
            if len(pending) >= 2 * jobs:
                yield done(pending.popleft())
        while pending:
            yield done(pending.popleft())


def write_gguf(path: str, cfg: ModelConfig, tokens, types, merges, mix: str, weights, jobs: int = 1,
               extra_shapes: Optional[dict] = None) -> None:
    """Write a GGUF: metadata of `cfg` + tokenizer, then `weights` ((name, float32 array in NumPy order), in the
    order of `expected_tensors(cfg)`), each quantized to its type in `mix`. Shared by the random tiny models and the
    trained demo model (pymoe/demo/train.py)."""
    w = GGUFWriter(path, cfg.arch)
    _write_metadata(w, cfg, tokens, types, merges, mix, n_mtp=1 if extra_shapes else 0)
    shapes = {**expected_tensors(cfg), **(extra_shapes or {})}
    for name, shape, qtype, data in _quantized(weights, mix, jobs, cfg):
        if tuple(shape) != shapes[name]:
            raise ValueError(f"tensor {name} has shape {list(shape)}, expected {list(shapes[name])}")
        if qtype == Q.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


def _write_metadata(w: GGUFWriter, cfg: ModelConfig, tokens, types, merges, mix: str, n_mtp: int = 0) -> None:
    w.add_name(cfg.name)
    file_type = {"f32": LlamaFileType.ALL_F32, "q2_0": LLAMA_FTYPE_MOSTLY_Q2_0}.get(mix, LlamaFileType.MOSTLY_Q2_K)
    w.add_file_type(int(file_type))
    w.add_context_length(cfg.n_ctx_train)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layers + n_mtp)  # the converters count NextN blocks in block_count
    if n_mtp:
        w.add_nextn_predict_layers(n_mtp)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim_v)
    w.add_rope_freq_base(cfg.rope_freq_base)
    w.add_rope_dimension_count(cfg.rope_dim)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_expert_count(cfg.n_expert)
    w.add_expert_used_count(cfg.n_expert_used)
    if cfg.traits.ff_key == "feed_forward_length":
        w.add_feed_forward_length(cfg.n_ff_exp)
    else:
        # the dense MLP's width (GLM); unused by qwen2/3moe but written by llama.cpp's converter too
        w.add_feed_forward_length(cfg.n_ff or cfg.n_ff_exp)
        w.add_expert_feed_forward_length(cfg.n_ff_exp)
    if cfg.has_shared_expert and cfg.arch in ("glm4moe", "deepseek2", "dots1"):  # the converter writes the count;
        #                                                                          n_ff_shexp = count x n_ff_exp
        w.add_expert_shared_count(cfg.n_ff_shexp // cfg.n_ff_exp)
    elif cfg.has_shared_expert:
        w.add_expert_shared_feed_forward_length(cfg.n_ff_shexp)
    if cfg.rope_sections:  # qwen35moe (make_config)
        w.add_rope_dimension_sections(list(cfg.rope_sections))
    if cfg.arch == "qwen3vlmoe":  # conversion/qwen3vl.py Qwen3VLMoeTextModel.set_gguf_parameters
        w.add_num_deepstack_layers(cfg.n_deepstack)
    if cfg.arch in ("qwen3next", "qwen35moe"):  # conversion/qwen.py Qwen3NextModel.set_gguf_parameters
        w.add_ssm_conv_kernel(cfg.ssm_conv)
        w.add_ssm_state_size(cfg.ssm_state)
        w.add_ssm_group_count(cfg.ssm_k_heads)
        w.add_ssm_time_step_rank(cfg.ssm_v_heads)
        w.add_ssm_inner_size(cfg.ssm_inner)
        w.add_full_attention_interval(QWEN3NEXT["interval"])
    if cfg.arch == "gpt-oss":  # conversion/gpt_oss.py GptOssModel.set_gguf_parameters and TextModel's rope scaling
        w.add_sliding_window(cfg.n_swa)
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(cfg.rope_scale)
        w.add_rope_scaling_orig_ctx_len(cfg.rope_ctx_orig)
    if cfg.arch == "deepseek2":  # conversion/deepseek.py DeepseekV2Model and base.py's MoE keys
        w.add_leading_dense_block_count(cfg.n_dense_lead)
        if cfg.q_lora_rank:  # V2-Lite's config says null: no key
            w.add_q_lora_rank(cfg.q_lora_rank)
        w.add_kv_lora_rank(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.head_dim_mla)
        w.add_value_length_mla(cfg.head_dim_v_mla)
        w.add_expert_weights_scale(cfg.expert_weights_scale)
        if cfg.norm_topk:  # written only when true
            w.add_expert_weights_norm(cfg.norm_topk)
        w.add_expert_group_count(cfg.n_expert_groups)
        w.add_expert_group_used_count(cfg.n_group_used)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if cfg.gating == "sigmoid"
                                 else ExpertGatingFuncType.SOFTMAX)
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(cfg.rope_scale)
        w.add_rope_scaling_orig_ctx_len(cfg.rope_ctx_orig)
        w.add_rope_scaling_yarn_log_mul(0.1 * cfg.yarn_log_mul)  # the converter's legacy 0.1 factor
    if cfg.arch == "dots1":  # conversion/dots1.py Dots1Model.set_gguf_parameters and base.py's MoE keys
        w.add_leading_dense_block_count(cfg.n_dense_lead)
        w.add_expert_weights_scale(cfg.expert_weights_scale)
        w.add_expert_weights_norm(cfg.norm_topk)
        w.add_expert_group_count(cfg.n_expert_groups)
        w.add_expert_group_used_count(cfg.n_group_used)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    if cfg.arch == "glm4moe":  # conversion/glm.py Glm4MoeModel.set_gguf_parameters
        w.add_leading_dense_block_count(cfg.n_dense_lead)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(cfg.expert_weights_scale)
        w.add_expert_weights_norm(cfg.norm_topk)
    w.add_vocab_size(cfg.n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    eos = tokens.index(EOS_TOKEN)
    w.add_bos_token_id(eos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def main_args(argv: Optional[list] = None):  # pragma: no cover - thin wrapper used by tools/make-tiny-model
    import argparse

    ap = argparse.ArgumentParser(prog="make-tiny-model", description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", required=True, help="GGUF file to write")
    ap.add_argument("--arch", default="qwen3moe", choices=list(ARCHS), help="architecture (default qwen3moe)")
    ap.add_argument("--preset", default="tiny", choices=[p for p in PRESETS if p not in LARGE_PRESETS], help="size preset (default tiny)")
    ap.add_argument("--quant", default="f32", choices=QUANT_MIXES, help="quant mix (default f32)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--variant", default="", help="a variant of the arch's tiny config: deepseek2 'lite' "
                    "(DeepSeek-V2-Lite: one q projection, softmax routing, no selection bias, 27 layers)")
    ap.add_argument("--mtp", action="store_true", help="append a NextN/MTP block after the trunk, as the converters "
                    "write it for Qwen3-Next, GLM-4.5 and DeepSeek-V3 (run by pymoe run --spec mtp)")
    ap.add_argument("--jobs", type=int, default=1, help="processes quantizing tensors (default 1); the file is the "
                    "same for any number")
    return ap.parse_args(argv)


def copy_metadata(r, w, file_type=None, change=None) -> None:
    """Every metadata key of GGUFReader `r` into GGUFWriter `w` (made with r's architecture, which it writes itself),
    as stored; `file_type`: a new general.file_type, if given; `change`: key -> a new value of the same type, or
    None to leave the key out."""
    from gguf import GGUFValueType

    change = change or {}
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        if key in change:
            if change[key] is not None:
                w.add_key_value(key, change[key], vtype)
        elif key == "general.file_type" and file_type is not None:
            w.add_key_value(key, int(file_type), vtype)
        elif vtype == GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == GGUFValueType.STRING:
                val = [bytes(field.parts[i]) for i in field.data]
            else:
                val = [field.parts[i].tolist()[0] for i in field.data]
            w.add_key_value(key, val, vtype, sub_type=sub)
        elif vtype == GGUFValueType.STRING:
            w.add_key_value(key, bytes(field.parts[-1]), vtype)
        else:
            w.add_key_value(key, field.parts[-1].tolist()[0], vtype)


def write_first_layers(src: str, dst: str, n_layers: int) -> None:
    """A draft model cut from a model: its first `n_layers` blocks, then its own output norm and head (the idea of
    self-speculative / layer-skip drafting), every tensor byte for byte, the metadata with block_count n_layers and
    no MTP block. Same vocabulary and tokenizer, so it drafts for the full model (`--spec draft:FILE`)."""
    from gguf import GGUFReader, GGUFWriter

    r = GGUFReader(src)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    total = int(r.fields[f"{arch}.block_count"].parts[-1][0])
    nextn = int(r.fields[f"{arch}.nextn_predict_layers"].parts[-1][0]) if f"{arch}.nextn_predict_layers" in r.fields else 0
    if not 0 < n_layers <= total - nextn:
        raise ValueError(f"{src}: keep 1 .. {total - nextn} of its {total - nextn} layers, not {n_layers}")
    dense_lead = f"{arch}.leading_dense_block_count"
    change = {f"{arch}.block_count": n_layers, f"{arch}.nextn_predict_layers": None,
              f"{arch}.attention.recurrent_layers": None}  # per-layer arrays: recomputed from the interval
    if dense_lead in r.fields:
        change[dense_lead] = min(int(r.fields[dense_lead].parts[-1][0]), n_layers)
    w = GGUFWriter(dst, arch)
    copy_metadata(r, w, change=change)
    for t in r.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_layers:
            continue
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


def write_repeated_layers(src: str, dst: str, sources: list) -> None:
    """A GGUF whose layer i is layer sources[i] of `src`, byte for byte (every blk.{sources[i]}.* tensor renamed
    blk.{i}.*), the other tensors and the metadata as in src but block_count len(sources). Written one tensor at a
    time from src's memory map by gguf-py's writer, so a file larger than memory can be made: the real-shape file
    (bench/real_shape.py) is llama.cpp's quantization of a few random layers, repeated to the family's depth."""
    from gguf import GGUFReader

    r = GGUFReader(src)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    n_src = int(r.fields[f"{arch}.block_count"].parts[-1][0])
    if not sources or not all(0 <= j < n_src for j in sources):
        raise ValueError(f"{src}: layers to repeat must lie in 0 .. {n_src - 1}, got {sources}")
    by_layer = {}  # source layer -> [(suffix, tensor)] in file order
    head, tail = [], []  # the tensors before the first layer's, and after
    for t in r.tensors:
        if t.name.startswith("blk."):
            layer, suffix = t.name.split(".", 2)[1:]
            by_layer.setdefault(int(layer), []).append((suffix, t))
        else:
            (tail if by_layer else head).append((t.name, t))
    order = head + [(f"blk.{i}.{suffix}", t) for i, j in enumerate(sources) for suffix, t in by_layer[j]] + tail
    w = GGUFWriter(dst, arch)
    copy_metadata(r, w, change={f"{arch}.block_count": len(sources)})
    for name, t in order:
        data = t.data
        w.add_tensor_info(name, data.shape, data.dtype, data.nbytes,
                          raw_dtype=None if t.tensor_type in (Q.F32, Q.F16) else t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, t in order:
        w.write_tensor_data(t.data)
    w.close()


def write_mtp_companion(model: str, dst: str, tensors, change: Optional[dict] = None) -> None:
    """An MTP companion of the GGUF `model` (what GGUFModel.attach_mtp reads, `pymoe run --spec mtp:FILE`): the
    model's metadata with block_count + 1 and nextn_predict_layers 1, and only the MTP block's tensors.
    tensors: (name, data, qtype) in stored form (float32 values for F32, the quantized bytes otherwise), named
    blk.{n_layers}.* as expected_mtp_tensors lists them. change: more metadata changes (copy_metadata's)."""
    from gguf import GGUFReader, GGUFValueType

    r = GGUFReader(model)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    key = f"{arch}.nextn_predict_layers"
    if key in r.fields and int(r.fields[key].parts[-1][0]):
        raise ValueError(f"{model}: has an MTP block of its own")
    n_layers = int(r.fields[f"{arch}.block_count"].parts[-1][0])
    name = bytes(r.fields["general.name"].parts[-1]).decode() if "general.name" in r.fields else arch
    w = GGUFWriter(dst, arch)
    copy_metadata(r, w, change={f"{arch}.block_count": n_layers + 1, "general.name": f"{name} MTP head",
                                **(change or {})})
    w.add_key_value(key, 1, GGUFValueType.UINT32)
    for tname, data, qtype in tensors:
        if qtype == Q.F32:
            w.add_tensor(tname, np.asarray(data, np.float32))
        else:
            w.add_tensor(tname, np.asarray(data), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


def write_f32_copy(src: str, dst: str) -> None:
    """Copy a GGUF with every tensor dequantized to F32 (pymoe's reference dequantizer), metadata unchanged but the
    file type. The oracle for K-quant files: llama.cpp quantizes activations to 8 bits when it multiplies by K-quant
    weights, so pymoe on the quantized file is compared with llama.cpp on this float copy (same weights, float math).
    """
    from gguf import GGUFReader

    r = GGUFReader(src)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    w = GGUFWriter(dst, arch)  # writes general.architecture itself
    copy_metadata(r, w, file_type=LlamaFileType.ALL_F32)
    for t in r.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        raw = np.asarray(t.data).view(np.uint8)
        values = quant.dequantize(raw.reshape(-1, raw.shape[-1]), t.tensor_type)  # F32 rows come back unchanged
        w.add_tensor(t.name, values.reshape(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
