"""Scale on paper: the planner's cost model extended to expert parallelism (EP) across machines.

What this is: `ep_scale(model, node, network, nodes)`, a prediction of decode speed when a model's routed experts are
spread over N nodes and every MoE layer exchanges tokens over the network (all-to-all dispatch and combine), next to
one node that holds what it can and reads the rest over PCIe (pymoe's single-box case, plan.py). `bench/ep_scale.py`
prints docs/scaling-out.md's table with it (the article's model and a DeepSeek-V3-sized one).
What this is not: a measurement, nor a runtime (pymoe runs one device; vLLM and SGLang run EP). Every number is a
prediction from the inputs written in each row.

The model, per decode step of B tokens (B concurrent requests, one token each), N nodes of G GPUs:
    placement    each node holds E / N of every MoE layer's experts in host RAM and caches what fits in its GPUs:
                 slots = floor((G x (VRAM - per_gpu_reserve) - dense_resident) / slot_bytes); the dense weights are
                 on every node once (data-parallel attention, as SGLang's and DeepSeek's decode deployments run);
                 coverage = slots / (L_moe x E / N), hit rate = hit_of_coverage(coverage) (uniform routing: the
                 coverage itself, a lower bound; or a static profile's curve)
    experts      per MoE layer a node reads the distinct experts its share of the step touches:
                 U = E / N x (1 - (1 - k / E)^B) (uniform routing's expectation), U x S x (hit / (G x hbm) +
                 miss / (G x pcie)); the node's G GPUs are one pool with G times the bandwidth (an assumption: EP
                 inside the node, no cross-GPU traffic counted there)
    network      per MoE layer, dispatch then combine: each node sends its B / N tokens' k expert copies, the share
                 (N - 1) / N of them to other nodes: B / N x k x (N - 1) / N x n_embd x act_bytes each way, at the
                 node's network bandwidth, plus one latency each way: 2 x (latency + bytes / bw). None for N = 1.
    dense        the dense weights once per step on each node: dense_bytes_per_token / (G x hbm)
    fixed        fixed_s per step (launches, sync, sampling)
    t_step = fixed + dense + L_moe x (experts + network);  per-request tok/s = 1 / t_step;  all requests B / t_step
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from pymoe.errors import PymoeError
from .plan import GiB, ModelFacts, fmt_size


@dataclass(frozen=True)
class Node:
    """One machine: G GPUs of `vram` bytes, each reading its memory at hbm_bw and host RAM at pcie_bw (bytes/s)."""

    gpus: int
    vram: int
    hbm_bw: float
    pcie_bw: float
    per_gpu_reserve: int  # runtime + KV cache + activations per GPU: what the experts cannot use
    label: str = ""


@dataclass(frozen=True)
class Network:
    bw: float  # bytes/s one node sends (and receives) at
    latency_s: float  # one all-to-all's fixed cost (a message's latency and the kernel's launch)
    act_bytes: int = 2  # bytes per activation value sent (BF16)

    @property
    def label(self) -> str:
        return f"{self.bw * 8 / 1e9:g} Gbit/s, {self.latency_s * 1e6:g} us"


_NET_RE = re.compile(r"^\s*([0-9.]+)\s*(gbit|gb|tbit)\s*(?:/s)?\s*,\s*([0-9.]+)\s*(us|ms)\s*$", re.I)


def parse_network(text: str) -> Network:
    """`400Gbit,5us` -> Network(bw=50e9 bytes/s, latency 5e-6 s). Units: Gbit, Tbit (bits/s), GB (bytes/s); us, ms."""
    m = _NET_RE.match(str(text))
    if not m:
        raise PymoeError(f"--network {text!r}: expected a bandwidth and a latency, e.g. 400Gbit,5us")
    v, unit, lat, lunit = float(m.group(1)), m.group(2).lower(), float(m.group(3)), m.group(4).lower()
    bw = v * {"gbit": 1e9 / 8, "tbit": 1e12 / 8, "gb": 1e9}[unit]
    if bw <= 0:
        raise PymoeError(f"--network {text!r}: the bandwidth must be positive")
    return Network(bw, lat * (1e-6 if lunit == "us" else 1e-3))


@dataclass(frozen=True)
class ScaleRow:
    nodes: int
    gpus: int
    slots_per_node: int
    coverage: float
    hit_rate: float
    experts_s: float  # per step, all MoE layers
    network_s: float
    dense_s: float
    fixed_s: float
    batch: int

    @property
    def step_s(self) -> float:
        return self.experts_s + self.network_s + self.dense_s + self.fixed_s

    @property
    def tok_s_per_request(self) -> float:
        return 1.0 / self.step_s

    @property
    def tok_s_total(self) -> float:
        return self.batch / self.step_s


def distinct_experts(n_expert: int, k: int, tokens: float) -> float:
    """Expected distinct experts of one layer that `tokens` tokens touch under uniform routing."""
    return n_expert * (1.0 - (1.0 - k / n_expert) ** tokens)


def ep_row(model: ModelFacts, node: Node, net: Network, n_nodes: int, batch: int, fixed_s: float,
           hit_of_coverage: Optional[Callable[[float], float]] = None) -> ScaleRow:
    if n_nodes < 1 or batch < 1:
        raise PymoeError("nodes and batch must be at least 1")
    hit_of = hit_of_coverage or (lambda c: c)
    L, E, k, S = model.n_moe_layers, model.n_expert, model.k, model.slot_bytes
    per_node_experts = L * E / n_nodes
    free = node.gpus * (node.vram - node.per_gpu_reserve) - model.dense_resident_bytes
    slots = max(0, int(free // S))
    cov = min(1.0, slots / per_node_experts)
    slots = min(slots, int(math.ceil(per_node_experts)))
    hit = 1.0 if cov >= 1.0 else float(hit_of(cov))
    touched = distinct_experts(E, k, batch) / n_nodes  # per node per layer
    per_layer = touched * S * (hit / (node.gpus * node.hbm_bw) + (1 - hit) / (node.gpus * node.pcie_bw))
    if n_nodes > 1:
        sent = batch / n_nodes * k * (n_nodes - 1) / n_nodes * model.n_embd * net.act_bytes
        net_layer = 2 * (net.latency_s + sent / net.bw)
    else:
        net_layer = 0.0
    return ScaleRow(n_nodes, n_nodes * node.gpus, slots, cov, hit, L * per_layer, L * net_layer,
                    model.dense_bytes_per_token / (node.gpus * node.hbm_bw), fixed_s, batch)


def ep_scale(model: ModelFacts, node: Node, net: Network, nodes: Sequence[int], batches: Sequence[int],
             fixed_s: float, hit_of_coverage=None) -> list[ScaleRow]:
    return [ep_row(model, node, net, n, b, fixed_s, hit_of_coverage) for b in batches for n in nodes]


def format_scale(rows: Sequence[ScaleRow], model: ModelFacts, node: Node, net: Network) -> list[str]:
    lines = [f"model {model.name}: {model.n_layers} layers ({model.n_dense} dense) x {model.n_expert} experts, "
             f"top-{model.k}, slot {fmt_size(model.slot_bytes)}, n_embd {model.n_embd}; dense "
             f"{fmt_size(model.dense_resident_bytes)} resident, {fmt_size(model.dense_bytes_per_token)} read per step",
             f"node {node.label}: {node.gpus} x {node.vram / GiB:g} GiB at {node.hbm_bw / 1e9:g} GB/s, PCIe "
             f"{node.pcie_bw / 1e9:g} GB/s, {fmt_size(node.per_gpu_reserve)} per GPU reserved; network {net.label}, "
             f"{net.act_bytes} bytes per value",
             "| batch | nodes | GPUs | coverage per node | hit | experts ms | network ms | dense ms | fixed ms | "
             "tok/s per request | tok/s all requests |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r.batch} | {r.nodes} | {r.gpus} | {100 * r.coverage:.1f}% | {100 * r.hit_rate:.1f}% | "
                     f"{1e3 * r.experts_s:.2f} | {1e3 * r.network_s:.2f} | {1e3 * r.dense_s:.2f} | "
                     f"{1e3 * r.fixed_s:.2f} | {r.tok_s_per_request:.1f} | {r.tok_s_total:.0f} |")
    return lines
