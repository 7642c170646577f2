"""A deterministic test picture (NumPy only): colour gradients, a disc and stripes, so every channel and both
axes carry structure that a transposed or flipped patch order would change."""
from __future__ import annotations

import numpy as np


def picture(width: int, height: int) -> np.ndarray:
    """uint8 [height, width, 3]."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    r = 255 * x / max(1, width - 1)
    g = 255 * y / max(1, height - 1)
    b = 127 + 127 * np.sin(x / 7.0) * np.cos(y / 11.0)
    disc = (x - 0.6 * width) ** 2 + (y - 0.4 * height) ** 2 < (0.2 * min(width, height)) ** 2
    r = np.where(disc, 255 - r, r)
    stripes = (x.astype(np.int64) // 9) % 2 == 0
    g = np.where(stripes & (y > height / 2), 0.5 * g, g)
    return np.clip(np.stack([r, g, b], -1).round(), 0, 255).astype(np.uint8)


def png_bytes(width: int, height: int) -> bytes:
    import io
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(picture(width, height)).save(buf, format="PNG")
    return buf.getvalue()
