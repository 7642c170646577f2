"""The qwen3vl vision tower in NumPy: normalised pixels -> one embedding per merged 2x2 patch group, in the
language model's width. The readable reference (float32 throughout).

What this is: clip.cpp's `clip_graph_qwen3vl::build` (qwen3vl.cpp in llama.cpp's mtmd models), which is transformers'
`Qwen3VLVisionModel` (Qwen3-VL, Qwen3.5), step by step:
  1. patches: the [3, H, W] grid cut into P x P squares, ordered in merge groups (row of groups, column of groups,
     then dy, dx inside a group), as clip.cpp's spatial-merge permute and HF's processor order them
  2. patch embedding: the Conv3D over two identical frames is one matmul with (W0 + W1) (the converter splits it)
  3. learned position embeddings, bilinearly resized (align corners) from the n x n grid to the image's grid
  4. blocks: LayerNorm -> attention (fused qkv, 2-D RoPE: a quarter of the head rotates by the patch's row, a
     quarter by its column, NeoX halves; full attention over the image) -> residual -> LayerNorm -> GELU MLP
  5. merger: LayerNorm per patch, 2x2 neighbours side by side (4D wide), fc1 -> GELU -> fc2 to the model's width
Numerics: the block MLP's GELU is the tanh form (HF gelu_pytorch_tanh; ggml_gelu); the merger's is the erf form
(HF nn.GELU; clip.cpp uses the tanh form there too, a difference below 1e-3 per activation).
  6. deepstack (Qwen3-VL): the output of each block marked in the file goes, 2x2 neighbours side by side, through
     its own merger (LayerNorm over the 4D-wide row, fc1 -> GELU -> fc2); those rows follow the main output's,
     feature-wise (clip.cpp's ggml_concat along the width): [T, O (1 + n_deepstack)]
Kernels: `encode(pixels, m, backend)` runs every linear layer of the blocks, the merger and the deepstack mergers
(qkv, attn_out, ffn_up, ffn_down, mm.0, mm.2, fc1, fc2) through a pymoe backend's `linear` on the file's own rows
(F32, F16, Q8_0 as stored: backends/cpu.CPUBackend), the rest (patch embedding, norms, RoPE, softmax attention)
in NumPy; `backend=None` is the NumPy reference, float32 copies and BLAS, which tests/test_vision_kernels.py holds
the kernel path to, block by block.
What this is not: video, the language side (engine/multimodal.py, engine/model.py adds the deepstack parts).

Legend: N patches, T = N / merge^2 tokens, D ViT width, H heads, hd head size, O the model's embedding width.
"""
from __future__ import annotations

import numpy as np

from .mmproj import MMProj, VisionConfig

ROPE_THETA = 10000.0  # clip.cpp: ggml_rope_multi(..., freq_base 10000); HF VisionRotaryEmbedding(theta=10000)


def grid(pixels: np.ndarray, c: VisionConfig) -> tuple[int, int]:
    """(rows, cols) of patches of a [3, H, W] image."""
    return pixels.shape[1] // c.patch_size, pixels.shape[2] // c.patch_size


def patchify(pixels: np.ndarray, c: VisionConfig) -> np.ndarray:
    """[3, H, W] -> [N, 3 * P * P] patches in merge order (group row, group column, dy, dx)."""
    P, m = c.patch_size, c.merge
    gh, gw = grid(pixels, c)
    x = pixels.reshape(3, gh // m, m, P, gw // m, m, P)  # c, by, dy, py, bx, dx, px
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # by, bx, dy, dx, c, py, px
    return np.ascontiguousarray(x.reshape(gh * gw, 3 * P * P))


def patch_positions(gh: int, gw: int, merge: int) -> np.ndarray:
    """int [N, 2]: each patch's (row, column), in merge order (clip.cpp's "positions" input)."""
    r, cidx = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    pos = np.stack([r, cidx], -1).reshape(gh // merge, merge, gw // merge, merge, 2).transpose(0, 2, 1, 3, 4)
    return pos.reshape(-1, 2)


def position_embeddings(table: np.ndarray, side: int, gh: int, gw: int, merge: int) -> np.ndarray:
    """[side*side, D] learned table -> [N, D] for a gh x gw grid, bilinear with aligned corners (HF
    fast_pos_embed_interpolate; clip.cpp GGML_SCALE_MODE_BILINEAR | ALIGN_CORNERS), in merge order."""
    t = table.reshape(side, side, -1)
    ys, xs = np.linspace(0, side - 1, gh), np.linspace(0, side - 1, gw)
    y0, x0 = ys.astype(np.int64), xs.astype(np.int64)
    y1, x1 = np.minimum(y0 + 1, side - 1), np.minimum(x0 + 1, side - 1)
    dy, dx = (ys - y0)[:, None, None], (xs - x0)[None, :, None]
    out = ((1 - dy) * (1 - dx) * t[y0][:, x0] + (1 - dy) * dx * t[y0][:, x1]
           + dy * (1 - dx) * t[y1][:, x0] + dy * dx * t[y1][:, x1])  # [gh, gw, D]
    pos = patch_positions(gh, gw, merge)
    return out[pos[:, 0], pos[:, 1]].astype(np.float32)


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x * x * x)))


def erf(x: np.ndarray) -> np.ndarray:
    """Abramowitz & Stegun 7.1.26: |error| <= 1.5e-7, below float32's resolution of the GELU around it."""
    s = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t \
        * np.exp(-a * a)
    return (s * y).astype(x.dtype)


def gelu_erf(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + erf(x * np.float32(0.7071067811865476)))


def rope_2d(x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """x [N, H, hd], pos [N, 2] -> x rotated: dims (i, i + hd/2) for i < hd/4 by row * f_i, for hd/4 <= i < hd/2
    by column * f_(i - hd/4), f_j = theta^(-4j / hd) (NeoX halves; clip.cpp GGML_ROPE_TYPE_VISION)."""
    hd = x.shape[-1]
    q = hd // 4
    inv = ROPE_THETA ** (-np.arange(q, dtype=np.float64) * 4.0 / hd)  # [hd/4]
    ang = np.concatenate([pos[:, :1] * inv, pos[:, 1:] * inv], axis=1)  # [N, hd/2]
    cos, sin = np.cos(ang)[:, None, :].astype(np.float32), np.sin(ang)[:, None, :].astype(np.float32)
    a, b = x[..., :hd // 2], x[..., hd // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def linear(x: np.ndarray, m: MMProj, name: str, backend=None) -> np.ndarray:
    """x [N, C] @ W.T + b for the tower's `name`.weight [R, C] and `name`.bias: NumPy on float32 copies (backend
    None), or the backend's kernel on the file's rows (`MMProj.dense`)."""
    if backend is None:
        y = x @ m.floats(name + ".weight").T
    else:
        y = backend.linear(m.dense(name + ".weight", backend), np.ascontiguousarray(x, dtype=np.float32))
    return y + m.floats(name + ".bias")


def attention(x: np.ndarray, m: MMProj, i: int, pos: np.ndarray, backend=None) -> np.ndarray:
    c = m.config
    N, H, hd = x.shape[0], c.n_head, c.head_dim
    qkv = linear(x, m, f"v.blk.{i}.attn_qkv", backend).reshape(N, 3, H, hd)  # [N, 3, H, hd]
    q, k, v = (a.transpose(1, 0, 2) for a in (rope_2d(qkv[:, 0], pos), rope_2d(qkv[:, 1], pos), qkv[:, 2]))
    s = (q @ k.transpose(0, 2, 1)) * np.float32(1.0 / np.sqrt(hd))  # [H, N, N] (matmul: BLAS; einsum is not)
    s -= s.max(-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(-1, keepdims=True)
    o = (s @ v).transpose(1, 0, 2).reshape(N, c.n_embd)  # [H, N, hd] -> [N, D]
    return linear(o, m, f"v.blk.{i}.attn_out", backend)


def block(x: np.ndarray, m: MMProj, i: int, pos: np.ndarray, backend=None) -> np.ndarray:
    c = m.config
    f = lambda n: m.floats(f"v.blk.{i}.{n}")  # noqa: E731
    x = x + attention(layer_norm(x, f("ln1.weight"), f("ln1.bias"), c.eps), m, i, pos, backend)
    h = layer_norm(x, f("ln2.weight"), f("ln2.bias"), c.eps)
    h = gelu_tanh(linear(h, m, f"v.blk.{i}.ffn_up", backend))  # [N, F]
    return x + linear(h, m, f"v.blk.{i}.ffn_down", backend)


def encode(pixels: np.ndarray, m: MMProj, backend=None) -> np.ndarray:
    """Normalised [3, H, W] (preprocess.py) -> float32 [T, O (1 + n_deepstack)], T = (H/P/merge) * (W/P/merge)
    image tokens. backend: a pymoe backend whose `linear` runs the linear layers (None: NumPy)."""
    c = m.config
    gh, gw = grid(pixels, c)
    w = m.floats("v.patch_embd.weight") + m.floats("v.patch_embd.weight.1")  # [D, 3, P, P]: two equal frames
    x = patchify(pixels, c) @ w.reshape(c.n_embd, -1).T + m.floats("v.patch_embd.bias")  # [N, D]
    x = x + position_embeddings(m.floats("v.position_embd.weight"), c.n_pos_side, gh, gw, c.merge)
    pos = patch_positions(gh, gw, c.merge)
    deep = []
    for i in range(c.n_layers):
        x = block(x, m, i, pos, backend)
        if i in c.deepstack:
            deep.append(deepstack_merger(x, m, i, backend))
    x = layer_norm(x, m.floats("v.post_ln.weight"), m.floats("v.post_ln.bias"), c.eps)
    x = x.reshape(-1, c.n_embd * c.merge * c.merge)  # [T, 4D]: a group's patches are consecutive rows
    x = gelu_erf(linear(x, m, "mm.0", backend))
    x = linear(x, m, "mm.2", backend)  # [T, O]
    return np.concatenate([x] + deep, axis=1).astype(np.float32)  # [T, O (1 + n_deepstack)]


def deepstack_merger(x: np.ndarray, m: MMProj, i: int, backend=None) -> np.ndarray:
    """Block i's output [N, D] -> [T, O]: 2x2 neighbours side by side, LayerNorm over the 4D row, fc1 -> GELU ->
    fc2 (HF Qwen3VLVisionPatchMerger(use_postshuffle_norm=True), clip.cpp's deepstack branch)."""
    c = m.config
    f = lambda n: m.floats(f"v.deepstack.{i}.{n}")  # noqa: E731
    h = layer_norm(x.reshape(-1, c.n_embd * c.merge * c.merge), f("norm.weight"), f("norm.bias"), c.eps)
    h = gelu_erf(linear(h, m, f"v.deepstack.{i}.fc1", backend))
    return linear(h, m, f"v.deepstack.{i}.fc2", backend)
