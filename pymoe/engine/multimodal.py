"""Images in a prompt: where their embeddings go and at which M-RoPE positions.

What this is: `PromptMedia(tokens, pad_id, images)`: the chat template writes an image as
`<|vision_start|>` + one `<|image_pad|>` per image token + `<|vision_end|>` (engine/multimodal.expand_pads puts
as many pads as the encoder gives tokens); each run of pad tokens takes, in order, one image's projected
embeddings (pymoe/vision/encoder.py) in place of the pad token's embedding row. Positions are llama.cpp's
(mtmd_image_tokens_get_decoder_pos, mtmd_helper_eval_chunks), which are transformers' Qwen3-VL get_rope_index:
    text token at position p:                 (t, h, w) = (p, p, p), the next is p + 1
    image of rows x cols tokens starting at p: token k is (p, p + k // cols, p + k % cols),
                                               the text after it starts at p + max(rows, cols)
The model turns (t, h, w) into rotation angles by its rope.dimension_sections (engine/model.imrope_axes).
Attention stays causal in storage order: llama.cpp's M-RoPE mask (cells ordered by t, then row, then column)
is the same order for an image laid out row by row.
What this is not: the vision tower (pymoe/vision/), or prompt formatting (engine/tokenizer.py renders the template).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from pymoe.errors import PymoeError


@dataclass(frozen=True)
class ImageEmbeddings:
    """One encoded image: embeddings float32 [rows * cols, D] in raster order, its token grid, and `key`, the
    sha256 of the image's bytes (what prefix reuse compares: two images with equal pad tokens are not equal)."""

    embeddings: np.ndarray
    rows: int
    cols: int
    key: str

    @property
    def n_tokens(self) -> int:
        return self.rows * self.cols


def image_key(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def expand_pads(tokens, pad_id: int, images) -> list:
    """A rendered prompt with one pad token per image -> the same with image i's pad repeated n_tokens times."""
    out, i = [], 0
    for t in tokens:
        if t == pad_id:
            if i >= len(images):
                raise PymoeError(f"the prompt has more image places than the {len(images)} images given")
            out.extend([pad_id] * images[i].n_tokens)
            i += 1
        else:
            out.append(int(t))
    if i != len(images):
        raise PymoeError(f"{len(images)} images but the prompt has {i} image places")
    return out


@dataclass
class PromptMedia:
    """tokens [T] with runs of `pad_id` (one run per image, as many pads as its tokens) and the images, in order."""

    tokens: np.ndarray
    pad_id: int
    images: list
    rows: np.ndarray = field(init=False)  # indices of the pad tokens in `tokens`
    embeddings: np.ndarray = field(init=False)  # [len(rows), D]
    relative: np.ndarray = field(init=False)  # [T, 3] positions from 0; add where the cache stands
    next_relative: int = field(init=False)  # the position after the prompt, from 0

    def __post_init__(self):
        tokens = np.asarray(self.tokens, dtype=np.int64).reshape(-1)
        self.tokens = tokens
        pos = np.zeros((tokens.size, 3), dtype=np.int64)
        rows, p, i, k = [], 0, 0, 0
        while k < tokens.size:
            if tokens[k] != self.pad_id:
                pos[k] = p
                p, k = p + 1, k + 1
                continue
            if i >= len(self.images):
                raise PymoeError(f"the prompt has more image places than the {len(self.images)} images given")
            img = self.images[i]
            end = k + img.n_tokens
            if end > tokens.size or not np.all(tokens[k:end] == self.pad_id) or (
                    end < tokens.size and tokens[end] == self.pad_id):
                raise PymoeError(f"image {i + 1}: the prompt's run of image pad tokens is not its {img.n_tokens} "
                                 "tokens")
            j = np.arange(img.n_tokens)
            pos[k:end, 0] = p
            pos[k:end, 1] = p + j // img.cols
            pos[k:end, 2] = p + j % img.cols
            rows.extend(range(k, end))
            p, k, i = p + max(img.rows, img.cols), end, i + 1
        if i != len(self.images):
            raise PymoeError(f"{len(self.images)} images but the prompt has {i} image places")
        self.rows = np.asarray(rows, dtype=np.int64)
        self.embeddings = (np.concatenate([im.embeddings for im in self.images]) if self.images
                           else np.zeros((0, 0), np.float32))
        self.relative, self.next_relative = pos, p

    def at(self, kv) -> "MediaSlice":
        """Positions for a prompt appended where `kv` stands (its storage index plus its rope shift)."""
        get = getattr(kv, "pos_delta", None)
        base = kv.n + (get() if get is not None else 0)
        return MediaSlice(self.rows, self.embeddings, self.relative + base, self.next_relative + base)

    @property
    def key(self) -> tuple:
        """The images' identity for prefix reuse: (sha256 of each image's bytes, in order)."""
        return tuple(im.key for im in self.images)


@dataclass(frozen=True)
class MediaSlice:
    """What one forward call of rows [T] needs: `rows` to replace, their `embeddings`, every row's (t, h, w)
    `positions` [T, 3], and `next_position` (where text after these rows goes on)."""

    rows: np.ndarray
    embeddings: np.ndarray
    positions: np.ndarray
    next_position: int

    def slice(self, a: int, b: int) -> "MediaSlice":
        """The rows a..b-1 (a chunk of the prefill)."""
        keep = (self.rows >= a) & (self.rows < b)
        b = min(b, self.positions.shape[0])
        nxt = self.next_position if b == self.positions.shape[0] else int(self.positions[b - 1].max()) + 1
        return MediaSlice(self.rows[keep] - a, self.embeddings[keep], self.positions[a:b], nxt)
