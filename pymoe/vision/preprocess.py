"""Image bytes -> the normalised pixel grid the vision tower reads. NumPy + Pillow.

What this is: Qwen2-VL's image processor (transformers `Qwen2VLImageProcessor`, which Qwen3-VL and Qwen3.5 use),
step by step: decode to RGB; `smart_resize` to sides that are multiples of patch_size x merge (32 pixels for
Qwen3-VL), keeping the aspect ratio and the pixel count inside [min_pixels, max_pixels]; bicubic resize (Pillow's,
as transformers' slow processor); scale to [0, 1]; normalise with the mmproj file's image_mean / image_std.
Patching (the grid cut into patch_size squares, in merge order) is the encoder's first step (encoder.py).
What this is not: video, or llama.cpp's own bicubic (clip.cpp resizes with its own code, so its pixels differ from
Pillow's in the last bits; pymoe follows the model's processor).

Token budget: llama.cpp's clip.cpp bounds a qwen-VL image to 8..4096 merged tokens; pymoe uses the same bounds.
"""
from __future__ import annotations

import io
import math

import numpy as np

from pymoe.errors import PymoeError

MIN_TOKENS, MAX_TOKENS = 8, 4096  # clip.cpp: hparams.set_limit_image_tokens(8, 4096) for the qwen-VL projectors


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' qwen2_vl smart_resize: sides rounded to multiples of `factor`, area kept in bounds."""
    if max(height, width) / min(height, width) > 200:
        raise PymoeError(f"image aspect ratio {max(height, width) / min(height, width):.0f} is over 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def decode_image(data: bytes, where: str = "image"):
    """Bytes of a PNG/JPEG/... -> a Pillow RGB image; one-line error when Pillow cannot read them."""
    from PIL import Image, UnidentifiedImageError
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise PymoeError(f"{where}: not an image Pillow can read ({type(e).__name__})") from None
    return img.convert("RGB")


def preprocess(data: bytes, cfg, where: str = "image") -> np.ndarray:
    """Image bytes -> float32 [3, H, W], H and W multiples of patch_size * merge, normalised per channel."""
    from PIL import Image
    img = decode_image(data, where)
    factor = cfg.patch_size * cfg.merge
    h, w = smart_resize(img.height, img.width, factor, MIN_TOKENS * factor * factor, MAX_TOKENS * factor * factor)
    if (w, h) != img.size:
        img = img.resize((w, h), Image.BICUBIC)
    x = np.asarray(img, dtype=np.float32).transpose(2, 0, 1) / 255.0  # [3, H, W] in [0, 1]
    mean = np.asarray(cfg.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(cfg.image_std, dtype=np.float32)[:, None, None]
    return ((x - mean) / std).astype(np.float32)
