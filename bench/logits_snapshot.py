"""Save, or compare against a saved file, the logits and greedy tokens of every test model and the demo model.

What it is for: a refactor that must not change a single bit (issue "One structure for every MoE family"). Run it
before the change (`--save before.npz`), then after (`--compare before.npz`): every array must be equal bit for bit.
Covered: the tiny files of tests/ (4 archs x F32 / Q2_K mix, written by pymoe.demo.tinymodel with the tests' seed), the
demo model; each through the CPU backend and the reference backend (prefill logits of a 24-token prompt, then 6
decoded tokens' logits), greedy tokens with no pool and with a small slot pool (lru, 2 slots per layer).
What it is not: a test of correctness (tests/ hold the oracles); it only says "nothing moved".

    python bench/logits_snapshot.py --save /tmp/before.npz
    python bench/logits_snapshot.py --compare /tmp/before.npz
"""
import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pymoe  # noqa: E402
from pymoe.demo import DEMO_MODEL  # noqa: E402
from pymoe.demo.tinymodel import write_model  # noqa: E402

ARCHS = ("qwen3moe", "qwen2moe", "llama", "olmoe")


def models(tmp):
    for arch in ARCHS:
        for mix in ("f32", "q2_k"):
            path = os.path.join(tmp, f"tiny-{arch}-{mix}.gguf")
            write_model(path, arch, "tiny", mix, seed=0)
            yield f"{arch}-{mix}", path
    yield "demo", DEMO_MODEL


def snapshot(name, path):
    out = {}
    for backend in ("cpu", "reference"):
        m = pymoe.load(path, backend=backend)
        ids = np.random.default_rng(5).integers(0, m.config.n_vocab, 24)
        kv = m.model.new_kv(64)
        logits = [m.model.prefill(ids, kv)]
        for t in range(6):
            logits.append(m.model.decode_one_token(int(logits[-1][-1].argmax()) if t == 0 else int(logits[-1].argmax()),
                                                   kv)[None])
        out[f"{name}/{backend}/logits"] = np.concatenate(logits)
    for slots in (None, 2 * m.config.n_layers):
        m = pymoe.load(path, backend="cpu", cache_slots=slots, policy="lru")
        toks = list(m.generate([3, 4, 5, 6], max_tokens=12, stop_at_eos=False))
        out[f"{name}/greedy/{slots or 'nopool'}"] = np.array(toks)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", help="write the snapshot to this .npz")
    g.add_argument("--compare", help="compare with this saved .npz; exit 1 on any difference")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        snap = {}
        for name, path in models(tmp):
            snap.update(snapshot(name, path))
            print(f"{name}: done", flush=True)
    if args.save:
        np.savez(args.save, **snap)
        print(f"saved {len(snap)} arrays to {args.save}")
        return 0
    before = np.load(args.compare)
    bad = [k for k in before.files if k not in snap or before[k].shape != snap[k].shape
           or not np.array_equal(before[k].view(np.uint8), snap[k].view(np.uint8))]
    bad += [k for k in snap if k not in before.files]
    for k in bad:
        print(f"DIFFERENT: {k}")
    print(f"{len(before.files)} arrays compared: {len(bad)} different")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
