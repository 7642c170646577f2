"""Numba CUDA kernels of pymoe: quantized mat-vec/mat-mat, the MoE expert block, RMSNorm, RoPE, decode attention.

What this is: the GPU side of the forward pass, one concern per file, each with its host wrapper taking and
returning device arrays (numba device arrays, or anything with `__cuda_array_interface__` such as cupy arrays,
wrapped without a copy; CuPy is never imported here):

  quant_matvec.py  matvec / matmul of raw GGML rows of every pymoe.quant format (VRAM slot or mapped host memory)
  moe.py           expert_block: SwiGLU gate+up fused, down with the routing weight accumulated into Y
  norm_rope.py     rmsnorm, rope (NEOX and normal pairing), add_bias
  attention.py     decode_attention (one query token), chunk_attention (a prompt chunk, one launch) against the KV
                   cache, GQA, causal by construction; kv_store (a device step's KV write at a row read on the device)
  mla.py           DeepSeek's MLA pieces: the compressed cache row, the absorbed query, the value up-projection
  route_groups.py  DeepSeek's group-limited router (top K within the best expert groups)
  step.py          the decode step on the device: embedding, residual adds, routers, routed experts, argmax
  deltanet.py      Gated DeltaNet's decode step: the short causal conv, the gated delta rule and gated RMSNorm
  gated_attention.py  gated attention's query/gate split and output gate (qwen3next, qwen35moe)
  gpt_oss.py       gpt-oss's decode attention with a sliding window and sinks, its biased router and experts
  reduce.py        block-wide sum / max (shared-memory trees) used by the kernels above

What this is not: memory management or streams (pymoe/backends), routing (pymoe/engine/moe.py), the references. Every
kernel has a NumPy reference in pymoe (quant.dequantize(w) @ x; reference.rmsnorm, reference.apply_rope,
reference.attention, reference.swiglu_expert in pymoe/backends/reference.py) and tests/test_cuda_kernels.py compares each kernel with it.

Running without a GPU: set NUMBA_ENABLE_CUDASIM=1 before Numba is imported and every kernel runs in Numba's CUDA
simulator (pure Python, one Python thread per CUDA thread: use small shapes). That is what CI does. Kernels compile
lazily, on their first launch, so importing this package needs neither a GPU nor the simulator.

Numba CUDA itself: numba (0.60+) still ships the built-in `numba.cuda` target, deprecated in favour of NVIDIA's
`numba-cuda` package, which, when installed, transparently replaces `numba.cuda` (it needs the `cuda-bindings`
package even for the simulator). The code here uses only the API common to both.
"""
from .attention import chunk_attention, decode_attention, kv_store
from .moe import expert_block
from .norm_rope import add_bias, rmsnorm, rope
from .quant_matvec import DEVICE_FORMATS, decode_rows_cpu, matmul, matvec

__all__ = ["matvec", "matmul", "expert_block", "rmsnorm", "rope", "add_bias", "decode_attention", "chunk_attention",
           "kv_store", "DEVICE_FORMATS", "decode_rows_cpu"]
