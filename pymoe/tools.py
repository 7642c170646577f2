"""The helper tools, as console commands the install puts on PATH (and tools/ keeps as thin scripts):

    pymoe-build-profile TRACE... -o expert-profile.bin [--slots N] [--plot heat.png]   (tools/build-profile)
    pymoe-make-tiny-model -o tiny.gguf --arch qwen3moe [--preset tiny] [--quant f32]   (tools/make-tiny-model)
    pymoe-make-draft-model MODEL.gguf -o draft.gguf [--layers 1]                      (tools/make-draft-model)

Each prints one line per error and exits 2, like `pymoe`. What this is not: the work itself (experts/profile.py,
demo/tinymodel.py).
"""
from __future__ import annotations

import argparse
import os
import sys

from pymoe.errors import PymoeError
from pymoe.experts.profile import Profile, load_profile_source

BUILD_PROFILE_DOC = """Rank (layer, expert) pairs by routed frequency into an expert profile: `tools/build-profile TRACE... -o FILE`.

    tools/build-profile run1.npz run2.npz -o expert-profile.bin --slots 5784 --plot heatmap.png
    profile expert-profile.bin: 24576 ranked pairs, built for 5784 slots

Inputs are routing traces from `pymoe run --trace` (.npz), counted together, or routing-heat JSONs
(`{"heat": [[count per expert] per layer]}`). The file format is in docs/trace-files.md; `pymoe run --profile FILE`
pre-fills its slots from it, hottest first. --plot draws the layer x expert heat map (needs matplotlib).
What this is not: the ranking itself (pymoe/experts/profile.py) or a simulator (`pymoe simulate`)."""


def build(paths, phase):
    """The counts of every input (trace .npz, heat .json, or profile .bin) added up, ranked (one model shape)."""
    heats = [load_profile_source(p, phase).heat() for p in paths]
    if len({h.shape for h in heats}) > 1:
        raise PymoeError(f"inputs of different shapes: {sorted({h.shape for h in heats})}")
    return Profile.from_heat(sum(heats))


def plot_heat(profile, path, title, slots=None):
    """Left: the layer x expert heat map (share of each layer's lookups), one tick per layer (at most 16 labels);
    right: the static bound by coverage, with the profile's slot count marked."""
    import numpy as np

    from pymoe.experts.simulate import pyplot

    plt = pyplot()
    heat = profile.heat().astype(float)  # [L, E]
    share = heat / np.maximum(heat.sum(axis=1, keepdims=True), 1.0)  # [L, E] share of the layer's lookups
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), gridspec_kw={"width_ratios": [3, 1]})
    im = axes[0].imshow(share, aspect="auto", cmap="inferno", interpolation="nearest")
    axes[0].set_xlabel("expert")
    axes[0].set_ylabel("layer")
    step = max(1, -(-profile.n_layers // 16))  # whole layers only: no fractional ticks on a 4-layer model
    axes[0].set_yticks(np.arange(0, profile.n_layers, step))
    axes[0].set_title(title)
    fig.colorbar(im, ax=axes[0], label="share of the layer's lookups")
    n = profile.n_pairs
    x = np.arange(1, n + 1)
    axes[1].plot(100 * x / n, 100 * np.cumsum(profile.counts) / max(profile.counts.sum(), 1))
    if slots:
        cov, hit = 100 * slots / n, 100 * profile.coverage_hit_rate(slots)
        axes[1].axvline(cov, color="gray", linestyle=":")
        axes[1].annotate(f"{slots} slots: {hit:.0f}%", (cov, hit), textcoords="offset points", xytext=(5, -12))
    axes[1].set_xlabel("coverage, % of pairs (hottest first)")
    axes[1].set_ylabel("static hit rate, % of lookups")
    axes[1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_profile_main(argv=None):
    """`pymoe-build-profile` (and tools/build-profile): rank (layer, expert) pairs into an expert profile."""
    ap = argparse.ArgumentParser(prog="build-profile", description=BUILD_PROFILE_DOC.split("\n")[0])
    ap.add_argument("inputs", nargs="+", metavar="TRACE", help="routing traces (.npz) or routing-heat JSONs")
    ap.add_argument("-o", "--output", default="expert-profile.bin", help="profile file (default: %(default)s)")
    ap.add_argument("--slots", type=int, default=None,
                    help="the slot count this profile is built for, recorded in the file (default: every pair)")
    ap.add_argument("--phase", choices=["all", "decode", "prefill"], default="all",
                    help="which lookups of a trace to count (default: %(default)s)")
    ap.add_argument("--plot", default=None, metavar="PNG", help="draw the layer x expert heat map to this image")
    args = ap.parse_args(argv)
    try:
        if args.slots is not None and args.slots < 0:
            raise PymoeError(f"--slots must be >= 0, got {args.slots}")
        profile = build(args.inputs, None if args.phase == "all" else args.phase)
        profile.save(args.output, built_for_slots=args.slots)
        print(profile.log_line(args.output))
        slots = profile.built_for_slots
        print(f"static bound: the top {slots} pairs ({100 * slots / profile.n_pairs:.1f}% coverage) serve "
              f"{100 * profile.coverage_hit_rate(slots):.1f}% of {int(profile.counts.sum())} counted lookups")
        if args.plot:
            plot_heat(profile, args.plot, f"routing heat: {', '.join(os.path.basename(p) for p in args.inputs)}",
                      args.slots)
            print(f"heat map: {args.plot}")
    except PymoeError as e:
        print(f"build-profile: error: {e}", file=sys.stderr)
        sys.exit(2)


def make_tiny_model_main(argv=None):
    """`pymoe-make-tiny-model`: a random-weight MoE GGUF of any supported arch (pymoe/demo/tinymodel.py)."""
    from pymoe.demo.tinymodel import main_args, write_model

    args = main_args(argv)
    try:
        cfg = write_model(args.output, args.arch, args.preset, args.quant, args.seed, progress=True, jobs=args.jobs,
                          mtp=args.mtp, variant=args.variant)
    except (OSError, ValueError) as e:
        print(f"make-tiny-model: {e}", file=sys.stderr)
        sys.exit(2)
    size = os.path.getsize(args.output)
    print(f"wrote {args.output}: {cfg.arch} {args.preset} {args.quant}, {cfg.n_layers} layers, "
          f"{cfg.n_expert} experts (top-{cfg.n_expert_used}), {size / 1e6:.1f} MB")


def make_draft_model_main(argv=None):
    """`pymoe-make-draft-model`: a draft model cut from a model's first layers (tinymodel.write_first_layers)."""
    from pymoe.demo.tinymodel import write_first_layers

    ap = argparse.ArgumentParser(prog="make-draft-model",
                                 description="Cut a draft model (for --spec draft:FILE) from a model's first layers.")
    ap.add_argument("model", help="the GGUF to cut from")
    ap.add_argument("-o", "--output", required=True, help="GGUF file to write")
    ap.add_argument("--layers", type=int, default=1, help="blocks to keep (default 1)")
    args = ap.parse_args(argv)
    try:
        write_first_layers(args.model, args.output, args.layers)
    except (OSError, ValueError, KeyError) as e:
        print(f"make-draft-model: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {args.output}: the first {args.layers} layers of {args.model}, "
          f"{os.path.getsize(args.output) / 1e6:.1f} MB")
