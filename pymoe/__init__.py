"""pymoe: run Mixture-of-Experts LLMs stored as GGUF files, keeping hot experts in a slot cache.

Start reading at `pymoe/gguf/loader.py` (GGUF -> ModelConfig + tensor views), then `pymoe/quant/` (how 2-bit weights are
laid out and multiplied without being dequantized as a whole). docs/ explains the mechanism with pointers into code.
"""
__version__ = "0.1.0"

import os as _os

# cuda_kernels/ sits at the top of the repository and is installed as pymoe.cuda_kernels (setup.cfg's package_dir).
# Run from a checkout without installing (PYTHONPATH=., as scripts/gpu-check does), it is found beside this folder.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if (_os.path.isfile(_os.path.join(_checkout, "cuda_kernels", "__init__.py"))
        and not _os.path.isdir(_os.path.join(__path__[0], "cuda_kernels"))):
    __path__.append(_checkout)

from .errors import PymoeError  # noqa: F401
from .gguf.loader import GGUFModel, load_gguf  # noqa: F401
from .api import Engine, load  # noqa: F401,E402
