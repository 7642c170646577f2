"""The server's parallel slots on the CUDA backend (Numba's CUDA simulator, the NumPy reference kernels).

What this is: two requests decoded at once by the server's scheduler (serve/scheduler.Scheduler, `--parallel 2`) on
the CUDA backend, each answer equal to the same request decoded alone and to the reference backend's greedy tokens
(the float path: the same math as the device kernels). The slots keep host KV caches (the device KV cache is lent to
one sequence at a time: docs/expert-cache.md "The decode step on the device"), so their decode steps run version 2 with
the experts through the device slot pool, misses included (4 slots, pcie_frac 0.5: slot, spill and cpu paths all
taken). Families: a plain GQA one, a Gated DeltaNet hybrid (recurrent state per slot) and MLA with expert groups.
"""
from cuda_sim import IN_PROCESS, fresh_interpreter_test, in_process  # first: the simulator on

import pytest  # noqa: E402

import pymoe  # noqa: E402
from pymoe.engine.sampler import SamplingParams  # noqa: E402
from pymoe.serve.scheduler import Job, Scheduler  # noqa: E402

pytestmark = pytest.mark.cuda

MiB = 2**20
SIM = dict(kernels="reference", free_bytes=700 * MiB + 64 * MiB)  # a 64 MiB "device" beyond the reserve
PROMPTS = ([5, 17, 42, 7, 99, 3, 250, 11], [64, 128, 200, 31, 9, 12])
N_NEW = 8


def run(engine, prompts, parallel):
    """Each prompt's greedy tokens through the scheduler with `parallel` slots, all submitted at once."""
    with Scheduler(engine, parallel=parallel, kv="f32") as sched:
        jobs = [sched.submit(Job(prompt_ids=list(p), max_tokens=N_NEW, ignore_eos=True,
                                 sampling=SamplingParams(temperature=0))) for p in prompts]
        for job in jobs:
            list(job.events(timeout=600))
        return [job.generated for job in jobs], sched.max_batch


@in_process
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next", "deepseek2"])
def test_two_server_slots_decoding_at_once_equal_their_solo_answers(tiny_model, arch):
    path = tiny_model(arch, "q2_k")
    ref = pymoe.load(path, backend="reference")
    want = [list(ref.generate(p, max_tokens=N_NEW, stop_at_eos=False)) for p in PROMPTS]
    engine = pymoe.load(path, backend="cuda", backend_options=SIM, cache_slots=4, pcie_frac=0.5)
    solo = [run(engine, [p], 1)[0][0] for p in PROMPTS]
    both, max_batch = run(engine, PROMPTS, 2)
    assert max_batch == 2  # the two were decoded in one step at least once
    assert both == solo == want
    d = engine.cache.stats.counts["decode"]
    assert d["hits"] > 0 and d["spill"] > 0 and d["cpu"] > 0  # every miss path taken


if not IN_PROCESS:
    test_this_file_in_a_fresh_interpreter = fresh_interpreter_test(__file__)
