"""Record the stored routing traces of bench/traces/ (bench/traces/README.md; the format: docs/trace-files.md).

What this is: the exact recipe of each stored trace, so that any of them can be recorded again. Each trace is the
engine's own recorder (`Engine.record_trace`, what `pymoe run --trace` wires) on the CPU backend, written as
NAME.npz in bench/traces/ with a sidecar NAME.json: how it was made (this command, the model file and its sha256, the
prompts as text and token ids, sampling settings and seeds) and its tune / held-out split (requests).
  demo-code      the demo model on 8 held-out Python prompts (train.is_heldout files of the stdlib, 256 tokens each
                 from the middle of the file), 128 sampled tokens each
  demo-prose     the demo model on 8 English prose prompts (paragraphs of pydoc_data/topics.py, the Python
                 documentation's text, which the demo corpus excludes), 256 tokens each, 128 sampled tokens each
  demo-chat      the demo model in one 24-turn chat on its chat template (<|im_start|>role ... <|im_end|>), the KV
                 prefix kept between turns as the server's prefix reuse does: each turn prefills only the tokens not
                 already in the KV cache (request r = turn r: its prefill rows are those new tokens), then samples a
                 reply of up to 80 tokens
  moe64-code     the 64-expert top-8 model (the demo recipe at 64 experts, pymoe/demo/train.py; its command and
                 perplexity: bench/traces/README.md) on the same 8 held-out prompts as demo-code, cut to their first 128
                 tokens: the model was trained on 256-token windows, its context (128 prompt + 128 sampled)
Sampling everywhere: temperature 0.7, top-k 40, top-p 0.95, min-p 0.05, repeat penalty 1.1 (the bench's demo
trace), seed = request number; no stop at end-of-text for the code and prose requests (every request decodes its
full length), the chat stops a reply at <|im_end|> / <|endoftext|>.
What this is not: a benchmark (bench/cache_policies.py replays the traces), or a test (tests/test_stored_traces.py).

    PYTHONPATH=. python bench/record_traces.py demo-code demo-prose demo-chat
    PYTHONPATH=. python bench/record_traces.py moe64-code --model moe64.gguf
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import sysconfig
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "traces")
SAMPLING = dict(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1)
N_PROMPTS, PROMPT_TOKENS, DECODE_TOKENS = 8, 256, 128
CHAT_REPLY_TOKENS, CHAT_CTX = 80, 4096
CHAT_SYSTEM = "You are a helpful assistant who answers questions about Python with short code examples."
CHAT_TURNS = [
    "How do I read a text file line by line?",
    "Now skip the empty lines and strip the whitespace.",
    "Can you put that in a function that returns a list?",
    "What if the file does not exist? Handle the error.",
    "Write a class that counts words in a file.",
    "Add a method that returns the ten most common words.",
    "How would I test this class with unittest?",
    "Show me how to parse command line arguments for it.",
    "Now read the path from an environment variable instead.",
    "How do I walk a directory tree and find all .py files?",
    "Sort them by size, largest first.",
    "Write a function that computes the sha256 of each file.",
    "Run that in a thread pool to make it faster.",
    "How do I log progress with the logging module?",
    "Write a context manager that times a block of code.",
    "Make it a decorator as well.",
    "How do I serialise the results to JSON?",
    "And read them back into a dictionary?",
    "Write a dataclass for one result with a to_dict method.",
    "How do I compare two such results for equality?",
    "Write a generator that yields the lines of a large file in chunks.",
    "How do I handle Unicode decoding errors there?",
    "Explain the difference between a list and a tuple with an example.",
    "Finally, wrap everything in a main function with argparse.",
]


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def code_prompts(tokenizer) -> list[dict]:
    """N_PROMPTS held-out stdlib files (the demo split, train.is_heldout), every (33 // N_PROMPTS)-th in sorted order,
    the PROMPT_TOKENS tokens starting at the first line boundary past the file's middle."""
    from pymoe.demo.train import read_corpus

    _, heldout = read_corpus()
    names = [n for n in sorted(heldout) if len(heldout[n]) > 8000]  # long enough for 256 tokens past the middle
    step = max(1, len(names) // N_PROMPTS)
    out = []
    for name in names[::step][:N_PROMPTS]:
        text = heldout[name]
        start = text.index("\n", len(text) // 2) + 1
        ids = tokenizer.encode(text[start:start + 8 * PROMPT_TOKENS])[:PROMPT_TOKENS]
        out.append({"source": f"stdlib/{name}, from character {start}", "ids": ids})
    return out


def prose_prompts(tokenizer) -> list[dict]:
    """N_PROMPTS English paragraphs of pydoc_data/topics.py (the documentation text pydoc shows; excluded from the
    demo corpus): a topic's prose is its paragraphs with no indented line (reST code blocks are indented), no '>>>'
    and at least 12 words; of the topics (sorted) with at least PROMPT_TOKENS tokens of it, every
    (len // N_PROMPTS)-th, the first PROMPT_TOKENS tokens."""
    from pydoc_data.topics import topics

    cands = []
    for name in sorted(topics):
        paras = [p for p in re.split(r"\n\s*\n", topics[name])
                 if not any(ln.startswith((" ", "\t")) for ln in p.splitlines()) and ">>>" not in p
                 and len(p.split()) >= 12]
        ids = tokenizer.encode("\n\n".join(paras))[:PROMPT_TOKENS]
        if len(ids) == PROMPT_TOKENS:  # enough prose in this topic
            cands.append({"source": f"pydoc_data/topics.py topic {name!r}, its unindented paragraphs", "ids": ids})
    return cands[::max(1, len(cands) // N_PROMPTS)][:N_PROMPTS]


def record_prompts(engine, prompts: list[dict], meta: dict, path: str) -> dict:
    rec = engine.record_trace(meta)
    for seed, p in enumerate(prompts):
        out = list(engine.generate(p["ids"], max_tokens=DECODE_TOKENS, stop_at_eos=False, seed=seed, **SAMPLING))
        p["reply_ids"] = out
    rec.save(path)
    return {"requests": [{"request": i, "seed": i, "source": p["source"],
                          "prompt": engine.tokenizer.decode(p["ids"]), "prompt_ids": p["ids"],
                          "reply": engine.tokenizer.decode(p["reply_ids"])} for i, p in enumerate(prompts)]}


def record_chat(engine, meta: dict, path: str) -> dict:
    """One conversation; KV prefix reuse between turns (serve/scheduler.py's _place_prompt: the rendered
    conversation's tokens that are already in the KV cache are kept, only the rest is prefilled)."""
    from pymoe.engine.sampler import Sampler, SamplingParams

    model, tok = engine.model, engine.tokenizer
    rec = engine.record_trace(meta)
    kv = model.new_kv(CHAT_CTX)
    cached: list[int] = []  # the token ids whose keys and values are in kv (positions 0 .. kv.n - 1)
    messages = [{"role": "system", "content": CHAT_SYSTEM}]
    turns = []
    for turn, text in enumerate(CHAT_TURNS):
        messages.append({"role": "user", "content": text})
        ids = tok.encode(tok.apply_chat_template(messages))
        n = min(len(ids), len(cached))
        diff = np.flatnonzero(np.asarray(ids[:n]) != np.asarray(cached[:n]))
        reused = min(int(diff[0]) if diff.size else n, len(ids) - 1)  # at least one token read for the logits
        kv.n, cached = reused, ids[:reused]
        rec.start_request(len(ids) - reused)
        logits = model.prefill(np.asarray(ids[reused:]), kv)[-1]
        model.cache.end_prefill()
        cached = list(ids)
        sampler, history, reply = Sampler(SamplingParams(seed=turn, **SAMPLING)), list(ids), []
        while True:
            t = sampler(logits, history)
            history.append(t)
            reply.append(t)
            if tok.is_eog(t) or len(reply) == CHAT_REPLY_TOKENS:
                break
            logits = model.decode_one_token(t, kv)
            cached.append(t)
        text_reply = tok.decode([t for t in reply if not tok.is_eog(t)])
        messages.append({"role": "assistant", "content": text_reply})
        turns.append({"request": turn, "seed": turn, "user": text, "prompt_tokens": len(ids), "reused": reused,
                      "prefilled": len(ids) - reused, "reply_tokens": len(reply), "reply": text_reply})
    rec.save(path)
    return {"system": CHAT_SYSTEM, "n_ctx": CHAT_CTX, "turns": turns}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="+", choices=["demo-code", "demo-prose", "demo-chat", "moe64-code"])
    ap.add_argument("--model", default=None, help="the GGUF file (default: the demo model; moe64-code needs it)")
    ap.add_argument("--out-dir", default=OUT_DIR)
    args = ap.parse_args(argv)
    import pymoe
    from pymoe import demo

    os.makedirs(args.out_dir, exist_ok=True)
    for name in args.names:
        model = args.model or demo.demo_model()
        if name == "moe64-code" and args.model is None:
            sys.exit("record_traces: moe64-code needs --model (the 64-expert GGUF of bench/traces/README.md)")
        t0 = time.perf_counter()
        engine = pymoe.load(model, backend="cpu", threads=1, n_ctx=CHAT_CTX if name == "demo-chat" else None)
        how = {"name": name, "command": "PYTHONPATH=. python bench/record_traces.py " + name +
               (f" --model {os.path.basename(model)}" if args.model else ""),
               "model_file": os.path.basename(model), "model_sha256": sha256(model), "backend": "cpu",
               "python": sys.version.split()[0], "stdlib": sysconfig.get_paths()["stdlib"],
               "sampling": SAMPLING}
        path = os.path.join(args.out_dir, name + ".npz")
        if os.path.exists(path):
            os.remove(path)  # a fresh recording, never appended to an old one
        if name == "demo-chat":
            how.update(record_chat(engine, {"recipe": name}, path), max_reply_tokens=CHAT_REPLY_TOKENS)
        else:
            prompts = (prose_prompts if name == "demo-prose" else code_prompts)(engine.tokenizer)
            n_prompt = min(PROMPT_TOKENS, engine.n_ctx - DECODE_TOKENS)  # the moe64 model's context is 256
            for p in prompts:
                p["ids"] = p["ids"][:n_prompt]
            how.update(record_prompts(engine, prompts, {"recipe": name}, path), decode_tokens=DECODE_TOKENS,
                       stop_at_eos=False)
        from pymoe.experts.trace import Trace

        tr = Trace.load(path)
        n_req = int(tr.meta["n_requests"])
        how["split"] = {"tune": list(range(n_req // 2)), "heldout": list(range(n_req // 2, n_req)),
                        "rule": "the first half of the requests tune, the second half are held out"}
        how["summary"] = tr.summary()
        with open(os.path.join(args.out_dir, name + ".json"), "w") as f:
            json.dump(how, f, indent=1, ensure_ascii=False)
            f.write("\n")
        print(f"{name}: {tr.summary()} -> {path} ({os.path.getsize(path) / 1e3:.0f} kB, "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
