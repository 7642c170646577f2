"""Perplexity of one text under pymoe and under llama.cpp (llama-cpp-python), same GGUF file, same token ids.

What this is: the check behind docs/demo-model.md's "pymoe within 2% of llama.cpp". The text is tokenized once, by
pymoe's tokenizer (llama.cpp's own tokenization of it is compared and reported, not used), and both engines score
exactly the same (context, target) pairs (pymoe/engine/perplexity.py `windows`). llama.cpp runs with an F32 KV cache. On a
K-quant file llama.cpp multiplies with 8-bit-quantized activations and pymoe in float32, so the two differ a little;
on a float file they agree to rounding. It also reports the routing skew pymoe saw on the text (share of lookups
served by the top 10/25/50% of experts per layer) and can save those counts (`--heat-out`, int64 [L, E]).
What this is not: a speed benchmark (bench/compare_llamacpp.py).

    PYTHONPATH=. python bench/perplexity_vs_llamacpp.py pymoe/demo/data/demo-moe.gguf --heldout --chunks 40
    PYTHONPATH=. python bench/perplexity_vs_llamacpp.py model.gguf --text TEXT_FILE --n-ctx 512
"""
from __future__ import annotations

import argparse
import json

import numpy as np

import pymoe
from pymoe.engine.perplexity import engine_perplexity, llamacpp_perplexity, top_share


def heldout_ids(engine) -> np.ndarray:
    """The demo model's held-out split (pymoe/demo/train.py), tokenized by pymoe, files joined by <|endoftext|>."""
    from pymoe.demo.tinymodel import EOS_TOKEN
    from pymoe.demo.train import read_corpus

    _, heldout = read_corpus()
    eos = engine.tokenizer.encode(EOS_TOKEN, special=True)
    ids = []
    for text in heldout.values():
        ids += engine.tokenizer.encode(text, special=False) + eos
    return np.asarray(ids, dtype=np.int64)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="GGUF file")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="a text file to score")
    src.add_argument("--heldout", action="store_true", help="the demo model's held-out stdlib files")
    ap.add_argument("--n-ctx", type=int, default=512, help="window size in tokens (default 512)")
    ap.add_argument("--stride", type=int, default=None, help="window stride (default n-ctx: disjoint chunks)")
    ap.add_argument("--chunks", type=int, default=0, help="score only the first CHUNKS windows' tokens (0: all)")
    ap.add_argument("--threads", type=int, default=2, help="threads for both engines (default 2)")
    ap.add_argument("--heat-out", default=None, help="save pymoe's routing counts int64 [L, E] to this .npy")
    ap.add_argument("--json", default=None, help="write the numbers to this JSON file")
    args = ap.parse_args(argv)

    engine = pymoe.load(args.model, threads=args.threads)
    if args.heldout:
        ids = heldout_ids(engine)
    else:
        with open(args.text, encoding="utf-8") as f:
            ids = np.asarray(engine.tokenizer.encode(f.read()), dtype=np.int64)
    if args.chunks:
        ids = ids[:args.chunks * args.n_ctx]
    out = {"model": args.model, "n_ctx": args.n_ctx, "stride": args.stride or args.n_ctx, "tokens": int(ids.size)}

    try:  # llama.cpp's tokenization of the same text, for the record (specials excluded: they are not text)
        from llama_cpp import Llama

        text = engine.tokenizer.decode([int(t) for t in ids if not engine.tokenizer.is_eog(int(t))])
        llm = Llama(model_path=args.model, vocab_only=True, verbose=False)
        mine = engine.tokenizer.encode(text, special=False)
        out["tokenization_equal"] = llm.tokenize(text.encode(), add_bos=False, special=False) == mine
        del llm
    except ImportError:
        out["tokenization_equal"] = None

    p = engine_perplexity(engine, ids, args.n_ctx, args.stride, heat=True, progress=True)
    q = llamacpp_perplexity(args.model, ids, args.n_ctx, args.stride, n_threads=args.threads, progress=True)
    out.update(scored=p.n_tokens, pymoe_ppl=p.ppl, llamacpp_ppl=q.ppl, rel_diff=p.ppl / q.ppl - 1,
               pymoe_seconds=p.seconds, llamacpp_seconds=q.seconds,
               max_abs_nll_diff=float(np.max(np.abs(np.asarray(p.nll) - np.asarray(q.nll)))))
    out["skew"] = {f"top{int(f * 100)}": top_share(p.heat, f).round(4).tolist() for f in (0.10, 0.25, 0.50)}
    print(f"{args.model}: {out['scored']} tokens scored in windows of {args.n_ctx}")
    print(f"  pymoe     perplexity {p.ppl:9.4f}   ({p.seconds:.0f} s)")
    print(f"  llama.cpp perplexity {q.ppl:9.4f}   ({q.seconds:.0f} s)")
    print(f"  pymoe / llama.cpp - 1 = {out['rel_diff'] * 100:+.3f}%   (largest per-token NLL difference "
          f"{out['max_abs_nll_diff']:.3f}; tokenization equal: {out['tokenization_equal']})")
    print("  routing skew (share of lookups served by the top 10% / 25% / 50% of experts):")
    for i in range(p.heat.shape[0]):
        print(f"    layer {i}: " + " / ".join(f"{out['skew'][k][i] * 100:.1f}%" for k in out["skew"]))
    if args.heat_out:
        np.save(args.heat_out, p.heat)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
