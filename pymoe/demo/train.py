"""Train the demo MoE shipped as pymoe/demo/data/demo-moe.gguf: a small qwen3moe on the Python standard library's source.

What this is: the whole recipe, from corpus to GGUF, in the order it runs (`tools/train-demo-model` calls `main`):
    corpus     the *.py files of `sysconfig.get_paths()["stdlib"]` (no tests, no site-packages, no generated
               tables), split into train / held-out *by file* with a hash of the relative path (so the split is the
               same on every machine with the same Python, whatever the directory order)
    tokenizer  a byte-level BPE trained on the train split with `tokenizers`, pre-tokenized with the Qwen2 regex
               that the file's `tokenizer.ggml.pre = "qwen2"` makes llama.cpp and pymoe use (tinymodel.train_tokenizer)
    model      `DemoMoE`, a PyTorch qwen3moe: per-head q/k RMSNorm, NEOX RoPE, GQA, softmax -> top-k -> renormalised
               weights, SwiGLU experts, untied output head, plus the Switch/Mixtral load-balancing loss
    training   AdamW, linear warm-up then cosine decay, random windows of the train token stream, checkpoints
    evaluation held-out perplexity of the float model, and the unigram baseline (train counts, add-one smoothing)
    export     tinymodel.write_gguf: llama.cpp's metadata keys and tensor names, the Q2_K mix of quant_type
What this is not: a general trainer, or part of the inference path. torch is imported inside the functions that
need it, so `import pymoe` never needs torch (`pip install pymoe[train]` brings it).

Weight layout = GGUF layout. Parameters are named and shaped exactly as the GGUF tensors (NumPy order, y = x @ W.T),
so the export is a transpose-free copy. No Q/K permutation: llama.cpp's converter does not permute qwen3moe, and the
rotation here is NEOX-style (rotate_half: pairs (i, i + d/2)), which is what pymoe/engine/model.py and llama.cpp compute.
Determinism: the file split is a hash; the tokenizer trainer is deterministic; the weights, batches and routing
depend only on `--seed` (torch on the CPU, a fixed thread count).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from pymoe.gguf.config import ARCHS, ModelConfig
from pymoe.gguf.loader import expected_tensors

# --- corpus --------------------------------------------------------------------------------------------------------

EXCLUDE_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                "encodings", "pydoc_data"}  # tests, third-party code, generated codec tables and doc strings
MAX_FILE_BYTES = 256 * 1024  # anything larger is generated or an outlier (none of stdlib's hand-written code is)
HELDOUT_PERCENT = 5


def stdlib_files(root: Optional[str] = None) -> list[str]:
    """Relative paths of the stdlib's *.py files used as the corpus, sorted."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in EXCLUDE_DIRS and not x.startswith("config-")]
        for f in files:
            p = os.path.join(d, f)
            if f.endswith(".py") and not f.startswith("_sysconfigdata") and os.path.getsize(p) <= MAX_FILE_BYTES:
                out.append(os.path.relpath(p, root))
    return sorted(out)


def is_heldout(rel_path: str) -> bool:
    """The split by file: a stable hash of the relative path (not Python's salted hash())."""
    h = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:4], "little")
    return h % 100 < HELDOUT_PERCENT


def read_corpus(root: Optional[str] = None) -> tuple[dict[str, str], dict[str, str]]:
    """(train, heldout): relative path -> source text."""
    root = root or sysconfig.get_paths()["stdlib"]
    train, heldout = {}, {}
    for rel in stdlib_files(root):
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            text = f.read()
        (heldout if is_heldout(rel) else train)[rel] = text
    return train, heldout


# --- tokenizer -----------------------------------------------------------------------------------------------------

def build_tokenizer(train_texts: list[str], vocab_size: int):
    """-> (tokens, types, merges, hf_tokenizer). The `tokenizers` object encodes exactly like the GGUF file will
    (same Qwen2 split regex, byte alphabet and ranked merges); specials are never in the source text."""
    from tokenizers import Tokenizer

    from .tinymodel import train_tokenizer
    from pymoe.engine.tokenizer import QWEN2_REGEX

    tokens, types, merges = train_tokenizer(vocab_size, split_regex=QWEN2_REGEX, texts=train_texts)
    spec = {
        "version": "1.0", "added_tokens": [], "normalizer": None, "post_processor": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_REGEX}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
    }
    return tokens, types, merges, Tokenizer.from_str(json.dumps(spec))


def encode_stream(hf_tok, texts: list[str], eos: int) -> np.ndarray:
    """All texts as one int32 token stream, each file followed by <|endoftext|>."""
    out = []
    for enc in hf_tok.encode_batch(texts):
        out.extend(enc.ids)
        out.append(eos)
    return np.asarray(out, dtype=np.int32)


def unigram_perplexity(train_ids: np.ndarray, heldout_ids: np.ndarray, n_vocab: int) -> float:
    """The baseline: p(token) from train counts with add-one smoothing, no context at all."""
    counts = np.bincount(train_ids, minlength=n_vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[heldout_ids].mean()))


# --- the model -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DemoConfig:
    n_layers: int = 4
    n_embd: int = 256  # multiple of 256: K-quant rows (quant_type falls back to Q4_0 otherwise)
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_expert: int = 32
    n_expert_used: int = 4
    n_ff_exp: int = 256  # multiple of 256 (ffn_down rows)
    n_vocab: int = 4096
    n_ctx: int = 512  # training sequence length = the file's context_length
    rope_base: float = 10000.0
    rms_eps: float = 1e-6

    def model_config(self, n_vocab: int) -> ModelConfig:
        t = ARCHS["qwen3moe"]
        return ModelConfig(
            arch="qwen3moe", name="pymoe-demo-moe", n_layers=self.n_layers, n_embd=self.n_embd, n_vocab=n_vocab,
            n_ctx_train=self.n_ctx, n_head=self.n_head, n_head_kv=self.n_head_kv, head_dim=self.head_dim,
            head_dim_v=self.head_dim, n_expert=self.n_expert, n_expert_used=self.n_expert_used,
            n_ff_exp=self.n_ff_exp, n_ff_shexp=0, rms_eps=float(np.float32(self.rms_eps)),
            rope_freq_base=self.rope_base, rope_dim=self.head_dim, rope_neox=t.rope_neox, qk_norm=t.qk_norm,
            qkv_bias=t.qkv_bias, norm_topk=t.norm_topk, tied_output=False)


def build_model(cfg: ModelConfig, seed: int, extra: Optional[dict] = None):
    """A torch.nn.Module whose parameters are named like the GGUF tensors ("blk.0.attn_q.weight" -> blk_0_attn_q).
    extra: more tensors, name -> shape (the MTP block of pymoe/demo/train_mtp.py: expected_mtp_tensors)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    def rmsnorm(x, w, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x, cos, sin):  # x [B, H, T, Dh]; NEOX: pairs (i, i + Dh/2) = HF's rotate_half
        n = x.shape[-1] // 2
        a, b = x[..., :n], x[..., n:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    class DemoMoE(nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.params = nn.ParameterDict()
            for name, shape in {**expected_tensors(cfg), **(extra or {})}.items():
                if name.endswith("norm.weight"):
                    w = torch.ones(shape)
                else:
                    fan_in = shape[-1]
                    std = 0.02 if name in ("token_embd.weight",) else 1.0 / math.sqrt(fan_in)
                    if name.endswith(("attn_output.weight", "ffn_down_exps.weight")):
                        std /= math.sqrt(2 * cfg.n_layers)  # residual branches start small (GPT-2)
                    if name.endswith("ffn_gate_inp.weight") or name == "output.weight":
                        std = 0.02
                    w = torch.randn(shape, generator=g) * std
                self.params[name.replace(".", "_")] = nn.Parameter(w)
            i = torch.arange(cfg.rope_dim // 2, dtype=torch.float64)
            self.inv_freq = cfg.rope_freq_base ** (-2.0 * i / cfg.rope_dim)

        def p(self, name):
            return self.params[name.replace(".", "_")]

        def gguf_tensors(self):
            """(GGUF name, float32 NumPy array) in expected_tensors order: what write_gguf takes."""
            for name in expected_tensors(cfg):
                yield name, self.p(name).detach().float().cpu().numpy()

        def moe(self, i, x):
            """x [N, D] -> (y [N, D], aux loss, expert ids [N, K])."""
            b = f"blk.{i}."
            E, K = cfg.n_expert, cfg.n_expert_used
            probs = F.softmax(x @ self.p(b + "ffn_gate_inp.weight").T, dim=-1)  # [N, E]
            w, ids = probs.topk(K, dim=-1)  # [N, K]
            w = w / w.sum(-1, keepdim=True)
            # Switch/Mixtral load balancing: E * sum_e (share of assignments to e) * (mean router prob of e)
            share = torch.bincount(ids.reshape(-1), minlength=E).float() / ids.numel()
            aux = E * (share * probs.mean(0)).sum()
            wg, wu, wd = (self.p(b + f"ffn_{p}_exps.weight") for p in ("gate", "up", "down"))
            flat = ids.reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=E).tolist()
            tok_of = order // K  # token of each sorted assignment
            w_sorted = w.reshape(-1)[order]
            y = torch.zeros_like(x)
            start = 0
            for e, n in enumerate(counts):
                if n == 0:
                    continue
                tok = tok_of[start:start + n]
                h = x[tok]  # [n, D]
                out = (F.silu(h @ wg[e].T) * (h @ wu[e].T)) @ wd[e].T  # [n, D]
                y.index_add_(0, tok, out * w_sorted[start:start + n, None])
                start += n
            return y, aux, ids

        def rope_tables(self, positions):
            """positions [T] -> (cos, sin) [T, Dh/2]."""
            theta = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
            return theta.cos().float(), theta.sin().float()

        def block(self, i, x, cos, sin):
            """Layer i (attention, then the MoE): x [B, T, D] -> (x [B, T, D], aux loss, expert ids [B*T, K])."""
            B, T, _ = x.shape
            H, G, Dh, eps = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rms_eps
            b = f"blk.{i}."
            h = rmsnorm(x, self.p(b + "attn_norm.weight"), eps)
            q = (h @ self.p(b + "attn_q.weight").T).view(B, T, H, Dh)
            k = (h @ self.p(b + "attn_k.weight").T).view(B, T, G, Dh)
            v = (h @ self.p(b + "attn_v.weight").T).view(B, T, G, Dh)
            q = rmsnorm(q, self.p(b + "attn_q_norm.weight"), eps).transpose(1, 2)  # [B, H, T, Dh]
            k = rmsnorm(k, self.p(b + "attn_k_norm.weight"), eps).transpose(1, 2)  # [B, G, T, Dh]
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            # GQA: query head h reads KV head h // (H / G)  (repeat_interleave, as pymoe and llama.cpp)
            k = k.repeat_interleave(H // G, dim=1)
            v = v.transpose(1, 2).repeat_interleave(H // G, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, Dh]
            x = x + a.transpose(1, 2).reshape(B, T, H * Dh) @ self.p(b + "attn_output.weight").T
            h = rmsnorm(x, self.p(b + "ffn_norm.weight"), eps)
            y, aux, ids = self.moe(i, h.reshape(B * T, -1))
            return x + y.view(B, T, -1), aux, ids

        def trunk(self, tokens):
            """tokens [B, T] -> (hidden [B, T, D] after the output norm, mean aux loss, per-layer expert ids)."""
            cos, sin = self.rope_tables(torch.arange(tokens.shape[1]))
            x = self.p("token_embd.weight")[tokens]  # [B, T, D]
            aux_total, all_ids = 0.0, []
            for i in range(cfg.n_layers):
                x, aux, ids = self.block(i, x, cos, sin)
                aux_total = aux_total + aux
                all_ids.append(ids)
            return rmsnorm(x, self.p("output_norm.weight"), cfg.rms_eps), aux_total / cfg.n_layers, all_ids

        def forward(self, tokens, return_ids=False):
            """tokens [B, T] -> (logits [B, T, V], mean aux loss[, per-layer expert ids])."""
            x, aux, all_ids = self.trunk(tokens)
            logits = x @ self.p("output.weight").T
            return (logits, aux, all_ids) if return_ids else (logits, aux)

        def mtp(self, h, nxt):
            """The MTP block (engine/mtp.py's MTPHead.forward, batched): h [B, T, D] the trunk's hidden states of
            positions 0 .. T-1, nxt [B, T] the tokens that followed them -> (logits [B, T, V] for the token after
            nxt, aux loss). Pair i sits at position i + 1, as in engine/mtp.py."""
            L, eps = cfg.n_layers, cfg.rms_eps
            b = f"blk.{L}."
            e = rmsnorm(self.p("token_embd.weight")[nxt], self.p(b + "nextn.enorm.weight"), eps)
            x = torch.cat([e, rmsnorm(h, self.p(b + "nextn.hnorm.weight"), eps)], dim=-1)  # [B, T, 2D]
            x = x @ self.p(b + "nextn.eh_proj.weight").T  # [B, T, D]
            cos, sin = self.rope_tables(torch.arange(1, h.shape[1] + 1))
            x, aux, _ = self.block(L, x, cos, sin)
            x = rmsnorm(x, self.p(b + "nextn.shared_head_norm.weight"), eps)
            return x @ self.p("output.weight").T, aux

    return DemoMoE()


# --- training ------------------------------------------------------------------------------------------------------

@dataclass
class TrainArgs:
    out_dir: str = "demo-train"
    output: str = "pymoe/demo/data/demo-moe.gguf"
    seed: int = 0
    steps: int = 600
    batch: int = 8
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    aux_coef: float = 0.002
    threads: int = 1  # on a shared 2-core machine one thread beats two (no OpenMP barriers to wait at)
    eval_chunks: int = 0  # held-out chunks of n_ctx tokens for the float perplexity (0: all)
    log_every: int = 10
    ckpt_every: int = 50


def lr_at(step: int, a: TrainArgs) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def heldout_chunks(ids: np.ndarray, n_ctx: int, n_chunks: int = 0) -> np.ndarray:
    """Non-overlapping windows [C, n_ctx] of the held-out stream (each evaluated from an empty context)."""
    c = len(ids) // n_ctx
    chunks = ids[:c * n_ctx].reshape(c, n_ctx)
    return chunks[:n_chunks] if n_chunks else chunks


def float_perplexity(model, chunks: np.ndarray, batch: int = 8) -> float:
    """exp(mean NLL) of every token after the first of each chunk, under the PyTorch model."""
    import torch
    import torch.nn.functional as F

    model.eval()
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(chunks), batch):
            x = torch.from_numpy(chunks[s:s + batch].astype(np.int64))
            logits, _ = model(x[:, :-1])
            nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
            n += x[:, 1:].numel()
    model.train()
    return math.exp(nll / n)


def log(msg: str, path: Optional[str] = None) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def prepare(a: TrainArgs, dc: DemoConfig):
    """Corpus -> tokenizer -> token streams, cached in out_dir (tokenizer training takes a minute)."""
    from .tinymodel import EOS_TOKEN

    os.makedirs(a.out_dir, exist_ok=True)
    cache = os.path.join(a.out_dir, f"data-v{dc.n_vocab}.npz")
    train, heldout = read_corpus()
    if os.path.exists(cache):
        z = np.load(cache, allow_pickle=False)
        tok = json.loads(str(z["tokenizer"]))
        return train, heldout, tok["tokens"], tok["types"], tok["merges"], z["train_ids"], z["heldout_ids"]
    tokens, types, merges, hf = build_tokenizer(list(train.values()), dc.n_vocab)
    eos = tokens.index(EOS_TOKEN)
    train_ids = encode_stream(hf, list(train.values()), eos)
    heldout_ids = encode_stream(hf, list(heldout.values()), eos)
    np.savez(cache, train_ids=train_ids, heldout_ids=heldout_ids,
             tokenizer=np.array(json.dumps({"tokens": tokens, "types": types, "merges": merges})))
    return train, heldout, tokens, types, merges, train_ids, heldout_ids


def train(a: TrainArgs, dc: DemoConfig) -> dict:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when torch loads OpenMP: no spinning threads
    import torch
    import torch.nn.functional as F

    from .tinymodel import write_gguf

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    logf = os.path.join(a.out_dir, "train.log")
    os.makedirs(a.out_dir, exist_ok=True)
    t0 = time.time()
    train_files, heldout_files, tokens, types, merges, train_ids, heldout_ids = prepare(a, dc)
    cfg = dc.model_config(len(tokens))
    info = {
        "python": sys.version.split()[0], "stdlib": sysconfig.get_paths()["stdlib"],
        "files_train": len(train_files), "files_heldout": len(heldout_files),
        "bytes_train": sum(len(t.encode()) for t in train_files.values()),
        "bytes_heldout": sum(len(t.encode()) for t in heldout_files.values()),
        "tokens_train": int(len(train_ids)), "tokens_heldout": int(len(heldout_ids)), "n_vocab": len(tokens),
        "demo_config": asdict(dc), "train_args": asdict(a),
    }
    log(f"corpus: {json.dumps({k: v for k, v in info.items() if k not in ('demo_config', 'train_args')})} "
        f"({time.time() - t0:.0f}s)", logf)

    model = build_model(cfg, a.seed)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.params.items() if p.dim() >= 2 and not n.endswith("token_embd_weight")]
    no_decay = [p for n, p in model.params.items() if not (p.dim() >= 2 and not n.endswith("token_embd_weight"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    ckpt = os.path.join(a.out_dir, "ckpt.pt")
    step = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        log(f"resumed from {ckpt} at step {step}", logf)
    log(f"model: {n_params / 1e6:.2f}M parameters, {cfg.n_layers} layers, {cfg.n_expert} experts top-"
        f"{cfg.n_expert_used}, ff {cfg.n_ff_exp}, D {cfg.n_embd}, vocab {cfg.n_vocab}; "
        f"{a.steps} steps x {a.batch} x {dc.n_ctx} tokens", logf)

    T = dc.n_ctx
    t_train, start_step = time.time(), step
    while step < a.steps:
        # batch `step` depends only on (seed, step): a resumed run sees the same batches
        rng = np.random.default_rng([a.seed, step])
        starts = rng.integers(0, len(train_ids) - T - 1, size=a.batch)
        xb = torch.from_numpy(np.stack([train_ids[s:s + T + 1] for s in starts]).astype(np.int64))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a)
        logits, aux = model(xb[:, :-1])
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), xb[:, 1:].reshape(-1))
        loss = ce + a.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % a.log_every == 0 or step == a.steps:
            dt = time.time() - t_train
            log(f"step {step}/{a.steps} loss {ce.item():.3f} aux {aux.item():.3f} lr {lr_at(step - 1, a):.2e} "
                f"{a.batch * T * (step - start_step) / dt:.0f} tok/s, {dt / 60:.1f} min", logf)
        if step % a.ckpt_every == 0 or step == a.steps:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    info["train_seconds"] = time.time() - t_train
    info["n_params"] = n_params

    chunks = heldout_chunks(heldout_ids, T, a.eval_chunks)
    info["float_ppl_heldout"] = float_perplexity(model, chunks)
    info["eval_tokens"] = int(chunks[:, 1:].size)
    info["unigram_ppl_heldout"] = unigram_perplexity(train_ids, chunks[:, 1:].reshape(-1), cfg.n_vocab)
    log(f"held-out perplexity: float model {info['float_ppl_heldout']:.2f}, unigram baseline "
        f"{info['unigram_ppl_heldout']:.2f} ({info['eval_tokens']} tokens)", logf)

    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    write_gguf(a.output, cfg, tokens, types, merges, "q2_k", model.gguf_tensors())
    info["gguf_bytes"] = os.path.getsize(a.output)
    log(f"wrote {a.output}: {info['gguf_bytes'] / 1e6:.2f} MB", logf)
    np.save(os.path.join(a.out_dir, "heldout_ids.npy"), heldout_ids)
    with open(os.path.join(a.out_dir, "train_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def main(argv=None) -> None:
    import argparse

    a, dc = TrainArgs(), DemoConfig()
    ap = argparse.ArgumentParser(prog="train-demo-model", description=__doc__.split("\n\n")[0])
    for obj in (a, dc):
        for k, v in asdict(obj).items():
            flags = ["--" + k.replace("_", "-")] + (["-o"] if k == "output" else [])
            ap.add_argument(*flags, type=type(v), default=v, help=f"(default {v})")
    ns = vars(ap.parse_args(argv))
    a = TrainArgs(**{k: ns[k] for k in asdict(a)})
    dc = DemoConfig(**{k: ns[k] for k in asdict(dc)})
    info = train(a, dc)
    print(json.dumps({k: v for k, v in info.items() if k not in ("demo_config", "train_args")}, indent=1))
