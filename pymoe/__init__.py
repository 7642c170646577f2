"""pymoe: run Mixture-of-Experts LLMs stored as GGUF files, keeping hot experts in a slot cache.

Start reading at `pymoe/gguf/loader.py` (GGUF -> ModelConfig + tensor views), then `pymoe/quant/` (how 2-bit weights are
laid out and multiplied without being dequantized as a whole). docs/ explains the mechanism with pointers into code.
"""
__version__ = "0.1.0"

from .errors import PymoeError  # noqa: F401
from .gguf.loader import GGUFModel, load_gguf  # noqa: F401
from .api import Engine, load  # noqa: F401,E402
