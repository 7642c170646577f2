"""`pymoe inspect`: a model file described for a person: config, tensor types and counts, one expert's bytes.

The "slot size" printed here (bytes of one expert's gate + up + down, as stored; the largest over the layers, whose
types may differ, e.g. llama.cpp's Q4_K_M: ffn_down Q4_K or Q6_K) is the unit every later part of pymoe counts in:
VRAM / slot size = how many experts the cache holds.
"""
from __future__ import annotations

from collections import Counter, defaultdict

from .loader import load_gguf


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{int(n)} B"


ATTENTION_WORDS = {"gqa": "softmax attention", "gated": "gated softmax attention", "gdn": "Gated DeltaNet (linear)",
                   "mla": "MLA (compressed KV)"}
FFN_WORDS = {"moe": "MoE", "moe+shared": "MoE + shared expert", "dense": "dense MLP"}


def layer_plan_lines(cfg) -> list:
    """The layer plan, consecutive layers of the same kind together: 'layers 0-2, 4-6: Gated DeltaNet + MoE'."""
    kinds = defaultdict(list)  # (attention, ffn, window) -> layers
    for p in cfg.layer_plan():
        kinds[(p.attention, p.ffn, p.window)].append(p.index)
    lines = [f"layer plan ({cfg.n_layers} layers" + (f", + {cfg.n_nextn} MTP/NextN not run" if cfg.n_nextn else "")
             + "):"]
    for (attention, ffn, window), layers in kinds.items():
        win = f", window {window}" if window else ""
        lines.append(f"  {'layer' if len(layers) == 1 else 'layers'} {_ranges(layers)}: "
                     f"{ATTENTION_WORDS.get(attention, attention)}{win} + {FFN_WORDS.get(ffn, ffn)}")
    kv = cfg.kv_values_per_token()
    lines.append(f"  KV cache: {kv} values per token over the layers that keep one"
                 + (" (+ a fixed recurrent state per sequence)" if cfg.has_recurrent_state else ""))
    return lines


def describe_model(path: str, show_tensors: bool = False) -> str:
    m = load_gguf(path)
    cfg = m.config
    lines = [f"model {path}", "config:"]
    lines += [f"  {k:<16} {v}" for k, v in cfg.describe()]
    lines += layer_plan_lines(cfg)

    by_type = Counter()
    bytes_by_type = defaultdict(int)
    for t in m.tensors.values():
        by_type[t.qtype.name] += 1
        bytes_by_type[t.qtype.name] += t.nbytes
    total = sum(bytes_by_type.values())
    lines.append(f"tensors: {len(m.tensors)} ({fmt_bytes(total)})")
    for name, count in sorted(by_type.items(), key=lambda kv: -bytes_by_type[kv[0]]):
        lines.append(f"  {name:<7} {count:>5} tensors  {fmt_bytes(bytes_by_type[name]):>12}")

    n_moe = len(cfg.moe_layers)
    n_experts = n_moe * cfg.n_expert
    dense = f" (+ {cfg.n_dense_lead} dense)" if cfg.n_dense_lead else ""
    lines.append(f"experts: {n_moe} layers{dense} x {cfg.n_expert} = {n_experts} experts, top-{cfg.n_expert_used}"
                 f", {fmt_bytes(m.expert_bytes_total)} in all ({100 * m.expert_bytes_total / total:.1f}% of the file)")
    by_layout = defaultdict(list)  # the experts' layout (types and bytes per matrix) -> layers that have it
    for i, lay in enumerate(m.expert_layouts()):
        if lay is None:
            continue
        by_layout[tuple((p, lay.types[p].name, shape[0] * shape[1]) for p, _, shape in lay.parts)].append(i)
    for layout, layers in by_layout.items():
        parts = ", ".join(f"{p} {qtype} {fmt_bytes(n)}" for p, qtype, n in layout)
        which = "layer" if len(layers) == 1 else "layers"
        lines.append(f"one expert ({which} {_ranges(layers)}): {parts}")
    lines.append(f"slot size: {m.slot_bytes} bytes ({fmt_bytes(m.slot_bytes)})")
    if show_tensors:
        lines.append("tensor list:")
        for t in m.tensors.values():
            lines.append(f"  {t.name:<34} {t.qtype.name:<6} {str(list(t.shape)):<20} {t.nbytes:>12}")
    return "\n".join(lines)


def _ranges(ids: list) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    out, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)
