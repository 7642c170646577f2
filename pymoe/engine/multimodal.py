"""Images in a prompt: where their embeddings go and at which M-RoPE positions.

What this is: `tokens_with_images` writes each image where the rendered prompt has a <__media__> marker, as
`<|vision_start|>` + one `<|image_pad|>` per image token + `<|vision_end|>` (what llama.cpp's mtmd_tokenize
makes); `PromptMedia(tokens, pad_id, images, starts)` gives each run of pad tokens, in order, one image's
projected embeddings (pymoe/vision/encoder.py) in place of the pad token's embedding row. Positions are llama.cpp's
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
from typing import Optional

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


MEDIA_MARKER = "<__media__>"  # where an image goes in a prompt's text (llama.cpp's mtmd_default_marker)
VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"  # Qwen-VL's


class ImagePrompt(list):
    """Token ids (a list, usable wherever ids are) that carry their images: `.media` (a PromptMedia)."""

    def __init__(self, ids, media: "PromptMedia"):
        super().__init__(ids)
        self.media = media


def tokens_with_images(tokenizer, text: str, images: list) -> ImagePrompt:
    """A rendered prompt whose text holds one MEDIA_MARKER per image -> ids with, at each marker,
    <|vision_start|> + one <|image_pad|> per image token + <|vision_end|> (what mtmd_tokenize makes for a
    Qwen-VL projector; the markers are read as special tokens when the vocabulary has them, as text otherwise)."""
    pieces = text.split(MEDIA_MARKER)
    if len(pieces) - 1 != len(images):
        raise PymoeError(f"{len(images)} images but the prompt has {len(pieces) - 1} image places ({MEDIA_MARKER})")
    pad = tokenizer.encode(IMAGE_PAD, add_bos=False)
    pad_id = pad[0] if len(pad) == 1 else 0  # a placeholder: its embedding row is replaced
    ids, starts = list(tokenizer.encode(pieces[0])), []
    for img, piece in zip(images, pieces[1:]):
        ids += tokenizer.encode(VISION_START, add_bos=False)
        starts.append(len(ids))
        ids += [pad_id] * img.n_tokens
        ids += tokenizer.encode(VISION_END, add_bos=False)
        if piece:
            ids += tokenizer.encode(piece, add_bos=False)
    return ImagePrompt(ids, PromptMedia(np.asarray(ids), pad_id, list(images), starts))


def image_key(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pad_runs(tokens: np.ndarray, pad_id: int) -> list:
    """Start index of each run of pad_id in tokens."""
    is_pad = tokens == pad_id
    return [int(i) for i in np.flatnonzero(is_pad & ~np.concatenate([[False], is_pad[:-1]]))]


@dataclass
class PromptMedia:
    """tokens [T] with one run of pad tokens per image (as many as its tokens) and the images, in order."""

    tokens: np.ndarray
    pad_id: int  # the image pad token (where `starts` is not given, runs of it mark the images)
    images: list
    starts: Optional[list] = None  # index of each image's first token; None: the runs of pad_id
    rows: np.ndarray = field(init=False)  # indices of the pad tokens in `tokens`
    embeddings: np.ndarray = field(init=False)  # [len(rows), D]
    relative: np.ndarray = field(init=False)  # [T, 3] positions from 0; add where the cache stands
    next_relative: int = field(init=False)  # the position after the prompt, from 0

    def __post_init__(self):
        tokens = np.asarray(self.tokens, dtype=np.int64).reshape(-1)
        self.tokens = tokens
        starts = self.starts if self.starts is not None else pad_runs(tokens, self.pad_id)
        if len(starts) != len(self.images):
            raise PymoeError(f"{len(self.images)} images but the prompt has {len(starts)} image places")
        pos = np.zeros((tokens.size, 3), dtype=np.int64)
        rows, p, k = [], 0, 0
        for i, (start, img) in enumerate(zip(starts, self.images)):
            end = start + img.n_tokens
            if start < k or end > tokens.size:
                raise PymoeError(f"image {i + 1}: its {img.n_tokens} tokens do not fit the prompt where it is")
            pos[k:start] = (p + np.arange(start - k))[:, None]  # the text before it
            p += start - k
            j = np.arange(img.n_tokens)
            pos[start:end, 0] = p
            pos[start:end, 1] = p + j // img.cols
            pos[start:end, 2] = p + j % img.cols
            rows.extend(range(start, end))
            p, k = p + max(img.rows, img.cols), end
        pos[k:] = (p + np.arange(tokens.size - k))[:, None]
        self.rows = np.asarray(rows, dtype=np.int64)
        self.embeddings = (np.concatenate([im.embeddings for im in self.images]) if self.images
                           else np.zeros((0, 0), np.float32))
        self.relative, self.next_relative = pos, p + tokens.size - k

    @property
    def start_rows(self) -> list:
        """Index of each image's first token."""
        out, k = [], 0
        for img in self.images:
            out.append(int(self.rows[k]))
            k += img.n_tokens
        return out

    def from_start(self) -> "MediaSlice":
        """Positions for the prompt at the start of a sequence (position 0)."""
        return MediaSlice(self.rows, self.embeddings, self.relative, self.next_relative)

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
