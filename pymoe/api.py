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
from .policies import DEFAULT_POLICY
from .sampler import Sampler, SamplingParams


class Engine:
    def __init__(self, path: str, backend: str = "cpu", threads: Optional[int] = None, n_ctx: Optional[int] = None,
                 progress: bool = False, cache_slots: Optional[int] = None, cache_gib: Optional[float] = None,
                 policy: str = DEFAULT_POLICY, profile: Optional[str] = None, pcie_frac: float = 1.0,
                 log=lambda line: None):
        """`cache_slots` / `cache_gib` size an expert slot pool (else: no pool on the CPU backend, every expert is
        read in place); `profile` (a path or a profile.Profile) pre-fills it; `log` receives the start-up lines
        (sizing, pre-fill)."""
        from .tokenizer import Tokenizer

        self.file = load_gguf(path)
        self.config = self.file.config
        self.backend = get_backend(backend, threads=threads)
        self.profile = profile
        if isinstance(profile, (str, bytes)) or hasattr(profile, "__fspath__"):
            from .profile import Profile

            self.profile = Profile.load(profile)
            log(self.profile.log_line(profile))
        self.cache = self._make_cache(cache_slots, cache_gib, policy, pcie_frac, log)
        self.model = Model(self.file, self.backend, self.cache, progress=progress)
        self.backend.warm_up((t.qtype for t in self.file.tensors.values()), progress=progress)
        if hasattr(self.backend, "warm_up_experts"):  # the fused expert kernel of the CPU fast path
            self.backend.warm_up_experts(self.file.expert_types(0))
        self.tokenizer = Tokenizer(self.file)
        self.n_ctx = int(n_ctx or self.config.n_ctx_train)
        if self.n_ctx <= 0:
            raise PymoeError(f"context size must be > 0, got {self.n_ctx}")
        self.last_stats = RequestStats()

    def _make_cache(self, cache_slots, cache_gib, policy, pcie_frac, log):
        if cache_slots is None and cache_gib is None:
            cache = PassThroughCache(self.file)
            log(cache.describe())
            return cache
        from .cache import SlotCache

        n_total = self.config.n_layers * self.config.n_expert
        if cache_gib is not None:
            if cache_gib <= 0:
                raise PymoeError(f"--cache-gib must be > 0, got {cache_gib}")
            slots = int(cache_gib * 2**30 // self.file.slot_bytes)
            log(f"expert cache: {cache_gib:g} GiB / {self.file.slot_bytes} bytes per slot -> {slots} slots")
            cache_slots = max(1, min(slots, n_total))
        cache = SlotCache(self.file, int(cache_slots), policy=policy, profile=self.profile, pcie_frac=pcie_frac)
        log(cache.describe())
        if self.profile is not None:
            log(cache.prefill_from_profile())
        return cache

    def record_trace(self, meta_extra: Optional[dict] = None):
        """Start recording routing (every token, every layer) -> the TraceRecorder; save it with .save(path)."""
        from .trace import TraceRecorder

        cfg = self.config
        meta = dict(model=cfg.name or self.file.path, arch=cfg.arch, n_layers=cfg.n_layers, n_experts=cfg.n_expert,
                    k=cfg.n_expert_used, **(meta_extra or {}))
        self.model.trace = TraceRecorder(meta)
        return self.model.trace

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
         progress: bool = False, **cache_options) -> Engine:
    """cache_options: cache_slots, cache_gib, policy, profile, pcie_frac, log (see Engine)."""
    return Engine(path, backend=backend, threads=threads, n_ctx=n_ctx, progress=progress, **cache_options)
