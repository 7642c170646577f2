"""pymoe serve's default slot count (serve/slots.py default_parallel), decision by decision, and at start-up.

What this is: the rule's answers for each backend and expert-cache coverage, its memory bound worked out from the KV
bytes (the slots share the quarter of memory the default context rule gives KV), the coverage read from an engine,
then `pymoe serve` started without -np (the rule's count in /v1/status and its reason printed) and with -np 1.
What this is not: the measurement the CPU count comes from (bench/slots_sweep.py; docs/server.md).
"""
import dataclasses

import httpx
import pytest

import pymoe
from pymoe.engine.kv import SERVE_CTX_FLOOR, kv_bytes
from pymoe.serve.benchmark import StartedServer
from pymoe.serve.slots import CPU_SLOTS, coverage, default_parallel, memory_slots

PLENTY = 1 << 50  # bytes of memory: the memory bound never binds


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model("qwen3moe", "f32")


def config(model_path):
    return pymoe.load(model_path, n_ctx=64).config


def test_cpu_and_a_cuda_pool_of_every_expert_get_the_measured_count(model_path):
    cfg = config(model_path)
    assert CPU_SLOTS > 1  # the measurement's answer; a rule that gives 1 everywhere is no rule
    n, why = default_parallel(cfg, "cpu", 0.0, memory=PLENTY)  # cpu: no pool, every expert read in place
    assert n == CPU_SLOTS and why.startswith("cpu backend:") and "slots_sweep" in why
    n, why = default_parallel(cfg, "cuda", 1.0, memory=PLENTY)
    assert n == CPU_SLOTS and "every expert in slots" in why
    assert default_parallel(cfg, "cuda", None, memory=PLENTY)[0] == CPU_SLOTS  # before the pool is known: the most


def test_cuda_with_a_partial_cache_or_none_gets_one_slot(model_path):
    cfg = config(model_path)
    n, why = default_parallel(cfg, "cuda", 0.25, memory=PLENTY)
    assert n == 1 and "25% of the experts" in why and "section 7" in why
    n, why = default_parallel(cfg, "cuda", 0.0, memory=PLENTY)
    assert n == 1 and "no expert cache" in why
    assert default_parallel(cfg, "cuda", 0.999, memory=PLENTY)[0] == 1  # one expert short is still partial


def test_the_slots_share_the_quarter_of_memory_that_kv_may_take(model_path):
    cfg = dataclasses.replace(config(model_path), n_ctx_train=1 << 20)
    floor = kv_bytes(cfg, SERVE_CTX_FLOOR, "f16")  # one slot's KV at the default rule's floor
    assert memory_slots(cfg, "f16", memory=4 * floor * 2) == 2  # a quarter of memory holds exactly two
    assert memory_slots(cfg, "f16", memory=4 * floor * 2 - 4) == 1
    assert memory_slots(cfg, "f16", memory=floor) == 1  # never 0: one slot is what -np 1 would get anyway
    n, why = default_parallel(cfg, "cpu", None, "f16", memory=4 * floor * 2)
    assert n == 2 and f"at {SERVE_CTX_FLOOR} tokens" in why and "0.25 of memory" in why
    given = kv_bytes(cfg, 1000, "int8")  # -c 1000 --kv int8: the bound is at that context and type
    assert default_parallel(cfg, "cpu", None, "int8", n_ctx=1000, memory=4 * given * 3)[0] == min(3, CPU_SLOTS)
    assert default_parallel(cfg, "cuda", 0.5, memory=PLENTY)[0] == 1  # the bound only lowers


def test_coverage_of_an_engine(model_path):
    engine = pymoe.load(model_path, n_ctx=64, cache_slots=3)
    n_total = len(engine.config.moe_layers) * engine.config.n_expert
    assert coverage(engine) == 3 / n_total
    assert coverage(pymoe.load(model_path, n_ctx=64)) == 0.0  # the cpu backend's default: no pool
    assert coverage(pymoe.load(model_path, n_ctx=64, cache_slots=n_total)) == 1.0


def test_pymoe_serve_prints_its_choice_and_np_overrides(model_path):
    def started(args):
        with StartedServer(model_path, ["-c", "128", *args], start_timeout=300) as srv:
            parallel = httpx.get(srv.url + "/v1/status", timeout=30).json()["parallel"]
            srv.log.seek(0)
            return parallel, srv.log.read()

    parallel, log = started([])
    assert parallel == CPU_SLOTS
    assert f"pymoe serve: {CPU_SLOTS} slot(s): cpu backend: " in log and "; -np overrides" in log
    assert f"tokens per slot (-c): {CPU_SLOTS} x " in log
    parallel, log = started(["-np", "1"])
    assert parallel == 1 and "slot(s):" not in log and "tokens per slot (-c): 1 x " in log
