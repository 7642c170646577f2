"""Decode throughput of `pymoe serve` per slot count (-np) and client count: what the default slot rule rests on.

For each -np in --parallel it starts `pymoe serve MODEL -np N` (pymoe.serve.benchmark.StartedServer), sends one
warm-up request, then for each c in --concurrency runs c clients, each sending --requests streamed
/v1/completions back to back (a short token-id prompt, exactly --gen tokens: ignore_eos, greedy). A row: the
aggregate tok/s (all generated tokens / wall time; prefill included, the prompts are short) and the median of the
server's own per-request decode tok/s. --rounds repeats the whole sweep (servers restarted), since a shared machine
is noisy; the table shows every round's aggregate and their median.

    PYTHONPATH=. python bench/slots_sweep.py                         # the demo model, -np 1,2,4 x c 1,2,4
    PYTHONPATH=. python bench/slots_sweep.py /work/bigm/mid-Q4_K_M.gguf --gen 16 --requests 1
    PYTHONPATH=. python bench/slots_sweep.py MODEL --steps 20 --rounds 5   # no server: decode steps, interleaved

--steps S: without HTTP, in one process: one model, a KV cache per sequence (short prompts prefilled), then per
round S `decode_batch` steps of N sequences for each N in --parallel in turn (interleaved, so a load that drifts
on a shared machine touches every N alike); tok/s = N x S / the block's time, the median over rounds.

What this is not: the article's protocol (`pymoe bench`), or a measurement on an idle machine.
"""
import argparse
import asyncio
import json
import statistics
import sys

from pymoe.demo import DEMO_MODEL
from pymoe.engine.tokenizer import Tokenizer
from pymoe.serve.benchmark import Prompts, StartedServer, run_clients


class NoBar:
    def update(self, n):
        pass


def ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=DEMO_MODEL)
    p.add_argument("--parallel", type=ints, default=[1, 2, 4], help="slot counts (-np) to serve with")
    p.add_argument("--concurrency", type=ints, default=[1, 2, 4], help="client counts")
    p.add_argument("--gen", type=int, default=48, help="tokens generated per request")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens per request")
    p.add_argument("--requests", type=int, default=2, help="requests per client at each client count")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ctx", type=int, default=512, help="-c of the servers (small: the KV is not the question)")
    p.add_argument("--serve-arg", action="append", default=[], help="one more `pymoe serve` argument (repeat)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--steps", type=int, default=0, help="decode steps per block, without a server (0: the server)")
    a = p.parse_args(argv)
    if a.steps:
        return step_sweep(a)

    prompts = Prompts(Tokenizer.from_file(a.model))
    rows = []  # (np, c, round, aggregate tok/s, median decode tok/s)
    for rnd in range(a.rounds):
        for n in a.parallel:
            args = ["-np", str(n), "-c", str(a.ctx), "--max-queue", "64", *a.serve_arg]
            with StartedServer(a.model, args, start_timeout=600) as srv:
                asyncio.run(run_clients(srv.url, {}, [prompts.make(a.prompt)], 1, a.gen, 600, NoBar()))  # warm-up
                for c in a.concurrency:
                    outs, wall = asyncio.run(run_clients(
                        srv.url, {}, [prompts.make(a.prompt) for _ in range(c * a.requests)], c, a.gen, 600, NoBar()))
                    bad = [o for o in outs if not o.ok]
                    if bad:
                        sys.exit(f"slots_sweep: -np {n} c {c}: {len(bad)} requests failed: {bad[0]}")
                    agg = sum(o.n_generated for o in outs) / wall
                    dec = statistics.median(o.decode_tok_s for o in outs if o.decode_tok_s)
                    rows.append((n, c, rnd, agg, dec))
                    print(f"round {rnd + 1}: -np {n} c {c}: {agg:7.1f} tok/s aggregate, {dec:7.1f} decode tok/s "
                          "per request (median)", flush=True)
    print(f"\n{a.model}: --gen {a.gen} --prompt {a.prompt} --requests {a.requests}, aggregate tok/s "
          f"(rounds; median), median per-request decode tok/s")
    print("| -np | " + " | ".join(f"c = {c}" for c in a.concurrency) + " |")
    print("| --- |" + " --- |" * len(a.concurrency))
    for n in a.parallel:
        cells = []
        for c in a.concurrency:
            aggs = [r[3] for r in rows if r[0] == n and r[1] == c]
            decs = [r[4] for r in rows if r[0] == n and r[1] == c]
            cells.append(f"{' / '.join(f'{x:.0f}' for x in aggs)}; {statistics.median(aggs):.0f} "
                         f"({statistics.median(decs):.0f} per request)")
        print(f"| {n} | " + " | ".join(cells) + " |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump([dict(zip(("parallel", "c", "round", "aggregate_tok_s", "decode_tok_s"), r)) for r in rows],
                      f, indent=1)


def step_sweep(a):
    import time

    import numpy as np

    import pymoe
    from pymoe.engine.batch import decode_batch
    from pymoe.engine.kv import new_kv

    most = max(a.parallel)
    n_ctx = a.prompt + most + 1 + a.rounds * a.steps * len(a.parallel)  # sequence 0 decodes in every block
    m = pymoe.load(a.model, n_ctx=n_ctx)
    rng = np.random.default_rng(0)
    kvs = [new_kv(m.config, n_ctx, "f16") for _ in range(most)]
    last = [int(m.model.prefill(rng.integers(10, min(200, m.config.n_vocab), a.prompt + j), kv)[-1].argmax())
            for j, kv in enumerate(kvs)]
    rates = {n: [] for n in a.parallel}
    decode_batch(m.model, last, kvs)  # warm-up: every kernel compiled
    for rnd in range(a.rounds):
        for n in a.parallel:
            t0 = time.perf_counter()
            for _ in range(a.steps):
                logits = decode_batch(m.model, last[:n], kvs[:n])
                last[:n] = [int(row.argmax()) for row in logits]
            rates[n].append(n * a.steps / (time.perf_counter() - t0))
        print(f"round {rnd + 1}: " + ", ".join(f"N={n} {rates[n][-1]:.1f} tok/s" for n in a.parallel), flush=True)
    print(f"\n{a.model}: {a.steps} decode_batch steps per block, {a.rounds} rounds, tok/s of all N sequences "
          "(median; min-max)")
    for n in a.parallel:
        print(f"| {n} | {statistics.median(rates[n]):.1f} | {min(rates[n]):.1f}-{max(rates[n]):.1f} |")


if __name__ == "__main__":
    main()
