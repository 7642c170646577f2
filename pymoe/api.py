"""The Python API readers and tests use: `pymoe.load(path)` -> an `Engine` with logits(), generate(), tokenizer.

    m = pymoe.load("model.gguf", backend="cpu")
    m.logits(ids)                       # float32 [n_tokens, n_vocab], one forward from an empty KV cache
    m.tokenizer.encode("hello")         # token ids
    for t in m.generate("def f(", max_tokens=20): ...   # new token ids (greedy unless temperature > 0)
    m.last_stats.prompt_line()          # the per-request telemetry of the last generate()

What this is: the wiring of loader -> backend -> expert cache -> model -> tokenizer -> sampler in one place.
What this is not: math (model.py, moe.py) or I/O (cli.py).
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence, Union

import numpy as np

from .backends import get_backend
from .cache import PassThroughCache
from .errors import PymoeError
from .generate import RequestStats, generate_tokens, stream_text
from .loader import load_gguf
from .model import Model
from .sampler import Sampler, SamplingParams


class Engine:
    def __init__(self, path: str, backend: str = "cpu", threads: Optional[int] = None, n_ctx: Optional[int] = None,
                 progress: bool = False):
        from .tokenizer import Tokenizer

        self.file = load_gguf(path)
        self.config = self.file.config
        self.backend = get_backend(backend, threads=threads)
        self.cache = PassThroughCache(self.file)
        self.model = Model(self.file, self.backend, self.cache, progress=progress)
        self.backend.warm_up((t.qtype for t in self.file.tensors.values()), progress=progress)
        self.tokenizer = Tokenizer(self.file)
        self.n_ctx = int(n_ctx or self.config.n_ctx_train)
        if self.n_ctx <= 0:
            raise PymoeError(f"context size must be > 0, got {self.n_ctx}")
        self.last_stats = RequestStats()

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """float32 [n_tokens, n_vocab]: one forward over `ids` from an empty KV cache."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        return self.model.prefill(ids, self.model.new_kv(max(self.n_ctx, ids.size)))

    def encode_prompt(self, prompt: Union[str, Sequence[int]], chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if chat:
                prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def generate(self, prompt: Union[str, Sequence[int]], max_tokens: int = 128, chat: bool = False,
                 stop_at_eos: bool = True, **sampling) -> Iterator[int]:
        """New token ids after the prompt (text or ids). `sampling`: SamplingParams fields (temperature, seed...)."""
        self.last_stats = RequestStats()
        is_stop = self.tokenizer.is_eog if stop_at_eos else (lambda t: False)
        return generate_tokens(self.model, self.encode_prompt(prompt, chat), max_tokens,
                               Sampler(SamplingParams(**sampling)), is_stop, self.n_ctx, self.last_stats)

    def stream(self, prompt: Union[str, Sequence[int]], max_tokens: int = 128, chat: bool = False,
               stop: Sequence[str] = (), **sampling) -> Iterator[str]:
        """Text pieces of the answer, stop strings applied; telemetry in `last_stats`."""
        self.last_stats = RequestStats()
        return stream_text(self.model, self.tokenizer, self.encode_prompt(prompt, chat), max_tokens,
                           Sampler(SamplingParams(**sampling)), stop, self.n_ctx, self.last_stats)


def load(path: str, backend: str = "cpu", threads: Optional[int] = None, n_ctx: Optional[int] = None,
         progress: bool = False) -> Engine:
    return Engine(path, backend=backend, threads=threads, n_ctx=n_ctx, progress=progress)
