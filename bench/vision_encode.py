#!/usr/bin/env python3
"""Time to turn one picture into image tokens: preprocessing and the vision tower (pymoe/vision/), median of N.

What this is: the tiny mmproj file (pymoe/demo/tinyvision.py: 2 blocks of width 32, the Qwen3.5 tower's layout),
a real one (--mmproj), or --shape qwen3vl-30b: the vision tower of Qwen3-VL-30B-A3B at its real size with seeded
random weights, held in memory (no file: 1.7 GB of float32); one synthetic picture of --size pixels
(pymoe/vision/testimages.py), the NumPy reference tower with BLAS limited to --threads threads. Prints one line per
stage and the token grid.
What this is not: llama.cpp's clip.cpp timing (it prints its own "image slice encoded in N ms").

    python bench/vision_encode.py --size 448 --threads 2
    python bench/vision_encode.py --size 448 --threads 2 --shape qwen3vl-30b --repeat 3 --warmup 0
"""
import argparse
import os
import sys
import tempfile
import time

# Qwen3-VL-30B-A3B's vision_config (transformers' Qwen3VLMoeVisionConfig defaults: depth 27, hidden_size 1152,
# intermediate_size 4304, num_heads 16, patch_size 16, spatial_merge_size 2, num_position_embeddings 2304,
# deepstack_visual_indexes 8, 16, 24) with out_hidden_size 2048, the 30B-A3B text model's width
QWEN3VL_30B = dict(n_embd=1152, n_head=16, n_ff=4304, n_layers=27, patch_size=16, merge=2, n_pos_side=48,
                   n_out=2048, eps=1e-6, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), deepstack=(8, 16, 24))


class InMemoryTower:
    """What vision/encoder.encode reads of an MMProj (`.config`, `.floats(name)`), from tinyvision's seeded weights."""

    def __init__(self, shape: dict):
        from pymoe.demo.tinyvision import vision_weights
        from pymoe.vision.mmproj import VisionConfig

        self.config = VisionConfig(
            projector="qwen3vl_merger", n_embd=shape["n_embd"], n_ff=shape["n_ff"], n_layers=shape["n_layers"],
            n_head=shape["n_head"], patch_size=shape["patch_size"], merge=shape["merge"], n_out=shape["n_out"],
            eps=shape["eps"], image_mean=shape["image_mean"], image_std=shape["image_std"],
            n_pos_side=shape["n_pos_side"], deepstack=shape["deepstack"])
        self.weights = vision_weights(0, shape)

    def floats(self, name):
        return self.weights[name]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mmproj", default=None, help="an mmproj GGUF (default: write the tiny one)")
    ap.add_argument("--n-embd", type=int, default=256, help="the language model's width the file must project to")
    ap.add_argument("--size", type=int, default=448, help="picture side in pixels")
    ap.add_argument("--threads", type=int, default=2, help="BLAS threads")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--kernels", action="store_true",
                    help="the linear layers on pymoe's CPU kernels (CPUBackend.linear) instead of NumPy's BLAS")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first (the file's float copies are made then)")
    ap.add_argument("--shape", choices=("tiny", "qwen3vl-30b"), default="tiny",
                    help="without --mmproj: the tiny file, or Qwen3-VL-30B-A3B's tower with random weights in memory")
    a = ap.parse_args()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(a.threads)  # before NumPy loads its BLAS
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import numpy as np

    from pymoe.demo.tinyvision import write_mmproj
    from pymoe.vision.encoder import encode
    from pymoe.vision.mmproj import load_mmproj
    from pymoe.vision.preprocess import preprocess
    from pymoe.vision.testimages import png_bytes

    path = a.mmproj
    if a.shape == "qwen3vl-30b" and path is None:
        path = "Qwen3-VL-30B-A3B tower (random weights)"
        m = InMemoryTower(QWEN3VL_30B)
    else:
        if path is None:
            path = os.path.join(tempfile.mkdtemp(), "mmproj-tiny.gguf")
            write_mmproj(path)
        m = load_mmproj(path, a.n_embd)
    data = png_bytes(a.size, a.size)
    backend = None
    if a.kernels:
        from pymoe.backends.cpu import CPUBackend
        if not hasattr(m, "dense"):
            ap.error("--kernels needs an mmproj file (the in-memory tower has no file rows)")
        backend = CPUBackend(threads=a.threads)
    for _ in range(a.warmup):
        encode(preprocess(data, m.config), m, backend)  # float copies (or kernel weights) made once, on first use
    pre, enc = [], []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        px = preprocess(data, m.config)
        t1 = time.perf_counter()
        out = encode(px, m, backend)
        pre.append((t1 - t0) * 1e3)
        enc.append((time.perf_counter() - t1) * 1e3)
    print(f"{a.size}x{a.size}, {a.threads} threads, {'pymoe kernels' if a.kernels else 'NumPy'}, "
          f"{os.path.basename(path)}: {out.shape[0]} image tokens "
          f"of width {out.shape[1]}")
    print(f"preprocess {np.median(pre):.0f} ms, encode {np.median(enc):.0f} ms (median of {a.repeat}; "
          f"encode min {min(enc):.0f}, max {max(enc):.0f})")


if __name__ == "__main__":
    main()
