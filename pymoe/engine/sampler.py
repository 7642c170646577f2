"""Choosing the next token from logits: greedy, or the sampler chain of llama.cpp (temperature, top-k, top-p, min-p,
typical-p, top-n-sigma, XTC, or mirostat v1/v2 instead of the truncations), with logit biases, repetition,
presence, frequency and DRY penalties, a minimum length and a grammar.

What this is: `Sampler(SamplingParams, constraint=None, top_logprobs=None, end_ids=())`, a small stateful object
(it owns the random generator, so a seed makes a whole generation reproducible, the grammar's position, mirostat's
running target and the count of tokens drawn). The order of the steps is llama.cpp's default sampler chain
(common/sampling.h: penalties, dry, top_n_sigma, top_k, typ_p, top_p, min_p, xtc, temperature), with the grammar
first and the minimum length after the penalties:
    grammar mask -> logit bias -> repetition / presence / frequency penalties -> DRY -> min_tokens (end ids masked)
    -> top-n-sigma -> top-k -> typical-p -> top-p -> min-p -> XTC -> temperature -> draw
With mirostat (1 or 2) the truncation steps (top-n-sigma .. XTC) are left out, as in llama.cpp, and the chain ends
    ... -> min_tokens -> temperature -> mirostat's own truncation -> draw -> mirostat's target updated
(llama.cpp also leaves out the penalties and DRY under mirostat; here they apply: a request that asks for them
gets them). Each step follows llama.cpp's definition in src/llama-sampler.cpp, with min_keep = 0.
At temperature 0 the draw is the argmax after min_tokens: the truncation steps, XTC and mirostat only act on a
random draw.
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
    # llama.cpp's further samplers; each default is "off"
    typical_p: float = 1.0  # keep the locally typical tokens up to this mass (1.0: off)
    top_n_sigma: float = -1.0  # keep logits within n standard deviations of the largest (<= 0: off)
    xtc_probability: float = 0.0  # chance per draw of removing the likeliest tokens above xtc_threshold (0: off)
    xtc_threshold: float = 0.1
    mirostat: int = 0  # 1: mirostat, 2: mirostat 2.0, in place of the truncation steps (0: off)
    mirostat_tau: float = 5.0  # target surprise, in bits
    mirostat_eta: float = 0.1  # learning rate of the running target mu
    dry_multiplier: float = 0.0  # DRY: penalty for extending a repeated sequence (0: off)
    dry_base: float = 1.75
    dry_allowed_length: int = 2  # repeats longer than this are penalised
    dry_penalty_last_n: int = 64  # tokens of history scanned (0: off)
    dry_breakers: tuple = ()  # ((head id, (tail ids...)), ...): dry_breaker_sequences() of the breaker strings
    min_tokens: int = 0  # the end ids (Sampler's end_ids) are masked until this many tokens are drawn

    def validate(self) -> "SamplingParams":
        checks = [(self.temperature >= 0, "temperature must be >= 0"), (self.top_k >= 0, "top-k must be >= 0"),
                  (-2 <= self.presence_penalty <= 2, "presence penalty must be in [-2, 2]"),
                  (-2 <= self.frequency_penalty <= 2, "frequency penalty must be in [-2, 2]"),
                  (0 < self.top_p <= 1, "top-p must be in (0, 1]"), (0 <= self.min_p <= 1, "min-p must be in [0, 1]"),
                  (self.repeat_penalty > 0, "repeat penalty must be > 0"),
                  (self.repeat_last_n >= 0, "repeat-last-n must be >= 0"),
                  (self.seed is None or -1 <= self.seed < 2**64, "seed must be in [0, 2**64 - 1], or -1 (random)"),
                  (0 <= self.typical_p <= 1, "typical-p must be in [0, 1]"),
                  (0 <= self.xtc_probability <= 1, "xtc probability must be in [0, 1]"),
                  (0 <= self.xtc_threshold <= 1, "xtc threshold must be in [0, 1]"),
                  (self.mirostat in (0, 1, 2), "mirostat must be 0, 1 or 2"),
                  (self.mirostat_tau >= 0 and self.mirostat_eta >= 0, "mirostat tau and eta must be >= 0"),
                  (self.dry_multiplier >= 0, "dry multiplier must be >= 0"), (self.dry_base >= 1, "dry base must be >= 1"),
                  (self.dry_allowed_length >= 0 and self.dry_penalty_last_n >= 0,
                   "dry allowed length and last-n must be >= 0"),
                  (self.min_tokens >= 0, "min tokens must be >= 0")]
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


def softmax(z: np.ndarray) -> np.ndarray:
    """float64 probabilities of logits z (-inf: probability 0)."""
    z = np.asarray(z, dtype=np.float64)
    p = np.exp(z - z.max())
    return p / p.sum()


def top_n_sigma(logits: np.ndarray, n: float) -> np.ndarray:
    """llama.cpp's top-n-sigma: logits below max - n * std (mean and std over the finite logits) become -inf."""
    if n <= 0 or logits.size <= 1:
        return logits
    finite = logits[np.isfinite(logits)].astype(np.float64)
    if finite.size == 0:
        return logits
    with np.errstate(over="ignore"):  # n * std past the float range: -inf, nothing cut
        cut = finite.max() - n * finite.std()  # std: sqrt(mean of squared deviations), llama.cpp's (not n - 1)
    return np.where(logits < cut, np.float32(-np.inf), logits)


def typical(order: np.ndarray, cand: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's locally typical sampling over candidates (ids, logits): with the entropy H of their softmax, the
    tokens in order of |-log p_i - H| until their mass exceeds p -> (ids, logits), most likely first again."""
    if p >= 1.0:
        return order, cand
    live = np.isfinite(cand)  # a -inf candidate has p = 0: no surprise, no share of the entropy
    order, cand = order[live], cand[live]
    probs = softmax(cand)
    entropy = -(probs * np.log(probs)).sum()
    rank = np.argsort(np.abs(-np.log(probs) - entropy), kind="stable")  # most typical first
    over = np.flatnonzero(np.cumsum(probs[rank]) > p)
    keep = np.sort(rank[:over[0] + 1] if over.size else rank)  # positions in the logit order
    return order[keep], cand[keep]


def xtc(order: np.ndarray, cand: np.ndarray, probability: float, threshold: float, rng) -> tuple:
    """llama.cpp's XTC ("exclude top choices"): with chance `probability`, of the tokens whose probability is at least
    `threshold` all but the least likely are removed (nothing, when fewer than two are). Candidates most likely
    first. A uniform number is drawn at every call with probability > 0, as llama.cpp draws one."""
    if probability <= 0 or cand.size < 2 or rng.random() > probability:
        return order, cand
    above = int(np.sum(softmax(cand) >= threshold))  # sorted: the tokens above the threshold are a prefix
    last = above - 1  # llama.cpp's pos_last: the least likely token at or above the threshold
    return (order[last:], cand[last:]) if last > 0 else (order, cand)


def filter_candidates(logits: np.ndarray, top_k: int, top_p: float, min_p: float,
                      typical_p: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """-> (candidate ids, their logits), most likely first, after top-k, typical-p, top-p and min-p."""
    order = np.argsort(-logits, kind="stable")  # [V] most likely first
    if top_k > 0:
        order = order[:top_k]
    cand = logits[order].astype(np.float64)
    order, cand = typical(order, cand, typical_p)
    p = np.exp(cand - cand[0])
    p /= p.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), top_p) + 1)  # smallest prefix with mass >= top_p
        order, cand, p = order[:keep], cand[:keep], p[:keep]
    if min_p > 0.0:
        keep = p >= min_p * p[0]
        order, cand = order[keep], cand[keep]
    return order, cand


# --- DRY ("don't repeat yourself", llama.cpp's port of koboldcpp's, by pi6am) ----------------------------------------

DRY_MAX_BREAKER_BYTES = 40  # llama.cpp's MAX_CHAR_LEN: a longer breaker is refused here (llama.cpp cuts it)
DRY_MAX_TAIL = 20  # llama.cpp's MAX_SEQ_LEN: a breaker's tail tokens kept
DRY_FLOAT_MAX_LOG = 88.7228391  # log(float32 max): base ** exponent is kept below it, as llama.cpp does
DRY_KEPT = 16  # breaker sets whose token sequences a tokenizer keeps (each costs a pass over the vocabulary)


def dry_breaker_sequences(tokenizer, breakers) -> tuple:
    """Breaker strings -> ((head id, tail ids), ...), llama.cpp's get_overlapping_token_sequences: every token whose
    text holds a breaker is a head with no tail (a one-token breaker); a token whose text ends with the start of a
    breaker is a head whose tail is the tokenization of the rest of it. A pass over the vocabulary per breaker, kept on
    the tokenizer per set of breakers (the last DRY_KEPT sets: the server's requests may each send their own)."""
    cache = tokenizer.__dict__.setdefault("_dry_breakers", {})
    key = tuple(breakers)
    if key not in cache:
        while len(cache) >= DRY_KEPT:
            cache.pop(next(iter(cache)))  # the oldest
        out = {}
        for text in key:
            b = text.encode("utf-8")
            for t in range(tokenizer.n_vocab):
                word = tokenizer.token_bytes(t)
                if b in word:
                    out[(t, ())] = None
                    continue
                for pos in range(max(0, len(word) - len(b) + 1), len(word)):  # a suffix of word starts the breaker
                    if b.startswith(word[pos:]):
                        rest = b[len(word) - pos:].decode("utf-8", errors="ignore")
                        tail = tokenizer.encode(rest, add_bos=False, special=False)[:DRY_MAX_TAIL]
                        out[(t, tuple(tail))] = None
        cache[key] = tuple(out)
    return cache[key]


def z_function(s: Sequence[int]) -> list:
    """z[k] = the length of the longest common prefix of s and s[k:] (z[0] = 0), in O(len(s))."""
    n, z, left, right = len(s), [0] * len(s), 0, 0
    for k in range(1, n):
        if k < right:
            z[k] = min(right - k, z[k - left])
        while k + z[k] < n and s[z[k]] == s[k + z[k]]:
            z[k] += 1
        if k + z[k] > right:
            left, right = k, k + z[k]
    return z


def dry_penalties(history: Sequence[int], multiplier: float, base: float, allowed: int, last_n: int,
                  breakers: tuple = ()) -> dict:
    """llama.cpp's DRY over the last `last_n` tokens -> {token id: penalty to subtract from its logit}.

    A token that would extend a sequence already seen earlier in the window, when that sequence (the window's
    suffix) is at least `allowed` tokens long, gets multiplier * base ** (length - allowed), the longest such
    repeat counting. A repeat does not reach back past the latest breaker (a head followed by its tail), and a
    one-token breaker is never penalised itself."""
    if multiplier == 0 or base < 1 or last_n == 0:
        return {}
    window = list(history[-last_n:])
    n = len(window)
    if n <= allowed:
        return {}
    back = window[::-1]  # back[i]: the token i places from the end (llama.cpp's ring buffer rat(i))
    heads: dict = {}
    for head, tail in breakers:
        heads.setdefault(head, []).append(tail)
    limit = n  # how far back a repeat may reach: up to the latest breaker
    for i, token in enumerate(back):
        # the breaker starting i tokens from the end: its tail is the tokens after it, back[i - 1], back[i - 2], ...
        found = [len(tail) for tail in heads.get(token, ()) if len(tail) <= i
                 and all(back[i - 1 - j] == tail[j] for j in range(len(tail)))]
        if found:
            limit = i - max(found)
            break
    if limit < allowed:
        return {}
    # the suffix of the window that also ends k tokens earlier is z[k] long (z of the reversed window); the token that
    # followed that earlier occurrence, window[n - k], would extend the repeat
    longest: dict = {}
    for k, length in enumerate(z_function(back)):
        length = min(length, limit)
        if k > 0 and length >= allowed:
            token = window[n - k]
            longest[token] = max(longest.get(token, 0), length)
    single = {head for head, tail in breakers if not tail}
    max_exp = int(DRY_FLOAT_MAX_LOG / np.log(base)) if base > 1.000001 else 0
    return {t: multiplier * base ** (min(length - allowed, max_exp) if max_exp > 0 else length - allowed)
            for t, length in longest.items() if t not in single}


# --- mirostat (Basu et al. 2021), llama.cpp's v1 and v2 ----------------------------------------------------------------

MIROSTAT_M = 100  # the tokens v1 fits its Zipf exponent on (llama.cpp's m)


def mirostat_v1(ids: np.ndarray, probs: np.ndarray, mu: float, n_vocab: int) -> int:
    """How many of the candidates (most likely first) mirostat 1.0 keeps: Zipf's exponent s estimated from the m most
    likely tokens, s = sum t_i b_i / sum t_i^2 with t_i = log((i + 2) / (i + 1)), b_i = log(p_i / p_(i+1)); then
    k = (eps 2^mu / (1 - V^-eps)) ^ (1 / s) with eps = s - 1, at least 1."""
    m = min(MIROSTAT_M - 1, int(np.count_nonzero(probs)) - 1)
    i = np.arange(m)
    t = np.log((i + 2) / (i + 1))
    b = np.log(probs[:m] / probs[1:m + 1])
    if m <= 0 or not (t * t).sum() > 0:
        return 1
    s_hat = float((t * b).sum() / (t * t).sum())
    eps = s_hat - 1
    with np.errstate(all="ignore"):  # numpy floats: a large mu gives inf (Python's float power would raise)
        k = (eps * np.exp2(np.float64(mu)) / (1 - np.power(np.float64(n_vocab), -eps))) ** (1 / s_hat)
    return int(min(max(k, 1), len(ids))) if np.isfinite(k) else (len(ids) if k > 0 else 1)


def mirostat_v2(probs: np.ndarray, mu: float) -> int:
    """How many of the candidates (most likely first) mirostat 2.0 keeps: those before the first whose surprise
    -log2 p exceeds mu, at least 1."""
    with np.errstate(divide="ignore"):
        over = np.flatnonzero(-np.log2(probs) > mu)
    return max(int(over[0]) if over.size else len(probs), 1)


def log_probs(z: np.ndarray, token: int, top: int) -> tuple:
    """log-softmax of z [V] -> (log p(token), [(id, log p)] for the `top` most likely, most likely first)."""
    z = z.astype(np.float64)
    lse = z.max() + np.log(np.exp(z - z.max()).sum())  # [] log sum exp, shifted so the largest term is exp(0)
    # the ids at or above the top-th largest value (O(V), ties at the cut included), then the stable order of them:
    # the same as a stable argsort of all of z, most likely first and ties by id, without sorting V values
    best = np.flatnonzero(z >= -np.partition(-z, top - 1)[top - 1]) if 0 < top < z.size else np.arange(z.size)
    best = best[np.argsort(-z[best], kind="stable")][:top]
    return float(z[token] - lse), [(int(t), float(z[t] - lse)) for t in best]


@dataclass(frozen=True)
class DeviceDraw:
    """A plain random draw handed to a device decode step before it runs (`Sampler.device_draw`): the settings and
    the uniform number u the sampler's generator gave for it (backends/cuda.py `begin_step`)."""
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    u: float


def choice_for(probs: np.ndarray, u: float) -> int:
    """Generator.choice(len(probs), p=probs) with its one uniform number given: the index whose normalised
    cumulative sum first exceeds u (tests/test_cuda_sample_kernel.py checks the identity)."""
    cdf = probs.cumsum()
    cdf /= cdf[-1]
    return int(cdf.searchsorted(u, side="right"))


class Sampler:
    def __init__(self, params: SamplingParams = SamplingParams(), constraint=None, top_logprobs: Optional[int] = None,
                 end_ids=()):
        """constraint: a grammar.Constraint (the draw stays inside its grammar, and it follows each token drawn).
        top_logprobs: None (no log-probabilities), else how many alternatives to record beside the drawn token.
        end_ids: the end-of-generation token ids, masked while fewer than params.min_tokens tokens are drawn."""
        self.params = params.validate()
        self.rng = np.random.default_rng(None if params.seed == -1 else params.seed)
        self.constraint, self.top_logprobs = constraint, top_logprobs
        self.end_ids = np.asarray(sorted(end_ids), dtype=np.int64)
        self.last_logprobs: Optional[tuple] = None  # (log p(token), [(id, log p)] * top_logprobs) of the last draw
        self.mu = 2.0 * params.mirostat_tau  # mirostat's running target (llama.cpp starts it at 2 tau)
        self.n_drawn = 0  # tokens drawn so far (min_tokens)
        self._held_u: Optional[float] = None  # the uniform number of a draw handed to a device step (device_draw)

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """logits float32 [V] -> the next token id. Logits a device decode step left on the device
        (backends/cuda.StepLogits) carry their argmax: a plain greedy draw takes it and never brings them over; a
        plain random draw (`_plain_random`) is made there, for this sampler's next uniform number, which is the one
        rng.choice below would take (cuda_kernels/sample.py): the same tokens for a seed on every backend. After
        `device_draw`, the token the step drew for its u (`drawn_token`), or, had the step not made it, the draw
        here for that u."""
        u, self._held_u = self._held_u, None
        if u is not None and getattr(logits, "drawn_token", None) is not None:
            self.n_drawn += 1
            return int(logits.drawn_token)
        token = getattr(logits, "greedy_token", None)
        if token is not None and self._plain_greedy():
            self.n_drawn += 1
            return int(token)
        p = self.params
        if hasattr(logits, "can_sample") and self._plain_random() and logits.can_sample(p.top_k):
            self.n_drawn += 1
            return int(logits.sample(p.temperature, p.top_k, p.top_p, p.min_p, self.rng.random() if u is None else u))
        z = self._penalised(np.asarray(logits), history)
        if self.params.temperature == 0.0:
            token = int(np.argmax(z))
        else:
            ids, probs = self._distribution(z)
            pick = self.rng.choice(len(ids), p=probs) if u is None else choice_for(probs, u)
            token = int(ids[pick])
            self._drawn(probs[pick])
        if self.top_logprobs is not None:
            self.last_logprobs = log_probs(z, token, self.top_logprobs)
        if self.constraint is not None:
            self.constraint.accept(token)
        self.n_drawn += 1
        return token

    def device_draw(self, can_sample) -> Optional[DeviceDraw]:
        """The next draw, for a device decode step to make before this sampler is called on its logits: a plain
        random draw (`_plain_random`) whose top-k the device takes (can_sample(top_k)), with its uniform number
        drawn now, the one number the draw consumes either way (so a seed gives the same tokens); else None."""
        p = self.params
        if not (self._plain_random() and can_sample(p.top_k)):
            return None
        self._held_u = float(self.rng.random())
        return DeviceDraw(p.temperature, p.top_k, p.top_p, p.min_p, self._held_u)

    def _plain_greedy(self) -> bool:
        """The draw is the argmax of the logits as they are: temperature 0 and nothing that changes or reads them
        (grammar, bias, penalties, DRY, min_tokens' masking, log-probabilities)."""
        p = self.params
        return (p.temperature == 0.0 and self.constraint is None and self.top_logprobs is None and not p.logit_bias
                and p.repeat_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
                and not p.dry_multiplier and not (self.n_drawn < p.min_tokens and self.end_ids.size))

    def _plain_random(self) -> bool:
        """The draw is temperature > 0 over top-k, top-p and min-p of the logits as they are: nothing that changes or
        reads them (as `_plain_greedy`) and none of typical-p, top-n-sigma, XTC or mirostat."""
        p = self.params
        return (p.temperature > 0.0 and self.constraint is None and self.top_logprobs is None and not p.logit_bias
                and p.repeat_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
                and not p.dry_multiplier and not (self.n_drawn < p.min_tokens and self.end_ids.size)
                and p.typical_p >= 1.0 and p.top_n_sigma <= 0 and p.xtc_probability <= 0 and not p.mirostat)

    def _drawn(self, p: float) -> None:
        """After a random draw of a token of probability p (in the distribution drawn from): mirostat moves its target
        by the learning rate times the error of the token's surprise, mu -= eta (-log2 p - tau)."""
        if self.params.mirostat:
            self.mu -= self.params.mirostat_eta * (-np.log2(p) - self.params.mirostat_tau)

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
        if p.dry_multiplier:
            dry = dry_penalties(history, p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n,
                                p.dry_breakers)
            if dry:
                logits = logits.copy()
                # multiplier * base^exp may pass float32's range (100 * 100^19): kept finite, so a token the grammar
                # leaves alone is still drawable
                penalty = np.minimum(np.asarray(list(dry.values())), np.finfo(np.float32).max)
                logits[list(dry)] -= penalty.astype(np.float32)
        if self.n_drawn < p.min_tokens and self.end_ids.size:
            ended = logits.copy()
            ended[self.end_ids] = -np.inf
            if np.isfinite(ended).any():  # a grammar that allows nothing but the end keeps it
                logits = ended
        return logits

    def distribution(self, logits: np.ndarray, history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """The distribution a draw at temperature > 0 samples from: (candidate ids [C], probabilities [C]). logits:
        an array, or a row a device step left on the device (backends/cuda.StepLogits: brought over here)."""
        return self._distribution(self._penalised(np.asarray(logits), history))

    def _distribution(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The penalised logits -> (candidate ids, their probabilities): the truncation steps and the temperature
        (or, with mirostat, the temperature and mirostat's truncation)."""
        p = self.params
        if p.mirostat:
            ids = np.argsort(-z, kind="stable")  # [V] most likely first
            cand = z[ids].astype(np.float64)
        else:
            ids, cand = filter_candidates(top_n_sigma(z, p.top_n_sigma), p.top_k, p.top_p, p.min_p, p.typical_p)
            ids, cand = xtc(ids, cand, p.xtc_probability, p.xtc_threshold, self.rng)
        with np.errstate(over="ignore"):
            z = cand / p.temperature
        if not np.isfinite(z[0]):  # a temperature so small the largest logit overflows (inf - inf): greedy, as at 0
            return ids[:1], np.ones(1)
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        if p.mirostat:
            keep = mirostat_v1(ids, probs, self.mu, z.size) if p.mirostat == 1 else mirostat_v2(probs, self.mu)
            ids, probs = ids[:keep], probs[:keep] / probs[:keep].sum()
        return ids, probs

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
        self.n_drawn += 1
        if self.rng.random() < p_draft:
            self._drawn(p_draft)
            return int(draft), True
        rest = np.where(ids == draft, 0.0, probs)
        pick = self.rng.choice(len(ids), p=rest / rest.sum())
        self._drawn(probs[pick])
        return int(ids[pick]), False
