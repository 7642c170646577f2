"""Prediction: decode tok/s when a model's experts are spread over 1, 2, 4, 8 nodes (expert parallelism), for the
reference article's model and a DeepSeek-V3-sized one: the table of docs/scaling-out.md, "When you outgrow one machine".

What this is: experts/scale.ep_scale on hand-written ModelFacts (neither model is a file here) with every input
printed; a prediction, not a measurement (pymoe runs one device).
  article    48 layers x 512 experts, top-10, slot 1.318 MiB, n_embd 2048; one RTX 5090 per node (31.8 GiB, 1792
             GB/s, PCIe 13.9 GB/s probed), 5.8 GiB overhead + 884 MiB reserve per GPU, the fitted 3.46 ms fixed time
             (dense reads inside it: docs/planning.md, "Calibration"); hit rate from the static bound of the
             measured Qwen3-Next heat at the node's coverage.
  deepseek   61 layers (3 dense) x 256 experts, top-8, hidden 7168, expert FFN 2048, FP8 weights: slot 3 x 7168 x
             2048 B = 42 MiB; dense weights 671e9 - 58 x 256 x 44.04e6 = 17.1e9 B (the published 671B total),
             read per token 37e9 - 58 x 8 x 44.04e6 = 16.6e9 B (the published 37B active); 8 x H100 80 GiB per node
             (3350 GB/s, PCIe 50 GB/s), 8 GiB per GPU for runtime, KV and activations; fixed 1 ms (assumed); uniform
             routing (no heat of this model here: a lower bound).
  network    400 Gbit/s per node for the article's single-GPU nodes, 3.2 Tbit/s (8 x 400G NICs) for the 8-GPU nodes;
             latency 5 us (one message on the wire) and 50 us (a sensitivity, standing for all-to-all kernels that
             take tens of microseconds per layer), BF16 activations both ways.

    PYTHONPATH=. python bench/ep_scale.py
"""
from __future__ import annotations

import json
import os

import numpy as np

from pymoe.experts.plan import GiB, MiB, ModelFacts
from pymoe.experts.profile import Profile
from pymoe.experts.scale import Network, Node, ep_scale, format_scale

HEAT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "routing-heat",
                    "qwen3-next-80b-a3b.json")
NODES = (1, 2, 4, 8)
BATCHES = (1, 64)

ARTICLE = ModelFacts("article (Qwen3-Next shape)", n_layers=48, n_expert=512, k=10, slot_bytes=round(1.318 * MiB),
                     n_embd=2048)
ARTICLE_NODE = Node(1, int(31.8 * GiB), 1792e9, 13.9e9, int(5.8 * GiB) + 884 * MiB, "1 x RTX 5090")
SLOT_V3 = 3 * 7168 * 2048  # gate + up + down, FP8: one byte per weight
DEEPSEEK = ModelFacts("DeepSeek-V3-sized", n_layers=61, n_dense=3, n_expert=256, k=8, slot_bytes=SLOT_V3,
                      dense_resident_bytes=int(671e9 - 58 * 256 * SLOT_V3),
                      dense_bytes_per_token=int(37e9 - 58 * 8 * SLOT_V3), n_embd=7168)
H100_NODE = Node(8, 80 * GiB, 3350e9, 50e9, 8 * GiB, "8 x H100 80GB")


def main():
    heat = np.asarray(json.load(open(HEAT))["heat"], dtype=np.int64)
    profile = Profile.from_heat(heat)
    static = lambda c: profile.coverage_hit_rate(int(c * profile.n_pairs))  # noqa: E731
    for model, node, bw, fixed, hit in ((ARTICLE, ARTICLE_NODE, 400e9 / 8, 3.46e-3, static),
                                        (DEEPSEEK, H100_NODE, 3200e9 / 8, 1e-3, None)):
        for lat in (5e-6, 50e-6):
            net = Network(bw, lat)
            print("\n".join(format_scale(ep_scale(model, node, net, NODES, BATCHES, fixed, hit), model, node, net)))
            print()


if __name__ == "__main__":
    main()
