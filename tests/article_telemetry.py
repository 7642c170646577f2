"""The reference article's published figures as pymoe telemetry lines (a converter for tests/test_report.py).

The article (/work/shared/reference/) publishes aggregates, not its 2,890 requests: round figures, bucket means and a
concurrency sweep. Each becomes the fewest telemetry lines that carry it exactly: one request per round, one
request per published bucket, c requests per concurrency level. Nothing here is a measurement of pymoe; the report
run over these lines must give back the article's own numbers (its slope, intercept, round comparison, cliff).

Where each number comes from (the article's sections):
  1.3   slots 5784 (round 1) and 19530 (round 2); 24,576 experts; slot 1.318 MiB (docs/planning.md section 2)
  3.1   hit rates 86.5% (round 1) and 99.7% (round 2); 3.3: misses 13.5% and 0.3%
  4.1   spill-share buckets: 0% -> 231.8 tok/s, (0, 0.5%] -> 141.4, the plateau to 3% -> 137.7, above 5% -> 72
  4.2   hit-rate buckets: 90-95% -> 143 tok/s, 95-99% -> 280
  4.3   round 2's spill share 0.00%; appendix B's example line: 2.31% of routed lookups spilled at 86.3% hits
        (the only round-1 spill figure given: used as round 1's)
  6.2   cache 7.45 GiB -> 140.6 tok/s (round 1), 25.14 GiB -> 256.2 tok/s (round 2); slope 6.53, intercept 91.9
  9.2   c = 1, 2, 4, 8, 16: throughput 192, 220, 216, 213, 209 tok/s; TTFT 0.16, 0.80, 1.94, 3.54, 7.28 s
The model: 48 MoE layers x 512 experts, top-10 (docs/planning.md section 2).
"""
from __future__ import annotations

import json

from pymoe.experts.telemetry import FORMAT, VERSION

GiB, MiB = 2**30, 2**20
SLOT_BYTES = round(1.318 * MiB)
FACTS = dict(source="serve", model="article (Qwen3.8-Flash-Next Q2_0)", arch="qwen3next", backend="cuda",
             policy="strata", n_layers=48, n_moe_layers=48, n_expert=512, k=10, experts=48 * 512,
             slot_bytes=SLOT_BYTES, gpu=True, n_ctx=32768, pcie_frac=None, reserve_bytes=None)
ROUNDS = {  # name: (slots, cache GiB, free at sizing GiB, hit rate, spill share, decode tok/s)
    "round1": (5784, 7.45, 8.31, 0.865, 0.0231, 140.6),
    "round2": (19530, 25.14, 26.01, 0.997, 0.0, 256.2),
}
SPILL_BUCKETS = [(0.0, 231.8), (0.0025, 141.4), (0.02, 137.7), (0.08, 72.0)]  # (a share inside, tok/s), 4.1
HIT_BUCKETS = [(0.925, 143.0), (0.97, 280.0)]  # 4.2
SWEEP = {1: (192, 0.16), 2: (220, 0.80), 4: (216, 1.94), 8: (213, 3.54), 16: (209, 7.28)}  # c: (tok/s, TTFT s), 9.2
LOOKUPS = 480 * 1000  # 1000 decoded tokens' lookups (48 layers x top-10 per token)
GENERATED = 192  # tokens per request (the appendix-B line's "192 generated")


def request(slots, cache_gib, hit, spill, tok_s, t_start=1.0e9, life_s=None, ttft_s=0.1, concurrency=1.0,
            free_gib=None) -> dict:
    hits = round(hit * LOOKUPS)
    n_spill = round(spill * LOOKUPS)
    decode_s = (GENERATED - 1) / tok_s
    life = life_s if life_s is not None else ttft_s + decode_s
    return dict(format=FORMAT, version=VERSION, kind="request", time=t_start + life, **FACTS, slots=slots,
                cache_bytes=round(cache_gib * GiB), coverage=slots / FACTS["experts"],
                free_bytes_at_sizing=None if free_gib is None else round(free_gib * GiB), status="ok",
                stop_reason="length", t_start=t_start, t_end=t_start + life, queue_s=0.0, ttft_s=ttft_s,
                prompt_tokens=26, reused_tokens=0, generated_tokens=GENERATED, decoded_tokens=GENERATED - 1,
                prompt_s=ttft_s, decode_s=decode_s, prefill_tok_s=26 / ttft_s, decode_tok_s=tok_s, pool=True,
                lookups=LOOKUPS, hits=hits, misses=dict(spill=n_spill, cpu=LOOKUPS - hits - n_spill, host=0),
                promoted=0, prefetched=0, concurrency_at_start=round(concurrency), concurrency_mean=concurrency,
                spec_drafted=None, spec_accepted=None, spec_acceptance=None)


def write(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def rounds(directory) -> list:
    """Two files, a round each, one request carrying the round's figures (sections 1.3, 3.1, 4.3, 6.2)."""
    return [write(directory / f"{name}.jsonl", [request(slots, gib, hit, spill, tok, free_gib=free)])
            for name, (slots, gib, free, hit, spill, tok) in ROUNDS.items()]


def buckets(directory) -> str:
    """One file, one request per published bucket figure (sections 4.1 and 4.2); a spill bucket's request has no
    other miss (hit = 1 - spill), a hit bucket's request spills nothing."""
    recs = [request(19530, 25.14, 1 - s, s, tok) for s, tok in SPILL_BUCKETS]
    recs += [request(5784, 7.45, h, 0.0, tok) for h, tok in HIT_BUCKETS]
    return write(directory / "buckets.jsonl", recs)


def sweep(directory) -> str:
    """One file: at each concurrency c, c requests in flight together for their whole lives (concurrency_mean = c),
    each of a lifetime that makes c x tokens / lifetime the article's throughput, with its TTFT (section 9.2)."""
    recs = []
    for c, (thr, ttft) in SWEEP.items():
        life = c * GENERATED / thr
        recs += [request(19530, 25.14, 0.997, 0.0, 256.2, t_start=1.0e9 + 1000 * c, life_s=life, ttft_s=ttft,
                         concurrency=float(c)) for _ in range(c)]
    return write(directory / "sweep.jsonl", recs)
