"""Choosing the next token from logits: greedy, or temperature + top-k + top-p + min-p, with logit biases,
repetition, presence and frequency penalties, and a grammar.

What this is: `Sampler(SamplingParams, constraint=None, top_logprobs=None)`, a small stateful object (it owns the
random generator, so a seed makes a whole generation reproducible, and the grammar's position). The order of the
steps is llama.cpp's default sampler chain, with the grammar first:
    grammar mask -> logit bias -> repetition / presence / frequency penalties -> top-k -> top-p -> min-p
    -> temperature -> draw
With `top_logprobs` (0 or more) the sampler records, for each token it draws, its log-probability and the n most
likely tokens' (`last_logprobs`): the log-softmax of the logits after the mask, bias and penalties, before top-k/p
and temperature: the model's distribution as the request shaped it, not the truncated one the draw used.
What this is not: stop handling (generate.py), or anything that changes logits of the model itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from pymoe.errors import PymoeError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax); the other settings are then ignored
    top_k: int = 40  # keep the k most likely tokens (0: all)
    top_p: float = 0.95  # keep the smallest set whose probability reaches p (1.0: all)
    min_p: float = 0.05  # drop tokens below min_p * p(most likely) (0.0: none)
    repeat_penalty: float = 1.0  # >1 discourages tokens seen in the last `repeat_last_n` (1.0: off)
    repeat_last_n: int = 64
    seed: Optional[int] = None  # None or -1 (llama.cpp's "random"): a fresh random generator; else 0 .. 2**64 - 1
    presence_penalty: float = 0.0  # OpenAI's: minus this from the logit of every token seen (same window)
    frequency_penalty: float = 0.0  # OpenAI's: minus this times how often the token was seen (same window)
    logit_bias: tuple = ()  # ((token id, bias), ...): added to those logits before anything else (OpenAI, llama.cpp)

    def validate(self) -> "SamplingParams":
        checks = [(self.temperature >= 0, "temperature must be >= 0"), (self.top_k >= 0, "top-k must be >= 0"),
                  (-2 <= self.presence_penalty <= 2, "presence penalty must be in [-2, 2]"),
                  (-2 <= self.frequency_penalty <= 2, "frequency penalty must be in [-2, 2]"),
                  (0 < self.top_p <= 1, "top-p must be in (0, 1]"), (0 <= self.min_p <= 1, "min-p must be in [0, 1]"),
                  (self.repeat_penalty > 0, "repeat penalty must be > 0"),
                  (self.repeat_last_n >= 0, "repeat-last-n must be >= 0"),
                  (self.seed is None or -1 <= self.seed < 2**64, "seed must be in [0, 2**64 - 1], or -1 (random)")]
        for ok, what in checks:
            if not ok:
                raise PymoeError(what)
        return self


def apply_repetition_penalty(logits: np.ndarray, recent: Sequence[int], penalty: float) -> np.ndarray:
    """llama.cpp/CTRL style: a seen token's logit is divided by `penalty` if positive, multiplied if negative."""
    if penalty == 1.0 or len(recent) == 0:
        return logits
    out = logits.copy()
    ids = np.unique(np.asarray(recent, dtype=np.int64))
    seen = out[ids]
    out[ids] = np.where(seen > 0, seen / penalty, seen * penalty)
    return out


def filter_candidates(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """-> (candidate ids, their logits), most likely first, after top-k, top-p and min-p."""
    order = np.argsort(-logits, kind="stable")  # [V] most likely first
    if top_k > 0:
        order = order[:top_k]
    cand = logits[order].astype(np.float64)
    p = np.exp(cand - cand[0])
    p /= p.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), top_p) + 1)  # smallest prefix with mass >= top_p
        order, cand, p = order[:keep], cand[:keep], p[:keep]
    if min_p > 0.0:
        keep = p >= min_p * p[0]
        order, cand = order[keep], cand[keep]
    return order, cand


def log_probs(z: np.ndarray, token: int, top: int) -> tuple:
    """log-softmax of z [V] -> (log p(token), [(id, log p)] for the `top` most likely, most likely first)."""
    z = z.astype(np.float64)
    lse = z.max() + np.log(np.exp(z - z.max()).sum())  # [] log sum exp, shifted so the largest term is exp(0)
    # the ids at or above the top-th largest value (O(V), ties at the cut included), then the stable order of them:
    # the same as a stable argsort of all of z, most likely first and ties by id, without sorting V values
    best = np.flatnonzero(z >= -np.partition(-z, top - 1)[top - 1]) if 0 < top < z.size else np.arange(z.size)
    best = best[np.argsort(-z[best], kind="stable")][:top]
    return float(z[token] - lse), [(int(t), float(z[t] - lse)) for t in best]


class Sampler:
    def __init__(self, params: SamplingParams = SamplingParams(), constraint=None, top_logprobs: Optional[int] = None):
        """constraint: a grammar.Constraint (the draw stays inside its grammar, and it follows each token drawn).
        top_logprobs: None (no log-probabilities), else how many alternatives to record beside the drawn token."""
        self.params = params.validate()
        self.rng = np.random.default_rng(None if params.seed == -1 else params.seed)
        self.constraint, self.top_logprobs = constraint, top_logprobs
        self.last_logprobs: Optional[tuple] = None  # (log p(token), [(id, log p)] * top_logprobs) of the last draw

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """logits float32 [V] -> the next token id."""
        z = self._penalised(logits, history)
        if self.params.temperature == 0.0:
            token = int(np.argmax(z))
        else:
            ids, probs = self._distribution(z)
            token = int(ids[self.rng.choice(len(ids), p=probs)])
        if self.top_logprobs is not None:
            self.last_logprobs = log_probs(z, token, self.top_logprobs)
        if self.constraint is not None:
            self.constraint.accept(token)
        return token

    def _penalised(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The grammar's mask, then logit bias, then the repetition penalty, then presence and frequency penalties
        (llama.cpp's order):
            z[t] = -inf (t outside the grammar);  z[t] += bias[t];  z[t] /= or *= repeat_penalty (seen t);
            z[t] -= presence * [seen t] + frequency * count(t)
        over the last `repeat_last_n` tokens of the history (prompt included)."""
        p = self.params
        if self.constraint is not None:
            logits = np.where(self.constraint.allowed(), logits, np.float32(-np.inf))
        if p.logit_bias:
            logits = logits.copy()
            for t, bias in p.logit_bias:
                logits[t] += np.float32(bias)
        recent = history[-p.repeat_last_n:] if p.repeat_last_n else ()
        if p.repeat_penalty != 1.0:
            logits = apply_repetition_penalty(logits, recent, p.repeat_penalty)
        if (p.presence_penalty or p.frequency_penalty) and len(recent):
            ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
            logits = logits.copy()
            logits[ids] -= np.float32(p.presence_penalty) + np.float32(p.frequency_penalty) * counts.astype(np.float32)
        return logits

    def distribution(self, logits: np.ndarray, history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """The distribution a draw at temperature > 0 samples from: (candidate ids [C], probabilities [C])."""
        return self._distribution(self._penalised(logits, history))

    def _distribution(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = self.params
        ids, cand = filter_candidates(z, p.top_k, p.top_p, p.min_p)
        with np.errstate(over="ignore"):
            z = cand / p.temperature
        if not np.isfinite(z[0]):  # a temperature so small the largest logit overflows (inf - inf): greedy, as at 0
            return ids[:1], np.ones(1)
        probs = np.exp(z - z.max())
        return ids, probs / probs.sum()

    def verify(self, logits: np.ndarray, history: Sequence[int], draft: int) -> tuple[int, bool]:
        """Speculative decoding's check of one drafted token (engine/speculative.py) -> (token, draft kept).

        Greedy: keep the draft when it is the argmax. Temperature > 0, for a deterministic draft (the proposal puts
        all its mass on `draft`): keep it with probability p(draft), else draw from p with `draft` removed and the
        rest renormalised. Then P(draft) = p(draft) and P(x) = (1 - p(draft)) p(x) / (1 - p(draft)) = p(x) for
        every other x: the target distribution exactly (Leviathan et al. 2023's rule with q one-hot)."""
        if self.constraint is not None:
            raise PymoeError("speculative decoding does not take a grammar (a draft would move its position)")
        if self.params.temperature == 0.0:
            x = self(logits, history)
            return x, x == draft
        ids, probs = self.distribution(logits, history)
        p_draft = float(probs[ids == draft].sum())
        if self.rng.random() < p_draft:
            return int(draft), True
        rest = np.where(ids == draft, 0.0, probs)
        return int(ids[self.rng.choice(len(ids), p=rest / rest.sum())]), False
