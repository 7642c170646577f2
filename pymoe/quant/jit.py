"""One compiled function per format from one template: `bind(template, name, constants)`.

What this is: the kernels that differ per weight format (quant/kernels.py, quant/repack.py, quant/qact.py) are
written once, as a template whose format-specific parts are globals (the format's decoder, its row or tile dot,
its sizes). `bind` makes a fresh function from the template's code object with those globals bound to one format's
values, under its own name, and compiles it with Numba: the values are compile-time constants, and the name keys
Numba's on-disk cache, so the next process finds the same machine code again.
What this is not: a cache invalidator. Numba's cache watches the template's source file only; a caller whose
constants come from other files puts a fingerprint of them into the name (kernels._act_fingerprint).
"""
from __future__ import annotations

import types

from numba import njit


def bind(template, name: str, constants: dict, parallel: bool = False):
    """njit(cache=True, parallel=parallel) of `template` with `constants` as its globals, named `name`."""
    fn = types.FunctionType(template.__code__, {**template.__globals__, **constants}, name)
    fn.__qualname__ = name
    return njit(parallel=parallel, cache=True)(fn)
