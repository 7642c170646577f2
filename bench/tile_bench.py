"""The start both tile-dot benchmarks share (bench/tile_forms.py, bench/two_row_dots.py): their command line
(--formats, --rounds) and one Numba thread.

What this is: argument parsing and the thread setting, nothing measured. What it is not: a benchmark of its own.
"""
from __future__ import annotations

import argparse


def start(doc: str, formats: str) -> argparse.Namespace:
    """Parse --formats (default `formats`, comma-separated tiled formats) and --rounds; run Numba on 1 thread."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--formats", default=formats, help=f"tiled formats (default {formats})")
    ap.add_argument("--rounds", type=int, default=40, help="alternated rounds (default 40)")
    args = ap.parse_args()
    import numba

    numba.set_num_threads(1)
    return args
