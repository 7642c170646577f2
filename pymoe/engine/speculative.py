"""Speculative decoding: draft k tokens cheaply, check them all in one forward of k + 1 positions, keep the prefix
the model agrees with.

What this is: `Speculator(drafter, k)`, whose `step(...)` replaces one decode step of the generation loop
(engine/generate.py) by:
    drafts d1..dk   = drafter.propose(history, k)           cheap guesses of the next k tokens
    logits [k+1, V] = model.forward([t0, d1..dk], kv)       t0: the last sampled token, not yet in the KV cache
    for i = 0..k-1:  x = the target's choice at logits[i]; keep d(i+1) while x == d(i+1) (greedy), or accept
                     d(i+1) with probability p(d(i+1)) and else draw from p without it (temperature > 0)
    a bonus token from logits[k] when all k were kept
    kv.n            = p0 + 1 + accepted                      the rejected positions' K/V are simply overwritten later
so one forward yields 1 .. k + 1 tokens. Greedy output is token for token the output without speculation: each
position's logits are the bits a single decode step computes (the CPU fast path's contract, tests/test_model.py),
and the target's choice is made by the same sampler on the same history. At temperature > 0 the output has
exactly the target's distribution (`Sampler.verify`; tests/test_speculative.py tests it statistically).
Recurrent state (Gated DeltaNet layers) cannot be cut back by moving kv.n: it is saved before the verification
forward and, when a draft was rejected, restored and advanced over the kept tokens only (one more forward of
1 + accepted positions); on a device KV cache whose state the device holds, the save is a device snapshot
(backends/cuda.py `DeviceKVCache.snapshot_recurrent`), so the rollback moves no state over PCIe.

Drafters (one interface, `propose(history, k) -> list of at most k ids`):
    ngram        prompt lookup: the tokens that followed the latest earlier occurrence of the last n tokens
                 (n = 4 .. 1, longest first) in prompt + output; no model, strong when the output repeats its input
    draft:FILE   a second, smaller GGUF with the same vocabulary, decoding greedily on its own KV cache
    mtp          the file's own MTP (nextn) block, drafting from the trunk's last hidden state (engine/mtp.py);
    mtp:FILE     the same from a companion GGUF holding only the block (GGUFModel.attach_mtp; the demo's trained head)
Drafts are deterministic (a one-hot proposal), which is what makes the acceptance rule above exact.

Why experts per step rise: a verification forward routes k + 1 tokens through every MoE layer at once, so it
touches the union of their experts (up to (k + 1) x K per layer instead of K), each read once for all of them. On a
slot pool that means more distinct experts per step but fewer steps; `SpecStats` counts both (`verify_experts`,
`single_experts`, from `Model.last_experts`), next to the acceptance rate. A verification also costs more than a
one-token step, so speculation times itself and backs off when it does not pay (BACKOFF_* below).
Several busy server slots speculate together: serve/scheduler.py runs `drafts` per slot, one batched forward of
every slot's tokens (engine/batch.py forward_batch), and `judge` per slot.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from pymoe.errors import PymoeError


class NgramDrafter:
    """Prompt lookup: propose what followed the most recent earlier match of the history's last n tokens."""

    name = "ngram"

    def __init__(self, n_max: int = 4, n_min: int = 1):
        self.n_max, self.n_min = n_max, n_min

    def propose(self, history: list, k: int) -> list:
        h = np.asarray(history, dtype=np.int64)  # [N]
        N = h.size
        for n in range(min(self.n_max, N - 1), self.n_min - 1, -1):
            tail = h[N - n:]  # [n]
            # windows[s] = h[s : s + n] for every start s whose match is followed by at least one token
            windows = np.lib.stride_tricks.sliding_window_view(h[:N - 1], n)  # [N - n, n]
            starts = np.flatnonzero((windows == tail).all(axis=1))
            if starts.size:
                full = starts[starts + n + k <= N]  # matches followed by k tokens: the latest of those, else the latest
                s = int(full[-1] if full.size else starts[-1]) + n
                return h[s:s + k].tolist()
        return []


class ModelDrafter:
    """A smaller model of the same vocabulary drafting greedily on its own KV cache. It keeps the tokens it has
    seen; on each call it rewinds to the part of the history it shares with them (or starts over, for a draft
    model with recurrent state) and reads the rest."""

    name = "draft"

    def __init__(self, engine, target_vocab: int, n_ctx: int):
        if engine.config.n_vocab != target_vocab:
            raise PymoeError(f"{engine.path}: draft model has {engine.config.n_vocab} tokens, the model "
                             f"{target_vocab}: a draft model needs the same vocabulary")
        self.engine, self.model, self.target_vocab = engine, engine.model, target_vocab
        self.kv = self.model.new_kv(n_ctx)
        self.seen: list = []  # tokens whose K/V (or state) the draft cache holds, in order

    def fork(self) -> "ModelDrafter":
        """Another sequence's drafter over the same draft model, with its own KV cache (a server slot's)."""
        return ModelDrafter(self.engine, self.target_vocab, self.kv.n_ctx)

    def propose(self, history: list, k: int) -> list:
        common = 0
        for a, b in zip(self.seen, history):
            if a != b:
                break
            common += 1
        common = min(common, len(history) - 1)  # the last token is always read, for its logits
        if self.model.cfg.has_recurrent_state and common < len(self.seen):
            self.kv.clear()
            common = 0
        self.kv.n, self.seen = common, list(history[:common])
        if self.kv.n + len(history) - common + k > self.kv.n_ctx:
            return []  # the draft model's context is full: no drafts, plain decoding goes on
        logits = self.model.prefill(np.asarray(history[common:]), self.kv)[-1]  # [V]
        self.seen = list(history)
        drafts = []
        for i in range(k):
            drafts.append(int(np.argmax(logits)))
            if i + 1 < k:
                logits = self.model.decode_one_token(drafts[-1], self.kv)
                self.seen.append(drafts[-1])
        return drafts


@dataclass
class SpecStats:
    """What speculation did in one request: the article's acceptance rate, and experts per forward."""

    steps: int = 0  # verification forwards
    drafted: int = 0
    accepted: int = 0
    verify_experts: int = 0  # distinct (layer, expert) pairs summed over the verification forwards
    single_steps: int = 0  # plain one-token decode steps (the drafter had nothing to propose)
    single_experts: int = 0
    rollbacks: int = 0  # recurrent state restored and re-advanced after a rejection
    pauses: int = 0  # times drafting paused for BACKOFF_PAUSE steps (speculation was slower than plain steps)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def line(self, name: str, k: int) -> str:
        per = (self.accepted + self.steps) / self.steps if self.steps else 0.0
        ve = self.verify_experts / self.steps if self.steps else 0.0
        se = f"{self.single_experts / self.single_steps:.1f}" if self.single_steps else "-"
        return (f"speculation {name} k={k}: {self.steps} verify steps, acceptance {100 * self.acceptance:.1f}% "
                f"({self.accepted} / {self.drafted} drafted), {per:.2f} tokens per verify step; distinct experts "
                f"per step {ve:.1f} (verify) vs {se} (single-token, {self.single_steps} steps)"
                + (f"; drafting paused {self.pauses}x (slower than plain steps)" if self.pauses else ""))


# Back-off: a verification forward of k + 1 positions costs more than a one-token step (it reads the union of their
# experts: on the demo model on the CPU, 2.6x a one-token step for k = 4, bench/speculative.py), and drafting costs
# too, so drafts that are mostly rejected make decoding slower. Speculation therefore measures itself: the tokens and
# seconds of its verification steps (drafting included) and of plain steps (running means, weight 0.8 on the past).
# The first BACKOFF_CALIBRATE steps of a request are plain ones, to time them. After BACKOFF_WINDOW verifications,
# if they yield fewer tokens per second than plain steps did (or, were no plain step timed, fewer than
# BACKOFF_MIN_KEPT kept drafts per step), the next BACKOFF_PAUSE steps are plain steps (the drafter still sees every
# token), then drafting is tried again. The output is the same either way.
BACKOFF_CALIBRATE, BACKOFF_WINDOW, BACKOFF_MIN_KEPT, BACKOFF_PAUSE = 2, 8, 0.5, 16


class Speculator:
    def __init__(self, drafter, k: int = 4, backoff: bool = True):
        if k < 1:
            raise PymoeError(f"--spec-k must be >= 1, got {k}")
        self.drafter, self.k, self.backoff = drafter, k, backoff
        self.stats = SpecStats()
        self.kept: list = []  # drafts kept by the verifications since the last pause (back-off)
        self.pause = BACKOFF_CALIBRATE if backoff else 0  # plain steps left before drafting (again)
        self.rates = {"verify": [0.0, 0.0], "single": [0.0, 0.0]}  # running means of (tokens, seconds) per step

    def _timed(self, kind: str, tokens: list, t0: float) -> list:
        r, dt = self.rates[kind], time.perf_counter() - t0
        w = 0.8 if r[1] > 0 else 0.0
        r[0], r[1] = w * r[0] + (1 - w) * len(tokens), w * r[1] + (1 - w) * dt
        return tokens

    def _slower_than_plain(self) -> bool:
        v, one = self.rates["verify"], self.rates["single"]
        if one[1] > 0:
            return v[0] * one[1] < one[0] * v[1]  # v tokens / v seconds < one tokens / one seconds
        return float(np.mean(self.kept)) < BACKOFF_MIN_KEPT

    def begin(self, model, kv, reused: int = 0) -> None:
        """Before the prompt's prefill into `kv` (its first `reused` positions already there): the model counts
        experts per forward, and a drafter that reads the sequence's hidden states (mtp) hooks in."""
        model.count_experts = True
        if hasattr(self.drafter, "attach"):
            self.drafter.attach(model, kv, reused)

    def end(self, model, kv) -> None:
        model.count_experts = False
        if hasattr(self.drafter, "detach"):
            self.drafter.detach(model, kv)

    def step(self, model, kv, history: list, sampler, budget: int) -> list:
        """The token history[-1] is sampled but not in kv; -> the next 1 .. k + 1 tokens (at most `budget`)."""
        t0 = time.perf_counter()
        token = history[-1]
        drafts = self.drafts(kv, history, budget)
        if not drafts:  # a plain decode step
            logits = model.decode_one_token(token, kv)
            self.plain(model.last_experts)
            return self.timed("single", [sampler(logits, history)], t0)
        p0 = kv.n
        saved = getattr(kv, "snapshot_recurrent", kv.save_recurrent)() if model.cfg.has_recurrent_state else None
        logits = model.forward([token] + drafts, kv, "decode")  # [k + 1, V]
        out = self.judge(logits, drafts, history, sampler, model.last_experts)
        accepted = len(out) - 1
        kv.n = p0 + 1 + accepted  # the token and the drafts kept; the rest of the positions are overwritten later
        if saved is not None and accepted < len(drafts):  # state holds the rejected drafts too: redo the kept part
            kv.restore_recurrent(saved)
            kv.n = p0
            model.forward([token] + drafts[:accepted], kv, "decode")
            self.stats.rollbacks += 1
        return self.timed("verify", out, t0)

    # --- the parts of a step (serve/scheduler.py runs them for several slots around one batched forward) --------
    def drafts(self, kv, history: list, budget: int) -> list:
        """This step's drafts (none: a plain step), at most budget - 1 and what the context has room for."""
        k = self.draft_count(kv, budget)
        return self.drafter.propose(history, k) if k > 0 else []

    def draft_count(self, kv, budget: int) -> int:
        """How many tokens this step drafts: k, or fewer near the budget or the context's end; 0 while paused."""
        k = min(self.k, budget - 1, kv.n_ctx - kv.n - 1)
        if self.pause:
            self.pause -= 1
            k = 0
        return max(k, 0)

    def plain(self, experts: int = 0) -> None:
        """A step without drafts (paused, or nothing proposed): counted with the distinct experts it read."""
        self.stats.single_steps += 1
        self.stats.single_experts += experts

    def judge(self, logits, drafts: list, history: list, sampler, experts: int = 0) -> list:
        """logits [len(drafts) + 1, V] of the verification forward of [history[-1]] + drafts -> the tokens the step
        yields: the drafts kept, then the target's own token (the correction, or the bonus after all k)."""
        s = self.stats
        s.steps += 1
        s.drafted += len(drafts)
        s.verify_experts += experts
        out = []
        for i, d in enumerate(drafts):
            x, kept = sampler.verify(logits[i], history + out, d)
            out.append(x)
            if not kept:
                break
        else:
            out.append(sampler(logits[len(drafts)], history + out))
        s.accepted += len(out) - 1
        self.kept.append(len(out) - 1)
        return out

    def timed(self, kind: str, tokens: list, t0: float) -> list:
        """The end of a step ("single" or "verify") that began at t0: its running means, and the back-off check."""
        self._timed(kind, tokens, t0)
        if kind == "verify" and self.backoff and len(self.kept) >= BACKOFF_WINDOW and self._slower_than_plain():
            self.pause, self.kept = BACKOFF_PAUSE, []
            self.stats.pauses += 1
        return tokens


def propose_all(drafters: list, histories: list, ks: list) -> list:
    """Drafts for several sequences (server slots): together when their drafters can (a `propose_many` of their
    class, MtpDrafter's: one block forward for all sequences per drafted position), else one drafter after another."""
    many = getattr(type(drafters[0]), "propose_many", None) if drafters else None
    if many is not None and all(type(d) is type(drafters[0]) for d in drafters):
        return many(drafters, histories, ks)
    return [d.propose(h, k) if k > 0 else [] for d, h, k in zip(drafters, histories, ks)]


def parse_spec(spec: str) -> tuple[str, str]:
    """`--spec` -> (kind, draft path or ""), refusing what is not ngram / mtp / draft:FILE in one line (before any
    model is loaded)."""
    if spec == "ngram":
        return "ngram", ""
    if spec.startswith("draft:"):
        path = spec[len("draft:"):]
        if not path:
            raise PymoeError("--spec draft:FILE needs the draft model's GGUF file")
        return "draft", path
    if spec == "mtp":
        return "mtp", ""
    if spec.startswith("mtp:"):
        path = spec[len("mtp:"):]
        if not path:
            raise PymoeError("--spec mtp:FILE needs the MTP companion's GGUF file")
        return "mtp", path
    raise PymoeError(f"--spec must be ngram, draft:FILE, mtp or mtp:FILE, got '{spec}'")


def mtp_companion(model_path: str) -> str:
    """Where `--spec mtp` looks for an MTP companion of a file without an MTP block: beside it, .gguf -> .mtp.gguf
    (the demo model's trained head ships so: pymoe/demo/data/demo-moe.mtp.gguf)."""
    stem = model_path[:-len(".gguf")] if model_path.endswith(".gguf") else model_path
    return stem + ".mtp.gguf"


def make_speculator(spec: str, k: int, target, n_ctx: int, load_draft=None) -> Speculator:
    """`--spec` -> a Speculator: "ngram", "mtp" (the file's MTP block, engine/mtp.py; for a file without one, its
    companion `mtp_companion(path)` when that exists), "mtp:FILE" (the block from the companion FILE,
    GGUFModel.attach_mtp) or "draft:FILE" (loaded with `load_draft(path)`)."""
    kind, path = parse_spec(spec)
    if kind == "ngram":
        return Speculator(NgramDrafter(), k)
    if kind == "mtp":
        from .mtp import MtpDrafter

        file = target.file
        if not path and file.mtp_plan() is None and os.path.exists(mtp_companion(file.path)):
            path = mtp_companion(file.path)
        if path and getattr(file, "mtp_path", None) != path:
            file.attach_mtp(path)
        return Speculator(MtpDrafter(target, n_ctx), k)
    return Speculator(ModelDrafter(load_draft(path), target.cfg.n_vocab, n_ctx), k)
