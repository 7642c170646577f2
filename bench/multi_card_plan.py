"""Prediction: the article's model on several cards in one box (`pymoe plan --devices`) next to one card of the
summed size: the table of docs/scaling-out.md, "Several cards in one box".

What this is: experts/multi.plan_devices on hand-written ModelFacts (the article's model is not a file here: 48
layers x 512 experts, top-10, slot 1.318 MiB, n_embd 2048), with the inputs of docs/planning.md's capacity table:
5.8 GiB of overhead on one card, of which 512 MiB is the runtime (each card has its own) and the rest dense weights +
KV spread over the 48 layers; reserve 700 MiB per card, 184 MiB draft head on the last card; hit rates from the
static bound of the measured Qwen3-Next heat (per card over its own layers); --pcie 13.9, --device-bw 1792,
--fixed-ms 3.46; hop 10 us. The last column is the static bound of the same slot count in one global pool (what a
placement by heat across cards could reach at best). A prediction, not a measurement.

    PYTHONPATH=. python bench/multi_card_plan.py
"""
from __future__ import annotations

import json
import os

from pymoe.experts import multi
from pymoe.experts.plan import GiB, MiB, CostModel, ModelFacts, free_for_vram, plan_row, profile_hit_model
from pymoe.experts.profile import Profile

HEAT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "routing-heat",
                    "qwen3-next-80b-a3b.json")
ARTICLE = ModelFacts("article", n_layers=48, n_expert=512, k=10, slot_bytes=round(1.318 * MiB), n_embd=2048)
COST = CostModel(1792e9, 13.9e9, 3.46e-3)
OVERHEAD, RUNTIME, RESERVE, EXTRA = int(5.8 * GiB), 512 * MiB, 700 * MiB, 184 * MiB
BOXES = ([16], [16, 12], [28], [24, 8], [32], [12, 12, 12], [36], [8, 8, 8, 8], [32, 32])


def main():
    profile = Profile.from_heat(json.load(open(HEAT))["heat"])
    hits = multi.profile_device_hits(profile, "qwen3-next heat")
    print("| cards, GiB | layers per card | slots per card | coverage | hit (per-card pools) | hit (one global pool, "
          "same slots) | hops ms | predicted tok/s | one card of the sum: tok/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for box in BOXES:
        plan = multi.plan_devices([g * GiB for g in box], ARTICLE, (OVERHEAD - RUNTIME) / ARTICLE.n_layers, RUNTIME,
                                  RESERVE, hits, COST, EXTRA)
        one = plan_row(free_for_vram(sum(box) * GiB, OVERHEAD), ARTICLE, RESERVE, profile_hit_model(profile), COST,
                       EXTRA)
        print(f"| {' + '.join(map(str, box))} | {' / '.join(str(r.layers[1] - r.layers[0]) for r in plan.rows)} | "
              f"{' / '.join(str(r.slots) for r in plan.rows)} | {100 * plan.coverage:.1f}% | "
              f"{100 * plan.hit_rate:.1f}% | {100 * profile.coverage_hit_rate(plan.slots):.1f}% | "
              f"{1e3 * plan.n_hops * plan.hop_s:.3f} | {plan.tok_s:.1f} | {one.tok_s:.1f} |")


if __name__ == "__main__":
    main()
