"""A tiny qwen3vl mmproj file, written the way llama.cpp's converter writes one (same metadata keys, same tensor
names and types), with seeded random weights: the vision half of a tiny multimodal pair for tests and benchmarks.

What this is: `vision_weights(seed)` (the weights, by GGUF name, from NumPy's seeded generator alone, so the
oracle script can load the very same numbers into transformers' Qwen3.5 vision tower) and `write_mmproj(path)`.
tools/make-vision-oracle checks that this writer's file equals the converter's (convert_hf_to_gguf.py --mmproj
--outtype f32) key by key and tensor by tensor, and records transformers' outputs in tests/data/vision_oracle.npz.
What this is not: trained. Imports only NumPy and gguf, so the oracle's separate venv can import it.
"""
from __future__ import annotations

import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType

# The tower's shape (a Qwen3.5 tower shrunk): D 32, 2 heads of 16, FFN 64, 2 blocks, 16-pixel patches, 2x2 merge,
# an 8 x 8 table of learned positions (image_size 128), output 256 = the tiny qwen35moe's n_embd.
TINY = dict(n_embd=32, n_head=2, n_ff=64, n_layers=2, patch_size=16, merge=2, n_pos_side=8, n_out=256, eps=1e-6,
            image_mean=(0.48145466, 0.4578275, 0.40821073), image_std=(0.26862954, 0.26130258, 0.27577711))
# Qwen3-VL's tower at the same size: both blocks feed a deepstack merger (Qwen3-VL-30B-A3B: blocks 8, 16, 24 of 27),
# output 256 = the tiny qwen3vlmoe's n_embd, whose n_deepstack_layers is 2.
TINY_DEEPSTACK = dict(TINY, deepstack=(0, 1))


def vision_weights(seed: int = 0, shape: dict = TINY) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array in NumPy shape (the converter's names; conversion/qwen3vl.py)."""
    rng = np.random.default_rng(seed)
    D, F, P, n = shape["n_embd"], shape["n_ff"], shape["patch_size"], shape["n_layers"]
    M = D * shape["merge"] ** 2

    def mat(rows, cols):  # unit-variance outputs for unit-variance inputs
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def vec(k, base=0.0, scale=0.1):
        return (base + scale * rng.standard_normal(k)).astype(np.float32)

    w = {"v.patch_embd.weight": (rng.standard_normal((D, 3, P, P)) / np.sqrt(6 * P * P)).astype(np.float32),
         "v.patch_embd.weight.1": (rng.standard_normal((D, 3, P, P)) / np.sqrt(6 * P * P)).astype(np.float32),
         "v.patch_embd.bias": vec(D),
         "v.position_embd.weight": (0.5 * rng.standard_normal((shape["n_pos_side"] ** 2, D))).astype(np.float32)}
    for i in range(n):
        b = f"v.blk.{i}."
        w.update({b + "ln1.weight": vec(D, 1.0), b + "ln1.bias": vec(D),
                  b + "attn_qkv.weight": mat(3 * D, D), b + "attn_qkv.bias": vec(3 * D),
                  b + "attn_out.weight": mat(D, D), b + "attn_out.bias": vec(D),
                  b + "ln2.weight": vec(D, 1.0), b + "ln2.bias": vec(D),
                  b + "ffn_up.weight": mat(F, D), b + "ffn_up.bias": vec(F),
                  b + "ffn_down.weight": mat(D, F), b + "ffn_down.bias": vec(D)})
    w.update({"v.post_ln.weight": vec(D, 1.0), "v.post_ln.bias": vec(D),
              "mm.0.weight": mat(M, M), "mm.0.bias": vec(M),
              "mm.2.weight": mat(shape["n_out"], M), "mm.2.bias": vec(shape["n_out"])})
    for i in shape.get("deepstack", ()):  # conversion/qwen3vl.py: visual.deepstack_merger_list.k -> v.deepstack.i
        b = f"v.deepstack.{i}."
        w.update({b + "norm.weight": vec(M, 1.0), b + "norm.bias": vec(M), b + "fc1.weight": mat(M, M),
                  b + "fc1.bias": vec(M), b + "fc2.weight": mat(shape["n_out"], M), b + "fc2.bias": vec(shape["n_out"])})
    return w


def write_mmproj(path: str, seed: int = 0, shape: dict = TINY, f16: bool = False) -> None:
    """An mmproj GGUF with the metadata convert_hf_to_gguf.py writes for Qwen3_5MoeForConditionalGeneration
    (MmprojModel.set_gguf_parameters + Qwen3VLVisionModel.set_gguf_parameters), all tensors F32; f16: the linear
    layers' 2-D weights F16 instead (as in the mmproj-*-F16.gguf files people download; the weights are rounded)."""
    w = GGUFWriter(path, "clip")
    w.add_type("mmproj")
    w.add_file_type(1 if f16 else 0)  # --outtype f32 (LlamaFileType.ALL_F32), f16 (MOSTLY_F16)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.projection_dim", shape["n_out"])
    w.add_uint32("clip.vision.image_size", shape["n_pos_side"] * shape["patch_size"])
    w.add_uint32("clip.vision.patch_size", shape["patch_size"])
    w.add_uint32("clip.vision.embedding_length", shape["n_embd"])
    w.add_uint32("clip.vision.feed_forward_length", shape["n_ff"])
    w.add_uint32("clip.vision.block_count", shape["n_layers"])
    w.add_uint32("clip.vision.attention.head_count", shape["n_head"])
    w.add_array("clip.vision.image_mean", list(shape["image_mean"]))
    w.add_array("clip.vision.image_std", list(shape["image_std"]))
    w.add_string("clip.projector_type", "qwen3vl_merger")
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.spatial_merge_size", shape["merge"])
    w.add_float32("clip.vision.attention.layer_norm_epsilon", shape["eps"])
    deep = shape.get("deepstack", ())  # Qwen3.5: none
    w.add_array("clip.vision.is_deepstack_layers", [i in deep for i in range(shape["n_layers"])])
    for name, arr in vision_weights(seed, shape).items():
        if f16 and arr.ndim == 2 and name.endswith(".weight") and name != "v.position_embd.weight":
            w.add_tensor(name, arr.astype(np.float16), raw_dtype=GGMLQuantizationType.F16)
        else:
            w.add_tensor(name, arr, raw_dtype=GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
