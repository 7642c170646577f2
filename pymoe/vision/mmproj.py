"""mmproj GGUF -> `VisionConfig` + the vision tower's tensors. Validation with one-line errors.

What this is: the one place pymoe opens a multimodal projector file, the second GGUF that llama.cpp's converter
writes beside a multimodal model (`convert_hf_to_gguf.py --mmproj`, `general.architecture = clip`). It reads the
`clip.*` metadata with gguf-py's `GGUFReader` (through the model loader's `_open_reader`, so a broken file is a
one-line error), checks that the projector is one pymoe runs, that every tensor it needs is there with the shape the
metadata implies, and that the projector's output width is the model's embedding width.
What this is not: the encoder (encoder.py) or image preprocessing (preprocess.py).

Projector types run here (clip.cpp's PROJECTOR_TYPE_*): `qwen3vl_merger` (PROJECTOR_TYPE_QWEN3VL: Qwen3-VL and
Qwen3.5 vision towers, the converter's `Qwen3VLVisionModel`), with deepstack layers (Qwen3-VL: the blocks marked in
`clip.vision.is_deepstack_layers` feed mergers `v.deepstack.N.*` whose outputs go to the language model's first
layers, a `qwen3vlmoe` model's `n_deepstack_layers`) or without (Qwen3.5).

Finding the file: `--mmproj FILE` names it. Without it, `find_mmproj(model)` takes the one `mmproj*.gguf` in the
model's folder: llama.cpp picks an mmproj file by that name pattern when it fetches a model repository (`-hf`),
and downloaded repositories lay the pair out that way; two candidates are an error that asks for `--mmproj`.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import numpy as np

from pymoe.errors import PymoeError
from pymoe.gguf.loader import Tensor, _field_value, _open_reader, expected_tensor

PROJECTORS = ("qwen3vl_merger",)  # clip-impl.h PROJECTOR_TYPE_NAMES: PROJECTOR_TYPE_QWEN3VL


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's hyperparameters, from the mmproj file's `clip.vision.*` keys only."""

    projector: str  # clip.projector_type, e.g. "qwen3vl"
    n_embd: int  # clip.vision.embedding_length: the ViT width
    n_ff: int  # clip.vision.feed_forward_length
    n_layers: int  # clip.vision.block_count
    n_head: int  # clip.vision.attention.head_count
    patch_size: int  # clip.vision.patch_size (pixels per patch side)
    merge: int  # clip.vision.spatial_merge_size: merge x merge patches become one token
    n_out: int  # clip.vision.projection_dim: the language model's embedding width
    eps: float  # clip.vision.attention.layer_norm_epsilon
    image_mean: tuple  # per channel, applied after scaling pixels to [0, 1]
    image_std: tuple
    n_pos_side: int  # learned position embeddings form an n_pos_side x n_pos_side grid
    deepstack: tuple = ()  # the blocks whose output feeds a deepstack merger (clip.vision.is_deepstack_layers)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def expected_tensors(c: VisionConfig) -> dict[str, tuple]:
    """name -> NumPy shape, as convert_hf_to_gguf.py (conversion/qwen3vl.py) writes a qwen3vl mmproj file."""
    D, F, P = c.n_embd, c.n_ff, c.patch_size
    M = D * c.merge * c.merge  # the merger's width: merge^2 neighbouring patches side by side
    t = {
        "v.patch_embd.weight": (D, 3, P, P),  # the Conv3D's first temporal slice (conv as matmul: D x 3PP)
        "v.patch_embd.weight.1": (D, 3, P, P),  # its second temporal slice
        "v.patch_embd.bias": (D,),
        "v.position_embd.weight": (c.n_pos_side * c.n_pos_side, D),
        "v.post_ln.weight": (D,), "v.post_ln.bias": (D,),  # HF merger.norm (LayerNorm before the merge)
        "mm.0.weight": (M, M), "mm.0.bias": (M,),  # HF merger.linear_fc1
        "mm.2.weight": (c.n_out, M), "mm.2.bias": (c.n_out,),  # HF merger.linear_fc2
    }
    for i in range(c.n_layers):
        b = f"v.blk.{i}."
        t.update({b + "ln1.weight": (D,), b + "ln1.bias": (D,), b + "ln2.weight": (D,), b + "ln2.bias": (D,),
                  b + "attn_qkv.weight": (3 * D, D), b + "attn_qkv.bias": (3 * D,),
                  b + "attn_out.weight": (D, D), b + "attn_out.bias": (D,),
                  b + "ffn_up.weight": (F, D), b + "ffn_up.bias": (F,),
                  b + "ffn_down.weight": (D, F), b + "ffn_down.bias": (D,)})
    for i in c.deepstack:  # HF Qwen3VLVisionPatchMerger(use_postshuffle_norm=True): LayerNorm over the merged 4D
        b = f"v.deepstack.{i}."
        t.update({b + "norm.weight": (M,), b + "norm.bias": (M,), b + "fc1.weight": (M, M), b + "fc1.bias": (M,),
                  b + "fc2.weight": (c.n_out, M), b + "fc2.bias": (c.n_out,)})
    return t


class MMProj:
    """An opened, validated mmproj file: `.config` (VisionConfig), `.path`, `.floats(name)` (float32 weights)."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self.reader = _open_reader(self.path)
        where = f"{self.path}: "
        get = self._getter(where)
        arch = get("general.architecture")
        if arch != "clip":
            raise PymoeError(f"{where}not an mmproj file (general.architecture is {arch!r}, not 'clip')")
        if not get("clip.has_vision_encoder", False):
            raise PymoeError(f"{where}has no vision encoder (clip.has_vision_encoder is not true)")
        projector = get("clip.vision.projector_type", None) or get("clip.projector_type")
        if projector not in PROJECTORS:
            raise PymoeError(f"{where}clip.projector_type is {projector!r}; pymoe runs {', '.join(PROJECTORS)}")
        deepstack = tuple(i for i, d in enumerate(get("clip.vision.is_deepstack_layers", [])) if d)
        if deepstack and deepstack[-1] >= int(get("clip.vision.block_count")):
            raise PymoeError(f"{where}clip.vision.is_deepstack_layers marks block {deepstack[-1]} but the tower has "
                             f"{int(get('clip.vision.block_count'))} blocks")
        tensors = {t.name: Tensor(t.name, t.tensor_type, tuple(int(n) for n in reversed(t.shape)), t.data)
                   for t in self.reader.tensors}
        pos = tensors.get("v.position_embd.weight")
        if pos is None:
            raise PymoeError(f"{where}missing tensor v.position_embd.weight")
        n_pos = int(np.prod(pos.shape)) // max(1, int(get("clip.vision.embedding_length")))
        side = int(round(n_pos ** 0.5))
        if side * side != n_pos:
            raise PymoeError(f"{where}v.position_embd.weight has {n_pos} positions, not a square grid")
        D, H = int(get("clip.vision.embedding_length")), int(get("clip.vision.attention.head_count"))
        if H <= 0 or D % H or (D // H) % 4:
            raise PymoeError(f"{where}clip.vision.embedding_length {D} / attention.head_count {H} must give a "
                             "head size divisible by 4 (2-D RoPE: a quarter of it per axis and half)")
        self.config = VisionConfig(
            projector=projector, n_embd=D, n_ff=int(get("clip.vision.feed_forward_length")),
            n_layers=int(get("clip.vision.block_count")), n_head=H, patch_size=int(get("clip.vision.patch_size")),
            merge=int(get("clip.vision.spatial_merge_size", 2)), n_out=int(get("clip.vision.projection_dim")),
            eps=float(get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
            image_mean=tuple(float(v) for v in get("clip.vision.image_mean")),
            image_std=tuple(float(v) for v in get("clip.vision.image_std")), n_pos_side=side, deepstack=deepstack)
        if len(self.config.image_mean) != 3 or len(self.config.image_std) != 3:
            raise PymoeError(f"{where}clip.vision.image_mean and image_std must have 3 values (RGB)")
        self.tensors = {}
        for name, shape in expected_tensors(self.config).items():
            self.tensors[name] = expected_tensor(tensors, name, shape, where)
        file_size = os.path.getsize(self.path)
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > file_size:
                raise PymoeError(f"{where}truncated: tensor {t.name} ends at byte {t.data_offset + t.n_bytes} "
                                 f"but the file has {file_size} bytes")
        self._floats: dict[str, np.ndarray] = {}
        self._dense: dict = {}

    def _getter(self, where: str):
        def get(key, default=KeyError):
            value = _field_value(self.reader, key)
            if value is None:
                if default is KeyError:
                    raise PymoeError(f"{where}missing metadata key {key}")
                return default
            return value
        return get

    def floats(self, name: str) -> np.ndarray:
        """float32 weights of tensor `name` in NumPy shape, dequantized once and kept (the tower is small)."""
        if name not in self._floats:
            self._floats[name] = self.tensors[name].floats()
        return self._floats[name]

    def dense(self, name: str, backend):
        """`backend.dense` of tensor `name` (the file's rows, as stored), made once per backend."""
        key = (id(backend), name)
        if key not in self._dense:
            self._dense[key] = (backend, backend.dense(self.tensors[name]))  # the backend kept: its id stays its own
        return self._dense[key][1]

    def check_model(self, n_embd: int, model_path: str = "the model", n_deepstack: int = 0) -> None:
        """The projector's output must be the language model's embedding width (its rows replace token rows), and
        its deepstack mergers as many as the model's deepstack layers (llama.cpp: n_embd_inp = n_embd (1 + n))."""
        if self.config.n_out != n_embd:
            raise PymoeError(f"{self.path}: clip.vision.projection_dim is {self.config.n_out} but {model_path} has "
                             f"embedding width {n_embd}: this mmproj file belongs to another model")
        if len(self.config.deepstack) != n_deepstack:
            raise PymoeError(f"{self.path}: clip.vision.is_deepstack_layers marks {len(self.config.deepstack)} "
                             f"deepstack layers but {model_path} has n_deepstack_layers {n_deepstack}: this mmproj "
                             "file belongs to another model")


def find_mmproj(model_path: str | os.PathLike) -> str | None:
    """The one `mmproj*.gguf` beside `model_path`, None when there is none; two or more is an error."""
    folder = os.path.dirname(os.path.abspath(str(model_path)))
    found = sorted(glob.glob(os.path.join(glob.escape(folder), "mmproj*.gguf")))
    if len(found) > 1:
        raise PymoeError(f"{model_path}: {len(found)} mmproj*.gguf files beside the model "
                         f"({', '.join(os.path.basename(f) for f in found)}): name one with --mmproj")
    return found[0] if found else None


def load_mmproj(path, n_embd: int | None = None, model_path: str = "the model", n_deepstack: int = 0) -> MMProj:
    m = MMProj(path)
    if n_embd is not None:
        m.check_model(n_embd, model_path, n_deepstack)
    return m
