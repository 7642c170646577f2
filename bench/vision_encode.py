#!/usr/bin/env python3
"""Time to turn one picture into image tokens: preprocessing and the vision tower (pymoe/vision/), median of N.

What this is: the tiny mmproj file (pymoe/demo/tinyvision.py: 2 blocks of width 32, the Qwen3.5 tower's layout)
or a real one (--mmproj), one synthetic picture of --size pixels (pymoe/vision/testimages.py), the NumPy
reference tower with BLAS limited to --threads threads. Prints one line per stage and the token grid.
What this is not: llama.cpp's clip.cpp timing (it prints its own "image slice encoded in N ms").

    python bench/vision_encode.py --size 448 --threads 2
"""
import argparse
import os
import sys
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mmproj", default=None, help="an mmproj GGUF (default: write the tiny one)")
    ap.add_argument("--n-embd", type=int, default=256, help="the language model's width the file must project to")
    ap.add_argument("--size", type=int, default=448, help="picture side in pixels")
    ap.add_argument("--threads", type=int, default=2, help="BLAS threads")
    ap.add_argument("--repeat", type=int, default=5)
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
    if path is None:
        path = os.path.join(tempfile.mkdtemp(), "mmproj-tiny.gguf")
        write_mmproj(path)
    m = load_mmproj(path, a.n_embd)
    data = png_bytes(a.size, a.size)
    encode(preprocess(data, m.config), m)  # the weights' float copies are made once, on first use
    pre, enc = [], []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        px = preprocess(data, m.config)
        t1 = time.perf_counter()
        out = encode(px, m)
        pre.append((t1 - t0) * 1e3)
        enc.append((time.perf_counter() - t1) * 1e3)
    print(f"{a.size}x{a.size}, {a.threads} threads, {os.path.basename(path)}: {out.shape[0]} image tokens "
          f"of width {out.shape[1]}")
    print(f"preprocess {np.median(pre):.0f} ms, encode {np.median(enc):.0f} ms (median of {a.repeat}; "
          f"encode min {min(enc):.0f}, max {max(enc):.0f})")


if __name__ == "__main__":
    main()
