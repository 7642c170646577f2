"""backends/threads.py: the CPU backend's team of threads shrinks to the cores other processes leave free.

What this checks: the governor's arithmetic on given /proc/stat samples (others' use = all CPUs' busy time less this
process's own), that it re-measures only every INTERVAL_S, that /proc/stat really parses here; that the CPU backend
sets the count in the calling thread and only governs without -t (and not with PYMOE_ADAPT_THREADS=0); and that a
forward call gives the same bits whatever its team (the governor changes the count between calls of one request).
The speed it buys is bench/contention.py's (docs/performance.md), not a test's.
"""
import threading

import numba
import numpy as np
import pytest

import pymoe
from pymoe.backends.cpu import CPUBackend
from pymoe.backends.threads import ThreadGovernor, adaptive, cpu_ticks


class Machine:
    """A fake clock, process CPU time and /proc/stat ticks (100 ticks a second per core)."""

    def __init__(self, cores):
        self.cores, self.t, self.own, self.busy, self.total = cores, 0.0, 0.0, 0, 0

    def run(self, seconds, own_cores, other_cores):
        self.t += seconds
        self.own += own_cores * seconds
        self.busy += round((own_cores + other_cores) * seconds * 100)
        self.total += round(self.cores * seconds * 100)

    def governor(self, most):
        return ThreadGovernor(most, cores=self.cores, interval_s=0.2, ticks=lambda: (self.busy, self.total),
                              own_cpu=lambda: self.own, clock=lambda: self.t)


@pytest.mark.parametrize("cores,most,others,want", [
    (2, 2, 0.0, 2),  # quiet: every core
    (2, 2, 0.05, 2),  # a little noise does not cost a thread
    (2, 2, 1.0, 1),  # one busy process: the other core
    (2, 2, 2.0, 1),  # two: still one thread (never none)
    (8, 8, 3.0, 5),
    (8, 4, 1.0, 4),  # never more than allowed
])
def test_the_team_is_the_cores_the_others_leave(cores, most, others, want):
    m = Machine(cores)
    g = m.governor(most)
    m.run(0.5, own_cores=min(most, cores - others) if others < cores else 1.0, other_cores=others)
    assert g.threads() == want and g.others == pytest.approx(others, abs=0.03)


def test_measured_only_every_interval():
    m = Machine(2)
    g = m.governor(2)
    m.run(0.1, own_cores=1, other_cores=1)
    assert g.threads() == 2  # 0.1 s < the interval: not measured yet
    m.run(0.15, own_cores=1, other_cores=1)
    assert g.threads() == 1 and g.changes == 1
    m.run(0.05, own_cores=1, other_cores=0)
    assert g.threads() == 1  # quiet again, but within the interval
    m.run(0.3, own_cores=1, other_cores=0)
    assert g.threads() == 2 and g.changes == 2


def test_proc_stat_parses_here():
    busy, total = cpu_ticks()  # pymoe runs on Linux (setup.cfg)
    assert 0 <= busy <= total and total > 0
    assert cpu_ticks("/nonexistent") is None


def test_governed_only_without_a_thread_count(monkeypatch):
    assert adaptive(None) and not adaptive(2)
    monkeypatch.setenv("PYMOE_ADAPT_THREADS", "0")
    assert not adaptive(None)
    assert CPUBackend().governor is None and CPUBackend(threads=1).governor is None


def test_the_count_is_set_in_the_calling_thread():
    """Numba's thread count belongs to the thread that sets it: the server computes in its scheduler's thread."""
    backend = CPUBackend(threads=1)
    backend.share_cpu()  # in this thread first: the worker's count must still be set in the worker
    seen = []

    def worker():
        backend.share_cpu()
        seen.append(numba.get_num_threads())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [1] and backend.threads == 1


class Alternating:
    """A governor that changes the team every call: 1, most, 1, most, ..."""

    def __init__(self, most):
        self.most, self.n = most, 0

    def threads(self):
        self.n += 1
        return 1 if self.n % 2 else self.most


@pytest.mark.parametrize("act_bits", [16, 8])
def test_a_changing_team_gives_the_same_bits(act_bits, tiny_model):
    path = tiny_model("qwen3moe", "q2_k")
    fixed = pymoe.load(path, threads=2, act_bits=act_bits)
    changing = pymoe.load(path, act_bits=act_bits)
    changing.backend.governor = Alternating(2)
    prompt = "def add(a, b):\n    return"
    a = [fixed.logits(fixed.encode_prompt(prompt)[:n]) for n in (3, 7)]
    b = [changing.logits(changing.encode_prompt(prompt)[:n]) for n in (3, 7)]
    for x, y in zip(a, b):
        assert np.array_equal(x, y)
    out_a = list(fixed.generate(prompt, max_tokens=12, temperature=0, stop_at_eos=False))
    out_b = list(changing.generate(prompt, max_tokens=12, temperature=0, stop_at_eos=False))
    assert out_a == out_b and changing.backend.governor.n > 12
