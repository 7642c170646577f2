"""The model's own multi-token-prediction (MTP / NextN) block, run as a speculative-decoding drafter.

What this is: `MTPHead(model)`, the block the converters append after the trunk (blk.{n_layers}: qwen3next,
glm4moe and deepseek2 name it so; gguf/loader.GGUFModel.mtp_plan), and `MtpDrafter`, the `--spec mtp` drafter of
engine/speculative.py. As llama.cpp's MTP graph computes it (qwen3next.cpp graph_mtp, read in the llama.cpp that
llama-cpp-python 0.3.36 vendors), for the hidden state h_i of trunk position i (after the output norm) and the
token t_{i+1} that followed it:
    x  = eh_proj( [rmsnorm(embed(t_{i+1})) * enorm | rmsnorm(h_i) * hnorm] )         [T, 2D] -> [T, D]
    x  = x + attention(rmsnorm(x) * attn_norm)      a trunk attention block of the trunk's kind (gated / gqa /
                                                    mla) on the MTP block's own KV cache, at position i + 1
    x  = x + moe(rmsnorm(x) * ffn_norm)             routed experts (+ the shared expert)
    h' = rmsnorm(x) * shared_head_norm              (output_norm when the file has none)
    logits = h' @ output.T                          (nextn.shared_head_head when the file has one)
logits predict t_{i+2}; h' stands in for the trunk's h_{i+1} in the next step, so the block drafts k tokens
one after another from one trunk state.
`MtpDrafter` keeps the trunk's hidden states of its sequence (`Model.hidden_taps`, keyed by the KV cache), feeds
the block every committed (h_i, t_{i+1}) pair once (its KV cache then holds them in order: `entries`), and drafts
past them; the drafted entries are dropped (kv.n set back) at the next call. A server slot has its own drafter over
one shared `MTPHead`.
What this is not: a test of the head against llama.cpp (its MTP context needs the llama_batch_ext API, which
llama-cpp-python 0.3.36 does not bind), or a trainer (pymoe/demo/train_mtp.py trains the demo model's head, a
companion file: GGUFModel.attach_mtp; the tiny files' MTP blocks are random and draft at chance). The block's
experts are read in place (`PassThroughCache`), outside the slot pool.
"""
from __future__ import annotations

import bisect

import numpy as np

from pymoe.errors import PymoeError
from pymoe.experts.cache import PassThroughCache
from .kv import KVCache, Seqs, segments
from .moe import FFN


class MTPHead:
    def __init__(self, model):
        plan = model.file.mtp_plan()
        if plan is None:
            raise PymoeError(f"{model.file.path}: --spec mtp needs an MTP (nextn) block after the trunk, and this "
                             "file has none (nor a companion .mtp.gguf beside it: --spec mtp:FILE names one)")
        self.model, self.plan, L = model, plan, plan.index
        b, t = model.backend, model.file.get
        self.layer = model.layer_for(plan)  # the trunk's layer code reads blk.{L}.* like any layer
        self.eh_proj = b.dense(t(f"blk.{L}.nextn.eh_proj.weight"))  # [D, 2D]
        self.enorm = b.vector(t(f"blk.{L}.nextn.enorm.weight"))
        self.hnorm = b.vector(t(f"blk.{L}.nextn.hnorm.weight"))
        head_norm, head = t(f"blk.{L}.nextn.shared_head_norm.weight"), t(f"blk.{L}.nextn.shared_head_head.weight")
        self.head_norm = b.vector(head_norm) if head_norm is not None else model.output_norm
        self.head = b.dense(head) if head is not None else model.output
        self.embed_table = t(f"blk.{L}.nextn.embed_tokens.weight")  # None: the trunk's token_embd
        self.cache = PassThroughCache(model.file, "spill" if getattr(model.cache, "gpu", False) else None)

    def new_kv(self, n_ctx: int) -> KVCache:
        return KVCache(self.model.cfg, n_ctx, layers=(self.plan.index,))

    def forward(self, tokens, h: np.ndarray, kv) -> tuple[np.ndarray, np.ndarray]:
        """tokens [T] (t_{i+1} ..), h [T, D] (h_i ..), the pairs of kv.n .. kv.n + T - 1 -> (logits [T, V], h' [T, D]).
        kv: the block's KV cache, or several sequences' (engine/kv.py Seqs: each owning its rows, in order)."""
        m, cfg, layer = self.model, self.model.cfg, self.layer
        norm, eps, T = m.backend.rmsnorm, cfg.rms_eps, len(tokens)
        kvs = kv if isinstance(kv, list) else [kv]
        e = norm(m.embed(np.asarray(tokens, np.int64), self.embed_table), self.enorm, eps)  # [T, D]
        x = m.backend.linear(self.eh_proj, np.concatenate([np.asarray(e), np.asarray(norm(h, self.hnorm, eps))],
                                                          axis=1))  # [T, D]
        rope = m.rope_tables(m.positions(kvs, T) + 1)  # pair i sits at the position of t_{i+1}
        x = x + m.attention_block(layer, norm(x, layer.attn_norm, eps), kvs, self.plan.index, rope)
        y, _, _ = FFN[layer.plan.ffn](layer, norm(x, layer.ffn_norm, eps), self.cache, m.backend, "decode")
        x = x + y
        for one, rows in segments(kvs, T):
            one.n += rows.stop - rows.start
        hn = norm(x, self.head_norm, eps)  # [T, D]
        return np.asarray(m.backend.linear(self.head, hn)), np.asarray(hn)


class MtpDrafter:
    """`--spec mtp`: drafts with the file's MTP block from the trunk's last hidden states, for one sequence (one KV
    cache) at a time. `head`: an MTPHead to share (the server's slots share one; each has its drafter and block
    KV cache)."""

    name = "mtp"

    def __init__(self, model, n_ctx: int, head: MTPHead | None = None):
        self.head = head or MTPHead(model)
        self.kv = self.head.new_kv(n_ctx)
        self.hidden: dict = {}  # trunk position -> its hidden state [D], until fed to the block
        self.done = 0  # the pairs (h_i, t_{i+1}) before this one are fed (or skipped: see _pairs)
        self.entries: list = []  # the pair i of each committed entry of the block's KV cache, in order

    def fork(self) -> "MtpDrafter":
        """Another sequence's drafter over the same block (a server slot's)."""
        return MtpDrafter(self.head.model, self.kv.n_ctx, self.head)

    def attach(self, model, kv, reused: int = 0) -> None:
        """Follow the sequence of `kv`, whose first `reused` positions are already computed (a server slot's kept
        prefix): pairs inside that prefix stay in the block's cache, the rest is dropped."""
        keep = max(0, reused - 1)  # pair i needs t_{i+1}: the pairs of a prefix of r tokens are 0 .. r - 2
        self.entries = self.entries[:bisect.bisect_left(self.entries, keep)]
        self.done = min(self.done, keep)
        self.kv.n = len(self.entries)
        self.hidden = {p: h for p, h in self.hidden.items() if p < reused}
        model.hidden_taps[id(kv)] = self._keep

    def detach(self, model, kv) -> None:
        model.hidden_taps.pop(id(kv), None)

    def _keep(self, p0: int, h) -> None:
        h = np.asarray(h, np.float32)  # [T, D]
        for j in range(h.shape[0]):
            self.hidden[p0 + j] = h[j]  # a later forward over the same positions (after a rollback) overwrites

    def _pairs(self, history: list, k: int):
        """The committed pairs this call feeds the block, (t_{i+1} [m], h_i [m, D]) for i = done .. n - 1, with the
        block's cache set back to them (the entries drafted last time dropped); None: no drafts this time."""
        n = len(history) - 1  # trunk positions in the KV cache; history[n] is sampled, not yet run
        self.kv.n = len(self.entries)
        if n - 1 not in self.hidden and n > self.done:
            return None  # no hidden state of the last position (a prompt copied from another slot's cache)
        # Positions whose hidden states this drafter does not have (a prompt copied from a sibling's cache; in a kept
        # prefix, the last pairs' states, fed to the block in an earlier job and let go) are skipped: the block
        # keeps the entries it has (RoPE sees distances short by the pairs skipped).
        feed = [i for i in range(self.done, n) if i in self.hidden]
        if not feed or self.kv.n + len(feed) + k > self.kv.n_ctx:
            return None
        pairs = [history[i + 1] for i in feed], np.stack([self.hidden.pop(i) for i in feed])
        self.entries.extend(feed)
        self.done = n
        return pairs

    def propose(self, history: list, k: int) -> list:
        return MtpDrafter.propose_many([self], [history], [k])[0]

    @staticmethod
    def propose_many(drafters: list, histories: list, ks: list) -> list:
        """Drafts for several sequences whose drafters share one block (a server's slots; one sequence is
        `propose`): every sequence's new pairs in one block forward (a ragged batch), then each drafted position of
        all sequences in one forward of a row each. The block's rows are the same bits batched or alone (the CPU
        backend's row contract), so a sequence's drafts do not depend on the others."""
        out = [[] for _ in drafters]
        live = []  # (index, drafter, tokens, hidden) of the sequences that draft this time
        for j, (d, history, k) in enumerate(zip(drafters, histories, ks)):
            pairs = d._pairs(history, k) if k > 0 else None
            if pairs is not None:
                live.append((j, d, *pairs))
        if not live:
            return out
        head = live[0][1].head
        counts = [len(t) for _, _, t, _ in live]
        logits, h = head.forward([t for _, _, ts, _ in live for t in ts], np.concatenate([hh for *_, hh in live]),
                                 Seqs([d.kv for _, d, _, _ in live], counts))
        last = np.cumsum(counts) - 1  # each sequence's last pair: its first draft
        logits, h = logits[last], h[last]  # [N, V], [N, D]
        for i, (j, *_) in enumerate(live):
            out[j].append(int(np.argmax(logits[i])))
        while True:
            more = [i for i, (j, *_) in enumerate(live) if len(out[j]) < ks[j]]
            if not more:
                return out
            logits, h_more = head.forward([out[live[i][0]][-1] for i in more], h[more],
                                          Seqs([live[i][1].kv for i in more], [1] * len(more)))
            h[more] = h_more  # [len(more), D]: the block's state stands in for the trunk's
            for r, i in enumerate(more):
                out[live[i][0]].append(int(np.argmax(logits[r])))
