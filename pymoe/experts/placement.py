"""Expert placement for expert parallelism past one machine: logical experts -> physical experts on N GPUs, with
replicas of the hottest, from pymoe's routing counts; written in the file format SGLang's `--init-expert-location`
reads, with the predicted load imbalance of each placement.

What this is:
    layer_counts(sources)                    routed lookups per (MoE layer, expert) from traces / profiles / heat
    balanced_packing(weight, packs)          DeepSeek's EPLB packing: heaviest first, each to the lightest pack with
                                             room; every pack gets exactly n / packs items
    replicate(weight, n_phy)                 add replicas one at a time, each to the expert with the largest load per
                                             replica (weight / count)
    rebalance(weight, n_phy, groups, nodes, gpus)    the EPLB entry point: hierarchical (groups packed to nodes,
                                             replicas within a node, physical experts packed to the node's GPUs)
                                             when groups % nodes == 0, else the global policy (one group, one node)
    refine(...)                              pymoe's addition: pairwise swaps between the most and the least loaded
                                             GPU of a layer while a swap lowers the larger of the two loads
    trivial(...)                             the uniform placement: physical expert p holds logical p mod E
    gpu_loads(...), imbalance(...)           the predicted load of each GPU and max / mean
    write_sglang(path, ...)                  {"physical_to_logical_map": [[...]]} or {"logical_count": [[...]]}
What this is not: a runtime. pymoe runs one device; this hands a placement to an engine that runs many.

The algorithm is DeepSeek's EPLB (github.com/deepseek-ai/EPLB) as vLLM carries it in
vllm/distributed/eplb/rebalance_algo.py (`rebalance_experts`, read at commit 48dca59e71e4) and SGLang in
python/sglang/srt/eplb/eplb_algorithms/deepseek.py; written again here in NumPy from the description above (their
code is torch). The output is the same triple: phy2log int [L, P] (the logical expert each physical slot holds;
physical expert p lives on GPU p // (P / gpus)), log2phy int [L, E, R + 1] (-1 padded) and logcnt int [L, E].

The load model: a token routed to logical expert e in layer l is served by one of e's replicas, evenly in
expectation (SGLang's dispatch picks a replica on the token's own GPU when there is one, else a fair random one), so
physical expert p carries count[l, e] / logcnt[l, e]. A decode step waits at every MoE layer for its slowest GPU, so
the imbalance of a placement is sum over layers of the max GPU load / sum over layers of the mean GPU load (1.0:
perfect); per batch of B tokens when `batch` is given (the loads of each B consecutive tokens), else over all
counted tokens at once.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from pymoe.errors import PymoeError


# --- counts -------------------------------------------------------------------------------------------------------
def trace_counts(trace, phase: Optional[str] = "decode", batch: Optional[int] = None) -> np.ndarray:
    """int64 [L, E] routed lookups per (MoE layer, expert), or [n_batches, L, E] per `batch` consecutive tokens of
    the phase (a last partial batch is left out)."""
    rows = np.flatnonzero(trace.rows(phase))  # [n]
    ex = trace.experts[rows].astype(np.int64)  # [n, L, K]
    n, L, K = ex.shape
    E = trace.n_experts
    if batch is None:
        keys = (ex + (np.arange(L) * E)[None, :, None]).reshape(-1)
        return np.bincount(keys, minlength=L * E).reshape(L, E)
    nb = n // batch
    if nb == 0:
        raise PymoeError(f"--batch {batch}: the trace has only {n} {phase or ''} tokens".replace("  ", " "))
    ex = ex[:nb * batch].reshape(nb, batch, L, K)
    keys = (ex + (np.arange(nb) * L * E)[:, None, None, None] + (np.arange(L) * E)[None, None, :, None]).reshape(-1)
    return np.bincount(keys, minlength=nb * L * E).reshape(nb, L, E)


def layer_counts(paths: Sequence[str], phase: Optional[str] = "decode") -> tuple[np.ndarray, int, list]:
    """(counts int64 [L, E] summed over the sources, first MoE layer, the traces among them). Sources: trace .npz
    (their `phase` lookups), profile .bin, routing-heat .json; all of one shape."""
    from .profile import load_profile_source
    from .trace import Trace

    total, first, traces = None, 0, []
    for p in paths:
        if str(p).endswith(".npz"):
            t = Trace.load(p)
            traces.append(t)
            c, first = trace_counts(t, phase), t.first_moe_layer
        else:
            c = load_profile_source(p).heat()
        if total is not None and c.shape != total.shape:
            raise PymoeError(f"{p}: {c.shape[0]} layers x {c.shape[1]} experts, the others {total.shape[0]} x "
                             f"{total.shape[1]}")
        total = c if total is None else total + c
    if total is None:
        raise PymoeError("placement: give at least one trace, profile or heat file")
    return total, first, traces


# --- DeepSeek's EPLB, in NumPy ------------------------------------------------------------------------------------
def balanced_packing(weight: np.ndarray, packs: int) -> tuple[np.ndarray, np.ndarray]:
    """weight [X, n] -> (pack int [X, n], rank in pack int [X, n]): each row's n items into `packs` packs of exactly
    n / packs items, heaviest item first, each into the lightest pack that still has room (ties: the lower pack)."""
    X, n = weight.shape
    if n % packs:
        raise PymoeError(f"cannot pack {n} items into {packs} equal packs")
    per = n // packs
    pack = np.full((X, n), -1, dtype=np.int64)
    rank = np.full((X, n), -1, dtype=np.int64)
    for x in range(X):
        load = np.zeros(packs)  # [packs]
        items = np.zeros(packs, dtype=np.int64)  # [packs]
        for i in np.argsort(-weight[x], kind="stable"):
            room = np.flatnonzero(items < per)
            p = int(room[np.argmin(load[room])])
            pack[x, i], rank[x, i] = p, items[p]
            load[p] += weight[x, i]
            items[p] += 1
    return pack, rank


def replicate(weight: np.ndarray, n_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """weight [X, n_log] -> (phy2log [X, n_phy], replica rank [X, n_phy], count [X, n_log]): the first n_log
    physical experts are the logical ones; each further one replicates the expert whose load per replica is the
    largest (ties: the lower expert), which minimises the largest load per replica."""
    X, n_log = weight.shape
    if n_phy < n_log:
        raise PymoeError(f"{n_phy} physical experts cannot hold {n_log} logical ones")
    phy2log = np.tile(np.arange(n_phy, dtype=np.int64), (X, 1))
    rank = np.zeros((X, n_phy), dtype=np.int64)
    count = np.ones((X, n_log), dtype=np.int64)
    rows = np.arange(X)
    for p in range(n_log, n_phy):
        e = np.argmax(weight / count, axis=1)  # [X]
        phy2log[:, p], rank[:, p] = e, count[rows, e]
        count[rows, e] += 1
    return phy2log, rank, count


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def rebalance_hierarchical(weight: np.ndarray, n_phy: int, groups: int, nodes: int, gpus: int
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(phy2log [L, n_phy], replica rank [L, n_phy], logcnt [L, E]). Three steps, each a packing or replication:
      1. the E / groups experts of each group stay together; groups are packed to nodes by their summed load;
      2. within each node, its experts get the node's n_phy / nodes physical experts (replicate);
      3. each node's physical experts (load: the expert's load / its replica count) are packed to its GPUs.
    Physical experts are numbered GPU by GPU, so GPU g holds [g * n_phy / gpus, (g + 1) * n_phy / gpus)."""
    L, E = weight.shape
    for what, a, b in (("experts", E, groups), ("groups", groups, nodes), ("GPUs", gpus, nodes),
                       ("physical experts", n_phy, gpus)):
        if b <= 0 or a % b:
            raise PymoeError(f"{what}: {a} is not a multiple of {b}")
    gsize, g_per_node, per_gpu = E // groups, groups // nodes, n_phy // gpus
    # 1: groups -> nodes; "mlog" numbers the experts node by node (node-local logical ids)
    g_pack, g_rank = balanced_packing(weight.reshape(L, groups, gsize).sum(-1), nodes)  # [L, groups]
    log2mlog = ((g_pack * g_per_node + g_rank) * gsize)[:, :, None] + np.arange(gsize)  # [L, groups, gsize]
    log2mlog = log2mlog.reshape(L, E)
    mlog2log = _inverse(log2mlog)  # [L, E]
    # 2: replicas within each node: rows are (layer, node)
    w_mlog = np.take_along_axis(weight, mlog2log, axis=1).reshape(L * nodes, E // nodes)
    phy2mlog, phyrank, mlogcnt = replicate(w_mlog, n_phy // nodes)  # [L * nodes, n_phy / nodes]
    # 3: a node's physical experts -> its GPUs
    w_phy = np.take_along_axis(w_mlog / mlogcnt, phy2mlog, axis=1)  # [L * nodes, n_phy / nodes]
    pack, rank = balanced_packing(w_phy, gpus // nodes)
    pphy2phy = _inverse(pack * per_gpu + rank)  # position on the node's GPUs -> physical expert
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1)  # [L * nodes, n_phy / nodes]
    pphy2mlog = (pphy2mlog.reshape(L, nodes, -1) + (np.arange(nodes) * (E // nodes))[None, :, None]).reshape(L, -1)
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)  # [L, n_phy]
    prank = np.take_along_axis(phyrank, pphy2phy, axis=1).reshape(L, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(L, -1), log2mlog, axis=1)  # [L, E]
    return phy2log, prank, logcnt


@dataclass(frozen=True)
class Placement:
    name: str
    phy2log: np.ndarray  # int64 [L, P]: the logical expert of each physical expert
    gpus: int

    @property
    def n_phy(self) -> int:
        return int(self.phy2log.shape[1])

    def logcnt(self, n_log: int) -> np.ndarray:
        """int64 [L, E]: replicas per logical expert."""
        L = self.phy2log.shape[0]
        cnt = np.zeros((L, n_log), dtype=np.int64)
        np.add.at(cnt, (np.repeat(np.arange(L), self.n_phy), self.phy2log.reshape(-1)), 1)
        return cnt

    def log2phy(self, n_log: int) -> np.ndarray:
        """int64 [L, E, max replicas], -1 padded: the physical experts of each logical one, in order."""
        L = self.phy2log.shape[0]
        width = int(self.logcnt(n_log).max())
        out = np.full((L, n_log, width), -1, dtype=np.int64)
        fill = np.zeros((L, n_log), dtype=np.int64)
        for layer in range(L):
            for p, e in enumerate(self.phy2log[layer].tolist()):
                out[layer, e, fill[layer, e]] = p
                fill[layer, e] += 1
        return out


def rebalance(weight: np.ndarray, n_phy: int, groups: int = 1, nodes: int = 1, gpus: int = 1) -> Placement:
    """vLLM's / SGLang's `rebalance_experts` policy choice: hierarchical when groups % nodes == 0, else global."""
    weight = np.asarray(weight, dtype=np.float64)
    if groups % nodes == 0:
        phy2log, _, _ = rebalance_hierarchical(weight, n_phy, groups, nodes, gpus)
    else:
        phy2log, _, _ = rebalance_hierarchical(weight, n_phy, 1, 1, gpus)
    return Placement("eplb", phy2log, gpus)


def trivial(n_layers: int, n_log: int, n_phy: int, gpus: int) -> Placement:
    """The uniform placement (SGLang's `--init-expert-location trivial`): physical p holds logical p mod E, so GPU g
    holds a contiguous block of experts, and the R redundant slots repeat experts 0..R-1 whatever their load."""
    return Placement("uniform", np.tile(np.arange(n_phy, dtype=np.int64) % n_log, (n_layers, 1)), gpus)


def refine(placement: Placement, weight: np.ndarray, max_rounds: int = 10_000) -> Placement:
    """pymoe's addition to EPLB's greedy packing, per layer: swap one physical expert of the most loaded GPU with one
    of the least loaded GPU (the pair that brings the two closest to their mean) while that lowers the larger of the
    two loads; stops when no swap does. Replica counts are kept (EPLB's replication is already optimal for the
    largest load per replica); only which GPU holds which replica changes. A swap never raises any GPU's load above
    the old maximum, so the imbalance never grows."""
    weight = np.asarray(weight, dtype=np.float64)
    L, E = weight.shape
    G, per = placement.gpus, placement.n_phy // placement.gpus
    cnt = placement.logcnt(E)
    phy2log = placement.phy2log.copy()
    for layer in range(L):
        w = (weight[layer] / cnt[layer])[phy2log[layer]].reshape(G, per)  # [G, per] load of each physical slot
        slots = phy2log[layer].reshape(G, per)
        for _ in range(max_rounds):
            load = w.sum(1)
            hi, lo = int(np.argmax(load)), int(np.argmin(load))
            gap = load[hi] - load[lo]
            if gap <= 0:
                break
            d = w[hi][:, None] - w[lo][None, :]  # [per, per]: moving d from hi to lo
            ok = (d > 0) & (d < gap)  # the new max(hi - d, lo + d) < load[hi]
            if not ok.any():
                break
            i, j = np.unravel_index(np.argmin(np.where(ok, np.abs(gap - 2 * d), np.inf)), d.shape)
            w[hi, i], w[lo, j] = w[lo, j], w[hi, i]
            slots[hi, i], slots[lo, j] = slots[lo, j], slots[hi, i]
        phy2log[layer] = slots.reshape(-1)
    return Placement("pymoe", phy2log, placement.gpus)


# --- predicted load -----------------------------------------------------------------------------------------------
def gpu_loads(placement: Placement, counts: np.ndarray) -> np.ndarray:
    """counts [..., L, E] -> float [..., L, G]: tokens each GPU serves per layer, a replicated expert's tokens split
    evenly over its replicas."""
    counts = np.asarray(counts, dtype=np.float64)
    L, E = counts.shape[-2:]
    cnt = placement.logcnt(E)  # [L, E]
    per_phy = np.take_along_axis(counts / cnt, np.broadcast_to(placement.phy2log, counts.shape[:-1] +
                                                                (placement.n_phy,)), axis=-1)  # [..., L, P]
    return per_phy.reshape(counts.shape[:-1] + (placement.gpus, -1)).sum(-1)


def imbalance(placement: Placement, counts: np.ndarray) -> float:
    """sum of each layer's (and batch's) max GPU load / sum of its mean GPU load: 1.0 is perfect balance."""
    loads = gpu_loads(placement, counts)
    mean = loads.mean(-1).sum()
    return float(loads.max(-1).sum() / mean) if mean else 1.0


def placements(counts: np.ndarray, gpus: int, redundant: int = 0, groups: int = 1, nodes: int = 1
               ) -> list[Placement]:
    """The three placements compared: uniform, EPLB, pymoe (EPLB + refine), from counts [L, E]."""
    L, E = counts.shape
    n_phy = E + redundant
    if gpus < 1 or n_phy % gpus:
        raise PymoeError(f"--gpus {gpus}: {E} experts + {redundant} redundant = {n_phy} physical experts must "
                         f"divide evenly over the GPUs")
    if nodes < 1 or gpus % nodes:
        raise PymoeError(f"--nodes {nodes}: the GPUs ({gpus}) must divide evenly over the nodes")
    eplb = rebalance(counts, n_phy, groups, nodes, gpus)
    return [trivial(L, E, n_phy, gpus), eplb, refine(eplb, counts)]


# --- the file -----------------------------------------------------------------------------------------------------
def sglang_rows(placement: Placement, first_moe_layer: int) -> list:
    """physical_to_logical_map over all model layers, as SGLang sizes it (num_hidden_layers rows): the leading dense
    layers get the trivial row (they route nothing)."""
    n_phy = placement.n_phy
    E = int(placement.phy2log.max()) + 1
    dense = [(np.arange(n_phy) % E).tolist()] * first_moe_layer
    return dense + placement.phy2log.tolist()


def write_sglang(path, placement: Placement, counts: np.ndarray, first_moe_layer: int = 0,
                 form: str = "mapping") -> None:
    """SGLang's `--init-expert-location FILE.json`: {"physical_to_logical_map": [[...] per layer]} (form mapping;
    the only key: SGLang passes the file's keys as arguments) or {"logical_count": [[...] per layer]} (form counts:
    SGLang runs its own EPLB on them at start)."""
    if form == "mapping":
        data = {"physical_to_logical_map": sglang_rows(placement, first_moe_layer)}
    elif form == "counts":
        c = np.asarray(counts, dtype=np.int64)
        data = {"logical_count": [[0] * c.shape[1]] * first_moe_layer + c.tolist()}
    else:
        raise PymoeError(f"--format {form!r}: mapping or counts")
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, separators=(",", ":"))
    os.replace(tmp, path)


def report(paths: Sequence[str], gpus: int, redundant: int = 0, out: Optional[str] = None, groups: int = 1,
           nodes: int = 1, form: str = "mapping", batch: Optional[int] = None, phase: str = "decode",
           which: str = "pymoe") -> str:
    """What `pymoe placement` prints: the imbalance of each placement in-sample and, for traces, placed on the first
    half of each trace's tokens and measured on the second; then the file written."""
    phase = None if phase == "all" else phase
    counts, first, traces = layer_counts(paths, phase)
    L, E = counts.shape
    if batch is not None and (not traces or len(traces) != len(paths)):
        raise PymoeError("--batch needs traces only (profiles and heat files have no order)")

    def measured(sources):  # [..., L, E]: what the imbalance is measured on
        if batch is None:
            return sum(trace_counts(t, phase) for t in sources) if sources is not traces else counts
        return np.concatenate([trace_counts(t, phase, batch) for t in sources])

    ps = placements(counts, gpus, redundant, groups, nodes)
    lines = [f"placement: {L} MoE layers x {E} experts (first MoE layer {first}) on {gpus} GPUs in {nodes} node(s), "
             f"{redundant} redundant -> {E + redundant} physical experts, {(E + redundant) // gpus} per GPU; "
             f"{int(counts.sum())} routed lookups counted ({phase or 'all'})",
             "imbalance = sum over layers of the max GPU load / sum of the mean GPU load (1.000 = perfect)"
             + (f", per batch of {batch} consecutive tokens" if batch else ", all counted tokens at once"),
             f"{'':>10} " + " ".join(f"{p.name:>8}" for p in ps),
             f"{'in-sample':>10} " + " ".join(f"{imbalance(p, measured(traces)):>8.3f}" for p in ps)]
    if traces:
        halves = [_halves(t, phase) for t in traces]
        held = placements(sum(trace_counts(a, phase) for a, _ in halves), gpus, redundant, groups, nodes)
        ev = measured([b for _, b in halves])
        lines.append(f"{'held-out':>10} " + " ".join(f"{imbalance(p, ev):>8.3f}" for p in held)
                     + "   (placed on the first half of each trace's tokens, measured on the second)")
    if out is not None:
        chosen = {p.name: p for p in ps}.get(which)
        if chosen is None:
            raise PymoeError(f"--placement {which!r}: uniform, eplb or pymoe")
        write_sglang(out, chosen, counts, first, form)
        key, width = ("physical_to_logical_map", E + redundant) if form == "mapping" else ("logical_count", E)
        what = f"the {which} placement" if form == "mapping" else "SGLang balances them at start"
        lines.append(f"wrote {out}: SGLang --init-expert-location, {{\"{key}\": {first + L} layers x {width}}} ({what})")
    return "\n".join(lines)


def _halves(trace, phase):
    """The trace's rows split at the middle of its `phase` tokens (two Traces of the same shape)."""
    from .trace import Trace

    rows = np.flatnonzero(trace.rows(phase))
    cut = rows[len(rows) // 2] if len(rows) else 0
    parts = []
    for sl in (slice(0, cut), slice(cut, None)):
        parts.append(Trace(trace.experts[sl], trace.weights[sl], trace.phase[sl], trace.request[sl],
                           trace.forward[sl], trace.meta))
    return parts
