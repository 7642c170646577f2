#!/usr/bin/env python3
"""What a forced tool call costs with and without the grammar's forced tokens taken at once (issue 51).

What this is: the demo model (its own template: the generic tool format, serve/tools.py) on the scheduler alone (no
HTTP), N forced calls of one of two tools (tool_choice required), temperature 1 with seeds 1..N, run twice on the
same engine: with fast_forward (the tokens the grammar forces after a sampled one are taken without sampling and
read in the next step's forward, serve/scheduler.py) and without (every token sampled, one step each). Prints per
call: tokens generated, tokens sampled, forwards (decode steps), ms of wall time from submit to the end.
What this is not: a check that the calls are right (tests/test_generic_tools.py, tests/test_server.py).

    PYTHONPATH=. python bench/forced_tokens.py --calls 8
"""
import argparse
import platform
import time

import pymoe
from pymoe.demo import demo_model
from pymoe.engine.sampler import SamplingParams
from pymoe.serve import tools
from pymoe.serve.app import chat_prompt
from pymoe.serve.scheduler import Job, Scheduler
from pymoe.serve.schemas import ChatRequest

BOUNDED = {"type": "integer", "minimum": -999, "maximum": 999}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                         "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": BOUNDED, "b": BOUNDED}, "required": ["a", "b"]}}}]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    engine = pymoe.load(demo_model(), n_ctx=1024)
    req = ChatRequest.model_validate({"messages": [{"role": "user", "content": "weather in Paris?"}],
                                      "tools": TOOLS, "tool_choice": "required"})
    prompt = engine.tokenizer.encode(chat_prompt(req, engine.tokenizer))
    specs = [{"name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in TOOLS]
    grammar = tools.call_grammar(specs, "generic", engine.tokenizer)
    print(f"demo model, generic tool format, {args.calls} forced calls (seeds 1..{args.calls}, temperature 1), "
          f"prompt {len(prompt)} tokens, {platform.processor() or platform.machine()}")
    print("| forced tokens | tokens / call | sampled / call (one forward each) | ms / call |")
    print("| --- | --- | --- | --- |")
    texts = {}
    for rep, fast in enumerate((False, True, False, True)):  # each twice, alternating: the second pass is reported
        rows = []
        with Scheduler(engine, kv="f32", fast_forward=fast) as sched:
            for seed in range(1, args.calls + 1):
                job = Job(prompt_ids=prompt, max_tokens=args.max_tokens, grammar=grammar,
                          sampling=SamplingParams(temperature=1.0, seed=seed))
                t0 = time.perf_counter()
                sched.submit(job)
                text = "".join(v for kind, v in job.events(timeout=300) if kind == "piece")
                rows.append((job.stats.n_generated, job.stats.n_generated - job.stats.n_forced,
                             time.perf_counter() - t0, job.stats.stop_reason))
                texts.setdefault(fast, []).append(text)
        if rep >= 2:
            n = len(rows)
            print(f"| {'on' if fast else 'off'} | {sum(r[0] for r in rows) / n:.1f} | "
                  f"{sum(r[1] for r in rows) / n:.1f} | {sum(r[2] for r in rows) / n * 1e3:.0f} |")
    done = sum(r[3] == "stop" for r in rows)
    alike = sum(a == b for a, b in zip(texts[False][-args.calls:], texts[True][-args.calls:]))
    print(f"calls closed within {args.max_tokens} tokens (fast-forward on): {done}/{args.calls}; the same text with "
          f"and without: {alike}/{args.calls} (forced tokens may be tokenized otherwise than the sampled ones were)")


if __name__ == "__main__":
    main()
