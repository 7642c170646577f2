"""The embedded demo model: a small qwen3moe trained on the Python standard library, shipped as package data.

What this is: where the demo's files live and the prompt `pymoe run` uses when it is given no model, so that a
fresh install runs something readable out of the box. How the model was trained: docs/demo-model.md,
tools/train-demo-model.
"""
from __future__ import annotations

import os

from pymoe.errors import PymoeError

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
DEMO_MODEL = os.path.join(DATA_DIR, "demo-moe.gguf")
DEMO_PROFILE = os.path.join(DATA_DIR, "demo-moe.profile.bin")
DEMO_MTP = os.path.join(DATA_DIR, "demo-moe.mtp.gguf")  # its trained MTP head (`--spec mtp`; tools/train-demo-mtp)
DEMO_PROMPT = "import os\n\n\ndef read_lines(path):\n    "


def demo_model() -> str:
    if not os.path.exists(DEMO_MODEL):
        raise PymoeError(f"{DEMO_MODEL}: demo model missing from this install (tools/train-demo-model writes it); "
                         "pass a MODEL.gguf")
    return DEMO_MODEL


def demo_profile():
    """The demo's expert profile path, or None when it is not shipped."""
    return DEMO_PROFILE if os.path.exists(DEMO_PROFILE) else None
