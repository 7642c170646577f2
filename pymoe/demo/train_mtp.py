"""Train an MTP (NextN) head for the demo model on its frozen trunk: pymoe/demo/data/demo-moe.mtp.gguf.

What this is: the recipe behind the demo's `pymoe run --spec mtp` (tools/train-demo-mtp calls `main`), in the order
it runs:
    trunk      the shipped demo-moe.gguf, every tensor dequantized to float32 by pymoe's reference dequantizer, in
               train.build_model's DemoMoE, frozen: the hidden states the head learns from are those of the file
               pymoe runs (up to float rounding), not of the float model before quantization
    corpus     train.read_corpus's train split, tokenized by the file's own tokenizer (pymoe's, which reproduces
               the trainer's token stream), files joined by the end-of-text token
    head       the block engine/mtp.py runs, as llama.cpp's MTP graph computes it: for trunk position i,
               x = eh_proj([rmsnorm(embed(t_{i+1})) enorm | rmsnorm(h_i) hnorm]), one trunk block (attention + MoE)
               at position i + 1, shared_head_norm, the trunk's output head (frozen, shared)
    loss       distillation: cross-entropy of the head's distribution against the trunk's own next-token
               distribution at position i + 1 (the head is asked what the model will say after t_{i+1}, which is
               what greedy verification accepts), + the load-balancing loss of its router
    init       the block's attention and experts copied from the trunk's last layer, eh_proj random
    evaluation held-out windows, teacher-forced: how often the head's argmax equals the trunk's argmax one position
               later (the first draft's greedy acceptance on that text), and equals the text's next-next token
    export     tinymodel.write_mtp_companion: the demo's metadata with block_count + 1 and nextn_predict_layers 1,
               only the blk.4.* tensors, quantized by the same Q2_K mix as the trunk (quant_type)
What this is not: a head for any other model (the architecture is the demo's qwen3moe), or part of the inference path.
Why a companion file and not the tensors in demo-moe.gguf: llama.cpp refuses a qwen3moe file with tensors it does not
load, and the demo file must stay loadable there (it is the oracle's input in the tests); see
GGUFModel.attach_mtp. Determinism: batches and init depend only on `--seed` (torch on the CPU, fixed threads).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

import numpy as np

from .train import build_model, heldout_chunks, log, lr_at, read_corpus

DEMO = os.path.join(os.path.dirname(__file__), "data", "demo-moe.gguf")


@dataclass
class MtpArgs:
    model: str = DEMO
    output: str = ""  # default: the companion path beside the model (engine/speculative.mtp_companion)
    out_dir: str = "demo-train-mtp"
    seed: int = 0
    steps: int = 300
    batch: int = 8
    n_ctx: int = 512
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.1
    aux_coef: float = 0.002
    threads: int = 2
    eval_chunks: int = 48  # held-out windows of n_ctx tokens for the agreement figures (0: all)
    log_every: int = 10
    ckpt_every: int = 50


def token_streams(model_path: str) -> tuple[np.ndarray, np.ndarray]:
    """(train ids, held-out ids) of the demo corpus under the file's own tokenizer."""
    from pymoe.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_file(model_path)
    train, heldout = read_corpus()

    def stream(texts: dict) -> np.ndarray:
        ids = []
        for text in texts.values():
            ids.extend(tok.encode(text, add_bos=False, special=False))
            ids.append(tok.eos_id)
        return np.asarray(ids, np.int32)

    return stream(train), stream(heldout)


def load_frozen(model_path: str, seed: int):
    """The GGUF's trunk, dequantized, in a DemoMoE with the MTP block's parameters added; (model, ModelConfig)."""
    import torch

    from pymoe.gguf.loader import expected_mtp_tensors, load_gguf

    f = load_gguf(model_path)
    cfg = f.config
    if cfg.arch != "qwen3moe" or f.mtp_plan() is not None:
        raise SystemExit(f"{model_path}: the demo trainer makes heads for qwen3moe files without an MTP block")
    extra = expected_mtp_tensors(cfg)
    model = build_model(cfg, seed, extra=extra)
    with torch.no_grad():
        for name, t in f.tensors.items():
            model.p(name).copy_(torch.from_numpy(t.floats()))
            model.p(name).requires_grad_(False)
        last, L = f"blk.{cfg.n_layers - 1}.", f"blk.{cfg.n_layers}."
        for name in extra:  # the block starts as a copy of the trunk's last layer
            src = name.replace(L, last)
            if src in f.tensors:
                model.p(name).copy_(torch.from_numpy(f.tensors[src].floats()))
    return model, cfg, extra


def mtp_loss(model, xb, aux_coef: float):
    """xb [B, T + 1] -> (loss, its distillation part, agreement with the trunk, accuracy on the text), pairs
    i = 0 .. T - 2."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        h, _, _ = model.trunk(xb[:, :-1])  # [B, T, D]
        target = F.softmax(h[:, 1:] @ model.p("output.weight").T, dim=-1)  # [B, T-1, V]: the trunk's next choice
    logits, aux = model.mtp(h[:, :-1], xb[:, 1:-1])  # pair i = (h_i, t_{i+1}) -> t_{i+2}
    ce = -(target * F.log_softmax(logits, dim=-1)).sum(-1).mean()
    with torch.no_grad():
        pick = logits.argmax(-1)
        agree = (pick == target.argmax(-1)).float().mean().item()
        right = (pick == xb[:, 2:]).float().mean().item()
    return ce + aux_coef * aux, ce.detach(), agree, right


def evaluate(model, chunks: np.ndarray, batch: int = 8) -> dict:
    import torch

    model.eval()
    n, agree, right, ce = 0, 0.0, 0.0, 0.0
    with torch.no_grad():
        for s in range(0, len(chunks), batch):
            xb = torch.from_numpy(chunks[s:s + batch].astype(np.int64))
            _, c, a, r = mtp_loss(model, xb, 0.0)
            w = xb.shape[0]
            n, agree, right, ce = n + w, agree + a * w, right + r * w, ce + c.item() * w
    model.train()
    return {"agreement": agree / n, "accuracy": right / n, "distill_ce": ce / n, "windows": n}


def train(a: MtpArgs) -> dict:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when torch loads OpenMP: no spinning threads
    import torch

    from pymoe.engine.speculative import mtp_companion
    from .tinymodel import _quantized, write_mtp_companion

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    os.makedirs(a.out_dir, exist_ok=True)
    logf = os.path.join(a.out_dir, "train.log")
    output = a.output or mtp_companion(a.model)
    t0 = time.time()
    model, cfg, extra = load_frozen(a.model, a.seed)
    train_ids, heldout_ids = token_streams(a.model)
    log(f"trunk {a.model} frozen; corpus {len(train_ids)} train / {len(heldout_ids)} held-out tokens "
        f"({time.time() - t0:.0f}s)", logf)
    params = [model.p(n) for n in extra]
    n_params = sum(p.numel() for p in params)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    chunks = heldout_chunks(heldout_ids, a.n_ctx + 1, a.eval_chunks)
    before = evaluate(model, chunks)
    log(f"MTP block: {n_params / 1e6:.2f}M parameters; held-out before training: {json.dumps(before)}", logf)
    ckpt = os.path.join(a.out_dir, "ckpt.pt")
    step = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=False)
        with torch.no_grad():
            for n in extra:
                model.p(n).copy_(state["model"][n])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        log(f"resumed from {ckpt} at step {step}", logf)
    T = a.n_ctx
    t_train, start_step = time.time(), step
    while step < a.steps:
        rng = np.random.default_rng([a.seed, step])  # batch `step` depends only on (seed, step)
        starts = rng.integers(0, len(train_ids) - T - 1, size=a.batch)
        xb = torch.from_numpy(np.stack([train_ids[s:s + T + 1] for s in starts]).astype(np.int64))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a)
        loss, ce, agree, right = mtp_loss(model, xb, a.aux_coef)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % a.log_every == 0 or step == a.steps:
            dt = time.time() - t_train
            log(f"step {step}/{a.steps} distill {ce.item():.3f} agree {agree:.3f} right {right:.3f} "
                f"lr {lr_at(step - 1, a):.2e} {a.batch * T * (step - start_step) / dt:.0f} tok/s, {dt / 60:.1f} min",
                logf)
        if step % a.ckpt_every == 0 or step == a.steps:
            torch.save({"model": {n: model.p(n).detach() for n in extra}, "opt": opt.state_dict(), "step": step},
                       ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    after = evaluate(model, chunks)
    log(f"held-out after training: {json.dumps(after)}", logf)
    weights = ((n, model.p(n).detach().float().numpy()) for n in extra)
    write_mtp_companion(a.model, output, ((n, data, qtype) for n, _, qtype, data in
                                          _quantized(weights, "q2_k", 1, cfg)))
    info = {"args": asdict(a), "n_params": n_params, "train_seconds": time.time() - t_train,
            "heldout_before": before, "heldout_after": after, "output": output,
            "output_bytes": os.path.getsize(output)}
    log(f"wrote {output}: {info['output_bytes'] / 1e6:.2f} MB", logf)
    with open(os.path.join(a.out_dir, "train_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def main(argv=None) -> None:
    import argparse

    a = MtpArgs()
    ap = argparse.ArgumentParser(prog="train-demo-mtp", description=__doc__.split("\n\n")[0])
    for k, v in asdict(a).items():
        flags = ["--" + k.replace("_", "-")] + (["-o"] if k == "output" else [])
        ap.add_argument(*flags, type=type(v), default=v, help=f"(default {v!r})")
    info = train(MtpArgs(**vars(ap.parse_args(argv))))
    print(json.dumps({k: v for k, v in info.items() if k != "args"}, indent=1))
