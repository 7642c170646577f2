"""The CUDA backend: dense weights and the expert slot pool in device memory, every expert in pinned host memory.

What this is:
  - `CUDABackend`: the contract of backends/protocol.py. The engine's blocks run unchanged: the attention block
    moves its input to the device once (`to_device`), and its projections, biases, q/k norms, RoPE, the KV write
    into the device KV cache (`DeviceKVCache`, one per sequence: `prepare` allocates one for each of the server's
    slots that fits, `new_kv` lends each to one sequence at a time) and attention run there
    until `to_host`. Weight matrices live on the device as their raw GGUF rows (uint8 [R, row_bytes], any supported
    type, F32 included) and are multiplied by the Numba CUDA kernels of cuda_kernels/
    (quant_matvec.matmul, moe.expert_block, norm_rope, attention), which decode blocks on the fly. Given host
    arrays (version 2: the residual stream, the router, the output projection on the host), a primitive answers
    with host arrays; the norms and RoPE of host arrays run on the CPU backend it holds (`self.cpu`, float path).
  - The device decode step (version 3: `begin_step` .. `end_step`): one decode token from the token id to the
    greedy token on the device, the routed experts read through the residency table (expert -> slot or -1) from
    their slot or the mapped file (cuda_kernels/step.py); one copy back (the token id and the routing ids) and one
    synchronisation per token; the expert cache's lookups follow the step, or, with "cpu" misses, are made inside it
    per MoE layer (one more synchronisation each) (docs/expert-cache.md "The decode step on the device").
    Gated DeltaNet layers (qwen3next, qwen35moe) run their conv and delta rule there too (`gdn_step`), on a state the
    device KV cache keeps beside a host copy for the host-side forwards (`DeviceKVCache`).
    PYMOE_DEVICE_STEP=0: version 2 only.
  - `HostMapping`: the GGUF memory map registered once as pinned, *mapped* host memory (cudaHostRegister with the
    Mapped and ReadOnly flags, through CuPy: the one CuPy call of this file). A kernel reads an expert's bytes
    straight from host RAM over PCIe through the device pointer of its mmap view: the "spill" miss path. The bytes
    are never copied a second time in host RAM.
  - `DevicePool`: the N slots of the expert cache, uint8 [N, slot_bytes] in device memory. `write` copies an
    expert into a slot on the *copy stream*, after waiting for the event recorded when the last kernel that read
    the slot was launched, and records a "ready" event that the compute stream waits for before it reads the slot.
    So a slot is never overwritten while a kernel reads it, nor read before its copy has landed, and the copies of
    promotions overlap with compute.
  - `DeviceMemory`: every device byte pymoe allocates goes through it, against a budget (free memory at start-up
    minus the reserve); exceeding it is an error, never a silent over-allocation.
Miss paths, as the expert cache tagged each expert (`ExpertBytes.where`, experts/cache.py):
    slot   -> the kernel reads the slot (HBM);
    spill  -> the kernel reads the expert's mmap bytes over PCIe (mapped host memory; no slot used);
    cpu    -> the CPU computes that expert (pymoe's CPU kernels, float path like the GPU's) while the GPU runs the
              others; the two partial outputs are added;
    staged -> prefill: the expert is copied once per chunk into one of two staging buffers on the copy stream,
              while the compute stream runs the previous expert (double buffering); with no more tokens than one
              kernel token tile it is read in place instead (one pass over its bytes either way).
Cost: every kernel launch, host<->device copy and host synchronisation is counted in `self.counts`
(backends/device_counts.py; per decoded token in `pymoe run`'s last line and /v1/status). In the simulator
(NUMBA_ENABLE_CUDASIM=1) the device stands for PYMOE_SIM_DEVICE_GIB GiB (default 8).
  - CUDA graphs (backends/cuda_graphs.py, PYMOE_CUDA_GRAPHS): a device step's launches held and run as one graph
    captured on CuPy's stream; what varies from step to step is read by the kernels from device arrays at fixed
    addresses (`begin_step`'s `at`: the token id, its position, its KV row; the residency table).
What this is not: model math (engine/), or the cache's policy (experts/cache.py). What comes next (one batched
device step for the server's slots) and how this is tested without a GPU (the CUDA simulator, with
`ReferenceKernels` or, on a micro model, the real kernels): docs/expert-cache.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from pymoe import quant
from pymoe.errors import PymoeError
from .pool import HostPool
from .device_counts import DeviceCounts
from pymoe.gguf.loader import EXPERT_PROJ, ExpertBytes, Tensor
from .cpu import CPUBackend, group_by_expert
from .reference import (apply_rope, attention, gdn_state_bytes, gdn_state_shapes, rmsnorm, rope_scaling, rope_tables,
                        silu, swiglu_expert)

MiB = 2**20
BATCH_DRAW = 10  # int32 words per row's draw record in a batched step's `at` (DRAW_WORDS, rounded up to even)
AT_WORDS = 4 + 9  # a step's `at` buffer: token id, position, KV row, a word unused, cuda_kernels/sample.draw_record
VERIFY_ROWS = 16  # the most rows (1 + drafts) of a verify step on the device (`begin_step`); more: version 2
DEFAULT_RESERVE = 700 * MiB  # left free on the device for the CUDA context, the kernels' code and the allocator


def cuda_module():
    """numba.cuda, or a one-line error saying why there is no CUDA device to use."""
    from numba import config
    from numba import cuda

    if not config.ENABLE_CUDASIM and not cuda.is_available():
        raise PymoeError("backend 'cuda': no CUDA GPU found (numba.cuda.is_available() is False); use --backend cpu")
    if config.ENABLE_CUDASIM:
        from .simulator import quicker

        quicker()  # barriers without the simulator's polling loop
    return cuda


def simulated() -> bool:
    from numba import config

    return bool(config.ENABLE_CUDASIM)


SIM_DEVICE_GIB = 8.0  # the simulated device's memory, unless PYMOE_SIM_DEVICE_GIB says otherwise


def simulated_device_gib() -> float:
    """The device size the simulator stands for (it has no memory of its own to report): PYMOE_SIM_DEVICE_GIB."""
    import os

    raw = os.environ.get("PYMOE_SIM_DEVICE_GIB", "")
    try:
        gib = float(raw) if raw else SIM_DEVICE_GIB
    except ValueError:
        gib = -1.0
    if not (gib > 0 and math.isfinite(gib)):
        raise PymoeError(f"PYMOE_SIM_DEVICE_GIB must be a positive number of GiB, got {raw!r}")
    return gib


def cuda_available() -> bool:
    """A real CUDA GPU is usable (the simulator does not count). Without an NVIDIA driver on the machine this
    answers without importing numba.cuda (which picks real-or-simulator once per process: tests rely on that)."""
    import ctypes.util
    import os

    if simulated() or not (os.path.exists("/proc/driver/nvidia") or ctypes.util.find_library("cuda")):
        return False
    try:
        from numba import cuda

        return not simulated() and cuda.is_available()
    except Exception:  # noqa: BLE001  (a broken driver install is "no GPU" here)
        return False


def shaped(buf, shape: tuple):
    """A contiguous device view of the first prod(shape) elements of the flat device array `buf`, in `shape`."""
    n = math.prod(shape)
    flat = buf[:n]
    view = flat.reshape(shape)
    return view if getattr(view, "__cuda_ndarray__", False) else type(buf)(view)  # the simulator returns ndarray


# --------------------------------------------------------------------------------------------------------------
# Kernels: the real ones (cuda_kernels/) and their NumPy references, with one signature
# --------------------------------------------------------------------------------------------------------------
# Kernel launches each operation makes (cuda_kernels/, for a non-empty input): the backend counts these whichever
# kernel set runs (the NumPy references stand in for the same launches); tests/test_cuda_real_kernels_sim.py checks
# them against the launches the simulator sees.
LAUNCHES = {"matmul": 1,  # quant_matvec.matmul: one kernel, grid (rows, token tiles)
            "expert_block": 2,  # moe.expert_block: gate_up, then down
            "rmsnorm": 1, "rope": 1, "add_bias": 1,  # norm_rope: one each, grid (rows,)
            "decode_attention": 1,  # attention.decode_attention: one token, grid (heads,)
            "chunk_attention": 1,  # attention.chunk_attention: a prompt chunk of T tokens, grid (T, heads)
            # the device decode step (version 3, cuda_kernels/step.py): one each, routed_experts two (gate_up, down)
            "embed": 1, "add": 1, "route_softmax": 1, "argmax": 1, "routed_experts": 2, "swiglu": 1,
            "sigmoid_gate": 1, "route_sigmoid": 1,
            "sample": 1,  # a random draw from a device step's logits (cuda_kernels/sample.py)
            # gpt-oss's (cuda_kernels/gpt_oss.py): attention with a window and sinks, its router, its experts
            "decode_attention_ws": 1, "route_softmax_weight": 1, "routed_experts_oai": 2,
            # DeepSeek-V2/V3 (cuda_kernels/mla.py, route_groups.py): one each
            "mla_kv_row": 1, "mla_query": 1, "mla_value": 1, "route_groups": 1,
            "mla_query_q": 1, "mla_value_q": 1,  # (k_b, v_b read in their stored type)
            # gated attention and Gated DeltaNet (qwen3next, qwen35moe: cuda_kernels/gated_attention.py, deltanet.py)
            "split_gate": 1, "gate_output": 1, "conv_step": 1, "rule_step": 1,
            "conv_chunk": 1, "rule_chunk": 1,  # a prompt chunk's Gated DeltaNet core (T tokens, one launch each)
            "kv_store": 1,  # a device step's KV write (attention.kv_store: the row read on the device)
            # the batched device step of B sequences (cuda_kernels/batch_step.py, ragged_attention.py): one each
            "rope_rows": 1, "kv_store_rows": 1, "ragged_attention": 1}


class DeviceKernels:
    """cuda_kernels/: quantized matmul and the fused SwiGLU expert block (Numba CUDA)."""

    name = "cuda_kernels"

    def matmul(self, w, qtype, X, out, stream):
        from pymoe.cuda_kernels import quant_matvec

        return quant_matvec.matmul(w, qtype, X, out=out, stream=stream)

    def expert_block(self, gate, up, down, types, X, wt, Y, H, stream):
        from pymoe.cuda_kernels import moe

        return moe.expert_block(gate, up, down, types, X, wt, Y, H=H, stream=stream)

    def rmsnorm(self, X, w, eps, out, stream):
        from pymoe.cuda_kernels import norm_rope

        return norm_rope.rmsnorm(X, w, eps, out=out, stream=stream)

    def rope(self, x, cos, sin, neox, p0, stream):
        from pymoe.cuda_kernels import norm_rope

        return norm_rope.rope(x, cos, sin, neox, p0=p0, stream=stream)

    def add_bias(self, Y, b, stream):
        from pymoe.cuda_kernels import norm_rope

        return norm_rope.add_bias(Y, b, stream=stream)

    def decode_attention(self, q, k_cache, v_cache, pos, out, scores, stream):
        from pymoe.cuda_kernels import attention

        return attention.decode_attention(q, k_cache, v_cache, pos, out=out, scores=scores, stream=stream)

    def chunk_attention(self, q, k_cache, v_cache, p0, window, sinks, out, stream):
        from pymoe.cuda_kernels import attention

        return attention.chunk_attention(q, k_cache, v_cache, p0, window, sinks, out=out, stream=stream)

    def kv_store(self, k, v, k_cache, v_cache, at, stream):
        from pymoe.cuda_kernels import attention

        return attention.kv_store(k, v, k_cache, v_cache, at, stream=stream)

    # the batched device step (B sequences)
    def rope_rows(self, x, cos, sin, neox, pos, stream):
        from pymoe.cuda_kernels import batch_step

        return batch_step.rope_rows(x, cos, sin, pos, neox, stream=stream)

    def kv_store_rows(self, k, v, k_all, v_all, seqs, rows, stream):
        from pymoe.cuda_kernels import batch_step

        return batch_step.kv_store_rows(k, v, k_all, v_all, seqs, rows, stream=stream)

    def ragged_attention(self, q, k_all, v_all, seqs, pos, window, sinks, out, stream):
        from pymoe.cuda_kernels import ragged_attention

        return ragged_attention.ragged_decode_attention(q, k_all, v_all, seqs, pos, window, sinks, out=out,
                                                        stream=stream)

    # the device decode step (version 3)
    def embed(self, w, qtype, tokens, out, stream):
        from pymoe.cuda_kernels import step

        return step.embed(w, qtype, tokens, out, stream=stream)

    def add(self, Y, X, stream):
        from pymoe.cuda_kernels import step

        return step.add(Y, X, stream=stream)

    def swiglu(self, G, U, stream):
        from pymoe.cuda_kernels import step

        return step.swiglu(G, U, stream=stream)

    def sigmoid_gate(self, Y, X, g, stream):
        from pymoe.cuda_kernels import step

        return step.sigmoid_gate(Y, X, g, stream=stream)

    def route_softmax(self, logits, k, norm_topk, ids, w, scale, stream):
        from pymoe.cuda_kernels import step

        return step.route_softmax(logits, k, norm_topk, ids, w, scale=scale, stream=stream)

    def route_sigmoid(self, logits, k, bias, norm_topk, ids, w, scale, stream):
        from pymoe.cuda_kernels import step

        return step.route_sigmoid(logits, k, bias, norm_topk, ids, w, scale=scale, stream=stream)

    def argmax(self, logits, out, stream):
        from pymoe.cuda_kernels import step

        return step.argmax(logits, out, stream=stream)

    def sample(self, logits, draw_k, draw_f, out, stream):
        from pymoe.cuda_kernels import sample

        return sample.sample_at(logits, draw_k, draw_f, out, stream=stream)

    def routed_experts(self, slots, host, table, offsets, part_off, row_bytes, types, shape, ids, w, X, Y, H, stream):
        from pymoe.cuda_kernels import step

        return step.routed_experts(slots, host, table, offsets, part_off, row_bytes, types, shape, ids, w, X, Y, H,
                                   stream=stream)

    # gpt-oss
    def decode_attention_ws(self, q, k_cache, v_cache, pos, window, sinks, out, scores, stream):
        from pymoe.cuda_kernels import gpt_oss

        return gpt_oss.decode_attention_ws(q, k_cache, v_cache, pos, window, sinks, out, scores, stream=stream)

    def route_softmax_weight(self, logits, bias, k, ids, w, stream):
        from pymoe.cuda_kernels import gpt_oss

        return gpt_oss.route_softmax_weight(logits, bias, k, ids, w, stream=stream)

    def routed_experts_oai(self, slots, host, table, offsets, part_off, row_bytes, types, shape, ids, w, X, Y, H,
                           biases, stream):
        from pymoe.cuda_kernels import gpt_oss

        return gpt_oss.routed_experts_oai(slots, host, table, offsets, part_off, row_bytes, types, shape, ids, w, X,
                                          Y, H, biases, stream=stream)

    # DeepSeek-V2/V3
    def route_groups(self, logits, k, bias, softmax, groups, groups_used, norm_topk, ids, w, scale, stream):
        from pymoe.cuda_kernels import route_groups

        return route_groups.route_groups(logits, k, bias, softmax, groups, groups_used, norm_topk, ids, w,
                                         scale=scale, stream=stream)

    def mla_kv_row(self, ckv, w, eps, cos, sin, p0, neox, cache, r0, stream):
        from pymoe.cuda_kernels import mla

        return mla.mla_kv_row(ckv, w, eps, cos, sin, p0, neox, cache, r0, stream=stream)

    def mla_query(self, q, k_b, cos, sin, p0, neox, scale, Q, stream):
        from pymoe.cuda_kernels import mla

        return mla.mla_query(q, k_b, cos, sin, p0, neox, scale, Q, stream=stream)

    def mla_value(self, a, v_b, out, stream):
        from pymoe.cuda_kernels import mla

        return mla.mla_value(a, v_b, out, stream=stream)

    def mla_query_q(self, q, k_b, qtype, cos, sin, p0, neox, scale, Q, stream):
        from pymoe.cuda_kernels import mla

        return mla.mla_query_q(q, k_b, qtype, cos, sin, p0, neox, scale, Q, stream=stream)

    def mla_value_q(self, a, v_b, qtype, out, stream):
        from pymoe.cuda_kernels import mla

        return mla.mla_value_q(a, v_b, qtype, out, stream=stream)
    # gated attention and Gated DeltaNet (qwen3next, qwen35moe)
    def split_gate(self, qg, q, gate, Dh, stream):
        from pymoe.cuda_kernels import gated_attention

        return gated_attention.split_gate(qg, q, gate, Dh, stream=stream)

    def gate_output(self, out, gate, stream):
        from pymoe.cuda_kernels import gated_attention

        return gated_attention.gate_output(out, gate, stream=stream)

    def conv_step(self, x, state, w, out, stream):
        from pymoe.cuda_kernels import deltanet

        return deltanet.conv_step(x, state, w, out, stream=stream)

    def rule_step(self, qkvc, z, b, a, dt, A, norm, M, o, nk, tiled, eps, stream):
        from pymoe.cuda_kernels import deltanet

        return deltanet.rule_step(qkvc, z, b, a, dt, A, norm, M, o, nk, tiled, eps, stream=stream)

    def conv_chunk(self, x, state, w, out, stream):
        from pymoe.cuda_kernels import deltanet

        return deltanet.conv_chunk(x, state, w, out, stream=stream)

    def rule_chunk(self, qkvc, z, b, a, dt, A, norm, M, o, nk, tiled, eps, stream):
        from pymoe.cuda_kernels import deltanet

        return deltanet.rule_chunk(qkvc, z, b, a, dt, A, norm, M, o, nk, tiled, eps, stream=stream)


class ReferenceKernels:
    """The same two operations in NumPy (dequantize the rows, then float32 math), on device arrays: for the
    simulator, where the real kernels are far too slow to run a model, and as a debugging aid on a GPU."""

    name = "reference"

    def matmul(self, w, qtype, X, out, stream):
        W = quant.dequantize(w.copy_to_host(), qtype)  # [R, C]
        out.copy_to_device((X.copy_to_host() @ W.T).astype(np.float32), stream=stream)  # [T, R]
        return out

    def expert_block(self, gate, up, down, types, X, wt, Y, H, stream):

        g, u, d = (quant.dequantize(a.copy_to_host(), types[p]) for a, p in ((gate, "gate"), (up, "up"), (down, "down")))
        x = X.copy_to_host()  # [n, D]
        h = (silu(x @ g.T) * (x @ u.T)).astype(np.float32)  # [n, F]
        y = Y.copy_to_host() + wt.copy_to_host()[:, None] * (h @ d.T)  # [n, D]
        Y.copy_to_device(y.astype(np.float32), stream=stream)
        return Y

    def rmsnorm(self, X, w, eps, out, stream):

        out.copy_to_device(rmsnorm(X.copy_to_host(), w.copy_to_host(), eps).astype(np.float32), stream=stream)
        return out

    def rope(self, x, cos, sin, neox, p0, stream):

        T, p0 = x.shape[0], _at(p0)
        c, s = cos.copy_to_host()[p0:p0 + T], sin.copy_to_host()[p0:p0 + T]
        x.copy_to_device(apply_rope(x.copy_to_host(), c, s, neox), stream=stream)
        return x

    def add_bias(self, Y, b, stream):
        Y.copy_to_device(Y.copy_to_host() + b.copy_to_host(), stream=stream)
        return Y

    def decode_attention(self, q, k_cache, v_cache, pos, out, scores, stream):

        pos = _at(pos)
        k, v = k_cache.copy_to_host()[:pos + 1], v_cache.copy_to_host()[:pos + 1]  # [S, G, Dh], [S, G, Dv]
        o = attention(q.copy_to_host()[None], k, v, pos)  # [1, H * Dv]
        out.copy_to_device(o.reshape(out.shape), stream=stream)
        return out

    def kv_store(self, k, v, k_cache, v_cache, at, stream):
        from pymoe.cuda_kernels.attention import kv_store_reference

        kc, vc = k_cache.copy_to_host(), v_cache.copy_to_host()
        kv_store_reference(k.copy_to_host(), v.copy_to_host(), kc, vc, _at(at))
        k_cache.copy_to_device(kc, stream=stream)
        v_cache.copy_to_device(vc, stream=stream)
        return k_cache, v_cache

    def rope_rows(self, x, cos, sin, neox, pos, stream):
        from pymoe.cuda_kernels.batch_step import rope_rows_reference

        x.copy_to_device(rope_rows_reference(x.copy_to_host(), cos.copy_to_host(), sin.copy_to_host(),
                                             pos.copy_to_host(), neox), stream=stream)
        return x

    def kv_store_rows(self, k, v, k_all, v_all, seqs, rows, stream):
        kh, vh = k.copy_to_host(), v.copy_to_host()  # (batch_step.kv_store_rows_reference, row by row: each
        for b, (c, r) in enumerate(zip(seqs.copy_to_host().tolist(), rows.copy_to_host().tolist())):  # a
            k_all[c, r].copy_to_device(np.ascontiguousarray(kh[b]), stream=stream)  # contiguous [G, Dh] on a GPU
            v_all[c, r].copy_to_device(np.ascontiguousarray(vh[b]), stream=stream)
        return k_all, v_all

    def ragged_attention(self, q, k_all, v_all, seqs, pos, window, sinks, out, stream):
        qh, sk = q.copy_to_host(), None if sinks is None else sinks.copy_to_host()  # [B, H, Dh]
        o = np.empty(tuple(out.shape), np.float32)  # [B, H, Dv]: ragged_decode_attention_reference, row by row
        for b, (c, p) in enumerate(zip(seqs.copy_to_host().tolist(), pos.copy_to_host().tolist())):
            k, v = k_all[c].copy_to_host()[:p + 1], v_all[c].copy_to_host()[:p + 1]  # [p + 1, G, Dh], [.., Dv]
            o[b] = attention(qh[b][None], k, v, p, window, sk).reshape(o.shape[1:])
        out.copy_to_device(o, stream=stream)
        return out

    def chunk_attention(self, q, k_cache, v_cache, p0, window, sinks, out, stream):
        T = q.shape[0]
        k, v = k_cache.copy_to_host()[:p0 + T], v_cache.copy_to_host()[:p0 + T]  # [S, G, Dh], [S, G, Dv]
        o = attention(q.copy_to_host(), k, v, p0, window, None if sinks is None else sinks.copy_to_host())
        out.copy_to_device(o.reshape(out.shape), stream=stream)  # [T, H * Dv] -> [T, H, Dv]
        return out

    def embed(self, w, qtype, tokens, out, stream):
        rows = w.copy_to_host()[tokens.copy_to_host()]  # [T, row_bytes]
        out.copy_to_device(quant.dequantize(rows, qtype).astype(np.float32), stream=stream)
        return out

    def add(self, Y, X, stream):
        Y.copy_to_device(Y.copy_to_host() + X.copy_to_host(), stream=stream)
        return Y

    def swiglu(self, G, U, stream):
        G.copy_to_device((silu(G.copy_to_host()) * U.copy_to_host()).astype(np.float32), stream=stream)
        return G

    def sigmoid_gate(self, Y, X, g, stream):
        from .reference import sigmoid

        z = (X.copy_to_host() * g.copy_to_host()).sum(axis=-1, keepdims=True)  # [T, 1]
        Y.copy_to_device((sigmoid(z) * Y.copy_to_host()).astype(np.float32), stream=stream)
        return Y

    def route_softmax(self, logits, k, norm_topk, ids, w, scale, stream):
        from .reference import route

        i, wt = route(logits.copy_to_host(), k, norm_topk)
        ids.copy_to_device(i.astype(np.int32), stream=stream)
        w.copy_to_device((wt * np.float32(scale)).astype(np.float32), stream=stream)
        return ids, w

    def route_sigmoid(self, logits, k, bias, norm_topk, ids, w, scale, stream):
        from .reference import route_sigmoid

        i, wt = route_sigmoid(logits.copy_to_host(), k, None if bias is None else bias.copy_to_host(), norm_topk,
                              scale)
        ids.copy_to_device(i.astype(np.int32), stream=stream)
        w.copy_to_device(wt, stream=stream)
        return ids, w

    def argmax(self, logits, out, stream):
        out.copy_to_device(np.argmax(logits.copy_to_host(), axis=1).astype(np.int32), stream=stream)
        return out

    def sample(self, logits, draw_k, draw_f, out, stream):
        from pymoe.cuda_kernels.sample import sample_reference

        (top_k,), (temperature, top_p, min_p, u) = draw_k.copy_to_host(), draw_f.copy_to_host()
        out.copy_to_device(sample_reference(logits.copy_to_host(), temperature, int(top_k), top_p, min_p, u),
                           stream=stream)
        return out

    def routed_experts(self, slots, host, table, offsets, part_off, row_bytes, types, shape, ids, w, X, Y, H, stream):
        from pymoe.cuda_kernels.step import routed_experts_reference

        read = self._reader(slots, host, table, offsets, part_off, row_bytes, shape)
        y = routed_experts_reference(read, types, ids.copy_to_host(), w.copy_to_host(), X.copy_to_host())
        Y.copy_to_device(y, stream=stream)
        return Y

    def decode_attention_ws(self, q, k_cache, v_cache, pos, window, sinks, out, scores, stream):
        pos = _at(pos)
        k, v = k_cache.copy_to_host()[:pos + 1], v_cache.copy_to_host()[:pos + 1]  # [S, G, Dh], [S, G, Dv]
        o = attention(q.copy_to_host()[None], k, v, pos, window, None if sinks is None else sinks.copy_to_host())
        out.copy_to_device(o.reshape(out.shape), stream=stream)
        return out

    def route_softmax_weight(self, logits, bias, k, ids, w, stream):
        from .reference import route_softmax_weight

        lg = logits.copy_to_host()
        i, wt = route_softmax_weight(lg if bias is None else lg + bias.copy_to_host(), k)
        ids.copy_to_device(i.astype(np.int32), stream=stream)
        w.copy_to_device(wt, stream=stream)
        return ids, w

    def routed_experts_oai(self, slots, host, table, offsets, part_off, row_bytes, types, shape, ids, w, X, Y, H,
                           biases, stream):
        from pymoe.cuda_kernels.gpt_oss import routed_experts_oai_reference

        read = self._reader(slots, host, table, offsets, part_off, row_bytes, shape)
        y = routed_experts_oai_reference(read, types, ids.copy_to_host(), w.copy_to_host(), X.copy_to_host(),
                                         tuple(b.copy_to_host() for b in biases))
        Y.copy_to_device(y, stream=stream)
        return Y

    @staticmethod
    def _reader(slots, host, table, offsets, part_off, row_bytes, shape):
        """read(e) -> expert e's gate, up, down rows where the table says (None: -2, left out)."""
        D, F = shape
        tab, off, po = table.copy_to_host(), offsets.copy_to_host(), part_off.copy_to_host()
        rb = row_bytes.copy_to_host()
        shapes = [(F, int(rb[0])), (F, int(rb[1])), (D, int(rb[2]))]

        def read(e):  # expert e's rows where the table says: its slot, or the mapped file (copied slice by slice)
            s = int(tab[e])
            if s == -2:  # left out: computed on the CPU
                return None
            src = [(slots[s], int(po[i])) if s >= 0 else (host, int(off[e, i])) for i in range(3)]
            views = [a[o:o + r * b] for (a, o), (r, b) in zip(src, shapes)]  # (the simulator slices to ndarrays)
            return [np.array(v.copy_to_host() if hasattr(v, "copy_to_host") else v).reshape(r, b)
                    for v, (r, b) in zip(views, shapes)]

        return read

    def route_groups(self, logits, k, bias, softmax, groups, groups_used, norm_topk, ids, w, scale, stream):
        from .reference import route_sigmoid

        i, wt = route_sigmoid(logits.copy_to_host(), k, None if bias is None else bias.copy_to_host(), norm_topk,
                              scale, groups, groups_used, "softmax" if softmax else "sigmoid")
        ids.copy_to_device(i.astype(np.int32), stream=stream)
        w.copy_to_device(wt, stream=stream)
        return ids, w

    def mla_kv_row(self, ckv, w, eps, cos, sin, p0, neox, cache, r0, stream):
        from pymoe.cuda_kernels.mla import mla_kv_row_reference

        T, p0, r0 = ckv.shape[0], _at(p0), _at(r0)
        rows = mla_kv_row_reference(ckv.copy_to_host(), w.copy_to_host(), eps, cos.copy_to_host()[p0:p0 + T],
                                    sin.copy_to_host()[p0:p0 + T], neox)  # [T, C + R]
        cache[r0:r0 + T].copy_to_device(rows.reshape(T, 1, -1).copy(), stream=stream)  # (no stride-0 unit axis)
        return cache

    def mla_query(self, q, k_b, cos, sin, p0, neox, scale, Q, stream):
        from pymoe.cuda_kernels.mla import mla_query_reference

        T, p0 = q.shape[0], _at(p0)
        Q.copy_to_device(mla_query_reference(q.copy_to_host(), k_b.copy_to_host(), cos.copy_to_host()[p0:p0 + T],
                                             sin.copy_to_host()[p0:p0 + T], neox, scale), stream=stream)
        return Q

    def mla_value(self, a, v_b, out, stream):
        from pymoe.cuda_kernels.mla import mla_value_reference

        out.copy_to_device(mla_value_reference(a.copy_to_host(), v_b.copy_to_host()), stream=stream)
        return out

    def mla_query_q(self, q, k_b, qtype, cos, sin, p0, neox, scale, Q, stream):
        from pymoe.cuda_kernels.mla import mla_query_q_reference

        T, p0 = q.shape[0], _at(p0)
        Q.copy_to_device(mla_query_q_reference(q.copy_to_host(), k_b.copy_to_host(), qtype,
                                               cos.copy_to_host()[p0:p0 + T], sin.copy_to_host()[p0:p0 + T], neox,
                                               scale), stream=stream)
        return Q

    def mla_value_q(self, a, v_b, qtype, out, stream):
        from pymoe.cuda_kernels.mla import mla_value_q_reference

        out.copy_to_device(mla_value_q_reference(a.copy_to_host(), v_b.copy_to_host(), qtype), stream=stream)
        return out

    def split_gate(self, qg, q, gate, Dh, stream):
        from pymoe.cuda_kernels.gated_attention import split_gate_reference

        a, g = split_gate_reference(qg.copy_to_host(), Dh)
        q.copy_to_device(a, stream=stream)
        gate.copy_to_device(g, stream=stream)
        return q, gate

    def gate_output(self, out, gate, stream):
        from pymoe.cuda_kernels.gated_attention import gate_output_reference

        out.copy_to_device(gate_output_reference(out.copy_to_host(), gate.copy_to_host()), stream=stream)
        return out

    def conv_step(self, x, state, w, out, stream):
        from pymoe.cuda_kernels.deltanet import conv_step_reference

        return _on_host(conv_step_reference, (x, state, w), out, state, stream)

    def rule_step(self, qkvc, z, b, a, dt, A, norm, M, o, nk, tiled, eps, stream):
        from pymoe.cuda_kernels.deltanet import rule_step_reference

        return _on_host(rule_step_reference, (qkvc, z, b, a, dt, A, norm, M, nk, tiled, eps), o, M, stream)

    def conv_chunk(self, x, state, w, out, stream):
        from pymoe.cuda_kernels.deltanet import conv_chunk_reference

        return _on_host(conv_chunk_reference, (x, state, w), out, state, stream)

    def rule_chunk(self, qkvc, z, b, a, dt, A, norm, M, o, nk, tiled, eps, stream):
        from pymoe.cuda_kernels.deltanet import rule_chunk_reference

        return _on_host(rule_chunk_reference, (qkvc, z, b, a, dt, A, norm, M, nk, tiled, eps), o, M, stream)


def _on_host(reference, args: tuple, out, state, stream):
    """Run the NumPy `reference` on host copies of the device arrays among `args` (other values pass as they are):
    its result goes to the device array `out`, and `state` (one of `args`, which the reference updates in place, as
    Gated DeltaNet's conv and rule references do) back to the device. -> out."""
    host = [a.copy_to_host() if hasattr(a, "copy_to_host") else a for a in args]
    out.copy_to_device(reference(*host), stream=stream)
    state.copy_to_device(next(h for a, h in zip(args, host) if a is state), stream=stream)
    return out


def _at(p) -> int:
    """A position given as an int, or as int32 [1] in device memory (a device step's: `CUDABackend.begin_step`)."""
    return int(p) if isinstance(p, (int, np.integer)) else int(p.copy_to_host()[0])


KERNEL_SETS = {"cuda_kernels": DeviceKernels, "reference": ReferenceKernels}


# --------------------------------------------------------------------------------------------------------------
# Memory: the budget, the mapped GGUF file, the slot pool
# --------------------------------------------------------------------------------------------------------------
class DeviceMemory:
    """Every device allocation of pymoe, counted against `limit` bytes (asserted: never exceeded)."""

    def __init__(self, cuda, limit: int, counts: DeviceCounts):
        self.cuda = cuda
        self.allocate = lambda shape, dtype: cuda.device_array(shape, dtype=dtype)  # (CuPy's pool with graphs on)
        self.counts = counts
        self.limit = int(limit)
        self.used = 0
        self.by_what: dict[str, int] = {}

    def alloc(self, shape, dtype, what: str):
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if self.used + nbytes > self.limit:
            raise PymoeError(f"device memory budget exceeded: {what} needs {nbytes / MiB:.1f} MiB, "
                             f"{(self.limit - self.used) / MiB:.1f} MiB of {self.limit / MiB:.1f} MiB left")
        self.used += nbytes
        self.by_what[what] = self.by_what.get(what, 0) + nbytes
        return self.allocate(shape, dtype)

    def upload(self, host: np.ndarray, what: str):
        dev = self.alloc(host.shape, host.dtype, what)
        dev.copy_to_device(np.ascontiguousarray(host))
        self.counts.copy(f"{what} to device", host.nbytes)
        return dev


class HostMapping:
    """The GGUF memory map as pinned, mapped host memory: `device_view(a)` of any view `a` into it, without a copy.

    On a GPU: cudaHostRegister(base, size, Mapped | ReadOnly) (the mmap is read-only: without the ReadOnly flag the
    driver refuses it), then the device pointer of `a` is base_dev + (a's address - base). In the simulator,
    device arrays are NumPy arrays, so the view is `a` itself, wrapped."""

    PORTABLE, MAPPED, READ_ONLY = 0x01, 0x02, 0x08  # cudaHostRegister{Portable, Mapped, ReadOnly}: portable, so
    # that one registration serves every device of several (backends/multi_device.py)

    def __init__(self, cuda, mm: np.ndarray):
        self.cuda = cuda
        self.mm = mm
        self.base = mm.ctypes.data
        self.size = mm.nbytes
        self.dev_base = None
        if not simulated():
            try:
                import cupy
            except ImportError as e:
                raise PymoeError("backend 'cuda' needs CuPy to pin the model file: pip install 'pymoe[cuda12]' "
                                 "(or [cuda13])") from e
            rt = cupy.cuda.runtime
            rt.hostRegister(self.base, self.size, self.PORTABLE | self.MAPPED | self.READ_ONLY)
            self.dev_base = rt.hostGetDevicePointer(self.base, 0)
            self._unregister = lambda: rt.hostUnregister(self.base)

    def device_view(self, a: np.ndarray):
        addr = a.ctypes.data
        if not (self.base <= addr and addr + a.nbytes <= self.base + self.size):
            raise ValueError("device_view: the array is not inside the mapped model file")
        if self.dev_base is None:  # the simulator: a device array wrapping the very same host bytes
            from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

            return FakeCUDAArray(a)
        cai = {"shape": a.shape, "strides": a.strides, "typestr": a.dtype.str, "version": 3,
               "data": (self.dev_base + (addr - self.base), True)}
        return self.cuda.as_cuda_array(type("Mapped", (), {"__cuda_array_interface__": cai})())

    def close(self) -> None:
        if self.dev_base is not None:
            self._unregister()
            self.dev_base = None


class DevicePool(HostPool):
    """The expert cache's slots in device memory: uint8 [N, slot_bytes], the slot layout of pool.HostPool (each
    expert laid out with its own layer's types); copies on the copy stream, ordered by events."""

    def __init__(self, backend: "CUDABackend", n_slots: int, slot_bytes: int, layouts: list):
        self.backend = backend
        self.ready = [None] * n_slots  # event on the copy stream: the slot's last copy has landed
        self.last_read = [None] * n_slots  # event on the compute stream: the last kernel reading the slot is done
        self._event = backend.cuda.event
        self.unwaited: set = set()  # slots whose "ready" event the compute stream has not waited for yet
        self.step_read = None  # event on the compute stream after the last device step, whose kernels may have read
        # any slot (the residency table chose them on the device)
        super().__init__(n_slots, slot_bytes, layouts)

    def allocate(self, n_slots: int, slot_bytes: int):
        return self.backend.mem.alloc((n_slots, slot_bytes), np.uint8, "expert slots")

    def write(self, slot: int, ex: ExpertBytes) -> None:
        b = self.backend
        if self.last_read[slot] is not None:
            self.last_read[slot].wait(b.copy)  # never overwrite a slot a queued kernel still reads
        if self.step_read is not None:
            self.step_read.wait(b.copy)  # nor one the last device step's kernels may read
        for name, off, _ in self.layouts[ex.layer].parts:
            src = getattr(ex, name)  # a view into the pinned mmap: an asynchronous host -> device copy
            self.bytes[slot, off:off + src.nbytes].copy_to_device(src.reshape(-1), stream=b.copy)
            b.counts.copy("slot copies (promotions, prefetches) to device", src.nbytes)
        ready = self._event()
        ready.record(b.copy)
        self.ready[slot] = ready
        self.unwaited.add(slot)

    def part(self, slot: int, off: int, shape: tuple):
        return shaped(self.bytes[slot, off:off + shape[0] * shape[1]], shape)

    def before_read(self, slot: int) -> None:
        """Make the compute stream wait for the slot's copy, if one is in flight."""
        if self.ready[slot] is not None:
            self.ready[slot].wait(self.backend.compute)
            self.ready[slot] = None
        self.unwaited.discard(slot)

    def before_any_read(self) -> None:
        """Make the compute stream wait for every copy in flight (the device decode step: its kernels read whichever
        slots the residency table names, which the host does not know in advance)."""
        for slot in sorted(self.unwaited):
            self.before_read(slot)

    def after_read(self, slot: int, event) -> None:
        self.last_read[slot] = event

    def read(self, slot: int) -> np.ndarray:
        self.synchronize()
        self.backend.counts.copy("slot read back to host", self.bytes.shape[1])
        self.backend.counts.sync()  # copy_to_host without a stream blocks
        return self.bytes[slot].copy_to_host()

    def synchronize(self) -> None:
        self.backend.copy.synchronize()
        self.backend.counts.sync()


def transposed(name: str, a: np.ndarray) -> np.ndarray:
    """A Gated DeltaNet state array between the host's layout and the device's: "ssm" M [nv, dv, dk] <->
    [nv, dk, dv] (either way: the last two axes swap); "conv" as it is."""
    return np.ascontiguousarray(a.transpose(0, 2, 1) if name == "ssm" else a, np.float32)


class DeviceKVCache:
    """Keys and values of one sequence in device memory: float32 [L_kv, n_ctx, G, Dh] each (the fields of
    engine/kv.KVCache: n, n_ctx, rows, clear()). The backend owns one per sequence it was prepared for (the server's
    slots: `CUDABackend.prepare`), allocated at start-up within the budget, and lends each to one sequence at a time
    (`CUDABackend.new_kv`).
    Gated DeltaNet layers (qwen3next, qwen35moe) keep their conv and recurrent state here too, in two copies: on the
    device (`states`: layer -> {"conv" [K - 1, C], "ssm" [nv, dk, dv]: M transposed per head, the layout
    cuda_kernels/deltanet.py reads coalesced}, what the device step advances:
    `CUDABackend.gdn_step`) and on the host (what the host-side forwards advance: the server's batched forwards,
    through `recurrent` as engine/kv.KVCache's). `fresh` says which copy holds the present; the other is
    brought over whole, once, when it is next needed (`host_state`, `device_state`: one copy each way, counted).
    `snapshot` (the same shapes on the device, allocated only for an engine prepared for speculation:
    `CUDABackend.prepare`) holds the device state saved before a speculative verify forward (`snapshot_recurrent`),
    what a rollback goes back to without a host round trip; empty, speculation saves the host copy instead."""

    def __init__(self, k, v, n_ctx: int, rows: dict, states: Optional[dict] = None, backend=None,
                 snapshot: Optional[dict] = None):
        self.k, self.v = k, v  # device [L_kv, capacity, G, Dh], [L_kv, capacity, G, Dv]
        self.n_ctx, self.rows = n_ctx, rows  # rows: layer -> row (ModelConfig.kv_layers)
        self.n = 0
        self.shifts: list = []  # M-RoPE after an image (engine/kv.KVCache.shifts, `pos_delta`)
        self.states, self._backend = states or {}, backend
        self._recurrent: dict = {}  # layer -> {"conv", "ssm"} host float32 arrays (engine/kv.KVCache.recurrent)
        self.fresh = "host"  # where the recurrent state's present is: "host" or "device"
        self.snapshot, self._saved = snapshot or {}, None  # the device snapshot and the token of its last save

    def clear(self) -> None:
        self.n = 0
        self.shifts = []
        self._recurrent, self.fresh = {}, "host"

    @property
    def nbytes(self) -> int:
        """Device bytes of its K and V rows (MLA: V is a view of K, not counted twice)."""
        return self.k.nbytes + (0 if self._backend is not None and self._backend._cfg.traits.mla else self.v.nbytes)

    def pos_delta(self, n: Optional[int] = None) -> int:
        """engine/kv.KVCache.pos_delta: rope position - storage index (0 until an image)."""
        n = self.n if n is None else n
        return next((d for i, d in reversed(self.shifts) if i <= n), 0)

    def recurrent(self, layer: int, **shapes) -> dict:
        """engine/kv.KVCache.recurrent: the host copy of a Gated DeltaNet layer's state (brought from the device
        first if a device step advanced it), zeros on first use; the caller advances it, so it is the present."""
        states = self.host_state()
        if layer not in states:
            states[layer] = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
        return states[layer]

    def save_recurrent(self) -> dict:
        return {layer: {name: a.copy() for name, a in st.items()} for layer, st in self.host_state().items()}

    def restore_recurrent(self, saved) -> None:
        """Back to `saved`: a host copy (`save_recurrent`), made the present as it is (the device state it replaces
        is not brought back first: the next device step copies the saved one over), or the token of the last
        `snapshot_recurrent`, whose device snapshot is copied back into the device state (device to device: no
        PCIe), made the present."""
        if isinstance(saved, DeviceSnapshot):
            if saved is not self._saved:
                raise PymoeError("restore_recurrent: the device snapshot was taken again since this save")
            b = self._backend
            for i, st in self.states.items():
                for name, dev in st.items():
                    dev.copy_to_device(self.snapshot[i][name], stream=b.compute)
            self.fresh = "device"
            return
        self._recurrent = {layer: {name: a.copy() for name, a in st.items()} for layer, st in saved.items()}
        self.fresh = "host"

    def snapshot_recurrent(self):
        """What speculation saves before a verify forward (engine/speculative.py): while the device holds the
        present (after device steps or a prompt's device blocks), a copy of every layer's state into `snapshot`
        on the device (no PCIe, no synchronisation), -> its token (`DeviceSnapshot`); else (the host holds the
        present, or no snapshot was allocated: an engine not prepared for speculation) the host copy
        (`save_recurrent`: the device state comes back first, one copy and one synchronisation)."""
        if self.fresh != "device" or not self.snapshot:
            return self.save_recurrent()
        b = self._backend
        for i, st in self.states.items():
            for name, dev in st.items():
                self.snapshot[i][name].copy_to_device(dev, stream=b.compute)
        self._saved = DeviceSnapshot()
        return self._saved

    def host_state(self) -> dict:
        """The host copy, made the present: after device steps, every layer's state comes back (one copy, one
        synchronisation)."""
        if self.fresh == "device":
            b = self._backend
            out = {layer: {name: a.copy_to_host(stream=b.compute) for name, a in st.items()}
                   for layer, st in self.states.items()}
            b.compute.synchronize()
            b.counts.copy("recurrent state to host", sum(a.nbytes for st in out.values() for a in st.values()))
            b.counts.sync()
            self._recurrent = {layer: {name: transposed(name, a) for name, a in st.items()}
                               for layer, st in out.items()}
        self.fresh = "host"
        return self._recurrent

    def device_state(self, layer: int) -> dict:
        """The device copy of layer's state, made the present: after host-side forwards, every layer's state goes
        to the device (zeros for a layer the host has not touched: a new sequence)."""
        if self.fresh == "host":
            b, n = self._backend, 0
            for i, st in self.states.items():
                for name, dev in st.items():
                    host = self._recurrent.get(i, {}).get(name)
                    data = np.zeros(dev.shape, np.float32) if host is None else transposed(name, host)
                    dev.copy_to_device(data, stream=b.compute)
                    n += data.nbytes
            b.counts.copy("recurrent state to device", n)
            self.fresh = "device"
        return self.states[layer]


class DeviceSnapshot:
    """The token of one `DeviceKVCache.snapshot_recurrent` (only the latest one restores)."""


@dataclass(frozen=True)
class DeviceWeight:
    """A 2-D weight on the device as its raw GGUF rows: uint8 [R, row_bytes] of `qtype` (F32 too)."""

    qtype: quant.QType
    raw: object  # device array
    shape: tuple  # (R, C)
    what: str = "host products"  # what its products carry over PCIe when its input is on the host (`carries`)


class StepLogits:
    """The logits [1, V] of a device decode step, left on the device. `greedy_token`: their argmax, computed there
    and already on the host (the sampler's greedy draw needs nothing else: engine/sampler.py); `drawn_token`: the
    sampler's random draw the step was handed (`begin_step`'s draw), made there and back with the argmax, or None;
    `sample`: a random draw (temperature, top-k, top-p, min-p) made there for the sampler's uniform number after the
    step (one launch, 4 bytes back, one more synchronisation); anything else (np.asarray, indexing) brings them over
    once (V floats, one more synchronisation), while they are still there: until the next step begins.
    A verify step's logits [T, V] (`begin_step` with T rows): row t (`logits[t]`) carries its argmax as its
    `greedy_token`; a random draw brings them over (T V floats, one more synchronisation: sampled verification
    is the host's, engine/sampler.Sampler.verify)."""

    def __init__(self, backend: "CUDABackend", dev, token: int, step: int, parent: "StepLogits" = None, row: int = 0,
                 tokens=None):
        self._backend, self._dev, self.greedy_token, self._stepno = backend, dev, token, step
        self._parent, self._host, self._row = parent, None, row
        self._tokens = [token] if tokens is None else [int(t) for t in tokens]  # each row's argmax
        self.drawn_token = None  # the random draw begin_step was handed, made inside the step (end_step)
        self.hidden = None  # the step's normed last hidden states [T, D] (host), when end_step was asked for them
        self.shape = tuple(dev.shape) if parent is None else tuple(dev.shape)[1:]
        self.dtype, self.ndim = np.dtype(np.float32), len(self.shape)

    def _fetch(self) -> np.ndarray:
        if self._parent is not None:
            return self._parent._fetch()[self._row]
        if self._host is None:
            if self._backend._steps != self._stepno:
                raise PymoeError("backend 'cuda': the logits of an earlier decode step are gone (fetch them before "
                                 "the next step)")
            self._host = self._backend._get(self._dev, "logits to host")
        return self._host

    def can_sample(self, top_k: int) -> bool:
        """`sample` takes a draw with this top-k (cuda_kernels/sample.fits: at most K_MAX candidates); not from a
        verify step's rows (the sampler brings those over)."""
        from pymoe.cuda_kernels.sample import fits

        root = self if self._parent is None else self._parent
        return root.shape[0] == 1 and fits(top_k, self.shape[-1])

    def sample(self, temperature: float, top_k: int, top_p: float, min_p: float, u: float) -> int:
        """The host sampler's draw for the uniform u (engine/sampler.Sampler: its generator's next random()), made on
        the device: the token id."""
        root = self if self._parent is None else self._parent
        if self._backend._steps != self._stepno:
            raise PymoeError("backend 'cuda': the logits of an earlier decode step are gone (sample them before the "
                             "next step)")
        return self._backend.sample_step(root._dev, temperature, top_k, top_p, min_p, u)

    def __array__(self, dtype=None, copy=None):
        a = self._fetch()
        return a if dtype is None else a.astype(dtype)

    def __getitem__(self, i):
        T = self.shape[0]
        if self._parent is None and isinstance(i, (int, np.integer)) and -T <= i < T:  # a row: its argmax kept
            r = int(i) % T
            row = StepLogits(self._backend, self._dev, self._tokens[r], self._stepno, parent=self, row=r)
            row.drawn_token = self.drawn_token
            return row
        return self._fetch()[i]

    def __len__(self) -> int:
        return self.shape[0]


def gdn_widths(cfg) -> tuple:
    """The widest input and output of a Gated DeltaNet layer's projections (0, 0 without one): ssm_out reads
    nv dv = ssm_inner values, attn_qkv writes conv_dim = 2 nk dk + nv dv."""
    if not cfg.traits.hybrid:
        return 0, 0
    return cfg.ssm_inner, 2 * cfg.ssm_k_heads * cfg.ssm_state + cfg.ssm_inner


def gdn_step_floats(cfg) -> int:
    """Arena floats a device step's Gated DeltaNet layer takes beyond its attention's: qkv and its conv output
    (conv_dim each), z and o (nv dv each), beta and alpha (2 nv), the output (D); plus the gated attention's query
    and gate apart (2 H Dh) and its q projection's gate half (H Dh)."""
    if not cfg.traits.hybrid:
        return 0
    _, conv_dim = gdn_widths(cfg)
    return 2 * conv_dim + 2 * cfg.ssm_inner + 2 * cfg.ssm_v_heads + cfg.n_embd + 3 * cfg.n_head * cfg.head_dim


def carries(tensor_name: str) -> str:
    """What a dense weight's product moves when it runs on a host input (linear_raw): the names of DeviceCounts."""
    if tensor_name in ("output.weight", "token_embd.weight"):
        return "output projection"
    if "ffn_gate_inp" in tensor_name:
        return "router"
    if "shexp" in tensor_name:
        return "shared expert"
    if ".ffn_" in tensor_name:
        return "dense MLP"
    return "host-side attention"  # an attention projection on a host input (gpt-oss: after attention on the CPU)


# --------------------------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------------------------
class CUDABackend:
    """backends/protocol.py's contract: products and experts on the device, the host side of a forward (norms,
    RoPE, routing, attention over a host KV cache) on the CPU backend it holds (`self.cpu`, float path)."""

    name = "cuda"
    device_attention_kinds = frozenset({"mla"})  # attention.HOST_ATTENTION kinds this backend runs on the device

    def __init__(self, threads: Optional[int] = None, kernels: str = "cuda_kernels", reserve: int = DEFAULT_RESERVE,
                 free_bytes: Optional[int] = None, graphs=None):
        """`free_bytes`: device memory to plan with (default: what the driver reports free now; the simulator
        reports infinity, so tests give a number). `graphs`: what captures the decode step into CUDA graphs
        (backends/cuda_graphs.py; default: CuPy's, when PYMOE_CUDA_GRAPHS and the machine allow it)."""
        self.cuda = cuda = cuda_module()
        if kernels not in KERNEL_SETS:
            raise PymoeError(f"unknown kernel set {kernels!r} (choose from {', '.join(KERNEL_SETS)})")
        self.k = KERNEL_SETS[kernels]()
        # The CPU side: "cpu" misses, attention over host KV caches. Float path, like the GPU kernels,
        # so that which side computes an expert changes nothing but rounding order.
        self.cpu = CPUBackend(threads=threads, act_bits=0)
        self.host_backend = self.cpu  # where attention kinds without device kernels run (attention.HOST_ATTENTION)
        self.threads = self.cpu.threads
        from .cuda_graphs import CupyCapture, StepGraphs, wanted

        if graphs is None and wanted(kernels, simulated()):
            graphs = CupyCapture(cuda)
        self.graphs = StepGraphs(graphs) if graphs is not None else None  # the device step's CUDA graphs
        # (with them, the compute stream is CuPy's, the Numba kernels launch on it)
        self.compute = graphs.numba_stream(cuda) if graphs is not None else cuda.stream()
        self.copy = cuda.stream()
        from pymoe.cuda_kernels.quant_matvec import TOKEN_TILE  # (numba.cuda is imported by now: safe to load the kernels)

        self._token_tile = TOKEN_TILE  # tokens one kernel block serves: below it, staging an expert gains nothing
        self.note = None  # a start-up line for the log, if any (the simulator's stated device size)
        if free_bytes is None and simulated():  # the simulator reports infinite free memory: state a size
            gib = simulated_device_gib()
            free_bytes = int(gib * 2**30)
            self.note = f"simulated device: {gib:g} GiB (NUMBA_ENABLE_CUDASIM=1; times are not a GPU's)"
        if free_bytes is None:
            free_bytes = cuda.current_context().get_memory_info()[0]
        if not math.isfinite(free_bytes):
            raise PymoeError("backend 'cuda': the device reports no finite free memory (the simulator?): give "
                             "free_bytes")
        self.free_at_start = int(free_bytes)
        self.reserve = int(reserve)
        self.counts = DeviceCounts()  # launches, host<->device bytes, syncs: backends/device_counts.py
        self.mem = DeviceMemory(cuda, self.free_at_start - self.reserve, self.counts)
        if getattr(graphs, "allocate", None) is not None:  # CuPy's memory pool
            self.mem.allocate = lambda shape, dtype: graphs.allocate(cuda, shape, dtype)
        self.host: Optional[HostMapping] = None
        self.scratch: dict = {}
        self.chunk = 1
        self._vectors: dict = {}  # id(host vector) -> its device copy (norm weights, biases)
        self._arena_top = 0  # floats of scratch["arena"] handed out since the last to_device
        self._rope_host = None  # the host (cos, sin) tables now in scratch rope_cos / rope_sin
        self._stage = None  # two staging slots for prefill misses, and their events
        # The device decode step (version 3; PYMOE_DEVICE_STEP=0: version 2): see `begin_step`
        import os

        self.device_step = os.environ.get("PYMOE_DEVICE_STEP", "1") != "0"
        self.speculation = False  # `prepare`: each device KV cache gets a snapshot of its recurrent state too
        self._step = None  # the step under way: {"p0": position}; None outside a device step
        self._steps = 0  # device steps begun so far (StepLogits checks its logits are still there)
        self._res = None  # the residual stream's device array during a step
        self._table_host = None  # int32 [n_moe, E]: what the device residency table holds now
        self._hn = None  # the normed copy of the residual stream during a step
        self._bb = None  # the batched step's buffers (`_prepare_batch`), for up to `batch_max` sequences
        self.batch_max = 0
        self._batch = None  # the batched step under way: its B rows' views of `_bb` (`begin_batch`)
        self.recorder = None  # a device_counts.LaunchRecorder: each step's launches, when a test asks
        self._kvs: list = []  # the device KV caches (`prepare`), one per sequence they can be lent to (`new_kv`)
        self.kv_pool: tuple = ()  # their K and V planes, [S, L_kv, n_ctx, G, Dh] and [.., Dv] (`_kv_planes`)
        self._kv_holders: list = []
        self.kv_wanted = 0

    # --- set-up ------------------------------------------------------------------------------------------------
    def attach(self, file, host: Optional[HostMapping] = None) -> None:
        """Pin and map the model file (all of it: every expert can be a miss); `host`: a mapping made already
        (several devices share one: backends/multi_device.py)."""
        self.host = host or HostMapping(self.cuda, file.reader.data)
        cfg = file.config
        gdn_in, gdn_out = gdn_widths(cfg)
        self._widths = (max(cfg.n_embd, cfg.n_head * cfg.head_dim_v, cfg.n_ff_exp, cfg.n_ff_shexp or 0, cfg.n_ff,
                            gdn_in),
                        max(cfg.n_vocab, cfg.n_head * cfg.head_dim * (2 if cfg.traits.hybrid else 1), cfg.n_embd,
                            cfg.n_expert, cfg.n_ff_exp, cfg.n_ff_shexp or 0, cfg.n_ff, gdn_out))
        # (n_ff: the dense layers' MLP, GLM's first layer; hybrid: the gated attention's query and gate)
        self._moe = (cfg.n_expert_used, cfg.n_embd, cfg.n_ff_exp)
        self._cfg = cfg
        self._slot_bytes = file.slot_bytes
        self._file = file

    def activation_bytes(self, chunk: int, n_ctx: int) -> int:
        """Device bytes of the scratch buffers for forward calls of up to `chunk` tokens in a context of `n_ctx`
        (computed, not guessed)."""
        return sum(math.prod(shape) * np.dtype(dt).itemsize
                   for shape, dt in self._scratch_shapes(chunk, n_ctx).values())

    def _scratch_shapes(self, chunk: int, n_ctx: int) -> dict:
        w_in, w_out = self._widths
        K, D, F = self._moe
        c = self._cfg
        H, G, Dh, Dv = c.n_head, c.n_head_kv, c.head_dim, c.head_dim_v
        pairs = chunk * K  # (token, expert) pairs of a call: the rows of the gathered expert inputs
        return {"x": ((chunk * w_in,), np.float32), "y": ((chunk * w_out,), np.float32),
                "xg": ((pairs * D,), np.float32), "yg": ((pairs * D,), np.float32), "wg": ((pairs,), np.float32),
                "h": ((pairs * F,), np.float32), "stage": ((2, self._slot_bytes), np.uint8),
                # the attention block's device arrays (x, q, k, v, o, y of one block call), reused from the
                # start at each `to_device` (engine/attention.py: one per block)
                "arena": ((max(chunk * (w_in + H * Dh * (4 if c.traits.hybrid else 1) + G * Dh + G * Dv + H * Dv
                                        + w_out + self._mla_step_floats() + gdn_step_floats(c)),  # (hybrid:
                               # query and gate, then each apart; MLA: engine/mla.mla_device's q_a, q and value rows
                               # besides; Gated DeltaNet: engine/deltanet.gdn_device's rows)
                               # a device step's (one token): the attention block's q, k, v, o, y, the router's
                               # logits, the shared expert's gate, up and output, the logits
                               self._step_floats(1) + self._mla_step_floats() + gdn_step_floats(c)),), np.float32),
                "scores": ((H * n_ctx,), np.float32),
                "rope_cos": ((n_ctx * (c.rope_dim // 2),), np.float32),
                "rope_sin": ((n_ctx * (c.rope_dim // 2),), np.float32)}

    def _step_floats(self, T: int) -> int:
        """The arena floats of a device step of T rows of GQA layers (T > 1: a verify step): per row the attention
        block's q, k, v, o, y, the router's logits, the shared expert's (or dense MLP's) gate, up and output, the
        logits."""
        c = self._cfg
        H, G, Dh, Dv, D = c.n_head, c.n_head_kv, c.head_dim, c.head_dim_v, c.n_embd
        return T * (H * Dh + G * Dh + G * Dv + H * Dv + D + c.n_expert + 2 * max(c.n_ff_shexp or 0, c.n_ff) + D
                    + c.n_vocab)

    def _mla_step_floats(self) -> int:
        """MLA's arrays per row beyond the GQA block's (engine/mla.mla_device): the q_a row, q [H, N + R] and the
        value up-projection's output [H, V]; 0 for a model without MLA."""
        c = self._cfg
        if not c.traits.mla:
            return 0
        return (c.q_lora_rank or 0) + c.n_head * (c.head_dim_mla + c.head_dim_v_mla)

    def kv_bytes(self, n_ctx: int) -> int:
        c = self._cfg
        return n_ctx * c.kv_values_per_token() * 4

    def sequence_bytes(self, n_ctx: int) -> int:
        """Device bytes of one sequence's device KV cache of n_ctx positions: K/V rows (MLA: its compressed rows)
        and, with the device step, its Gated DeltaNet layers' conv and recurrent states: once, twice when prepared
        for speculation (the state and the snapshot a speculative rollback goes back to:
        `DeviceKVCache.snapshot_recurrent`)."""
        c = self._cfg
        n_gdn = sum(1 for i in range(c.n_layers) if c.recurrent and c.recurrent[i]
                    and (self.layers is None or i in self.layers))
        copies = 2 if self.speculation else 1  # (the state, and its snapshot for speculation)
        states = copies * n_gdn * gdn_state_bytes(c) if self.device_step else 0
        return self.kv_bytes(n_ctx) + states

    def prepare(self, chunk: int, n_ctx: int, device_kv: bool = True, sequences: int = 1, keep_free: int = 0,
                speculation: bool = False) -> None:
        """Allocate, after the weights and before the slot pool: the scratch buffers for calls of up to `chunk`
        tokens, the RoPE tables and the device KV caches of `n_ctx` positions (`sequences` of them, as many as the
        budget holds beyond `keep_free` bytes, one at least: the server's slots), each with the device step's copy
        of its Gated DeltaNet layers' state (none with `device_kv` False: a model whose attention runs on the host
        side keeps its KV caches there, engine/model.Model.new_kv) and, with `speculation`, a snapshot of it as
        large (`DeviceKVCache.snapshot`)."""
        self.chunk, self.n_ctx, self.speculation = int(chunk), int(n_ctx), bool(speculation)
        for name, (shape, dt) in self._scratch_shapes(self.chunk, self.n_ctx).items():
            self.scratch[name] = self.mem.alloc(shape, dt, "activations")
        c = self._cfg
        cos, sin = rope_tables(c.rope_dim, c.rope_freq_base, np.arange(self.n_ctx),  # [n_ctx, rope_dim / 2]: float64
                               rope_scaling(c))  # angles, as on the CPU, with the file's scaling (YaRN: gpt-oss)
        self.rope_dev = (shaped(self.scratch["rope_cos"], cos.shape), shaped(self.scratch["rope_sin"], sin.shape))
        self.rope_dev[0].copy_to_device(cos)
        self.rope_dev[1].copy_to_device(sin)
        self.counts.copy("RoPE tables to device", 4 * (cos.size + sin.size))
        n_seq = 1
        if device_kv:  # the other sequences' caches: as many as fit, before the pool takes the rest
            per_seq = max(self.sequence_bytes(self.n_ctx), 1)
            room = (self.mem.limit - self.mem.used - int(keep_free)) // per_seq - 1  # (the first is always made)
            n_seq += max(0, min(int(sequences) - 1, room))
        self.kv_pool = self._kv_planes(n_seq, device_kv)
        self._kvs = [self._device_kv(s, device_kv) for s in range(n_seq)]
        self.kv_wanted = int(sequences) if device_kv else 0  # (the start-up line says when fewer fit: memory_line)
        self._kv = self._kvs[0]
        self._kv_holders: list = [None] * len(self._kvs)  # weak references to the caches lent (`new_kv`)
        ev = self.cuda.event
        self._stage = {"free": [ev(), ev()], "ready": [ev(), ev()], "used": [False, False]}
        if self.device_step and len(c.moe_layers) and device_kv:
            self._prepare_step(cos, sin)
            if n_seq > 1:
                self._prepare_batch(n_seq)

    def _kv_planes(self, n_seq: int, device_kv: bool) -> tuple:
        """The K and V planes of every sequence's device KV cache, one pool each: float32 [S, L_kv, n_ctx, G, Dh]
        and [S, L_kv, n_ctx, G, Dv] (no layers without `device_kv`). Sequence s's cache is slice s, so one layer's
        caches of all sequences are one array, pool[:, row] (what cuda_kernels/ragged_attention.py reads). MLA caches
        one row [c | k_pe] per position: V is a view of its first kv_lora_rank values (config.kv_v_width)."""
        c = self._cfg
        mine = [i for i in c.kv_layers() if self.layers is None or i in self.layers]  # (one device of several)
        shape = (n_seq, len(mine) if device_kv else 0, self.n_ctx, c.n_head_kv)
        k = self.mem.alloc((*shape, c.head_dim), np.float32, "KV cache")
        v = k[..., :c.head_dim_v] if c.traits.mla else self.mem.alloc((*shape, c.head_dim_v), np.float32, "KV cache")
        return k, v

    def _device_kv(self, s: int, device_kv: bool) -> "DeviceKVCache":
        """Sequence s's device KV cache of n_ctx positions: slice s of the pool (`_kv_planes`; no rows without
        `device_kv`), with the device step's copy of its Gated DeltaNet layers' state (and its snapshot when
        prepared for speculation)."""
        c = self._cfg
        mine = [i for i in c.kv_layers() if self.layers is None or i in self.layers]  # (one device of several)
        rows = {layer: r for r, layer in enumerate(mine)} if device_kv else {}
        gdn = [i for i in range(c.n_layers) if c.recurrent and c.recurrent[i] and (self.layers is None
                                                                                     or i in self.layers)]
        shapes = {name: (shape[0], shape[2], shape[1]) if name == "ssm" else shape  # (`transposed`)
                  for name, shape in gdn_state_shapes(c).items()} if gdn else {}
        states, snapshot = ({i: {name: self.mem.alloc(shape, np.float32, "recurrent state")  # (what device steps
                                 for name, shape in shapes.items()} for i in gdn}  # advance; then its snapshot)
                            if device_kv and self.device_step and copy < 1 + self.speculation else {}
                            for copy in range(2))
        k, v = self.kv_pool
        kv = DeviceKVCache(k[s], v[s], self.n_ctx, rows, states, self, snapshot)
        kv.seq = s  # its slice of the pool (what a batched step's sequence table names)
        return kv

    def _prepare_step(self, cos: np.ndarray, sin: np.ndarray) -> None:
        """The device decode step's buffers (one token): the residual stream, the normed input of a block, the MoE
        output and hidden rows, the token id, the routing ids and weights of every MoE layer (the ids right after
        the token id in one int32 buffer, `step_back`, which comes back to the host in one copy), the residency
        table int32 [n_moe, E] (expert -> slot or -1), each expert's byte offsets in the mapped file int64
        [n_moe, E, 3], each MoE layer's slot layout (gate/up/down offsets and row bytes), and RoPE tables for the
        whole context of its own (the version 2 forward overwrites scratch rope_cos/rope_sin per call)."""
        c, f = self._cfg, self._file
        K, D, F = self._moe
        E, moe = c.n_expert, c.moe_layers
        n_moe = len(moe)
        layouts = f.expert_layouts()
        offsets = np.zeros((n_moe, E, 3), np.int64)
        part_off = np.zeros((n_moe, 3), np.int64)
        row_bytes = np.zeros((n_moe, 3), np.int64)
        self._expert_nbytes = np.zeros(n_moe, np.int64)
        for m, layer in enumerate(moe):
            parts = layouts[layer].parts  # ((proj, offset in a slot, (rows, row bytes)), ...) gate, up, down
            part_off[m] = [off for _, off, _ in parts]
            row_bytes[m] = [shape[1] for _, _, shape in parts]
            self._expert_nbytes[m] = layouts[layer].nbytes
            for e in range(E):
                ex = f.expert(layer, e)
                offsets[m, e] = [getattr(ex, p).ctypes.data - self.host.base for p in EXPERT_PROJ]
        alloc = self.mem.alloc
        sb = self._sb = {"at": alloc((AT_WORDS,), np.int32, "activations"),  # token id, RoPE position, KV row,
                         # (a word unused), a random draw's settings (cuda_kernels/sample.draw_record)
                         "back": alloc((2 + n_moe * K,), np.int32, "activations"),  # argmax, routing ids, the draw
                         "rw": alloc((n_moe * K,), np.float32, "activations"),
                         "res": alloc((1, D), np.float32, "activations"),
                         "hn": alloc((1, D), np.float32, "activations"),
                         "y": alloc((1, D), np.float32, "activations"),
                         "h": alloc((K, F), np.float32, "activations"),
                         "y_cpu": alloc((1, D), np.float32, "activations"),
                         "table_now": alloc((E,), np.int32, "activations")}
        self._table_host = np.full((n_moe, E), -1, np.int32)
        for name, host in (("table", self._table_host), ("offsets", offsets), ("part_off", part_off),
                           ("row_bytes", row_bytes), ("cos", cos), ("sin", sin)):
            sb[name] = self.mem.upload(np.ascontiguousarray(host), "residency table and expert offsets")
        self._rope_step = (cos, sin)  # host copies: a step checks that its tables are these rows
        self._host_file = self.host.device_view(self.host.mm.reshape(-1))  # the whole mapped file, uint8
        self._no_slots = self.mem.alloc((1, 1), np.uint8, "activations")  # the slots argument with no pool
        at = sb["at"]  # what varies from step to step, read by the kernels from fixed addresses (a CUDA graph
        self._at = {"token": at[0:1], "position": at[1:2], "row": at[2:3]}  # replays them: cuda_graphs.py)
        from pymoe.cuda_kernels.sample import draw_views

        self._draw_at = draw_views(at, 4)  # (top_k int32 [1], temperature, top_p, min_p, u float64 [4]) on the device
        # A verify step's (T rows, `begin_step`): its own `at` [position, KV row, T token ids] and its copy back
        # [T argmax ids, routing ids [n_moe, T, K]], routing weights; its float rows (residual, normed, MoE output
        # [T, D], hidden [T K, F]) in the version 2 expert scratch, which no device step uses
        R = self.verify_rows = min(VERIFY_ROWS, self.chunk)
        sb["v_at"] = alloc((2 + R,), np.int32, "activations")
        sb["v_back"] = alloc((R * (1 + n_moe * K),), np.int32, "activations")
        sb["v_rw"] = alloc((R * n_moe * K,), np.float32, "activations")
        self._plain = {name: sb[name] for name in ("res", "hn", "y", "h", "back", "rw")}
        self._bufs, self._at_plain = self._plain, self._at  # the step under way's: these, or a verify step's

    def _verify_buffers(self, T: int) -> dict:
        """A verify step's views: res, hn, y [T, D], h [T K, F], back [T (1 + n_moe K)], rw [n_moe T K]."""
        K, D, F = self._moe
        n_moe, sb, s = len(self._cfg.moe_layers), self._sb, self.scratch
        return {"res": shaped(s["xg"], (T, D)), "hn": shaped(s["yg"], (T, D)),
                "y": shaped(s["yg"].reshape(-1)[T * D:], (T, D)), "h": shaped(s["h"], (T * K, F)),
                "back": shaped(sb["v_back"], (T * (1 + n_moe * K),)), "rw": shaped(sb["v_rw"], (n_moe * T * K,))}

    def verify_fits(self, T: int) -> bool:
        """A verify forward of T rows fits a device step's buffers: at most `verify_rows` rows, its arena floats
        (`_step_floats`, MLA's and Gated DeltaNet's rows besides), its residual, normed and MoE output rows in the
        expert scratch (xg, yg)."""
        K, D, _ = self._moe
        return (self.step_ready() and 1 < T <= self.verify_rows and 2 * T <= self.chunk * K
                and self._step_floats(T) + T * (self._mla_step_floats() + gdn_step_floats(self._cfg))
                <= self.scratch["arena"].shape[0])

    # --- the device decode step (version 3) ------------------------------------------------------------------------
    # One decoded token of a sequence with a device KV cache runs on the device from the token id to the
    # greedy token: the engine's forward calls `begin_step` (the token id goes in), `embed` (the row gathered
    # there), the same blocks as always on device arrays (the residual stream stays in `step res`: rmsnorm of it
    # writes `step hn`, `add` adds into it), `moe_on_device` per MoE layer (router top-K and the routed experts
    # through the residency table, no host round trip), and `end_step` (argmax; the token id and every MoE layer's
    # routing ids come back in one copy: the step's one host synchronisation). The host then runs the expert
    # cache's lookups of that step (one step late) and the next `begin_step` uploads the residency table's changed
    # rows and orders the step after the promotions' copies.
    @property
    def lookups_in_step(self) -> bool:
        """A device step under way makes each MoE layer's cache lookup inside it (begin_step's `inline`)."""
        return self._step is not None and self._step["inline"]

    def step_ready(self) -> bool:
        return self.device_step and getattr(self, "_sb", None) is not None

    def owns(self, kv) -> bool:
        """kv is this backend's device KV cache (a device step needs one)."""
        return isinstance(kv, DeviceKVCache)

    def can_sample(self, top_k: int) -> bool:
        """A random draw with this top-k can be made on the device (cuda_kernels/sample.fits: at most K_MAX
        candidates of the vocabulary)."""
        from pymoe.cuda_kernels.sample import fits

        return fits(top_k, self._cfg.n_vocab)

    def begin_step(self, tokens: np.ndarray, p0: int, residency: Optional[np.ndarray], inline: bool = False,
                   row: Optional[int] = None, draw=None):
        """Start a device step of one token at position p0 (its KV row: `row`, p0 unless an image shifted the
        positions): bring the residency table up to date (residency: the cache's [L, E] -> slot or -1, or None with
        no pool), wait for copies in flight, put the token id, p0 and the row on the device in one copy (`at`: the
        kernels read them there, so each step makes the same launches, what a CUDA graph replays); returns the
        token id (int32 [1], device). inline: the cache may send misses to the CPU, so each MoE layer's lookup is
        made inside the step (`routing_to_host`, `experts_as_served`) and the table is not used. draw: the sampler's
        random draw (engine/sampler.DeviceDraw: its settings and its next uniform number), made inside the step
        (`end_step`), its settings in the same copy as the token id, or None (the step brings back the argmax).

        T > 1 tokens: a verify step (speculation's last token and its drafts, positions p0 .. p0 + T - 1, KV rows
        row ..; `verify_fits`): the position, the row and the T token ids go up in one copy (`v_at`), the blocks run
        on T rows (the KV rows written by `kv_store`, causal attention over them by `chunk_attention`), and
        `end_step` brings back the T argmax ids with the routing ids [n_moe, T, K]. Not inline, no draw, no graph.
        Returns the token ids (int32 [T], device)."""
        tokens = np.asarray(tokens).reshape(-1)
        T = tokens.size
        if T > 1 and (inline or draw is not None or not self.verify_fits(T)):
            raise PymoeError(f"backend 'cuda': a verify step of {T} rows takes no cpu misses nor draw, and at most "
                             f"{self.verify_rows} rows")
        if not inline:
            self.sync_table(residency)
        if self.cache_pool is not None:
            self.cache_pool.before_any_read()
        self._steps += 1
        if self.recorder is not None and T == 1:
            self.recorder.begin()
        row = int(p0 if row is None else row)
        if not (0 <= row and row + T <= self.n_ctx and 0 <= p0 and p0 + T <= self.n_ctx):
            raise PymoeError(f"backend 'cuda': position {p0} (KV row {row}) outside the device's {self.n_ctx}")
        self._step = {"p0": int(p0), "row": row, "inline": bool(inline), "draw": draw is not None, "T": T}
        self._arena_top = 0
        if T > 1:  # a verify step: [position, KV row, T token ids] up in one copy
            v_at = self._sb["v_at"]
            self._at = {"position": v_at[0:1], "row": v_at[1:2], "token": v_at[2:2 + T]}
            self._bufs = self._verify_buffers(T)
            data = np.concatenate([[p0, row], tokens]).astype(np.int32)
            shaped(v_at, (2 + T,)).copy_to_device(data, stream=self.compute)
            self.counts.copy("verify token ids and position to device", data.nbytes)
            return self._at["token"]
        self._at, self._bufs = self._at_plain, self._plain
        at = np.array([tokens[0], p0, row], np.int32)  # [token, position, KV row]
        if draw is None:
            shaped(self._sb["at"], (3,)).copy_to_device(at, stream=self.compute)
            self.counts.copy("token id and position to device", at.nbytes)
        else:  # [token, position, KV row, 0, draw_record] (AT_WORDS)
            from pymoe.cuda_kernels.sample import check_draw, draw_record

            check_draw(draw.temperature, draw.top_k, draw.u, self._cfg.n_vocab)
            at = np.concatenate([at, [0], draw_record(draw.temperature, draw.top_k, draw.top_p, draw.min_p,
                                                      draw.u)]).astype(np.int32)
            self._sb["at"].copy_to_device(at, stream=self.compute)
            self.counts.copy("token id, position and draw to device", at.nbytes)
        if self.graphs is not None and not inline:  # the step's launches: one CUDA graph (cuda_graphs.py)
            self.graphs.begin()
        return self._at["token"]

    def keep_on_device(self, vectors: list) -> None:
        """Upload these small float32 vectors now (a device step's norm weights), not in the first step."""
        for v in vectors:
            self._vec(v)

    def sync_table(self, residency) -> None:
        """Upload the rows of the residency table that changed since the last step (promotions, evictions, a
        prefill's placements); residency: the cache's [L, E] -> slot or -1 (None: no pool)."""
        if residency is None or not self.step_ready():
            return
        c = self._cfg
        rows = np.asarray(residency[c.moe_layers.start:c.moe_layers.stop], np.int32)  # [n_moe, E]
        E = rows.shape[1]
        for m in np.flatnonzero((rows != self._table_host).any(axis=1)):
            row = rows[m].copy()
            shaped(self._sb["table"].reshape(-1)[m * E:], (E,)).copy_to_device(row, stream=self.compute)
            self.counts.copy("residency table to device", row.nbytes)
            self._table_host[m] = row

    def embed(self, w: "DeviceWeight", tokens):
        """The residual stream of the step: row tokens[0] of the embedding's raw rows w, decoded on the device."""
        self._res, self._hn = self._bufs["res"], self._bufs["hn"]
        self._launch("embed", w.raw, w.qtype, tokens, self._res, self.compute)
        return self._res

    def moe_on_device(self, layer: int, logits, x, k: int, norm_topk: bool, scale: float, expert_types: dict,
                      shared: Optional[dict] = None, gating: str = "softmax", expert_bias=None, router_bias=None,
                      ffn=None, groups=(1, 1)):
        """Route (softmax top-K, or gating "sigmoid": sigmoid top-K chosen with `expert_bias`, engine/moe.py) and
        run the routed experts of one MoE layer on the device: logits [1, E], x [1, D] (device) -> (y [1, D], ids
        int32 [1, K], weights [1, K]), all device arrays. Each expert is read from the slot the residency table
        names, or from the mapped file over PCIe. shared: the layer's shared expert (gate/up/down weights, and
        qwen2moe's gate vector `gate_inp`), added after the routed ones as engine/moe.py does:
        y += sigmoid(x . gate_inp) * down(silu(gate x) * up x). gpt-oss: gating "softmax_weight" with `router_bias`
        added to the logits, and `ffn` (reference.ExpertFFN: the experts' biases and clamped SwiGLU). groups:
        (expert groups, groups used), DeepSeek's group-limited choice when the first is > 1."""
        ids, w = self.route_on_device(layer, logits, k, norm_topk, scale, gating, expert_bias, router_bias, groups)
        E, m = self._cfg.n_expert, layer - self._cfg.moe_layers.start
        y = self._routed(layer, shaped(self._sb["table"].reshape(-1)[m * E:], (E,)), expert_types, ids, w, x, ffn)
        return self._add_shared(y, x, shared), ids, w

    def route_on_device(self, layer: int, logits, k: int, norm_topk: bool, scale: float, gating: str = "softmax",
                        expert_bias=None, router_bias=None, groups=(1, 1)) -> tuple:
        """The router's top-K of one MoE layer on the device -> (ids int32 [1, K], weights [1, K]), device arrays
        (the ids in the buffer that comes back at the step's end)."""
        K = self._moe[0]
        m = layer - self._cfg.moe_layers.start
        if self._batch is not None:  # B rows: the layer's [B, K] in the batch's buffers (`begin_batch`)
            ids, w = self._batch["ids"][m], self._batch["w"][m]
        else:
            T = self._step["T"]  # (1, or a verify step's rows: [T, K] each)
            ids = shaped(self._bufs["back"][T + m * T * K:], (T, k))
            w = shaped(self._bufs["rw"][m * T * K:], (T, k))
        if groups[0] > 1:  # DeepSeek: the top K within the best groups (cuda_kernels/route_groups.py)
            bias = None if expert_bias is None else self._vec(expert_bias)
            self._launch("route_groups", logits, k, bias, gating == "softmax", int(groups[0]), int(groups[1]),
                         norm_topk, ids, w, float(scale), self.compute)
        elif gating == "sigmoid":
            bias = None if expert_bias is None else self._vec(expert_bias)
            self._launch("route_sigmoid", logits, k, bias, norm_topk, ids, w, float(scale), self.compute)
        elif gating == "softmax_weight":  # gpt-oss: the K largest of logits + router bias, softmaxed among them
            bias = None if router_bias is None else self._vec(router_bias)
            self._launch("route_softmax_weight", logits, bias, k, ids, w, self.compute)
        else:
            self._launch("route_softmax", logits, k, norm_topk, ids, w, float(scale), self.compute)
        return ids, w

    def _routed(self, layer: int, table, expert_types: dict, ids, w, x, ffn=None):
        """The routed experts' kernels with `table` (int32 [E]: slot, -1 the mapped file, -2 left out) -> y; ffn
        (gpt-oss): the kernels with the experts' biases and clamped SwiGLU."""
        K, D, F = self._moe
        m = layer - self._cfg.moe_layers.start
        E, sb = self._cfg.n_expert, self._sb
        slots = self.cache_pool.bytes if self.cache_pool is not None else self._no_slots
        offsets = shaped(sb["offsets"].reshape(-1)[m * E * 3:], (E, 3))
        part_off = shaped(sb["part_off"].reshape(-1)[m * 3:], (3,))
        row_bytes = shaped(sb["row_bytes"].reshape(-1)[m * 3:], (3,))
        Y, H = ((self._bufs["y"], self._bufs["h"]) if self._batch is None
                else (self._batch["y"], self._batch["h"]))
        args = (slots, self._host_file, table, offsets, part_off, row_bytes, expert_types, (D, F), ids, w, x, Y, H)
        if ffn is None:
            self._launch("routed_experts", *args, self.compute)
        else:
            biases = tuple(self._vec(ffn.bias[p]) for p in ("gate", "up", "down"))  # [E, F], [E, F], [E, D]
            self._launch("routed_experts_oai", *args, biases, self.compute)
        return Y

    def _add_shared(self, y, x, shared: Optional[dict]):
        if shared:
            out = self.mlp_on_device(shared, x)  # [1, D]
            if "gate_inp" in shared:
                self._launch("sigmoid_gate", out, x, self._vec(shared["gate_inp"]), self.compute)
            self._launch("add", y, out, self.compute)
        return y

    def routing_to_host(self, ids, w, x) -> tuple:
        """A device step whose cache may send misses to the CPU: this layer's routing ids and weights and its
        input row come to the host now (one synchronisation) -> (ids int [1, K], w [1, K], x [1, D]), host."""
        if self.graphs is not None:
            self.graphs.flush()
        out = [a.copy_to_host(stream=self.compute) for a in (ids, w, x)]
        self.compute.synchronize()
        for a, what in zip(out, ("routing ids to host (cpu misses)", "routing weights to host (cpu misses)",
                                 "expert input to host (cpu misses)")):
            self.counts.copy(what, a.nbytes)
        self.counts.sync()
        return out[0].astype(np.int64), out[1], out[2]

    def experts_as_served(self, layer: int, experts: dict, expert_types: dict, x, x_host, ids, w, ids_host, w_host,
                          shared: Optional[dict] = None, ffn=None):
        """The routed experts of one layer as the expert cache just served them (a lookup made inside the step):
        experts {e: ExpertBytes}, each a slot, spill or cpu. This call's table row (slot, -1 spill, -2 cpu) goes to
        the device and the kernels run the slot and spill experts while the CPU computes the cpu ones on x_host,
        in k order, weighted; their sum is added on the device -> y [1, D] (device). ffn: as `moe_on_device`."""
        E, sb = self._cfg.n_expert, self._sb
        row = np.full(E, -2, np.int32)
        slots = []
        for e, ex in experts.items():
            if ex.where == "slot":
                row[e] = ex.slot
                slots.append(ex.slot)
                self.cache_pool.before_read(ex.slot)
            elif ex.where != "cpu":  # spill: read over PCIe
                row[e] = -1
                self._count_spill(ex, 1)
        table = sb["table_now"]
        table.copy_to_device(row, stream=self.compute)
        self.counts.copy("served table row to device (cpu misses)", row.nbytes)
        y = self._routed(layer, table, expert_types, ids, w, x, ffn)
        done = self.cuda.event()
        done.record(self.compute)
        for slot in slots:
            self.cache_pool.after_read(slot, done)
        y_cpu, any_cpu = np.zeros((1, x_host.shape[1]), np.float32), False  # [1, D]
        for k, e in enumerate(ids_host[0].tolist()):  # meanwhile, on the CPU
            if experts[e].where == "cpu":
                y_cpu += w_host[0, k] * swiglu_expert(self.cpu, experts[e], expert_types, x_host, ffn)
                any_cpu = True
        if any_cpu:
            dev = sb["y_cpu"]
            dev.copy_to_device(y_cpu, stream=self.compute)
            self.counts.copy("cpu experts' output to device", y_cpu.nbytes)
            self._launch("add", y, dev, self.compute)
        return self._add_shared(y, x, shared)

    def mla_on_device(self, kv) -> bool:
        """engine/mla.mla_block runs `mla_device` (T rows on the device, one copy up and one back) over kv: this
        backend's device KV cache, with the device step on (PYMOE_DEVICE_STEP=0: the host form, version 2's)."""
        return self.device_step and isinstance(kv, DeviceKVCache)

    def _positions(self, p0: int, T: int, rope: tuple) -> tuple:
        """(cos, sin, position) a MLA kernel reads for T rows at KV row p0: in a device step the whole context's
        tables and the position in `at`; else this forward's tables [T, R / 2] (uploaded once per forward) from 0."""
        if self._in_step(p0, T):
            return self._sb["cos"], self._sb["sin"], self._at["position"]
        return (*self._rope_tables(*rope), 0)

    def mla_kv_write(self, kv, layer: int, p0: int, ckv, w: np.ndarray, eps: float, neox: bool, rope: tuple) -> None:
        """engine/mla.mla_device's compressed KV rows: ckv [T, C + R] (device) -> kv's rows p0.. of `layer` =
        [rmsnorm(ckv[:C]) * w | rope(ckv[C:])] (cuda_kernels/mla.py; in a device step row and position from `at`)."""
        cos, sin, pos = self._positions(p0, ckv.shape[0], rope)
        row = self._at["row"] if self._in_step(p0, ckv.shape[0]) else p0
        self._launch("mla_kv_row", ckv, self._vec(w), eps, cos, sin, pos, neox, kv.k[kv.rows[layer]], row,
                     self.compute)

    def mla_query(self, q, k_b: DeviceWeight, scale: float, neox: bool, p0: int, rope: tuple):
        """engine/mla.mla_device's absorbed queries: q [T, H * (N + R)] (device) at KV rows p0.., k_b attn_k_b's
        stored rows [H * C, S] ([H, C, N]) -> Q [T, H, C + R] = scale * [q_nope @ k_b[h].T | rope(q_pe)], in the
        arena (cuda_kernels/mla.py mla_query_q: k_b read in its stored type)."""
        H, C, N = k_b.shape
        T = q.shape[0]
        R = q.shape[1] // H - N
        Q = self._arena((T, H, C + R))
        cos, sin, pos = self._positions(p0, T, rope)
        self._launch("mla_query_q", self._reshaped(q, (T, H, N + R)), k_b.raw, k_b.qtype, cos, sin, pos, neox,
                     float(scale), Q, self.compute)
        return Q

    def mla_value(self, a, v_b: DeviceWeight):
        """The value up-projection: a [T, H * C] (device), v_b attn_v_b's stored rows [H * V, S] ([H, V, C]) ->
        [T, H * V], in the arena (cuda_kernels/mla.py mla_value_q)."""
        H, V, C = v_b.shape
        T = a.shape[0]
        out = self._arena((T, H * V))
        self._launch("mla_value_q", self._reshaped(a, (T, H, C)), v_b.raw, v_b.qtype,
                     self._reshaped(out, (T, H, V)), self.compute)
        return out

    def mlp_on_device(self, w: dict, x):
        """down(silu(gate x) * up x) of a device step's x [1, D] with dense weights w {gate, up, down} (a shared
        expert, a dense layer's MLP: engine/moe.swiglu_mlp) -> [1, D], in the arena."""
        g, u = self.linear(w["gate"], x), self.linear(w["up"], x)  # [1, F] each
        self._launch("swiglu", g, u, self.compute)
        return self.linear(w["down"], g)

    def end_step(self, logits, hidden=None):
        """Greedy argmax on the device (and the step's random draw, if begin_step had one), then the step's one copy
        back: the token id, every MoE layer's routing ids (and the drawn id) -> (token, ids int32 [n_moe, K],
        StepLogits). Counts the PCIe reads of the experts the table sent to the mapped file. A verify step (T rows):
        the argmax of each row and the routing ids [n_moe, T K] (row t's K ids at t K ..), logits [T, V]. hidden:
        the step's normed last hidden states [T, D] (device), copied back before the ids, in the same
        synchronisation (an MTP drafter reads them: engine/mtp.py), as the StepLogits' `hidden` (host)."""
        K = self._moe[0]
        T = self._step["T"]
        back = self._bufs["back"]
        n = T * (1 + len(self._cfg.moe_layers) * K)  # the argmax ids and the routing ids; the drawn id after them
        self._launch("argmax", logits, shaped(back, (T,)), self.compute)
        drawn = self._step["draw"]
        if drawn:  # the sampler's draw, into the word after the routing ids
            self._launch("sample", logits, *self._draw_at, back[n:n + 1], self.compute)
        if self.recorder is not None and T == 1:
            self.recorder.end()
        if self.graphs is not None:  # the step's launches, held until now: a graph's replay (or run directly)
            self.graphs.run()
        if self.cache_pool is not None:  # the step's kernels may have read any slot: copies into slots wait for them
            done = self.cuda.event()
            done.record(self.compute)
            self.cache_pool.step_read = done
        h_host = None
        if hidden is not None:  # on the stream before the ids' copy: on the host once `_get` has synchronised
            h_host = hidden.copy_to_host(stream=self.compute)
            self.counts.copy("hidden states to host (mtp)", h_host.nbytes)
        if drawn:
            host = self._get(shaped(back, (n + 1,)), "token, routing and drawn ids to host")
        elif T > 1:
            host = self._get(shaped(back, (n,)), "verify argmax and routing ids to host")
        else:
            host = self._get(shaped(back, (n,)), "token and routing ids to host")
        ids = host[T:n].reshape(-1, T * K)  # [n_moe, T K]
        for m in range(0 if self._step["inline"] else ids.shape[0]):  # (inline: counted as served)
            for e in np.unique(ids[m]):
                if self._table_host[m, e] < 0:
                    self.counts.copy("expert spill reads over PCIe", int(self._expert_nbytes[m]))
        self._step, self._res = None, None
        self._at, self._bufs = self._at_plain, self._plain
        out = StepLogits(self, logits, int(host[0]) if T == 1 else None, self._steps, tokens=host[:T])
        out.drawn_token = int(host[n]) if drawn else None
        out.hidden = h_host
        return int(host[0]), ids, out

    def sample_step(self, logits, temperature: float, top_k: int, top_p: float, min_p: float, u: float) -> int:
        """A random draw from a finished step's logits [1, V] (device) for the uniform u, when the step was not handed
        it (begin_step's `draw`): its settings up (36 bytes), one launch, the token id back (4 bytes, one
        synchronisation after the step's own)."""
        from pymoe.cuda_kernels.sample import check_draw, draw_record

        check_draw(temperature, top_k, u, self._cfg.n_vocab)
        rec = draw_record(temperature, top_k, top_p, min_p, u)
        shaped(self._sb["at"][4:], rec.shape).copy_to_device(rec, stream=self.compute)
        self.counts.copy("draw to device", rec.nbytes)
        out = self._sb["back"][-1:]
        self._launch("sample", logits, *self._draw_at, out, self.compute)
        return int(self._get(out, "sampled token id to host")[0])

    # --- the batched device step: B sequences' decode tokens in one step (engine/device_batch.py) ----------------
    # The version 3 step over B rows at once: one copy up (B token ids, RoPE positions, KV rows, sequence ids, and
    # each row's draw), the same kernels on [B, ..] arrays (embedding, norms, products, routers, routed experts,
    # argmax), RoPE and the KV write per row (cuda_kernels/batch_step.py), attention over each row's own cache in one
    # launch (cuda_kernels/ragged_attention.py), and one copy back (B token ids, every MoE layer's [B, K] routing
    # ids, the drawn ids): one host synchronisation for the B sequences.
    def _prepare_batch(self, n: int) -> None:
        """The batched step's buffers for up to n rows: `at` int32 [4 n + BATCH_DRAW n] (token ids, positions, KV rows,
        sequence ids, then a draw record per row at an even offset), `back` int32 [2 n + n_moe n K] (argmax, routing
        ids layer by layer [B, K], drawn ids), the routing weights, the residual stream, its normed copy, the MoE
        output [n, D] and hidden rows [n K, F]."""
        K, D, F = self._moe
        n_moe = len(self._cfg.moe_layers)
        alloc = self.mem.alloc
        self._bb = {"at": alloc((n * (4 + BATCH_DRAW),), np.int32, "activations"),
                    "back": alloc((n * (2 + n_moe * K),), np.int32, "activations"),
                    "rw": alloc((n * n_moe * K,), np.float32, "activations"),
                    "res": alloc((n, D), np.float32, "activations"), "hn": alloc((n, D), np.float32, "activations"),
                    "y": alloc((n, D), np.float32, "activations"), "h": alloc((n * K * F,), np.float32, "activations")}
        self.batch_max, self._batch_views = n, {}

    def _views(self, B: int) -> dict:
        """Views of the batch buffers for B rows (the same views every step of B rows: a CUDA graph's bucket)."""
        if B in self._batch_views:
            return self._batch_views[B]
        from pymoe.cuda_kernels.sample import draw_views

        K, D, F = self._moe
        n_moe, bb = len(self._cfg.moe_layers), self._bb
        at, back = bb["at"], bb["back"]
        n_ids = n_moe * B * K
        v = {"tokens": at[0:B], "pos": at[B:2 * B], "rows": at[2 * B:3 * B], "seqs": at[3 * B:4 * B],
             "draws": [draw_views(at, 4 * B + BATCH_DRAW * b) for b in range(B)],
             "argmax": back[0:B], "drawn": back[B + n_ids:2 * B + n_ids],
             "ids": [shaped(back[B + m * B * K:], (B, K)) for m in range(n_moe)],
             "w": [shaped(bb["rw"][m * B * K:], (B, K)) for m in range(n_moe)],
             "res": shaped(bb["res"].reshape(-1), (B, D)), "hn": shaped(bb["hn"].reshape(-1), (B, D)),
             "y": shaped(bb["y"].reshape(-1), (B, D)), "h": shaped(bb["h"], (B * K, F)), "B": B}
        self._batch_views[B] = v
        return v

    def batch_ready(self, B: int) -> bool:
        """A batched step of B rows fits the buffers: 2 <= B <= batch_max, and the arena holds B rows of a step's
        arrays (the attention block's, the router's logits, the shared expert's, the logits)."""
        if not (self.step_ready() and self._bb is not None and 2 <= B <= self.batch_max):
            return False
        c = self._cfg
        H, G, Dh, Dv, D = c.n_head, c.n_head_kv, c.head_dim, c.head_dim_v, c.n_embd
        per_row = (H * Dh + G * Dh + G * Dv + H * Dv + D + c.n_expert + 2 * max(c.n_ff_shexp or 0, c.n_ff) + D
                   + c.n_vocab)
        return B * per_row <= self.scratch["arena"].shape[0]

    def begin_batch(self, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray, kvs: list,
                    residency: Optional[np.ndarray], draws: list):
        """Start a device step of B sequences' decode tokens (kvs: their device KV caches, distinct; row b: token
        tokens[b] at RoPE position positions[b], KV row rows[b]): the residency table brought up to date, the copies
        in flight waited for, then one copy up of the row table (and each row's draw: engine/sampler.DeviceDraw or
        None) -> the token ids, int32 [B] on the device."""
        B = len(kvs)
        if not self.batch_ready(B):
            raise PymoeError(f"backend 'cuda': a batched step of {B} rows (the buffers hold 2..{self.batch_max})")
        seqs = [getattr(kv, "seq", -1) for kv in kvs]
        if min(seqs) < 0 or len(set(seqs)) != B:
            raise PymoeError("backend 'cuda': a batched step needs B distinct device KV caches")
        positions, rows = np.asarray(positions, np.int64), np.asarray(rows, np.int64)
        if positions.min() < 0 or positions.max() >= self.n_ctx or rows.min() < 0 or rows.max() >= self.n_ctx:
            raise PymoeError(f"backend 'cuda': a position or KV row outside the device's {self.n_ctx}")
        self.sync_table(residency)
        if self.cache_pool is not None:
            self.cache_pool.before_any_read()
        self._steps += 1
        if self.recorder is not None:
            self.recorder.begin()
        drawn = [d is not None for d in draws]
        self._step = {"p0": None, "row": None, "inline": False, "draw": any(drawn), "drawn": drawn, "batch": B}
        self._batch = v = self._views(B)
        self._arena_top = 0
        table = np.concatenate([np.asarray(tokens, np.int64).reshape(-1), positions, rows, seqs]).astype(np.int32)
        if not any(drawn):
            shaped(self._bb["at"], table.shape).copy_to_device(table, stream=self.compute)
            self.counts.copy("token ids, positions and sequence table to device", table.nbytes)
        else:  # each row's draw record after the table (rows without one: zeros, not read)
            from pymoe.cuda_kernels.sample import check_draw, draw_record

            recs = np.zeros((B, BATCH_DRAW), np.int32)
            for b, d in enumerate(draws):
                if d is not None:
                    check_draw(d.temperature, d.top_k, d.u, self._cfg.n_vocab)
                    rec = draw_record(d.temperature, d.top_k, d.top_p, d.min_p, d.u)  # [DRAW_WORDS]
                    recs[b, :rec.size] = rec
            table = np.concatenate([table, recs.reshape(-1)])
            shaped(self._bb["at"], table.shape).copy_to_device(table, stream=self.compute)
            self.counts.copy("token ids, positions, sequence table and draws to device", table.nbytes)
        if self.graphs is not None:  # the batch's launches: one CUDA graph per batch size (cuda_graphs.py)
            self.graphs.begin()
        return v["tokens"]

    def embed_batch(self, w: "DeviceWeight", tokens):
        """The batch's residual stream [B, D]: rows tokens[b] of the embedding's raw rows w, decoded on the device."""
        self._res, self._hn = self._batch["res"], self._batch["hn"]
        self._launch("embed", w.raw, w.qtype, tokens, self._res, self.compute)
        return self._res

    def rope_batch(self, x, neox: bool):
        """x [B, heads, Dh] (device) rotated in place, row b at its position (the step's tables, the positions read
        on the device)."""
        self._launch("rope_rows", x, self._sb["cos"], self._sb["sin"], neox, self._batch["pos"], self.compute)
        return x

    def _layer_planes(self, layer: int) -> tuple:
        """One layer's K and V caches of every sequence: kv_pool[:, row] -> [S, n_ctx, G, Dh], [S, n_ctx, G, Dv]."""
        r = self._kvs[0].rows[layer]
        return self.kv_pool[0][:, r], self.kv_pool[1][:, r]

    def kv_write_batch(self, layer: int, k, v) -> None:
        """k [B, G, Dh], v [B, G, Dv] (device): row b into its sequence's cache at its KV row."""
        ka, va = self._layer_planes(layer)
        self._launch("kv_store_rows", k, v, ka, va, self._batch["seqs"], self._batch["rows"], self.compute)

    def attention_batch(self, layer: int, q, window: int = 0, sinks=None):
        """q [B, H, Dh] (device) -> [B, H * Dv] (arena): row b over its sequence's cache, keys 0..its KV row (its own
        just written), in one launch (ragged attention; gpt-oss's window and sinks included)."""
        ka, va = self._layer_planes(layer)
        B, H, _ = q.shape
        Dv = va.shape[3]
        o = self._arena((B, H * Dv))
        dsinks = None if sinks is None else self._vec(sinks)
        self._launch("ragged_attention", q, ka, va, self._batch["seqs"], self._batch["rows"], int(window), dsinks,
                     self._reshaped(o, (B, H, Dv)), self.compute)
        return o

    def end_batch(self, logits) -> tuple:
        """Greedy argmax of each row (and each handed draw) on the device, then the one copy back -> (tokens int
        [B], ids int32 [B, n_moe, K], [StepLogits per row]). Counts each row's PCIe reads as its own step would."""
        K = self._moe[0]
        v, B = self._batch, self._batch["B"]
        n_moe = len(self._cfg.moe_layers)
        self._launch("argmax", logits, v["argmax"], self.compute)
        drawn = self._step["drawn"]
        for b in range(B):
            if drawn[b]:
                self._launch("sample", logits[b:b + 1], *v["draws"][b], v["drawn"][b:b + 1], self.compute)
        if self.recorder is not None:
            self.recorder.end()
        if self.graphs is not None:
            self.graphs.run()
        if self.cache_pool is not None:  # the step's kernels may have read any slot: copies into slots wait for them
            done = self.cuda.event()
            done.record(self.compute)
            self.cache_pool.step_read = done
        n = B * (1 + n_moe * K) + (B if any(drawn) else 0)
        what = "token, routing and drawn ids to host" if any(drawn) else "token and routing ids to host"
        host = self._get(self._bb["back"][:n], what + " (batch)")
        tokens = host[:B]
        ids = host[B:B * (1 + n_moe * K)].reshape(n_moe, B, K).transpose(1, 0, 2)  # [B, n_moe, K]
        for b in range(B):
            for m in range(n_moe):
                for e in np.unique(ids[b, m]):
                    if self._table_host[m, e] < 0:
                        self.counts.copy("expert spill reads over PCIe", int(self._expert_nbytes[m]))
        self._step, self._res, self._batch = None, None, None
        outs = []
        for b in range(B):
            out = StepLogits(self, logits[b:b + 1], int(tokens[b]), self._steps)
            out.drawn_token = int(host[B * (1 + n_moe * K) + b]) if drawn[b] else None
            outs.append(out)
        return tokens.astype(np.int64), ids, outs

    def new_kv(self, n_ctx: int):
        """A free device KV cache for a new sequence (one not lent to a sequence still alive), if there is one and it
        is big enough; else None (the caller then uses a host KV cache, and attention runs on the CPU for that
        sequence)."""
        import weakref

        if n_ctx > self.n_ctx:
            return None
        for i, (held, own) in enumerate(zip(self._kv_holders, self._kvs)):
            if held is None or held() is None:
                kv = DeviceKVCache(own.k, own.v, n_ctx, own.rows, own.states, self, own.snapshot)
                kv.seq = i
                self._kv_holders[i] = weakref.ref(kv)
                return kv
        return None

    def memory_line(self) -> str:
        parts = ", ".join(f"{what} {n / MiB:.1f} MiB" for what, n in self.mem.by_what.items())
        caches = len(self._kvs) if self._kvs and self._kvs[0].rows else 0
        held = (f"{caches} KV caches, one per sequence, each of" if caches > 1 else "the KV cache holds")
        line = (f"device memory: {self.free_at_start / 2**30:.2f} GiB free at start; {parts} ({held} "
                f"{self.n_ctx} positions in float32)")
        if caches < self.kv_wanted:  # the server's other slots keep host KV caches (attention on the CPU there)
            line += (f"\ndevice KV caches: {caches} of the {self.kv_wanted} sequences asked for fit beside the "
                     f"expert slots ({self.sequence_bytes(self.n_ctx) / MiB:.1f} MiB each); the others keep host "
                     "KV caches and decode with attention on the CPU (version 2)")
        return line

    def free_for_cache(self) -> int:
        """Device bytes free for the expert slots now: the budget left after weights and activations, plus the
        reserve (which `plan.slots_for` subtracts again, as it prints it)."""
        return self.mem.limit - self.mem.used + self.reserve

    def new_pool(self, n_slots: int, slot_bytes: int, layouts: list) -> DevicePool:
        return DevicePool(self, n_slots, slot_bytes, layouts)

    def share_cpu(self) -> None:
        """The CPU side's team (its share of the misses, host attention): backends/threads.py."""
        self.cpu.share_cpu()
        self.threads = self.cpu.threads

    def warm_up(self, qtypes, progress: bool = False) -> None:
        """Compile the kernels of these types now (one launch on a 1-row matrix each), not in the first request."""
        from tqdm import tqdm

        self.cpu.warm_up(qtypes)
        for qtype in tqdm(sorted(set(qtypes), key=lambda q: q.name), desc="CUDA kernels", disable=None if progress else True,
                          leave=False):
            fmt = quant.get_format(qtype)
            w = self.cuda.to_device(np.zeros((1, fmt.type_size), np.uint8))
            x = self.cuda.to_device(np.zeros((1, fmt.block_size), np.float32))
            self.counts.copy("kernel warm-up to device", w.nbytes + x.nbytes)
            self._launch("matmul", w, qtype, x, self.cuda.device_array((1, 1), np.float32), 0)
        self.cuda.synchronize()
        self.counts.sync()

    def warm_up_experts(self, expert_types: dict) -> None:
        """Compile the expert-block kernels of one gate/up/down type triple: one launch on the smallest expert of
        zeros those types allow (D one block of gate/up, F one block of down: 1 x 1 for F32, 256 x 256 for K-quants;
        a launch is D + F thread blocks, and the CUDA simulator runs each one as 32 Python threads)."""
        fmt = {p: quant.get_format(expert_types[p]) for p in EXPERT_PROJ}
        D = max(fmt["gate"].block_size, fmt["up"].block_size)  # block sizes are powers of two: a multiple of both
        F = fmt["down"].block_size
        rows = {"gate": (F, fmt["gate"].row_bytes(D)), "up": (F, fmt["up"].row_bytes(D)),
                "down": (D, fmt["down"].row_bytes(F))}
        dev = {p: self.cuda.to_device(np.zeros(shape, np.uint8)) for p, shape in rows.items()}
        X, Y = self.cuda.to_device(np.zeros((1, D), np.float32)), self.cuda.to_device(np.zeros((1, D), np.float32))
        wt, H = self.cuda.to_device(np.zeros(1, np.float32)), self.cuda.to_device(np.zeros((1, F), np.float32))
        self.counts.copy("kernel warm-up to device", sum(a.nbytes for a in (*dev.values(), X, Y, wt, H)))
        self._launch("expert_block", dev["gate"], dev["up"], dev["down"], expert_types, X, wt, Y, H, 0)
        self.cuda.synchronize()
        self.counts.sync()

    # --- weights -----------------------------------------------------------------------------------------------
    def dense(self, t: Tensor) -> DeviceWeight:
        return DeviceWeight(t.qtype, self.mem.upload(t.rows(), "dense weights"), t.shape, carries(t.name))

    def vector(self, t: Tensor) -> np.ndarray:
        return t.floats().reshape(-1)  # host: layer norms run there; `_vec` uploads the q/k norms and biases

    # --- compute -----------------------------------------------------------------------------------------------
    # Every launch, host<->device copy and host synchronisation of a forward goes through `_launch`, `_put`,
    # `_get` (or names its bytes to self.counts where it copies): backends/device_counts.py.
    def _launch(self, op: str, *args):
        """Run kernel-set operation `op` (LAUNCHES[op] kernel launches) on the compute stream's arguments."""
        self.counts.launch(LAUNCHES[op])
        if self.recorder is not None:
            self.recorder.launch(op, args)
        if self._step is not None and self.graphs is not None and \
                self.graphs.defer(op, args, lambda: getattr(self.k, op)(*args)):
            return None  # held for the step's graph (cuda_graphs.py)
        return getattr(self.k, op)(*args)

    def _put(self, name: str, host: np.ndarray, what: str):
        dev = shaped(self.scratch[name], host.shape)
        data = np.ascontiguousarray(host, dtype=self.scratch[name].dtype)
        dev.copy_to_device(data, stream=self.compute)
        self.counts.copy(what, data.nbytes)
        return dev

    def _get(self, dev, what: str) -> np.ndarray:
        """dev's bytes on the host, once the compute stream has run up to here (one host synchronisation)."""
        if self.graphs is not None:  # launches held for a graph run first (cuda_graphs.py `flush`)
            self.graphs.flush()
        out = dev.copy_to_host(stream=self.compute)
        self.compute.synchronize()  # the copy is asynchronous on the stream: its bytes are there only now
        self.counts.copy(what, out.nbytes)
        self.counts.sync()
        return out

    def _check_tokens(self, T: int) -> None:
        if T > self.chunk:
            raise PymoeError(f"backend 'cuda': {T} tokens in one call, the buffers hold {self.chunk} (--chunk)")

    # --- where arrays live ------------------------------------------------------------------------------------------
    # A primitive given a host array answers with a host array (the residual stream, the router, the output
    # projection: version 2 keeps them on the host); given a device array, with a device array. The attention block
    # (engine/attention.py) moves its input to the device once (`to_device`) and its output back once (`to_host`):
    # in between, projections, biases, norms, RoPE, the KV write and attention all run on the device.
    def to_device(self, x: np.ndarray):
        """x float32 [T, C] (host) -> the same on the device, at the start of scratch["arena"] (the arena is reused
        from its start: the previous block's device arrays are dead by now). A device array (a device step's
        normed residual) stays where it is; the arena is reset all the same."""
        if not isinstance(x, np.ndarray):
            self._arena_top = 0
            return x
        self._step = None  # a host input: not a device step (nor the rest of one that failed)
        self._check_tokens(x.shape[0])
        self._arena_top = 0
        dev = self._arena(x.shape)
        data = np.ascontiguousarray(x, dtype=np.float32)
        dev.copy_to_device(data, stream=self.compute)
        self.counts.copy("residual to device (attention block)", data.nbytes)
        return dev

    def to_host(self, a) -> np.ndarray:
        """-> a host array; during a device step a device array stays there (the residual add is on the device)."""
        if isinstance(a, np.ndarray) or self._step is not None:
            return a
        return self._get(a, "attention block to host")

    def _arena(self, shape: tuple):
        """A float32 device array of `shape` from scratch["arena"] (a bump allocator, reset by to_device)."""
        n = math.prod(shape)
        buf = self.scratch["arena"]
        if self._arena_top + n > buf.shape[0]:
            raise PymoeError(f"backend 'cuda': the attention block's arena ({buf.shape[0]} floats) is full")
        dev = shaped(buf[self._arena_top:], shape)
        self._arena_top += n
        return dev

    @staticmethod
    def _reshaped(a, shape: tuple):
        r = a.reshape(shape)
        return r if getattr(r, "__cuda_ndarray__", False) else type(a)(r)  # the simulator returns an ndarray

    # --- arithmetic -----------------------------------------------------------------------------------------------
    def linear(self, w: DeviceWeight, x):
        if isinstance(x, np.ndarray):
            return self.linear_raw(w.raw, w.qtype, x, w.what)
        y = self._arena((x.shape[0], w.shape[0]))  # [T, R] on the device
        self._launch("matmul", w.raw, w.qtype, x, y, self.compute)
        return y

    def linear_raw(self, raw, qtype, x: np.ndarray, what: str = "experts one at a time") -> np.ndarray:
        """x float32 [T, C] (host) @ W.T, W device rows uint8 [R, row_bytes] -> float32 [T, R] (host). `what`:
        the name its bytes are counted under (`carries`; the default: _experts_with_ffn's products)."""
        T, R = x.shape[0], raw.shape[0]
        self._check_tokens(T)
        xd = self._put("x", x, f"{what}: input to device")  # [T, C]
        yd = shaped(self.scratch["y"], (T, R))  # [T, R]
        self._launch("matmul", raw, qtype, xd, yd, self.compute)
        return self._get(yd, f"{what}: output to host")

    def linear_many(self, ws: list, x) -> list:
        return [self.linear(w, x) for w in ws]

    def add(self, a, vec):
        """a [T, n] + vec [n] (a bias), or a + b [T, n] (a device step's residual add); on the device in place."""
        if isinstance(a, np.ndarray):
            return a + vec
        if not isinstance(vec, np.ndarray):
            self._launch("add", a, vec, self.compute)
            return a
        self._launch("add_bias", a, self._vec(vec), self.compute)
        return a

    def view(self, a, shape: tuple):
        return a.reshape(shape) if isinstance(a, np.ndarray) else self._reshaped(a, shape)

    def split_gate(self, qg, Dh: int) -> tuple:
        """Gated attention's q projection [T, H 2 Dh] (per head the query, then the gate) -> q, gate [T, H Dh]
        (reference.HostArrays.split_gate; on the device: two arena arrays)."""
        if isinstance(qg, np.ndarray):
            return self.cpu.split_gate(qg, Dh)
        T, n = qg.shape[0], qg.shape[1] // 2
        q, gate = self._arena((T, n)), self._arena((T, n))
        self._launch("split_gate", qg, q, gate, Dh, self.compute)
        return q, gate

    def gate_output(self, out, gate):
        """out [T, n] * sigmoid(gate [T, n]) (in place on the device)."""
        if isinstance(out, np.ndarray) and isinstance(gate, np.ndarray):
            return self.cpu.gate_output(out, gate)
        if isinstance(gate, np.ndarray) or isinstance(out, np.ndarray):  # (attention on the CPU: out on the host)
            return self.cpu.gate_output(self.to_host(out), self.to_host(gate))
        self._launch("gate_output", out, gate, self.compute)
        return out

    def gdn_step(self, kv, layer_i: int, cfg, w: dict, qkv, z, ba: list):
        """A device step's Gated DeltaNet core (engine/deltanet.py `gdn_block`): qkv [1, conv_dim], z [1, nv dv],
        ba [1, 2 nv] or beta, alpha [1, nv] (device) -> o [1, nv dv] (device, before ssm_out), advancing the layer's
        conv and recurrent state in kv's device copy (cuda_kernels/deltanet.py: conv_step, rule_step)."""
        st = kv.device_state(layer_i)
        conv_dim = qkv.shape[1]
        qkvc = self._arena((conv_dim,))
        self._launch("conv_step", self._reshaped(qkv, (conv_dim,)), st["conv"], self._vec(w["conv"]), qkvc,
                     self.compute)
        flat = [self._reshaped(m, (m.shape[1],)) for m in ba]
        b, a = (flat[0], flat[1]) if len(flat) == 2 else (flat[0], flat[0])
        o = self._arena((1, z.shape[1]))
        self._launch("rule_step", qkvc, self._reshaped(z, (z.shape[1],)), b, a, self._vec(w["dt"]), self._vec(w["a"]),
                     self._vec(w["norm"]), st["ssm"], self._reshaped(o, (z.shape[1],)), cfg.ssm_k_heads,
                     cfg.traits.gdn_tiled, cfg.rms_eps, self.compute)
        return o

    def gdn_on_device(self, kv) -> bool:
        """engine/deltanet.gdn_block runs `gdn_device` (T rows on the device, one copy up and one back) over kv: this
        backend's device KV cache with the device copy of the recurrent state (the device step on)."""
        return self.device_step and isinstance(kv, DeviceKVCache) and bool(kv.states)

    def gdn_chunk(self, kv, layer_i: int, cfg, w: dict, qkv, z, ba: list):
        """engine/deltanet.gdn_device's core for T tokens of one sequence: qkv [T, conv_dim], z [T, nv dv], ba
        [T, 2 nv] or beta, alpha [T, nv] (device) -> o [T, nv dv] (device, before ssm_out), advancing the layer's
        conv and recurrent state in kv's device copy (cuda_kernels/deltanet.py: conv_chunk, rule_chunk, one launch
        each for the T tokens)."""
        st = kv.device_state(layer_i)
        T, conv_dim = qkv.shape
        qkvc = self._arena((T, conv_dim))
        self._launch("conv_chunk", qkv, st["conv"], self._vec(w["conv"]), qkvc, self.compute)
        b, a = (ba[0], ba[1]) if len(ba) == 2 else (ba[0], ba[0])
        o = self._arena((T, z.shape[1]))
        self._launch("rule_chunk", qkvc, z, b, a, self._vec(w["dt"]), self._vec(w["a"]), self._vec(w["norm"]),
                     st["ssm"], o, cfg.ssm_k_heads, cfg.traits.gdn_tiled, cfg.rms_eps, self.compute)
        return o

    def state_to_device(self, kv) -> None:
        """A sequence's recurrent state, as a host-side forward (prefill) left it, to the device now, so that the
        decode steps that follow move no state."""
        if isinstance(kv, DeviceKVCache) and kv.states:
            kv.device_state(next(iter(kv.states)))

    def rmsnorm(self, x, w, eps):
        """On the host: the CPU backend's (the residual stream); on the device: in place, over the last axis."""
        if isinstance(x, np.ndarray):
            return self.cpu.rmsnorm(x, w, eps)
        if x is self._res:  # the residual stream of a device step: kept, the normed copy goes to `step hn`
            self._launch("rmsnorm", x, self._vec(w), eps, self._hn, self.compute)
            return self._hn
        shape = tuple(x.shape)  # (the simulator's shape object takes no negative index)
        rows = self._reshaped(x, (math.prod(shape[:-1]), shape[-1]))  # [N, n]
        self._launch("rmsnorm", rows, self._vec(w), eps, rows, self.compute)
        return x

    def rope(self, x, cos, sin, neox):
        """x [T, heads, Dh]; cos, sin [T, rope_dim / 2] (host, this forward's positions): on the device in place,
        the tables uploaded once per forward call (every layer's q and k share them)."""
        if isinstance(x, np.ndarray):
            return self.cpu.rope(x, cos, sin, neox)
        if self._step is not None:  # a device step: the whole context's tables are on the device already
            p0, (c_all, s_all) = self._step["p0"], self._rope_step
            T = x.shape[0]
            if np.array_equal(cos, c_all[p0:p0 + T]) and np.array_equal(sin, s_all[p0:p0 + T]):
                self._launch("rope", x, self._sb["cos"], self._sb["sin"], neox, self._at["position"], self.compute)
                return x
        self._launch("rope", x, *self._rope_tables(cos, sin), neox, 0, self.compute)
        return x

    def _rope_tables(self, cos: np.ndarray, sin: np.ndarray) -> tuple:
        """This forward's RoPE tables [T, rope_dim / 2] on the device: uploaded once per forward call (every layer's
        q and k share them)."""
        if self._rope_host is None or self._rope_host[0] is not cos:
            self._rope_host = (cos, sin)  # kept alive, so that `is` can recognise them
            for name, table in (("rope_cos", cos), ("rope_sin", sin)):
                data = np.ascontiguousarray(table, np.float32)
                shaped(self.scratch[name], table.shape).copy_to_device(data, stream=self.compute)
                self.counts.copy("RoPE tables to device", data.nbytes)
        return tuple(shaped(self.scratch[name], cos.shape) for name in ("rope_cos", "rope_sin"))

    def kv_write(self, kv, layer: int, p0: int, k, v) -> None:
        """k [T, G, Dh], v [T, G, Dv] into kv at positions p0..: a device copy into the device KV cache (in a device
        step, the `kv_store` kernel, which reads the row from `at`), or, for a host KV cache (a sequence without the
        device one), to the host."""
        T = k.shape[0]
        if isinstance(kv, DeviceKVCache) and self._in_step(p0, T) and v is not None:  # the row read on the device
            r = kv.rows[layer]
            self._launch("kv_store", k, v, kv.k[r], kv.v[r], self._at["row"], self.compute)
        elif isinstance(kv, DeviceKVCache):
            r = kv.rows[layer]
            if self.recorder is not None:
                self.recorder.launch("device copy", (kv.k[r, p0:p0 + T], k))
            kv.k[r, p0:p0 + T].copy_to_device(k, stream=self.compute)  # device to device: no PCIe, not counted
            if v is not None:  # (MLA: V is part of the K row)
                kv.v[r, p0:p0 + T].copy_to_device(v, stream=self.compute)
            for a in (k, v):
                if isinstance(a, np.ndarray):  # (the attention block's k and v are device arrays)
                    self.counts.copy("KV to device", a.nbytes)
        else:
            kv.write(layer, p0, self.to_host(k), None if v is None else self.to_host(v))

    def _in_step(self, p0, T: int) -> bool:
        """The rows of the device step under way (one token, or a verify step's T) at its KV row: their position
        and row are read from `at` on the device."""
        return self._step is not None and T == self._step["T"] and p0 == self._step["row"]

    def kv_read(self, kv, layer: int, S: int) -> tuple:
        if isinstance(kv, DeviceKVCache) and self._in_step(S - 1, 1):  # the whole cache: attention reads its
            return kv.k[kv.rows[layer]], kv.v[kv.rows[layer]]  # length from `at` (the same views every step)
        if isinstance(kv, DeviceKVCache):
            return kv.k[kv.rows[layer], :S], kv.v[kv.rows[layer], :S]  # device views
        return kv.read(layer, S)

    def attention(self, q, k, v, p0, window: int = 0, sinks=None):
        """Over the device KV cache: one launch, token t attending to positions 0..p0 + t (all written before):
        for one token the decode-attention kernel (with a sliding window or sinks, gpt-oss, the variant of
        cuda_kernels/gpt_oss.py), for a chunk of T > 1 the chunk-attention kernel (window and sinks included; MLA's
        V a strided view of its cache); over a host KV cache: on the CPU (q brought to the host)."""
        if isinstance(k, np.ndarray):
            return self.cpu.attention(self.to_host(q), self.to_host(k), self.to_host(v), p0, window, sinks)
        if isinstance(q, np.ndarray):  # a host query over the device KV cache (MLA's version 2, engine/mla.py)
            self._arena_top = 0
            qd = self._arena(q.shape)
            data = np.ascontiguousarray(q, np.float32)
            qd.copy_to_device(data, stream=self.compute)
            self.counts.copy("MLA queries to device", data.nbytes)
            return self._get(self.attention(qd, k, v, p0), "MLA attention output to host")
        T, H, _ = q.shape
        Dv = v.shape[2]
        o = self._arena((T, H * Dv))  # [T, H * Dv]
        o3 = self._reshaped(o, (T, H, Dv))
        dsinks = None if sinks is None else self._vec(sinks)  # [H]
        if T > 1:
            self._launch("chunk_attention", q, k, v, p0, window, dsinks, o3, self.compute)
            return o
        scores = shaped(self.scratch["scores"], (H, self.n_ctx))
        pos = self._at["row"] if self._in_step(p0, 1) else p0  # (a step: the position read on the device)
        if not window and sinks is None:
            self._launch("decode_attention", q[0], k, v, pos, o3[0], scores, self.compute)
        else:
            self._launch("decode_attention_ws", q[0], k, v, pos, window, dsinks, o3[0], scores, self.compute)
        return o

    def route(self, logits, k, norm_topk):
        return self.cpu.route(self.to_host(logits), k, norm_topk)

    def _vec(self, host: np.ndarray):
        """The device copy of a small float32 vector of the model (uploaded on first use, counted)."""
        entry = self._vectors.get(id(host))
        if entry is None:  # the host array is kept with it, so its id() stays unique
            entry = self._vectors[id(host)] = (self.mem.upload(np.ascontiguousarray(host, np.float32),
                                                               "dense weights"), host)
        return entry[0]

    def moe_experts(self, experts: dict, expert_types: dict, x: np.ndarray, ids: np.ndarray, w: np.ndarray,
                    ffn=None):
        """The routed experts of one layer: x float32 [T, D], ids int [T, K], w float32 [T, K] -> y [T, D].
        (ffn, gpt-oss's expert biases and clamped SwiGLU, has no fused device kernel yet: `_experts_with_ffn`
        runs each expert's three products on the device and the biases and activation on the host.)

        The (token, expert) pairs are grouped by expert (the CPU backend's `group_by_expert`): expert used[i] owns
        pairs start[i]:start[i+1]. GPU experts (slot, spill, staged) are queued on the compute stream, all of them
        before the CPU starts on the "cpu" misses, so both sides work at once; the pairs' outputs are added into
        y on the host at the end, in ascending expert order per token."""
        if ffn is not None:
            return self._experts_with_ffn(experts, expert_types, x, ids, w, ffn)
        T, D = x.shape
        self._check_tokens(T)
        used, start, tok, weight = group_by_expert(np.ascontiguousarray(ids, dtype=np.int64),
                                                   np.ascontiguousarray(w, dtype=np.float32))
        P = tok.size
        out = np.zeros((P, D), dtype=np.float32)  # [P, D] each pair's weighted expert output
        spans = [(int(used[i]), int(start[i]), int(start[i + 1])) for i in range(used.size)]
        on_gpu = [(e, a, b) for e, a, b in spans if experts[e].where != "cpu"]
        if on_gpu:
            xg = self._put("xg", x[tok], "expert inputs to device")  # [P, D] the pairs' inputs (cpu experts' unused)
            wg = self._put("wg", weight, "expert weights to device")  # [P] the router's weights of the pairs
            yg = self._put("yg", out, "expert output zeros to device")  # [P, D] zeros, accumulated into by each expert
            hg = shaped(self.scratch["h"], (P, self._moe[2]))  # [P, F]
            done = self.cuda.event()
            slots = []
            for n, (e, a, b) in enumerate(on_gpu):
                ex = self._device_expert(experts[e], b - a, n)
                self._launch("expert_block", ex.gate, ex.up, ex.down, expert_types, xg[a:b], wg[a:b], yg[a:b],
                             hg[a:b], self.compute)
                if ex.where == "staged":
                    self._stage["free"][ex.slot].record(self.compute)
                if ex.where == "slot":
                    slots.append(ex.slot)
            done.record(self.compute)
            for slot in slots:
                self.cache_pool.after_read(slot, done)
        for e, a, b in spans:  # meanwhile, on the CPU
            if experts[e].where == "cpu":
                out[a:b] = weight[a:b, None] * swiglu_expert(self.cpu, experts[e], expert_types, x[tok[a:b]])
        if on_gpu:
            out += self._get(yg, "expert outputs to host")  # the GPU's rows; its rows of cpu experts are zero
        y = np.zeros((T, D), dtype=np.float32)  # [T, D]
        np.add.at(y, tok, out)  # pairs in ascending expert order: each token's experts added in that order
        return y

    def _experts_with_ffn(self, experts: dict, expert_types: dict, x, ids, w, ffn) -> np.ndarray:
        """One expert at a time (reference.swiglu_expert with `ffn`): a GPU expert's gate, up and down products by
        the device kernels over its slot or its mapped host bytes, the biases and swiglu_oai on the host; a "cpu"
        miss entirely on the CPU. Correct and simple, not fast: a fused device kernel is the next step."""
        y = np.zeros_like(x)  # [T, D]
        done = self.cuda.event()
        for e, ex in experts.items():
            tok, slot = np.nonzero(ids == e)  # [n] tokens routed to e, and at which of their K positions
            if ex.where == "cpu":
                out = swiglu_expert(self.cpu, ex, expert_types, x[tok], ffn)
            else:
                if ex.where == "slot":
                    self.cache_pool.before_read(ex.slot)
                    dev = ex
                else:  # spill or staged: read in place over PCIe
                    m = self.host.device_view
                    dev = ExpertBytes(ex.layer, ex.expert, m(ex.gate), m(ex.up), m(ex.down), where="spill")
                    self._count_spill(ex, tok.size)
                out = swiglu_expert(self, dev, expert_types, x[tok], ffn)  # linear_raw synchronises
                if ex.where == "slot":
                    done.record(self.compute)
                    self.cache_pool.after_read(ex.slot, done)
            y[tok] += w[tok, slot][:, None] * out  # [n, D]
        return y

    def _device_expert(self, ex: ExpertBytes, n_tokens: int, i: int) -> ExpertBytes:
        """Device arrays for the expert's gate/up/down, per its miss path (see the module docstring); i: this
        expert's place among the layer's GPU experts (staging buffers alternate with it)."""
        if ex.where == "slot":
            self.cache_pool.before_read(ex.slot)
            return ex
        if ex.where == "staged" and n_tokens > self._token_tile:  # worth one copy: the kernels read it several times
            return self._stage_in(ex, i % 2)
        m = self.host.device_view  # spill (or a staged expert with few tokens): read in place over PCIe
        self._count_spill(ex, n_tokens)
        return ExpertBytes(ex.layer, ex.expert, m(ex.gate), m(ex.up), m(ex.down), where="spill")

    def _count_spill(self, ex: ExpertBytes, n_tokens: int) -> None:
        """The PCIe bytes of a kernel reading the expert from mapped host memory: each launch's blocks read their
        rows once per token tile (cuda_kernels/quant_matvec.py: grid (rows, token tiles))."""
        tiles = -(-n_tokens // self._token_tile)
        self.counts.copy("expert spill reads over PCIe", tiles * sum(getattr(ex, p).nbytes for p in EXPERT_PROJ))

    def _stage_in(self, ex: ExpertBytes, b: int) -> ExpertBytes:
        """Copy the expert into staging buffer b (0/1) on the copy stream; the compute stream waits for it."""
        st = self._stage
        if st["used"][b]:
            st["free"][b].wait(self.copy)  # the previous expert in this buffer has been computed
        buf, off, views = self.scratch["stage"][b], 0, {}
        for name in EXPERT_PROJ:
            src = getattr(ex, name)
            dst = buf[off:off + src.nbytes]
            dst.copy_to_device(src.reshape(-1), stream=self.copy)
            self.counts.copy("prefill staging to device", src.nbytes)
            views[name] = shaped(dst, src.shape)
            off += src.nbytes
        st["ready"][b].record(self.copy)
        st["ready"][b].wait(self.compute)
        st["used"][b] = True
        return ExpertBytes(ex.layer, ex.expert, **views, where="staged", slot=b)

    cache_pool: Optional[DevicePool] = None  # set by the engine when the expert cache's pool is on this device
    layers: Optional[range] = None  # the layers this device runs, when it is one of several (multi_device.py)

    def close(self) -> None:
        if self.host is not None:
            self.host.close()
