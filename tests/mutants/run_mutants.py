#!/usr/bin/env python
"""Mutation check: plant known bugs ("mutants") in a temporary copy of the repo and confirm the oracle tests fail.

What this is: a table of mutants (MUTANTS below), each a plain string replacement in one file of pymoe/ plus the
oracle tests that must catch it, and the loop that checks them:
  1. snapshot the working tree (`git ls-files` + untracked, not ignored files) into a temp dir, with `../shared`
     (data the tests read from beside the checkout) linked beside the copy, read-only use;
  2. check that every mutant's `old` snippet occurs exactly once in its file (else stop: the table is stale);
  3. collect the node ids every mutant selects (patterns over `pytest --collect-only`; a pattern that matches
     nothing stops the run: the table is stale);
  4. baseline: run the union of the selected tests on the UNMUTATED copy; they must all pass (no failures, no
     skips), or no verdict below means anything;
  5. each mutant: a fresh copy, the replacement applied, its tests run -> "killed" (pytest exit 1: a test failed),
     "SURVIVED" (exit 0: every test passed with the bug in) or "error" (any other exit: collection error, usage
     error, timeout; not counted as killed).
Exit status 0 only when the baseline passed and every mutant was killed.

The mutated package really is the one imported: the tests run with this interpreter (`sys.executable`, the repo
venv's), cwd = the copy and PYTHONPATH = the copy, and the script checks that `pymoe.__file__` lies in the copy
before anything else runs (the editable install of /work/main would otherwise win).

Numba: its on-disk cache is keyed by the source file's directory path and content hash. Every run uses the same
copy path and its own NUMBA_CACHE_DIR: the baseline starts empty (everything compiles: minutes) and each mutant run
starts from a copy of the baseline's cache with the entries of the mutated module, and of every pymoe module that
imports it (directly or not), removed: Numba's content hash only watches a function's own file, and a cached caller
in another file would keep the unmutated callee compiled in. `--numba-cache fresh` compiles everything in every
run instead (slow; for when in doubt).

Usage (from the repo root, with the repo's venv):
    .venv/bin/python tests/mutants/run_mutants.py            # baseline + every mutant, then the table
    .venv/bin/python tests/mutants/run_mutants.py --list     # the table of mutants and their test selections
    .venv/bin/python tests/mutants/run_mutants.py --check    # the table against the tree, nothing run (CI)
    .venv/bin/python tests/mutants/run_mutants.py --only rope_base_halved --only sampler_drops_least_likely
This file is a script, not a test module: pytest does not collect it (its name does not match test_*.py, and the
folder has no __init__.py and no conftest).
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # file, relative to the repo root
    old: str  # exact source snippet, must occur exactly once in `path`
    new: str  # its replacement
    tests: tuple  # node-id patterns ('*' is the only wildcard) of the oracle tests that must catch it
    why: str  # the bug, in words


LLAMACPP_LOGITS = "tests/test_model_vs_llamacpp.py::test_logits_match_llamacpp"
# the same oracle on files whose routers are not saturated (routing-weight bugs are invisible on the others)
SOFT_ROUTER = "tests/test_model_vs_llamacpp.py::test_logits_match_llamacpp_with_a_soft_router"

MUTANTS: list[Mutant] = [
    Mutant(
        "rope_base_halved", "pymoe/backends/reference.py",
        "inv_freq = base ** (-2.0 * i / rope_dim)",
        "inv_freq = (base / 2) ** (-2.0 * i / rope_dim)",
        (LLAMACPP_LOGITS + "[*]",),
        "RoPE tables built from half the file's rope.freq_base"),
    Mutant(
        "decode_position_off_by_one", "pymoe/engine/model.py",
        "rope = self.rope_tables(np.arange(kv.n, kv.n + tokens.size) + _delta(kv))",
        'rope = self.rope_tables(np.arange(kv.n, kv.n + tokens.size) + _delta(kv) + (phase == "decode"))',
        ("tests/test_model.py::test_kv_cache_decode_equals_full_forward[*f32*]",
         "tests/test_model_vs_llamacpp.py::test_greedy_tokens_match_llamacpp[*]"),
        "a decoded token is rotated (RoPE) as if it sat one position later than its KV slot"),
    Mutant(
        "expert_gate_up_swapped", "pymoe/backends/reference.py",
        'return backend.linear_raw(ex.down, types["down"], silu(gate) * up)',
        'return backend.linear_raw(ex.down, types["down"], silu(up) * gate)',
        ("tests/test_model.py::test_moe_block_by_hand[*]", LLAMACPP_LOGITS + "[*f32*]"),
        "expert FFN computes down(silu(up x) * gate x) (the float, one-expert-at-a-time path)"),
    Mutant(
        "fused_moe_gate_up_swapped", "pymoe/quant/kernels.py",
        "silu_mul_into(g[i - c0], u[i - c0], hb)",
        "silu_mul_into(u[i - c0], g[i - c0], hb)",
        ("tests/test_kernels_qact.py::test_fused_moe_kernel_against_per_expert_reference[*]",
         # the whole-model check of the CPU backend's integer path; the llama.cpp test runs K-quant files on the
         # reference backend
         "tests/test_kernels_qact.py::test_cpu_and_reference_backends_agree_on_q2_k_models[*]"),
        "the fused integer MoE kernel (K-quant experts) computes silu(up) * gate"),
    Mutant(
        "silu_mul_exp_of_up", "pymoe/quant/kernels.py",
        "h[j] = exp_f32(-g[j])",
        "h[j] = exp_f32(-u[j])",
        ("tests/test_kernels_qact.py::test_fused_moe_kernel_against_per_expert_reference[*]",),
        "the fused MoE kernel's silu(g) * u (every path: decode's task per expert, the row tasks at 8, 15 and 16 "
        "bits) takes e^-u for e^-g"),
    Mutant(
        "scaled_q3_k_bias_off_by_one", "pymoe/quant/repack.py",
        "SCALED_BIAS = {QType.Q2_K: 0, QType.Q3_K: 127}",
        "SCALED_BIAS = {QType.Q2_K: 0, QType.Q3_K: 126}",
        ("tests/test_repack.py::test_scaled_layout_is_its_reference_and_gives_the_tile_dots_bits[*]",),
        "the scaled dot starts Q3_K's sums from -126 times the block's activation sum where its bytes hold +127"),
    Mutant(
        "scaled_expand_wrong_sub_block", "pymoe/quant/repack.py",
        "k = 8 * h + 2 * j + c // 4",
        "k = 8 * h + 2 * j + c // 8",
        ("tests/test_repack.py::test_scaled_layout_is_its_reference_and_gives_the_tile_dots_bits[*]",),
        "the compiled expansion into the scaled layout takes chunks 4-7's scales from the sub-block before theirs"),
    Mutant(
        "scaled_dot_drops_even_groups", "pymoe/quant/repack.py",
        "isums = [b.add(c0, c1) for c0, c1 in chains]",
        "isums = [c1 for c0, c1 in chains]",
        ("tests/test_repack.py::test_scaled_layout_is_its_reference_and_gives_the_tile_dots_bits[*]",),
        "the scaled dot keeps only the chain of odd groups"),
    Mutant(
        "scaled_matmul_one_pair", "pymoe/quant/repack.py",
        "SCALED_DOT(sc[(g - 4 * task) // 2]",
        "SCALED_DOT(sc[0]",
        ("tests/test_repack.py::test_scaled_layout_is_its_reference_and_gives_the_tile_dots_bits[*]",),
        "a prefill chunk's dense product (tile_matmul) reads its task's first scaled pair of row-groups for both"),
    Mutant(
        "moe_scaled_up_reads_gate", "pymoe/quant/kernels.py",
        "SCALED_DOT_UP(su, xq",
        "SCALED_DOT_UP(sg, xq",
        ("tests/test_repack.py::test_fused_moe_kernel_reads_the_tiles_with_the_same_bits[Q2_K-Q3_K]",),
        "the fused MoE kernel's prefill reads the scaled gate rows for up x"),
    Mutant(
        "moe_scaled_down_first_pair", "pymoe/quant/kernels.py",
        "SCALE_DOWN(dt[q0:q0 + 2], sd)",
        "SCALE_DOWN(dt[0:2], sd)",
        ("tests/test_repack.py::test_fused_moe_kernel_reads_the_tiles_with_the_same_bits[Q2_K-Q3_K]",),
        "the fused MoE kernel's prefill scales the first two down row-groups for every pair"),
    Mutant(
        "topk_renorm_dropped", "pymoe/backends/cpu.py",
        "        if norm_topk:\n            s = pairwise_sum(w[t], k)",
        "        if False:  # MUTANT: norm_topk ignored\n            s = pairwise_sum(w[t], k)",
        ("tests/test_model.py::test_moe_block_by_hand[*]", LLAMACPP_LOGITS + "[*f32*]", SOFT_ROUTER + "[*]"),
        "the compiled router (CPU backend's route hook) never renormalises the top-k weights"),
    Mutant(
        "olmoe_renorm_added", "pymoe/gguf/config.py",
        '"olmoe": ArchTraits(rope_neox=True, qk_norm="full", qkv_bias=False, shared_expert=False, norm_topk=False,',
        '"olmoe": ArchTraits(rope_neox=True, qk_norm="full", qkv_bias=False, shared_expert=False, norm_topk=True,',
        (LLAMACPP_LOGITS + "[*olmoe*]", SOFT_ROUTER + "[olmoe]"),
        "OLMoE's arch default renormalises the top-k routing weights (llama.cpp does not)"),
    Mutant(
        "q2k_reference_scale_min_swapped", "pymoe/quant/kquants.py",
        "return _affine(d, scales & 15, q, dmin, scales >> 4, sub=16)",
        "return _affine(d, scales >> 4, q, dmin, scales & 15, sub=16)",
        ("tests/test_dequant.py::test_reference_is_bit_exact_with_gguf[Q2_K]",
         "tests/test_kquants_layout.py::*Q2_K*", "tests/test_kquants_layout.py::test_q2_k_weight_index"),
        "NumPy reference dequantizer of Q2_K reads the scale from the high nibble and the min from the low one"),
    Mutant(
        "q2k_numba_decoder_scale_min_swapped", "pymoe/quant/kquants.py",
        "dl0, ml0 = d * np.float32(sc0 & 15), dmin * np.float32(sc0 >> 4)",
        "dl0, ml0 = d * np.float32(sc0 >> 4), dmin * np.float32(sc0 & 15)",
        ("tests/test_dequant.py::test_decode_block_is_bit_exact_with_reference[Q2_K]",
         "tests/test_kernels.py::test_matvec_and_matmul_match_reference[Q2_K]"),
        "Numba decode_q2_k swaps scale and min nibbles of the first sub-block of each 4-group"),
    Mutant(
        "q2k_int_dot_min_from_scale_nibble", "pymoe/quant/qact.py",
        "size=Q2_K_SIZE, d_off=80, dmin_off=82, min_fields=[(list(range(16)), [4] * 16, 15, 0)], prescale_one=True,",
        "size=Q2_K_SIZE, d_off=80, dmin_off=82, min_fields=[(list(range(16)), [0] * 16, 15, 0)], prescale_one=True,",
        ("tests/test_kernels_qact.py::test_int_matvec_and_matmul[Q2_K-*]",
         "tests/test_kernels_qact.py::test_fused_moe_kernel_against_per_expert_reference[*]"),
        "the integer-path Q2_K row dot (LLVM IR layout table) takes the mins from the scale nibbles"),
    Mutant(
        "sampler_drops_least_likely", "pymoe/engine/sampler.py",
        "        z = cand / p.temperature\n",
        "        ids, cand = (ids[:-1], cand[:-1]) if len(ids) > 1 else (ids, cand)  # MUTANT\n"
        "        z = cand / p.temperature\n",
        ("tests/test_sampler.py::*",),
        "the sampler never draws the least likely candidate left after top-k/top-p/min-p"),
    Mutant(
        "codebook_table_rotated", "pymoe/quant/qact.py",
        "return builder.call(fn, [vec(i8, 32, list(self.codebook) * 2), v])",
        "return builder.call(fn, [vec(i8, 32, list(self.codebook[1:] + self.codebook[:1]) * 2), v])",
        ("tests/test_kernels_qact.py::test_int_matvec_and_matmul[IQ4_XS-*]",
         "tests/test_kernels_qact.py::test_int_matvec_and_matmul[IQ4_NL-*]",
         "tests/test_kernels_qact.py::test_int_matvec_and_matmul[MXFP4-*]"),
        "the codebook formats' integer dots (vpshufb) look nibble k up as level k + 1"),
    Mutant(
        "int8_path_sign_not_moved", "pymoe/quant/qact.py",
        "                xv = x86(builder, \"llvm.x86.avx2.psign.b\", xv.type, [xv, v])",
        "                pass  # MUTANT: the weights' signs are dropped",
        ("tests/test_kernels_qact.py::test_int_matvec_and_matmul[*-8]",),
        "8-bit activations: |w| times x without w's sign moved onto x (vpsignb dropped)"),
    Mutant(
        "int8_path_abs_dropped", "pymoe/quant/qact.py",
        'v = x86(builder, "llvm.x86.avx2.psign.b", v.type, [v, v])',
        "pass  # MUTANT: the weights' magnitudes not taken",
        ("tests/test_kernels_qact.py::test_int_matvec_and_matmul[*-8]",),
        "8-bit activations: a signed weight read by vpmaddubsw as unsigned (|v| as vpsignb(v, v) dropped)"),
    Mutant(
        "iq_grid_signs_dropped", "pymoe/quant/qact.py",
        'v = x86(builder, "llvm.x86.avx2.psign.b", v.type, [v, signs])',
        "pass  # MUTANT: the grid rows' signs are dropped",
        ("tests/test_kernels_qact.py::test_int_matvec_and_matmul[IQ2_XXS-*]",
         "tests/test_kernels_qact.py::test_int_matvec_and_matmul[IQ3_S-*]"),
        "IQ2/IQ3 integer dots: the grid magnitudes without their sign table applied"),
    Mutant(
        "iq_grid_signs_not_on_x", "pymoe/quant/qact.py",
        'xv = x86(builder, "llvm.x86.avx2.psign.b", xv.type, [xv, signs])',
        "pass  # MUTANT: the grid rows' signs are not moved onto x",
        ("tests/test_kernels_qact.py::test_int_matvec_and_matmul[IQ2_XXS-8]",
         "tests/test_kernels_qact.py::test_int_matvec_and_matmul[IQ3_S-8]"),
        "IQ2/IQ3 8-bit dots: the magnitudes times x without the sign table moved onto x"),
    Mutant(
        "iq_pdep_high_parts_dropped", "pymoe/quant/qact.py",
        "both = builder.or_(lo, hi)", "both = lo",
        ("tests/test_kernels_qact.py::test_int_matvec_and_matmul[IQ1_M-*]",
         "tests/test_kernels_qact.py::test_int_matvec_and_matmul[IQ3_S-*]"),
        "IQ1/IQ2_S/IQ3_S row indices built by pdep without their high bits (CPUs with a fast pdep only: elsewhere "
        "this mutant survives)"),
    Mutant(
        "iq3s_index_bit_8_dropped", "pymoe/quant/qact.py",
        "_field(66 + g, 1, m, 1, 8)", "_field(66 + g, 1, m, 0, 8)",
        ("tests/test_kernels_qact.py::test_int_matvec_and_matmul[IQ3_S-*]",),
        "IQ3_S's integer dot reads only the low 8 bits of a grid row's index (qh's bit 8 dropped: 256 of 512 rows)"),
    Mutant(
        "iq1_delta_sign_ignored", "pymoe/quant/qact.py",
        "builder.select(set_, vec(i8, 32, [-1] * 32), vec(i8, 32, [1] * 32))", "vec(i8, 32, [1] * 32)",
        ("tests/test_kernels_qact.py::test_int_matvec_and_matmul[IQ1_S-*]",
         "tests/test_kernels_qact.py::test_int_matvec_and_matmul[IQ1_M-*]"),
        "IQ1's integer dots add +1/8 to every run, whatever the sign bit of its delta"),
    Mutant(
        "iq1m_scale_straddling_bit_dropped", "pymoe/quant/qact.py",
        "second_mask.append(1 if bit == 6 else 0)", "second_mask.append(0)",
        ("tests/test_kernels_qact.py::test_int_matvec_and_matmul[IQ1_M-*]",),
        "IQ1_M's integer dot reads the scale at bits 6-8 of a uint16 without its bit 8 (the one in the next byte)"),
    Mutant(
        "e8m0_subnormal_scales_as_normal", "pymoe/quant/qact.py",
        'bits = builder.select(builder.icmp_unsigned("<", e, vec(i32, 8, [2] * 8)), small, normal)',
        "bits = normal",
        ("tests/test_kernels_qact.py::test_mxfp4_int_dot_at_the_extreme_scales",),
        "MXFP4's integer dot reads E8M0 bytes 0 and 1 with the normal formula (bits (e - 1) << 23: -inf, 0)"),
    Mutant(
        "act_rounding_12_bits", "pymoe/quant/qact.py",
        "_QMAX = {np.dtype(np.int8): 127, np.dtype(np.int16): 32767}",
        "_QMAX = {np.dtype(np.int8): 127, np.dtype(np.int16): 2047}",
        ("tests/test_kernels_qact.py::*",),
        "the 16-bit activation path rounds x (and h) to 12 bits (reference and Numba twin alike)"),
    Mutant(
        "batch_rows_mixed", "pymoe/engine/batch.py",
        "model.attention_block(layer, a, seqs, i, rope)",
        "model.attention_block(layer, a[::-1], seqs, i, rope)",
        ("tests/test_batch.py::test_decode_batch_equals_single_decodes[*]",),
        "batched decode: sequence j attends with another row's hidden state (rows reversed)"),
    Mutant(
        "cache_promotion_without_copy", "pymoe/experts/cache.py",
        "        for slot, (lay, e) in pending.items():\n            self.pool.write(slot, self.model.expert(lay, e))",
        "        for slot, (lay, e) in pending.items():\n            pass  # MUTANT: promoted without copying the bytes",
        ("tests/test_cache.py::test_cache_never_changes_results[*lru-1.0*]",
         "tests/test_cache.py::test_cache_never_changes_results[*lfu-0.4*]",
         # the CPU backend computes from the file's bytes (or its repacked copies) wherever the cache says an
         # expert is, so only a check of the slot's bytes sees a promotion that never copied them
         "tests/test_cache.py::test_slot_bytes_equal_host_bytes_after_promotion"),
        "expert cache: a promotion marks the slot resident but never copies the expert's bytes into it"),
    Mutant(
        "lfu_heap_never_compacted", "pymoe/experts/policies.py",
        "        heapq.heappush(self.heap, (self.count.get(key, 0), self.clock, key))\n"
        "        if len(self.heap) > HEAP_SLACK * (self.size + 1):\n            self._compact()",
        "        heapq.heappush(self.heap, (self.count.get(key, 0), self.clock, key))",
        ("tests/test_policies.py::test_lfu_lfru_memory_stays_bounded_when_the_pool_rarely_evicts[lfu]",),
        "LFU's lazy-deletion heap grows by one entry per hit when the pool rarely evicts (issue 48)"),
    Mutant(
        "refused_miss_not_a_use", "pymoe/experts/policies.py",
        "        self.policy.on_use(key, t)  # a miss is a use, whether it takes a slot or not\n",
        "",
        ("tests/test_policies.py::test_every_lookup_is_a_use[*]",
         "tests/test_cache.py::test_every_lookup_reaches_the_policys_count"),
        "a miss served without a slot (prefill, refused by admission) never reaches LFU's / LFRU's record of use"),
    Mutant(
        "sim_counts_the_tables_answer", "pymoe/experts/simulate.py",
        "hit[t] = served.setdefault(key, table_hit)",
        "hit[t] = table_hit",
        ("tests/test_speculative.py::test_simulator_replays_a_speculative_run_with_the_engines_counts[*]",),
        "the simulator counts a repeat of a key within one lookup call as the table answers, not as the engine "
        "served it (a just-promoted expert counted a hit)"),
    Mutant(
        "slots_start_empty", "pymoe/api.py",
        "        log(cache.fill())  # every slot, from the profile and then in a stated order: slots never sit empty",
        "        pass  # MUTANT: no start-up fill",
        ("tests/test_cache.py::test_slots_never_sit_empty",),
        "the slot pool starts empty: every expert's first use misses"),
    Mutant(
        "slot_limit_counts_dense_layers", "pymoe/experts/cache.py",
        "self.n_total = n_total = len(self.moe_layers) * self.n_experts",
        "self.n_total = n_total = cfg.n_layers * self.n_experts",
        ("tests/test_cache.py::test_slot_limits_count_the_experts_of_moe_layers_only[*]",),
        "slot limits and coverage count the leading dense layers' nonexistent experts (issue 49)"),
    Mutant(
        "tokenizer_llama3_digit_groups_of_4", "pymoe/engine/tokenizer.py",
        '\\p{N}{1,3}"',
        '\\p{N}{1,4}"',
        ("tests/test_tokenizer.py::test_ids_match_llama_cpp_pre_tokenizers[llama-bpe]",),
        "Llama-3 pre-tokenizer regex groups digits by up to 4 instead of 3"),
    Mutant(
        "tokenizer_spm_no_prefix_after_special", "pymoe/engine/tokenizer.py",
        "                ids.append(piece)\n                prev_special = True",
        "                ids.append(piece)\n                prev_special = False  # MUTANT",
        ("tests/test_tokenizer.py::test_ids_match_llama_cpp_sentencepiece",),
        "SentencePiece: no space prefix on the text fragment after a special token"),
    Mutant(
        "plan_spill_at_device_bandwidth", "pymoe/experts/plan.py",
        "spill_s=spilled_bytes_per_token(hit_rate, facts) / cost.pcie_bw,",
        "spill_s=spilled_bytes_per_token(hit_rate, facts) / cost.device_bw,",
        ("tests/test_plan.py::*",),
        "planner cost model: spilled (missed) expert bytes priced at device bandwidth instead of PCIe"),
    Mutant(
        "report_cliff_largest_relative_drop", "pymoe/experts/report.py",
        "return max(falling, key=lambda d: d[3]) if falling else None",
        "return max(falling, key=lambda d: d[2]) if falling else None",
        ("tests/test_report.py::*",),
        "report: the cliff taken as the largest relative drop, not the steepest fall per point of share"),
    Mutant(
        "report_ranks_without_ties", "pymoe/experts/report.py",
        "    return sums[inv] / counts[inv]",
        "    return r",
        ("tests/test_report.py::*",),
        "report: Spearman's ranks without the average rank for ties"),
    Mutant(
        "report_pooled_hit_rate_per_request_mean", "pymoe/experts/report.py",
        "        return sum(counter(r) for r in p) / n if n else None",
        "        return float(np.mean([counter(r) / r['lookups'] for r in p])) if n else None",
        ("tests/test_report.py::*",),
        "report: a round's hit rate as the mean of its requests' rates, not pooled over lookups"),
    Mutant(
        "multi_hops_not_counted", "pymoe/experts/multi.py",
        "return self.fixed_s + sum(r.time_s for r in self.rows) + self.n_hops * self.hop_s",
        "return self.fixed_s + sum(r.time_s for r in self.rows)",
        ("tests/test_multi.py::*",),
        "several cards: the residual stream's hop between cards left out of the time per token"),
    Mutant(
        "eplb_replica_to_the_heaviest_expert", "pymoe/experts/placement.py",
        "e = np.argmax(weight / count, axis=1)  # [X]",
        "e = np.argmax(weight, axis=1)  # [X]",
        ("tests/test_placement.py::*",),
        "EPLB replication: every replica to the heaviest expert, not to the largest load per replica"),
    Mutant(
        "eplb_pack_lightest_first", "pymoe/experts/placement.py",
        "for i in np.argsort(-weight[x], kind=\"stable\"):",
        "for i in np.argsort(weight[x], kind=\"stable\"):",
        ("tests/test_placement.py::*",),
        "EPLB packing: lightest item first instead of heaviest"),
    Mutant(
        "scale_all_copies_off_node", "pymoe/experts/scale.py",
        "sent = batch / n_nodes * k * (n_nodes - 1) / n_nodes * model.n_embd * net.act_bytes",
        "sent = batch / n_nodes * k * model.n_embd * net.act_bytes",
        ("tests/test_scale.py::*",),
        "expert parallelism: every expert copy sent over the network, also those whose expert is on the same node"),
    Mutant(
        "rmsnorm_eps_outside_sqrt", "pymoe/backends/cpu.py",
        "denom = np.sqrt(pairwise_sum(sq, n) / np.float32(n) + eps)",
        "denom = np.sqrt(pairwise_sum(sq, n) / np.float32(n)) + eps",
        ("tests/test_kernels_cpu_backend.py::test_rmsnorm_and_rope_hooks_are_bit_identical_to_numpy",
         "tests/test_backends.py::test_cpu_primitives_give_the_references_bits", LLAMACPP_LOGITS + "[*f32*]"),
        "RMSNorm (the CPU backend's compiled hook) adds eps after the square root"),
    Mutant(
        "olmoe_qk_norm_skipped", "pymoe/engine/attention.py",
        'if cfg.qk_norm == "full":',
        'if cfg.qk_norm == "full" and False:  # MUTANT',
        (LLAMACPP_LOGITS + "[*olmoe*]",),
        "OLMoE's q/k RMSNorm (over the whole projection) is skipped"),
    Mutant(
        "qwen2moe_k_bias_dropped", "pymoe/engine/attention.py",
        'q, k, v = b.add(q, layer.bias["q"]), b.add(k, layer.bias["k"]), b.add(v, layer.bias["v"])',
        'q, k, v = b.add(q, layer.bias["q"]), k, b.add(v, layer.bias["v"])',
        (LLAMACPP_LOGITS + "[*qwen2moe*]",),
        "Qwen2-MoE's attn_k bias is not added (q and v biases still are)"),
    Mutant(
        "glm_selection_bias_in_weights", "pymoe/backends/reference.py",
        "    w = np.take_along_axis(probs, ids, axis=-1)  # [T, K]\n    if norm_topk:\n        w = w / np.maximum(",
        "    w = np.take_along_axis(choose, ids, axis=-1)  # [T, K]  MUTANT\n    if norm_topk:\n        w = w / np.maximum(",
        (LLAMACPP_LOGITS + "[*glm4moe*]",),
        "sigmoid routing (GLM): the weights take the selection bias exp_probs_b too"),
    Mutant(
        "dots1_selection_bias_ignored", "pymoe/backends/reference.py",
        "    choose = probs + bias if bias is not None else probs  # [T, E]",
        "    choose = probs  # [T, E]  MUTANT",
        (LLAMACPP_LOGITS + "[*dots1*]", "tests/test_model_vs_llamacpp.py::test_logits_match_llamacpp_with_a_soft_router[dots1]"),
        "sigmoid routing (dots1, DeepSeek-V3 style): the experts are chosen without the selection bias exp_probs_b"),
    Mutant(
        "dots1_weights_norm_key_ignored", "pymoe/gguf/config.py",
        'norm_topk=flag("expert_weights_norm", t.norm_topk),',
        "norm_topk=t.norm_topk,  # MUTANT",
        (LLAMACPP_LOGITS + "[*dots1*]",),
        "dots1: expert_weights_norm (true in dots.llm1) ignored for llama.cpp's arch default (false): the sigmoid "
        "weights are not renormalised"),
    Mutant(
        "glm_weights_scale_dropped", "pymoe/backends/reference.py",
        "    if scale not in (0.0, 1.0):\n        w = w * np.float32(scale)",
        "    if False:  # MUTANT\n        w = w * np.float32(scale)",
        (LLAMACPP_LOGITS + "[*glm4moe*]",),
        "sigmoid routing (GLM): expert_weights_scale (routed_scaling_factor 2.5) is not applied"),
    Mutant(
        "glm_dense_layer_runs_as_moe_plan", "pymoe/gguf/config.py",
        'return tuple(LayerPlan(i, attention(i), "dense" if i < self.n_dense_lead else moe,',
        'return tuple(LayerPlan(i, attention(i), "dense" if i < self.n_dense_lead - 1 else moe,',
        (LLAMACPP_LOGITS + "[*glm4moe*]", "tests/test_model_vs_llamacpp.py::test_greedy_tokens_match_llamacpp[*glm4moe*]"),
        "GLM: the leading dense layer is planned as an MoE layer (a loader error or wrong logits)"),
    Mutant(
        "attention_scores_one_key_vector", "pymoe/backends/attention_simd.py",
        "builder.store(builder.fadd(builder.load(a), builder.fmul(qd, ks[j])), a)",
        "builder.store(builder.fadd(builder.load(a), builder.fmul(qd, ks[0])), a)",
        ("tests/test_attention_simd.py::test_scores_have_the_bits_of_the_numpy_twin[*]",
         "tests/test_kernels_cpu_backend.py::test_attention_rows_against_einsum_and_independent_of_T"),
        "CPU attention's blocked scores loop multiplies every key vector of a block by the first one's keys"),
    Mutant(
        "attention_key_tiles_one_tile", "pymoe/backends/attention_simd.py",
        "starts.append(builder.add(builder.mul(builder.udiv(sj, const(TILE_KEYS)), tile),",
        "starts.append(builder.add(builder.mul(builder.udiv(s0, const(TILE_KEYS)), tile),",
        ("tests/test_attention_simd.py::test_scores_have_the_bits_of_the_numpy_twin[*]",
         "tests/test_kernels_cpu_backend.py::test_attention_reads_the_f32_caches_key_tiles_in_place"),
        "CPU attention reads a run's later key vectors from its first vector's tile (wrong past a tile's edge)"),
    Mutant(
        "kv_key_tiles_copy_drops_partial_tile", "pymoe/engine/kv.py",
        "nb = (n + TILE_KEYS - 1) // TILE_KEYS  # whole tiles",
        "nb = n // TILE_KEYS  # MUTANT whole tiles",
        ("tests/test_kernels_cpu_backend.py::test_attention_reads_the_f32_caches_key_tiles_in_place",),
        "a copied f32 KV prefix (n > 1 choices, prefix reuse) loses the keys of its last, partial tile"),
    Mutant(
        "expert_dots_hint_kept", "pymoe/quant/repack.py",
        "TILE_DOTS_STREAM = {q: _make_tile_dot(q, locality=qact.STREAM_LOCALITY)",
        "TILE_DOTS_STREAM = {q: _make_tile_dot(q, locality=3)",
        ("tests/test_repack.py::test_prefetch_hints_follow_the_cpu_and_the_environment",),
        "the experts' one-token dots ask for their bytes with the dense weights' hint, not this CPU's hint for bytes "
        "read once (no bit changes; Zen 4 decode ~20% slower)"),
    Mutant(
        "embed_first_row_only", "pymoe/engine/model.py",
        "fmt.decode_block(rows.reshape(-1), x.reshape(-1))",
        "fmt.decode_block(rows[0], x[0])",
        ("tests/test_dequant.py::test_embedding_rows_are_the_references_bits[*]",),
        "the compiled embedding lookup decodes only the first token's row (a prefill's other rows: garbage)"),
    Mutant(
        "dense_rows_left_in_file_pages", "pymoe/backends/cpu.py",
        "        elif self.repack and self._arena.enabled:",
        "        elif False:",
        ("tests/test_arena.py::test_cpu_backend_repacked_copies_live_in_its_arena",),
        "a dense weight without tiles (the F32 router, the output head) is read in the memory map's 4 KiB pages "
        "(no bit changes)"),
    Mutant(
        "heat_counts_an_expert_once", "pymoe/experts/cache.py",
        "        counts[e] += 1",
        "        counts[e] = max(counts[e], 1)",
        ("tests/test_cache.py::test_heat_counts_each_decode_lookup_of_each_expert[*]",),
        "the monitor's heat map marks an expert looked up instead of counting its lookups"),
    Mutant(
        "by_expert_first_weight", "pymoe/quant/kernels.py",
        "        wk = weight[start[k]]",
        "        wk = weight[0]",
        ("tests/test_repack.py::test_decode_one_task_per_expert_has_the_bits_of_the_row_tasks",
         "tests/test_repack.py::test_fused_moe_kernel_reads_the_tiles_with_the_same_bits[*]"),
        "decode's one-task-per-expert MoE kernel weighs every expert with the first one's routing weight"),
    Mutant(
        "arena_not_advised_huge", "pymoe/backends/arena.py",
        "        m.madvise(mmap.MADV_HUGEPAGE)",
        "        pass",
        ("tests/test_arena.py::test_a_chunk_starts_on_a_huge_page_and_is_advised_as_huge_pages",),
        "the arena's chunks are never advised as huge pages: the repacked experts back in 4 KiB pages (no bit "
        "changes; decode a few % slower)"),
    Mutant(
        "expert_tiles_outside_arena", "pymoe/backends/cpu.py",
        "mats = [repack.repack(m, q, self._arena.empty) if f else None",
        "mats = [repack.repack(m, q) if f else None",
        ("tests/test_arena.py::test_cpu_backend_repacked_copies_live_in_its_arena",),
        "a routed expert's repacked copies are plain NumPy arrays, in 4 KiB pages (no bit changes)"),
    Mutant(
        "stream_locality_zen4_nontemporal", "pymoe/quant/qact.py",
        'return 2 if cpu == "znver4" else 0 if cpu.startswith("znver") else 3',
        'return 0 if cpu.startswith("znver") else 3',
        ("tests/test_repack.py::test_prefetch_hints_follow_the_cpu_and_the_environment",),
        "Zen 4 gets the non-temporal expert hint of other Zen CPUs (measured slower than none there)"),
    Mutant(
        "attention_weighted_first_heads_total", "pymoe/backends/attention_simd.py",
        "pv = _splat(builder, builder.fdiv(builder.load(builder.gep(pa.data, [at])), tots[i]))",
        "pv = _splat(builder, builder.fdiv(builder.load(builder.gep(pa.data, [at])), tots[0]))",
        ("tests/test_attention_simd.py::test_weighted_rows_have_the_bits_of_the_numpy_twin[*]",
         "tests/test_kernels_cpu_backend.py::test_attention_rows_against_einsum_and_independent_of_T"),
        "CPU attention's output loop divides every head's weights by the first head's softmax sum"),
    Mutant(
        "gpt_oss_sinks_dropped_on_cpu", "pymoe/backends/cpu.py",
        "attention_rows(q, k, kt, v, p0, int(window), sinks, out, self.threads, in_place)",
        "attention_rows(q, k, kt, v, p0, int(window), _NO_SINKS, out, self.threads, in_place)  # MUTANT",
        (LLAMACPP_LOGITS + "[*gpt-oss*]",),
        "gpt-oss: the CPU backend's attention ignores the per-head sinks"),
    Mutant(
        "gpt_oss_window_one_wider", "pymoe/backends/reference.py",
        "hidden |= pos[:, None] - np.arange(S)[None, :] >= window  # [T, S] out of the window",
        "hidden |= pos[:, None] - np.arange(S)[None, :] > window  # MUTANT",
        (LLAMACPP_LOGITS + "[*gpt-oss*]",),
        "gpt-oss: the reference's sliding window lets in one position too many"),
    Mutant(
        "gpt_oss_swiglu_not_clamped", "pymoe/backends/reference.py",
        "    g = np.minimum(gate, np.float32(limit))",
        "    g = gate  # MUTANT",
        (LLAMACPP_LOGITS + "[*gpt-oss*]",),
        "gpt-oss: the expert activation's gate is not clamped at 7"),
    Mutant(
        "gpt_oss_yarn_mscale_dropped", "pymoe/backends/reference.py",
        "    mscale = 1.0 + 0.1 * np.log(scaling.factor)",
        "    mscale = 1.0  # MUTANT",
        (LLAMACPP_LOGITS + "[*gpt-oss*]",),
        "YaRN: cos and sin are not scaled by 1 + 0.1 ln(factor) (the attention temperature)"),
    Mutant(
        "gdn_heads_tiled_not_grouped", "pymoe/engine/deltanet.py",
        "q, k = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)",
        "q, k = np.tile(q, (1, r, 1)), np.tile(k, (1, r, 1))  # MUTANT",
        (LLAMACPP_LOGITS + "[*qwen3next*]", "tests/test_deltanet.py::test_llama_cpp_agrees_at_100_tokens"),
        "Gated DeltaNet: v head h reads q/k head h % nk (tiled) instead of h // r (grouped, as the converter writes)"),
    Mutant(
        "qwen35_heads_grouped_not_tiled", "pymoe/engine/deltanet.py",
        "q, k = np.tile(q, (1, r, 1)), np.tile(k, (1, r, 1))  # [T, nv, dk]",
        "q, k = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)  # MUTANT",
        (LLAMACPP_LOGITS + "[*qwen35moe*]",),
        "Qwen3.5: v head h reads q/k head h // r (qwen3next's grouped order) instead of h % nk"),
    Mutant(
        "gdn_chunked_decay_of_the_start_state_dropped", "pymoe/engine/deltanet.py",
        "oc = np.exp(G)[:, :, None] * np.einsum(\"hvk,htk->htv\", M, qc)",
        "oc = np.einsum(\"hvk,htk->htv\", M, qc)  # MUTANT",
        ("tests/test_deltanet.py::test_chunked_form_equals_recurrent_form[*]",
         "tests/test_deltanet.py::test_llama_cpp_agrees_at_100_tokens"),
        "chunked delta rule: the carried state is read without its decay within the chunk"),
    Mutant(
        "gdn_conv_state_not_carried", "pymoe/engine/deltanet.py",
        "    return y, xin[xin.shape[0] - (K - 1):].copy()",
        "    return y, state  # MUTANT",
        (LLAMACPP_LOGITS + "[*qwen3next*]", "tests/test_deltanet.py::test_state_carries_over_from_a_chunked_prefill_to_decode"),
        "Gated DeltaNet: the causal conv never updates its state (decode sees zeros instead of the last inputs)"),
    Mutant(
        "recurrent_prefix_reused_from_the_middle", "pymoe/serve/scheduler.py",
        "        if self.model.cfg.has_recurrent_state and reused < slot.kv.n:  # a recurrent state cannot be cut back",
        "        if False:  # MUTANT",
        ("tests/test_deltanet.py::test_server_never_reuses_part_of_a_recurrent_state",),
        "server: a qwen3next slot's prefix is reused from the middle of its recurrent state"),
    Mutant(
        "mla_scale_from_the_cache_head", "pymoe/engine/mla.py",
        "    Q = Q * np.float32(mla_scale(cfg) * np.sqrt(C + R))",
        "    Q = Q * np.float32(mla_scale(cfg) * np.sqrt(C + R)) * np.float32(np.sqrt(cfg.head_dim_mla / (C + R)))  # MUTANT",
        (LLAMACPP_LOGITS + "[*deepseek2*]",),
        "MLA: scores scaled by 1/sqrt(kv_lora_rank + rope) (the cached head) instead of 1/sqrt(key_length_mla)"),
    Mutant(
        "deepseek_expert_groups_ignored", "pymoe/backends/reference.py",
        "    if groups > 1:\n        T, E = choose.shape",
        "    if False:  # MUTANT\n        T, E = choose.shape",
        (LLAMACPP_LOGITS + "[*deepseek2*]",),
        "DeepSeek-V3 routing: the top K are chosen among all experts, not only the best expert groups"),
    Mutant(
        "iq2_xxs_sign_parity_dropped", "pymoe/quant/iquants.py",
        'KSIGNS = np.array([i | (bin(i).count("1") & 1) << 7 for i in range(128)], dtype=np.int64)',
        'KSIGNS = np.array([i for i in range(128)], dtype=np.int64)',
        ("tests/test_iquants.py::test_reference_is_bit_exact_with_ggml_and_gguf[IQ2_XXS]",
         "tests/test_dequant.py::test_reference_is_bit_exact_with_gguf[IQ3_XXS]"),
        "IQ2/IQ3 sign expansion: the implied 8th sign bit (parity of the other 7) is never set"),
    Mutant(
        "tq1_0_digit_order_reversed", "pymoe/quant/ternary.py",
        "    q = (u8(src, s + byte) * POW3[digit]) & 255",
        "    q = (u8(src, s + byte) * POW3[4 - digit]) & 255",
        ("tests/test_iquants.py::test_reference_is_bit_exact_with_ggml_and_gguf[TQ1_0]",
         "tests/test_kernels.py::test_matvec_and_matmul_match_reference[TQ1_0]"),
        "TQ1_0: the five base-3 digits of a byte read in reverse order"),
    Mutant(
        "spec_recurrent_state_not_restored", "pymoe/engine/speculative.py",
        "        if saved is not None and accepted < len(drafts):",
        "        if False:  # MUTANT",
        ("tests/test_speculative.py::test_greedy_speculation_equals_plain_decoding[qwen3next]",),
        "speculative decoding: the Gated DeltaNet state keeps the rejected drafts"),
    Mutant(
        "mtp_inputs_concatenated_in_the_wrong_order", "pymoe/engine/mtp.py",
        "np.concatenate([np.asarray(e), np.asarray(norm(h, self.hnorm, eps))]",
        "np.concatenate([np.asarray(norm(h, self.hnorm, eps)), np.asarray(e)]",
        ("tests/test_speculative.py::test_the_demo_models_trained_mtp_head_agrees_with_the_model_on_held_out_code",),
        "MTP block: [hidden | embedding] into eh_proj instead of [embedding | hidden] (the trained head drafts junk)"),
    Mutant(
        "mtp_first_draft_from_the_first_pair", "pymoe/engine/mtp.py",
        "        last = np.cumsum(counts) - 1  # each sequence's last pair: its first draft",
        "        last = np.cumsum(counts) - np.asarray(counts)  # MUTANT: the first pair's output",
        ("tests/test_speculative.py::test_mtp_drafter_drafts_from_the_newest_pair[*]",),
        "MTP drafting: the first draft is read from the oldest new pair's output, not the newest's"),
    Mutant(
        "server_spec_recurrent_state_not_restored", "pymoe/serve/scheduler.py",
        "            if saved[j] is not None and len(out) - 1 < len(d):",
        "            if False:  # MUTANT",
        ("tests/test_speculative.py::test_several_busy_slots_speculate_in_one_batched_forward[qwen3next-*]",),
        "server speculation over several slots: a hybrid slot's state keeps its rejected drafts"),
    Mutant(
        "ragged_batch_rows_all_at_the_first_position", "pymoe/engine/model.py",
        "np.arange(kv.n, kv.n + rows.stop - rows.start) + _delta(kv)",
        "np.full(rows.stop - rows.start, kv.n) + _delta(kv)",
        ("tests/test_batch.py::test_forward_batch_of_several_tokens_per_sequence_equals_separate_forwards[*]",),
        "forward_batch: every row of a sequence gets RoPE at the sequence's first new position"),
    Mutant(
        "spec_rejection_draws_from_the_full_distribution", "pymoe/engine/sampler.py",
        "        rest = np.where(ids == draft, 0.0, probs)",
        "        rest = probs  # MUTANT",
        ("tests/test_speculative.py::test_rejection_rule_keeps_the_target_distribution",),
        "speculative sampling: a rejected draft can be drawn again (the output over-weights drafted tokens)"),
    Mutant(
        "lfru_use_adds_nothing", "pymoe/experts/policies.py",
        "math.log2(2.0 ** (old - now) + 1.0)",
        "math.log2(2.0 ** (old - now) + 0.0)",
        ("tests/test_policies.py::test_lfru_by_hand_between_lru_and_lfu",),
        "LFRU: a use does not add to the decayed count (a key's score never grows)"),
    Mutant(
        "admission_cap_off_by_one", "pymoe/experts/policies.py",
        "if a.max_inserts and self._inserts >= a.max_inserts:",
        "if a.max_inserts and self._inserts > a.max_inserts:",
        ("tests/test_policies.py::test_admission_by_hand",),
        "admission: one insertion more per layer-step than --max-inserts"),
    Mutant(
        "window_uses_never_age", "pymoe/experts/policies.py",
        "                self.score[k] -= drop",
        "                self.score[k] -= 0.0  # MUTANT",
        ("tests/test_policies.py::test_window_by_hand_prior_window_and_payback",
         "tests/test_policies.py::test_window_heap_and_fifos_decide_as_a_scan_of_the_uses"),
        "window: a use keeps its first weight for ever (the age edges are never crossed: LFU with a prior)"),
    Mutant(
        "window_admits_every_miss", "pymoe/experts/policies.py",
        "        return self.score.get(key, 0.0) >= self.admit_ratio * self.score[self.victim(t)]",
        "        return True  # MUTANT",
        ("tests/test_policies.py::test_window_by_hand_prior_window_and_payback",),
        "window: payback admission off (a miss scored below the victim still takes its slot)"),
    Mutant(
        "cooc_no_lift", "pymoe/experts/compiled_cooc.py",
        "        lift[e] = max((1.0 - keep) - np.float64(q), 0.0)",
        "        lift[e] = 1.0 - keep  # MUTANT",
        ("tests/test_policies.py::test_cooc_by_hand_next_token_lift",),
        "cooc: the bonus is the transition probability itself, not its lift over the expert's base rate"),
    Mutant(
        "compiled_cooc_admits_every_miss", "pymoe/experts/compiled_cooc.py",
        "        return 1 if sc[key] >= fpar[F_ADMIT] * sc[_victim(sc, kv, heap, meta)] else 0",
        "        return 1  # MUTANT",
        ("tests/test_compiled_cooc.py::test_compiled_cooc_decides_as_the_reference*",),
        "compiled cooc: payback admission off (the reference refuses a miss scored below the victim)"),
    Mutant(
        "compiled_cooc_old_bonus_kept", "pymoe/experts/compiled_cooc.py",
        "            sc[g] -= old[i]",
        "            sc[g] -= 0.0  # MUTANT",
        ("tests/test_compiled_cooc.py::test_compiled_cooc_decides_as_the_reference*",),
        "compiled cooc: a bonus no new token renews stays in the key's score"),
    Mutant(
        "compiled_cooc_stale_last_use_live", "pymoe/experts/compiled_cooc.py",
        "        if kv[key, 1] == 1 and sc[key] == heap[0, 0] and kv[key, 0] == heap[0, 1]:",
        "        if kv[key, 1] == 1 and sc[key] == heap[0, 0]:  # MUTANT",
        ("tests/test_compiled_cooc.py::test_compiled_cooc_decides_as_the_reference*",),
        "compiled cooc: a heap entry of an older use of the same score is taken as live (ties by last use lost)"),
    Mutant(
        "decode_step_ignores_the_insert_cap", "pymoe/experts/compiled_cooc.py",
        "            if not hit and not (max_inserts > 0 and rec[o + R_INSERTS] >= max_inserts):",
        "            if not hit:  # MUTANT",
        ("tests/test_cache.py::test_compiled_decode_lookups_are_the_loops*",
         "tests/test_cache.py::test_a_compiled_step_is_its_layer_calls*"),
        "compiled decode lookups: the per-step insert cap is not applied (the loop's SlotTable applies it)"),
    Mutant(
        "compiled_lookups_first_step_always_fresh", "pymoe/experts/cache.py",
        "        rec[cc.R_FRESH], rec[cc.R_INSERTS] = table._step != step0 + 1, table._inserts",
        "        pass  # MUTANT",
        ("tests/test_cache.py::test_compiled_decode_lookups_are_the_loops*",
         "tests/test_cache.py::test_a_compiled_step_is_its_layer_calls*"),
        "compiled decode lookups: the first layer's insert count starts afresh although a prefetch for that step "
        "has already counted against its cap"),
    Mutant(
        "no_pool_step_lookups_dropped", "pymoe/experts/cache.py",
        '        for m, layer in enumerate(layers):\n            self.lookup(layer, ids[m], "decode")',
        '        for m, layer in enumerate(layers[:0]):  # MUTANT\n            self.lookup(layer, ids[m], "decode")',
        ("tests/test_device_counts.py::test_gpu_check_dry_run_in_the_simulator",),
        "no slot pool on a GPU: a device step's lookups are never counted (PassThroughCache.lookup_step)"),
    Mutant(
        "decode_step_heat_counts_an_expert_once", "pymoe/experts/compiled_cooc.py",
        "                heat[layer, e] += 1",
        "                heat[layer, e] = max(heat[layer, e], 1)  # MUTANT",
        ("tests/test_cache.py::test_compiled_decode_lookups_are_the_loops*",
         "tests/test_cache.py::test_a_compiled_step_is_its_layer_calls*"),
        "compiled decode lookups: the heat map marks an expert looked up instead of counting its lookups"),
    Mutant(
        "decode_step_forced_spill_ignored", "pymoe/experts/compiled_cooc.py",
        "                if hit and not (forced.shape[0] > 0 and forced[layer, e]):",
        "                if hit:  # MUTANT",
        ("tests/test_cache.py::test_compiled_decode_lookups_are_the_loops*",
         "tests/test_cache.py::test_a_compiled_step_is_its_layer_calls*"),
        "compiled decode lookups: a forced-spill hit is served from its slot"),
    Mutant(
        "gap_replay_never_bypasses", "pymoe/experts/gap.py",
        "            if nxt[t] >= heap_n[0]:\n                continue  # bypass: used no sooner than the furthest resident",
        "            if False:\n                continue  # MUTANT",
        ("tests/test_simulate.py::test_live_gap_replay_compiled_is_the_slot_tables",),
        "live gap: the compiled Belady replay admits every miss (demand-paging MIN, not MIN with bypass)"),
    Mutant(
        "cooc_bonus_never_replaced", "pymoe/experts/policies.py",
        "        self.bonus[layer] = new",
        "        self.bonus[layer] = {**old, **new}  # MUTANT",
        ("tests/test_policies.py::test_cooc_by_hand_next_token_lift",),
        "cooc: a layer's old bonuses stay when it routes its next token"),
    Mutant(
        "reuse_hazard_never_ages", "pymoe/experts/policies.py",
        "                    self._set_term(k, i + 1)\n",
        "                    pass  # MUTANT\n",
        ("tests/test_policies.py::test_reuse_by_hand_gap_histogram_hazard",),
        "reuse: a key's hazard term stays at its value when last used (its age never moves it to the next bin)"),
    Mutant(
        "reuse_gap_not_counted", "pymoe/experts/policies.py",
        "            own[j] += 1.0\n",
        "            pass  # MUTANT\n",
        ("tests/test_policies.py::test_reuse_by_hand_gap_histogram_hazard",),
        "reuse: a key's own gaps never reach its histogram (only its group's pooled one)"),
    Mutant(
        "grammar_mask_not_applied", "pymoe/engine/sampler.py",
        "            logits = np.where(self.constraint.allowed(), logits, np.float32(-np.inf))",
        "            logits = logits  # MUTANT",
        ("tests/test_server.py::test_response_format_json_schema_output_parses_and_follows_the_schema[1]",),
        "structured output: the grammar's mask never reaches the logits"),
    Mutant(
        "logprobs_at_the_sampling_temperature", "pymoe/engine/sampler.py",
        "            self.last_logprobs = log_probs(z, token, self.top_logprobs)",
        "            self.last_logprobs = log_probs(z / 0.5, token, self.top_logprobs)",
        ("tests/test_server.py::test_chat_logprobs_are_the_log_softmax_of_the_logits",),
        "logprobs: reported from logits scaled by a temperature, not the model's distribution"),
    Mutant(
        "disconnect_polled_only_when_idle", "pymoe/serve/app.py",
        "            if request is not None and time.monotonic() >= next_poll:",
        "            if request is not None and kind is None and time.monotonic() >= next_poll:",
        ("tests/test_server.py::test_a_non_streaming_client_that_leaves_is_noticed_while_tokens_flow",),
        "a non-streaming client's hang-up goes unnoticed while tokens keep coming"),
    Mutant(
        "event_wait_swallows_a_cancel", "pymoe/serve/app.py",
        "        done, _ = await asyncio.wait((get,), timeout=timeout)",
        "        done = [await asyncio.wait_for(get, timeout)]",
        ("tests/test_server.py::test_a_consumer_cancelled_as_an_event_arrives_stops",),
        "a consumer cancelled as an event arrives takes the event and runs on (asyncio.wait_for before 3.12)"),
    Mutant(
        "n_choices_share_one_seed", "pymoe/serve/scheduler.py",
        "        seed = None if self.sampling.seed in (None, -1) else (self.sampling.seed + i) % 2**64  # -1: random",
        "        seed = self.sampling.seed",
        ("tests/test_server.py::test_n_choices",),
        "n > 1: every choice drawn with the request's seed (n copies of one answer)"),
    Mutant(
        "forced_tool_choice_not_constrained", "pymoe/serve/app.py",
        "    if choice is None or (choice == \"auto\" and fmt != \"generic\"):\n        return job.grammar",
        "    if True:  # MUTANT\n        return job.grammar",
        ("tests/test_server.py::test_forced_tool_choice_gives_a_call_that_parses[1]",),
        "tools: a forced tool choice decoded without the call's grammar (the answer need not be a call)"),
    Mutant(
        "prefill_chunk_ignored", "pymoe/serve/scheduler.py",
        "        n = len(slot.pending) if not self.prefill_chunk else min(self.prefill_chunk, len(slot.pending))",
        "        n = len(slot.pending)  # MUTANT",
        ("tests/test_server.py::test_chunked_prefill_interleaves_with_decoding_and_keeps_the_tokens[5]",),
        "chunked prefill: a prompt read whole in one step (the other slots stall for all of it)"),
    Mutant(
        "token_type_outside_the_enum", "pymoe/engine/tokenizer.py",
        "        return UNDEFINED  # llama.cpp gives unknown type numbers",
        "        return TokenType.UNDEFINED  # MUTANT: llama.cpp gives unknown type numbers",
        ("tests/test_fuzz_gguf.py::test_every_mutant_is_valid_or_one_line",),
        "a token type outside gguf-py's enum raises AttributeError (the fuzzer's first finding)"),
    Mutant(
        "seed_minus_one_passed_to_numpy", "pymoe/engine/sampler.py",
        "        self.rng = np.random.default_rng(None if params.seed == -1 else params.seed)",
        "        self.rng = np.random.default_rng(params.seed)",
        ("tests/test_sampler.py::test_seed_minus_one_is_random",),
        "seed -1 (llama.cpp's random) reaches numpy, which raises in the engine thread"),
    Mutant(
        "device_sample_ties_by_larger_id", "cuda_kernels/sample.py",
        "            if keys[j] > ki or (keys[j] == ki and ids[j] < ii):",
        "            if keys[j] > ki or (keys[j] == ki and ids[j] > ii):",
        ("tests/test_cuda_sample_kernel.py::test_the_kernel_draws_the_twins_token[*]",),
        "the device draw orders equal logits by the larger id first (the host's stable sort: the smaller)"),
    Mutant(
        "device_draw_takes_two_uniforms", "pymoe/engine/sampler.py",
        "        self._held_u = float(self.rng.random())",
        "        self._held_u = float(self.rng.random() * 0 + self.rng.random())",
        ("tests/test_cuda_device_step.py::"
         "test_a_seeded_sampled_request_draws_the_cpu_backends_tokens_on_the_device[*]",),
        "a device draw advances the sampler's generator twice: a seed gives other tokens than on the CPU backend"),
    Mutant(
        "anthropic_tool_use_stop_reason_dropped", "pymoe/serve/app.py",
        "                if n_calls and stop_reason == \"end_turn\":\n                    stop_reason = \"tool_use\"",
        "                if False:  # MUTANT\n                    stop_reason = \"tool_use\"",
        ("tests/test_server.py::test_anthropic_tool_use_with_the_official_client",),
        "Anthropic: a streamed answer with a tool call ends with end_turn, not tool_use"),
    Mutant(
        "control_markers_not_preserved", "pymoe/serve/app.py",
        "    return tools.preserved_tokens(fmt, tokenizer) if choice is not None or fmt == \"harmony\" else frozenset()",
        "    return frozenset()  # MUTANT",
        ("tests/test_tool_formats.py::test_markers_that_are_control_tokens_are_shown_so_the_call_is_read",),
        "a tool format's markers that are control tokens vanish from the answer: the call is never read back"),
    Mutant(
        "forced_call_schema_left_open", "pymoe/serve/tools.py",
        "        specs = [{**s, \"parameters\": closed(s.get(\"parameters\"))} for s in specs]\n"
        "        return Grammar.from_request(\"lark\", one_of(",
        "        return Grammar.from_request(\"lark\", one_of(",
        ("tests/test_tool_formats.py::test_forced_grammar_accepts_the_template_text_and_generates_calls[*]",
         "tests/test_tool_formats.py::test_a_forced_call_closes_when_the_schema_leaves_other_keys_open"),
        "a forced call's arguments stay open to more keys: a weak model never closes the call"),
    Mutant(
        "shared_prefill_drops_recurrent_state", "pymoe/engine/kv.py",
        "        self.restore_recurrent(other.save_recurrent())\n",
        "",
        ("tests/test_server.py::test_n_choices_share_one_prefill_and_equal_separate_requests[*]",),
        "n > 1 on a hybrid: the siblings' copied prompt lacks the Gated DeltaNet state (wrong continuations)"),
    Mutant(
        "prefetch_victim_stays_resident", "pymoe/experts/cache.py",
        "                self.residency[lay, old] = -1\n                self._prefetched.get(lay, set()).discard(old)",
        "                self._prefetched.get(lay, set()).discard(old)  # MUTANT: residency left",
        ("tests/test_cuda_backend.py::test_lookahead_prefetch_turns_misses_into_hits[*]",
         "tests/test_prefetch.py::*"),
        "a lookahead prefetch evicts an expert but its residency still points at the slot (read with another's bytes)"),
    Mutant(
        "tile_scale_of_the_next_row", "pymoe/quant/repack.py",
        "_vec(_i32, 16, [r // 2 for r in range(16)])",
        "_vec(_i32, 16, [(r // 2 + 1) % 8 for r in range(16)])",
        ("tests/test_repack.py::test_tile_dot_has_the_bits_of_the_row_dots[*]",
         "tests/test_repack.py::test_fused_moe_kernel_reads_the_tiles_with_the_same_bits[*]"),
        "the repacked Q4_K dot multiplies each row's sub-block sums by the next row's scales"),
    Mutant(
        "tile_matvec3_skips_a_row_group_of_k", "pymoe/quant/repack.py",
        "for g in range(4 * (task - b0), min(n1, 4 * (task - b0) + 4)):\n                TILE_DOT_1(",
        "for g in range(4 * (task - b0), min(n1, 4 * (task - b0) + 3)):\n                TILE_DOT_1(",
        ("tests/test_repack.py::test_three_matrix_decode_call_has_the_bits_of_three_calls[*]",),
        "the three-matrix decode call (q, k, v) leaves one row-group of k's in four unwritten"),
    Mutant(
        "tile_mxfp4_scale_of_the_next_group", "pymoe/quant/repack.py",
        "ev = b.zext(e.load(wbase, e.at(t, 8 * g), ir.VectorType(_i8, 8)), _V8I)",
        "ev = b.zext(e.load(wbase, e.at(t, 8 * (g ^ 1)), ir.VectorType(_i8, 8)), _V8I)",
        ("tests/test_repack.py::test_tile_dot_has_the_bits_of_the_row_dots[*MXFP4]",),
        "the repacked MXFP4 dot scales each group by its neighbour group's E8M0 scale"),
    Mutant(
        "tile_q2_k_min_is_the_whole_byte", "pymoe/quant/repack.py",
        "[4] * m8.type.count)), e.VI)",
        "[0] * m8.type.count)), e.VI)",
        ("tests/test_repack.py::test_tile_dot_has_the_bits_of_the_row_dots[*Q2_K]",
         "tests/test_repack.py::test_decode_with_repacking_has_the_bits_of_decode_without[Q2_K-8]"),
        "the repacked Q2_K dot takes a sub-block's whole scale byte as its min (not the high nibble)"),
    Mutant(
        "tile_q6_k_bias_off_by_one", "pymoe/quant/repack.py",
        "bias, chunks_per_madd = 32, 2",
        "bias, chunks_per_madd = 31, 2",
        ("tests/test_repack.py::test_tile_dot_has_the_bits_of_the_row_dots[*Q6_K]",
         "tests/test_repack.py::test_decode_with_repacking_has_the_bits_of_decode_without[Q4_K_M-8]"),
        "the repacked Q6_K dot brings back 31 * bsum instead of 32 (every weight off by one step)"),
    Mutant(
        "tile_vnni_scale_sign_lost", "pymoe/quant/repack.py",
        "return s if sc8 is None else self.b.mul(s, (self.b.sext if signed else self.b.zext)(sc8, self.VI))",
        "return s if sc8 is None else self.b.mul(s, self.b.zext(sc8, self.VI))",
        ("tests/test_repack.py::test_tile_dot_has_the_bits_of_the_row_dots[*Q6_K]",
         "tests/test_repack.py::test_every_form_of_the_tile_dot_has_the_same_bits[Q3_K-*]"),
        "the VNNI tile dot reads Q6_K's signed scales as unsigned (a negative scale becomes 256 + sc); "
        "only CPUs with VNNI run that form: elsewhere this mutant survives"),
    Mutant(
        "tile_wide_fold_drops_the_second_chunk", "pymoe/quant/repack.py",
        "b.shuffle_vector(s, s, _vec(_i32, 8, range(8, 16))))",
        "b.shuffle_vector(s, s, _vec(_i32, 8, range(8))))",
        ("tests/test_repack.py::test_tile_dot_has_the_bits_of_the_row_dots[*Q4_K]",
         "tests/test_repack.py::test_every_form_of_the_tile_dot_has_the_same_bits[Q4_K-vnni-wide]"),
        "the wide (512-bit) Q4_K tile dot adds its first chunk's lanes twice and drops the second's; only CPUs "
        "with AVX-512 VNNI compile that form (Zen 4 tests it without running it by default): elsewhere this mutant "
        "survives"),
    Mutant(
        "two_row_twice_reads_the_first_plane_twice", "pymoe/quant/repack.py",
        "            one(tiles, xq[1], xd[1], xbs[1], out[1])",
        "            one(tiles, xq[0], xd[0], xbs[0], out[1])",
        ("tests/test_repack.py::test_two_row_dot_twice_has_the_bits_of_one_token_calls[*",),
        "the two-row dot's form `twice` (two one-token calls) gives the hi plane's result for the lo plane"),
    Mutant(
        "q8_0_dense_dots_hinted_again", "pymoe/quant/repack.py",
        "_NO_DENSE_HINTS = {QType.Q8_0}",
        "_NO_DENSE_HINTS = set()",
        ("tests/test_repack.py::test_dense_hints_per_format",),
        "Q8_0's dense dots ask for bytes ahead again, measured slower (bench/dense_ahead.py)"),
    Mutant(
        "padded_tile_rows_kept", "pymoe/backends/cpu.py",
        "        return y if y.shape[1] == w.shape[0] else np.ascontiguousarray(y[:, :w.shape[0]])",
        "        return y",
        ("tests/test_repack.py::test_dense_rows_past_the_last_tile_pad_it[*",),
        "the results of the zero rows that pad a dense weight's last tile are returned as rows of the product"),
    Mutant(
        "zen4_runs_the_intel_forms", "pymoe/quant/repack.py",
        "CPU_FORMS = {\"znver4\": {\"narrow\": WIDE, \"plain\": DUAL}}",
        "CPU_FORMS = {}",
        ("tests/test_repack.py::test_two_row_forms_follow_the_cpu_and_the_environment",),
        "Zen 4 runs Intel's forms of the tile dots (wide, dual), measured slower there"),
    Mutant(
        "form_tag_left_out_of_kernel_names", "pymoe/quant/repack.py",
        "f\"_s{STREAM_AHEAD}_l{qact.DENSE_LOCALITY}_{FORM_TAG}_{DENSE_TAG}\"",
        "f\"_s{STREAM_AHEAD}_l{qact.DENSE_LOCALITY}_{DENSE_TAG}\"",
        ("tests/test_repack.py::test_two_row_forms_follow_the_cpu_and_the_environment",),
        "the chosen forms are not in the dense products' kernel names: Numba's cache hands one form's kernels to a "
        "process that asked for another (PYMOE_DUAL, PYMOE_TWICE, PYMOE_WIDE_FORMATS)"),
    Mutant(
        "tile_iq4_xs_offset_off_by_one", "pymoe/quant/repack.py",
        "e.splat(e.b.mul(x.bsum32(e, g), ir.Constant(_i32, 128)), _i32, 8))",
        "e.splat(e.b.mul(x.bsum32(e, g), ir.Constant(_i32, 127)), _i32, 8))",
        ("tests/test_repack.py::test_tile_dot_has_the_bits_of_the_row_dots[*IQ4_XS]",
         "tests/test_repack.py::test_tile_dot_has_the_bits_of_the_row_dots[*Q8_0]",
         "tests/test_repack.py::test_tile_dot_has_the_bits_of_the_row_dots[*MXFP4]",
         "tests/test_repack.py::test_decode_with_repacking_has_the_bits_of_decode_without[IQ4_XS-8]"),
        "the VNNI IQ4_XS, MXFP4 and Q8_0 tile dots take 127 * bsum off the weights + 128 (every weight one step high); "
        "only CPUs with VNNI run that form: elsewhere this mutant survives"),
    Mutant(
        "rmsnorm_parallel_skips_a_row", "pymoe/backends/cpu.py",
        "for t in range(16 * task, min(N, 16 * task + 16)):",
        "for t in range(16 * task, min(N, 16 * task + 15)):",
        ("tests/test_kernels_cpu_backend.py::test_rmsnorm_and_rope_hooks_are_bit_identical_to_numpy",),
        "a prefill chunk's rmsnorm leaves one row in 16 unwritten"),
    Mutant(
        "pair_start_off_by_one", "pymoe/quant/repack.py",
        "ir.Constant(_i32, -128)), _i32)",
        "ir.Constant(_i32, -127)), _i32)",
        ("tests/test_repack.py::test_two_row_group_dot_has_the_bits_of_two_calls[*",
         "tests/test_repack.py::test_tile_dot_has_the_bits_of_the_row_dots[*IQ4_XS]"),
        "the two-row-group IQ4_XS and Q8_0 dots start their sums from -127 * bsum (every weight one step high); "
        "only CPUs with 512-bit VNNI run that form: elsewhere this mutant survives"),
    Mutant(
        "sim_swap_not_counted", "pymoe/backends/simulator.py",
        "    sim_kernel.swapped_cuda_module = swapped_cuda_module\n",
        "",
        ("tests/test_simulator.py::test_a_device_function_of_another_module_reads_cuda_after_its_barrier",),
        "the simulator's own swap of a module's `cuda` stays: the first thread out of a device function puts the real "
        "module back under the others"),
    Mutant(
        "sim_barrier_one_thread_early", "pymoe/backends/simulator.py",
        "                if self.waiting == self.live:",
        "                if self.waiting >= self.live - 1:",
        ("tests/test_simulator.py::test_barriers_in_another_modules_device_function_give_numpys_sums",
         "tests/test_simulator.py::test_threads_that_returned_do_not_hold_a_barrier"),
        "the barrier lets the block through while one thread has not arrived: it reads what that thread has not yet "
        "written"),
    Mutant(
        "header_cache_read_is_not_a_use", "pymoe/gguf/header.py",
        "            os.utime(entry)  # used now: the last to be pruned",
        "            pass",
        ("tests/test_loader.py::test_the_header_cache_keeps_the_entries_used_last",),
        "pruning by the time an entry was written, not last read: the entry in use goes first"),
    Mutant(
        "header_cache_views_at_offset_zero", "pymoe/gguf/header.py",
        "view = plain[offset:offset + n_bytes].view(np.dtype(dtype)).reshape(data_shape)",
        "view = plain[:n_bytes].view(np.dtype(dtype)).reshape(data_shape)",
        ("tests/test_loader.py::test_the_header_cache_gives_the_parsed_model_back_and_only_for_the_same_file",),
        "a cached tensor's view starts at the file's first byte instead of its offset"),
    Mutant(
        "bound_fitted_copies_never", "pymoe/experts/bound.py",
        "            if past.size and np.random.random() < locality:\n                for _try in range(8):",
        "            if past.size and np.random.random() < 0.0:\n                for _try in range(8):",
        ("tests/test_bound.py::test_the_pick_probabilities_match_the_generators_draws",),
        "the fitted sampler never copies a past lookup: its probabilities are the popularity alone"),
    Mutant(
        "bound_one_key_too_many", "pymoe/experts/bound.py",
        "top = np.take_along_axis(flat, order[:, :slots], axis=1)",
        "top = np.take_along_axis(flat, order[:, :slots + 1], axis=1)",
        ("tests/test_bound.py::test_an_iid_one_pick_trace_has_the_bound_by_hand",),
        "the best set holds C + 1 keys: the bound counts one slot more than the pool has"),
    Mutant(
        "tile_low16_sign_lost", "pymoe/quant/repack.py",
        "return self.b.zext(self.b.sext(v8, ir.VectorType(_i16, v8.type.count)), self.VI)",
        "return self.b.zext(v8, self.VI)",
        ("tests/test_repack.py::test_tile_dot_has_the_bits_of_the_row_dots[*Q3_K]",
         "tests/test_repack.py::test_tile_dot_has_the_bits_of_the_row_dots[*Q6_K]"),
        "the vpmaddwd products read Q3_K's and Q6_K's signed scales as unsigned bytes (a negative scale becomes 256 + sc)"),
    Mutant(
        "dual_second_plane_reads_the_first", "pymoe/quant/repack.py",
        "second = e.splat(e.load(self.c.xbase, e.at(self.c.xo, k), _i32), _i32, 16)",
        "second = e.splat(e.load(self.a.xbase, e.at(self.a.xo, k), _i32), _i32, 16)",
        ("tests/test_repack.py::test_dual_two_row_dot_has_the_bits_of_one_token_calls[*",
         "tests/test_repack.py::test_two_plane_decode_calls_have_the_bits_of_one_token_calls[*"),
        "the dual two-row dot meets the second plane's lanes with the first plane's activations; only CPUs with "
        "512-bit VNNI run that form: elsewhere this mutant survives"),
    Mutant(
        "gfni_bits_matrix_reversed", "pymoe/quant/repack.py",
        "m[7 - (at + i)] = 1 << (lo + i)",
        "m[at + i] = 1 << (lo + i)",
        ("tests/test_repack.py::test_tile_dot_has_the_bits_of_the_row_dots[*Q2_K]",
         "tests/test_repack.py::test_tile_dot_has_the_bits_of_the_row_dots[*Q6_K]"),
        "the GFNI bit-field extraction writes the fields to the mirrored bit positions; only CPUs with GFNI run it: "
        "elsewhere this mutant survives"),
    Mutant(
        "pair_second_row_group_reads_the_first", "pymoe/quant/repack.py",
        "self.load(wbase, self.b.add(off, self.stride), ty)",
        "self.load(wbase, off, ty)",
        ("tests/test_repack.py::test_two_row_group_dot_has_the_bits_of_two_calls[*",
         "tests/test_repack.py::test_fused_moe_kernel_reads_the_tiles_with_the_same_bits[*"),
        "lanes 8-15 of the two-row-group dot read the first row-group's tiles again; only CPUs with 512-bit VNNI "
        "run that form: elsewhere this mutant survives"),
    Mutant(
        "decoded_gate_rows_one_row_off", "pymoe/quant/kernels.py",
        "DECODE_GATE(gate[r + j], dg[j // TILE_ROWS], j % TILE_ROWS)",
        "DECODE_GATE(gate[r + j], dg[j // TILE_ROWS], (j + 1) % TILE_ROWS)",
        ("tests/test_repack.py::test_fused_moe_kernel_decodes_iq_experts_with_the_bits_of_one_token_calls[*",),
        "the MoE kernel decodes each gate row of an IQ expert into the scratch tile's next row (prefill, 8-bit)"),
    Mutant(
        "decoded_down_second_row_group_columns", "pymoe/quant/kernels.py",
        "y[tok[a + m], r + q * TILE_ROWS + j] += weight[a + m] * out8[j]",
        "y[tok[a + m], r + j] += weight[a + m] * out8[j]",
        ("tests/test_repack.py::test_fused_moe_kernel_decodes_iq_experts_with_the_bits_of_one_token_calls[*",),
        "a decoded down step's second row-group adds its leftover tokens' results into the first's columns"),
    Mutant(
        "decoded_dot_bsum_of_the_wrong_sub_block", "pymoe/quant/repack.py",
        "minus = [e.b.mul(e.load(x.bsbase, e.at(x.bso, k), _i32)",
        "minus = [e.b.mul(e.load(x.bsbase, e.at(x.bso, 2 * g), _i32)",
        ("tests/test_repack.py::test_decoded_layout_holds_the_weights_and_gives_the_row_dots_bits[*",),
        "the decoded layout's VNNI dot takes 128 times the group's first bsum off both of its sub-blocks' sums; "
        "only CPUs with VNNI run that form: elsewhere this mutant survives"),
    Mutant(
        "decoded_scale_of_the_first_half", "pymoe/quant/qact.py",
        "for half, lane in ((0, 0), (1, 8)):",
        "for half, lane in ((0, 0), (1, 0)):",
        ("tests/test_repack.py::test_decoded_layout_holds_the_weights_and_gives_the_row_dots_bits[IQ2_XS]",),
        "row_decode stores a group's first sub-block scale for both of its halves (IQ2_XS's scales are per 16)"),
    Mutant(
        "decode_tiles_row_groups_folded", "pymoe/quant/repack.py",
        "ROW_DECODE(raw[r], out[r // ROWS], r % ROWS)",
        "ROW_DECODE(raw[r], out[(r // ROWS) % 2], r % ROWS)",
        ("tests/test_repack.py::test_decoded_layout_holds_the_weights_and_gives_the_row_dots_bits[IQ1_S]",),
        "decode_tiles (matmul_act's decoded prefill) writes row-groups 2, 3, ... over the first two"),
    Mutant(
        "moe_tile_chunk_tail_dropped", "pymoe/quant/kernels.py",
        "                            for m in range(i, c1):",
        "                            for m in range(i, c1 - 1):",
        ("tests/test_repack.py::test_fused_moe_kernel_reads_the_tiles_with_the_same_bits[Q4_K-Q6_K]",),
        "the fused MoE kernel's down over repacked tiles skips the last single token of each chunk of TILE_TOKENS"),
    Mutant(
        "quantize_act_lane_max_short", "pymoe/quant/qact.py",
        "            for i in range(SUB):\n                lanes[i] = max(lanes[i], abs(xb[SUB * s + i]))",
        "            for i in range(SUB - 1):\n                lanes[i] = max(lanes[i], abs(xb[SUB * s + i]))",
        ("tests/test_kernels_qact.py::test_quantize_act_matches_reference[*]",),
        "the Numba activation quantizer's block maximum skips every 16th value (lane 15 of its running maxima)"),
    Mutant(
        "tile_q5_k_int16_overflow", "pymoe/quant/repack.py",
        "if five and not e.vnni and c == 3:",
        "if five and not e.vnni and c == 99:",
        ("tests/test_repack.py::test_tile_dot_at_the_int16_bound[Q5_K]",),
        "the AVX2 and portable Q5_K tile dots sum a whole sub-block's pair sums in int16 (62992 at most): they "
        "overflow at the largest weights"),
    Mutant(
        "tile_q8_0_group_scale_of_the_next_group", "pymoe/quant/repack.py",
        "d8 = b.fpext(e.per_row(wbase, e.at(t, 16 * g), ir.VectorType(ir.HalfType(), 8)), e.VF)",
        "d8 = b.fpext(e.per_row(wbase, e.at(t, 16 * ((g + 1) % 8)), ir.VectorType(ir.HalfType(), 8)), e.VF)",
        ("tests/test_repack.py::test_tile_dot_has_the_bits_of_the_row_dots[*Q8_0]",
         "tests/test_repack.py::test_decode_with_repacking_has_the_bits_of_decode_without[Q8_0-8]"),
        "the repacked Q8_0 dot scales each group by the next group's d"),
    Mutant(
        "repack_iq4_xs_scale_bias", "pymoe/quant/repack.py",
        "t[16 + 8 * j + r] = np.uint8((ls - 32) & 255)",
        "t[16 + 8 * j + r] = np.uint8((ls - 31) & 255)",
        ("tests/test_repack.py::test_repack_is_the_reference_layout_and_comes_back[IQ4_XS]",),
        "the compiled IQ4_XS repacking stores each 6-bit scale minus 31 (every group's scale one too large)"),
    Mutant(
        "repack_chunks_reversed", "pymoe/quant/repack.py",
        "t[dst + 32 * c + 4 * r + i] = blk[src + 4 * c + i]",
        "t[dst + 32 * (c ^ 1) + 4 * r + i] = blk[src + 4 * c + i]",
        ("tests/test_repack.py::test_repack_is_the_reference_layout_and_comes_back[*]",
         "tests/test_repack.py::test_decode_with_repacking_has_the_bits_of_decode_without[*]"),
        "the compiled repacking swaps neighbouring 4-weight chunks (x meets the wrong weights)"),
    Mutant(
        "exact_block_mins_added", "pymoe/quant/qact.py",
        "a0 = fma1(msum, builder.fneg(builder.fmul(dmin, dx)), a0)",
        "a0 = fma1(msum, builder.fmul(dmin, dx), a0)",
        ("tests/test_kernels_qact.py::test_int_matvec_and_matmul[Q4_K-8]",),
        "8-bit Q4_K (exact per-block sums): the mins term added instead of subtracted"),
    Mutant(
        "exact_group_scale_swapped", "pymoe/quant/qact.py",
        "builder.extract_element(ddx, ir.Constant(i32, g)), a0])",
        "builder.extract_element(ddx, ir.Constant(i32, g ^ 1)), a0])",
        ("tests/test_kernels_qact.py::test_int_matvec_and_matmul[MXFP4-8]",),
        "8-bit MXFP4 (exact per-group sums): each group's sum scaled by its neighbour's scale"),
    Mutant(
        "probe_reads_dense_layers", "pymoe/experts/probe.py",
        "for i in cfg.moe_layers[:layers] for e",
        "for i in range(min(layers, cfg.n_layers)) for e",
        ("tests/test_every_command.py::test_every_command_on_every_family[glm4moe]",),
        "pymoe probe asks the leading dense layers for experts (KeyError on glm4moe / deepseek2)"),
    Mutant(
        "trace_profile_layers_unshifted", "pymoe/experts/cache.py",
        "return [int(k) + self.first_moe * self.n_experts for k in profile.keys()]",
        "return [int(k) for k in profile.keys()]",
        ("tests/test_every_command.py::test_every_command_on_every_family[glm4moe]",
         "tests/test_cache.py::test_slots_never_sit_empty"),
        "a profile's MoE layers taken as the model's layers: the slots pre-filled with a dense layer's (no) experts"),
    Mutant(
        "unknown_tensor_accepted", "pymoe/gguf/loader.py",
        "            if block is not None and cfg.n_layers <= block < n_blocks:",
        "            if True:",
        ("tests/test_every_command.py::test_blocks_beyond_block_count_are_refused",
         "tests/test_every_command.py::test_a_tensor_under_an_unknown_name_is_refused"),
        "a tensor the metadata does not account for is loaded without a word (llama.cpp refuses the file)"),
    Mutant(
        "governor_counts_own_threads", "pymoe/backends/threads.py",
        "self.others = max(0.0, busy_cores - own_cores)",
        "self.others = max(0.0, busy_cores)",
        ("tests/test_threads.py::test_the_team_is_the_cores_the_others_leave[*]",),
        "the governor counts this process's own threads as others': a quiet machine runs one thread"),
    Mutant(
        "team_set_once_for_all_threads", "pymoe/backends/cpu.py",
        "        me = threading.get_ident()",
        "        me = 0",
        ("tests/test_threads.py::test_the_count_is_set_in_the_calling_thread",),
        "the team size is set in one thread only: the server's scheduler thread keeps Numba's default"),
    # images (docs/vision.md)
    Mutant(
        "vision_rope_rows_cols_swapped", "pymoe/vision/encoder.py",
        "ang = np.concatenate([pos[:, :1] * inv, pos[:, 1:] * inv], axis=1)",
        "ang = np.concatenate([pos[:, 1:] * inv, pos[:, :1] * inv], axis=1)",
        ("tests/test_vision.py::test_embeddings_match_transformers[*]",),
        "the vision tower's 2-D RoPE turns the first quarter of a head by the column, the second by the row"),
    Mutant(
        "vision_patches_in_raster_order", "pymoe/vision/encoder.py",
        "x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # by, bx, dy, dx, c, py, px",
        "x = x.transpose(1, 2, 4, 5, 0, 3, 6)  # by, dy, bx, dx, c, py, px",
        ("tests/test_vision.py::test_pixels_equal_transformers_processor[*]",
         "tests/test_vision.py::test_embeddings_match_transformers[*]"),
        "patches in raster order within a row of groups: the 2 x 2 merge joins the wrong patches"),
    Mutant(
        "imrope_h_and_w_swapped", "pymoe/engine/model.py",
        "axes[i] = 1 if s % 3 == 1 and s < 3 * sections[1] else 2 if s % 3 == 2 and s < 3 * sections[2] else 0",
        "axes[i] = 2 if s % 3 == 1 and s < 3 * sections[1] else 1 if s % 3 == 2 and s < 3 * sections[2] else 0",
        ("tests/test_vision_llamacpp.py::test_logits_after_an_image_match_llamacpp[*]",
         "tests/test_vision_deepstack.py::test_logits_with_an_image_match_transformers[*]"),
        "M-RoPE pairs of the h section turn by the image column, those of the w section by the row"),
    Mutant(
        "image_rope_shift_dropped", "pymoe/engine/model.py",
        "            kv.shifts.append((kv.n, int(media.next_position - kv.n)))",
        "            pass",
        ("tests/test_vision_llamacpp.py::test_decode_after_an_image_goes_on_from_the_shifted_position",),
        "decode after an image goes on at the storage index, not max(rows, cols) past the image's start"),
    Mutant(
        "image_rows_not_placed", "pymoe/engine/model.py",
        "            x[media.rows] = media.embeddings[:, :D]",
        "            pass  # ",
        ("tests/test_vision_llamacpp.py::test_logits_after_an_image_match_llamacpp[*]",),
        "the image pad tokens keep their own embedding rows: the picture never reaches the model"),
    Mutant(
        "device_split_ignores_sizes", "pymoe/backends/multi_device.py",
        "split(n_layers, [max(u, 1e-9) for u in usable])",
        "split(n_layers, [1.0 for u in usable])",
        ("tests/test_multi_device.py::test_the_split_is_the_planners_and_each_device_holds_its_layers[*]",),
        "several devices get equal layer ranges whatever their memory: not the planner's split"),
    Mutant(
        "device_pool_serves_every_layer", "pymoe/experts/device_caches.py",
        "gpu=True, layers=r,",
        "gpu=True, layers=None,",
        ("tests/test_multi_device.py::test_per_device_counters_equal_the_simulators_one_pool_per_card",),
        "each device's slot pool is filled with (and paced by) every layer's experts, not its own layers'"),
    Mutant(
        "deepstack_parts_one_layer_late", "pymoe/engine/model.py",
        "x[media.rows] += media.embeddings[:, (i + 1) * x.shape[1]:(i + 2) * x.shape[1]]",
        "x[media.rows] += media.embeddings[:, i * x.shape[1]:(i + 1) * x.shape[1]]",
        ("tests/test_vision_deepstack.py::test_logits_after_an_image_match_llamacpp[*]",),
        "layer k gets deepstack part k - 1 (layer 0 the main rows again): the parts are off by one"),
    Mutant(
        "deepstack_merger_norm_per_patch", "pymoe/vision/encoder.py",
        "h = layer_norm(x.reshape(-1, c.n_embd * c.merge * c.merge), f(\"norm.weight\"), f(\"norm.bias\"), c.eps)",
        "h = layer_norm(x, f(\"norm.weight\")[:c.n_embd], f(\"norm.bias\")[:c.n_embd], c.eps).reshape("
        "-1, c.n_embd * c.merge * c.merge)",
        ("tests/test_vision_deepstack.py::test_deepstack_tower_matches_clip_cpp[*]",),
        "the deepstack merger normalises each patch (the main merger's pre-shuffle norm), not the 4D-wide row"),
    Mutant(
        "step_routed_experts_ignore_the_table", "cuda_kernels/step.py",
        "    if s >= 0:  # uniform in the block: the barriers below are reached by every thread",
        "    if s >= 1 << 30:  # uniform in the block: the barriers below are reached by every thread",
        ("tests/test_cuda_step_kernels.py::test_routed_experts_read_slots_and_the_mapped_file_as_the_table_says",),
        "the device step's gate/up kernel reads every expert from the mapped file, whatever the residency table says"),
    Mutant(
        "step_route_ties_to_the_higher_id", "cuda_kernels/step.py",
        "                if best < 0 or p > bp:",
        "                if best < 0 or p >= bp:",
        ("tests/test_cuda_step_kernels.py::test_route_softmax_matches_the_reference_router[*]",),
        "the device router's top-K breaks ties towards the higher expert id (the reference: the lower)"),
    Mutant(
        "step_table_never_uploaded", "pymoe/backends/cuda.py",
        "        if residency is None or not self.step_ready():",
        "        if True:",
        ("tests/test_cuda_device_step.py::test_a_device_step_moves_token_ids_and_routing_ids_only[*]",),
        "the device step's residency table stays all -1: every expert read over PCIe, slots never used"),
    Mutant(
        "step_cpu_miss_also_on_the_device", "pymoe/backends/cuda.py",
        "            elif ex.where != \"cpu\":  # spill: read over PCIe",
        "            else:  # spill: read over PCIe",
        ("tests/test_cuda_device_step.py::test_device_step_logits_match_the_float_path[cpu misses-*]",),
        "a device step's \"cpu\" miss is also read over PCIe by the kernels: its term added twice"),
    Mutant(
        "gpt_oss_step_window_one_wider", "cuda_kernels/gpt_oss.py",
        "first = max(0, pos - window + 1) if window else 0",
        "first = max(0, pos - window) if window else 0",
        ("tests/test_cuda_gpt_oss_kernels.py::test_decode_attention_with_window_and_sinks_matches_the_reference[*]",),
        "gpt-oss's device attention lets one position too many into the sliding window"),
    Mutant(
        "chunk_attention_window_one_wider", "cuda_kernels/attention.py",
        "        first = n_keys - window",
        "        first = n_keys - window - 1",
        ("tests/test_cuda_kernels.py::test_chunk_attention_matches_reference_and_the_decode_kernel[window-sinks]",),
        "prefill attention on the device lets one position too many into the sliding window"),
    Mutant(
        "gpt_oss_step_sink_not_in_denominator", "cuda_kernels/gpt_oss.py",
        "        total += math.exp(sinks[h] - best)",
        "        total += np.float32(0.0)",
        ("tests/test_cuda_gpt_oss_kernels.py::test_decode_attention_with_window_and_sinks_matches_the_reference[*]",),
        "gpt-oss's device attention takes the sink into the maximum but not into the softmax's denominator"),
    Mutant(
        "gpt_oss_step_down_bias_dropped", "cuda_kernels/step.py",
        "                total += w[t, j] * (acc[0] + b_down[e, d])",
        "                total += w[t, j] * acc[0]",
        ("tests/test_cuda_gpt_oss_kernels.py::test_routed_oai_experts_read_slots_and_the_mapped_file_as_the_table_says",),
        "gpt-oss's device experts leave out the down projection's bias"),
    Mutant(
        "batch_kv_rows_all_into_the_first_cache", "cuda_kernels/batch_step.py",
        "    c = seqs[b]",
        "    c = seqs[0]",
        ("tests/test_cuda_batch_step.py::test_kv_store_rows_writes_each_row_into_its_own_cache",),
        "the batched step writes every row's K/V into the first row's sequence"),
    Mutant(
        "batch_lookups_of_the_first_row", "pymoe/engine/device_batch.py",
        "cache.lookup_step(list(cfg.moe_layers), np.asarray(ids[j])",
        "cache.lookup_step(list(cfg.moe_layers), np.asarray(ids[0])",
        ("tests/test_cuda_batch_step.py::test_a_batched_step_equals_single_steps[*tiny*]",
         "tests/test_cuda_batch_step.py::test_the_simulator_replays_a_batched_run_with_its_counts[*]"),
        "the batched step's cache lookups use the first row's routing ids for every row"),
]


# --- the copy --------------------------------------------------------------------------------------------------------

def git_files(repo: Path) -> list[str]:
    """Tracked files plus untracked files that are not ignored, as the working tree has them now."""
    out = []
    for args in (["ls-files", "-z"], ["ls-files", "-z", "--others", "--exclude-standard"]):
        r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, check=True)
        out += [p for p in r.stdout.decode().split("\0") if p]
    return sorted(set(out))


def snapshot(repo: Path, dest: Path) -> int:
    """Copy the working tree's files (git's view) to dest -> the number of files copied."""
    n = 0
    for rel in git_files(repo):
        src = repo / rel
        if not src.is_file():  # deleted in the working tree, or a submodule
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
        n += 1
    return n


def check_table(tree: Path, mutants: list[Mutant]) -> list[str]:
    """-> one line per mutant whose `old` does not occur exactly once in its file (the table is stale)."""
    problems, names = [], set()
    for m in mutants:
        if m.name in names:
            problems.append(f"{m.name}: duplicate mutant name")
        names.add(m.name)
        f = tree / m.path
        if not f.is_file():
            problems.append(f"{m.name}: {m.path} does not exist")
            continue
        n = f.read_text().count(m.old)
        if n != 1:
            problems.append(f"{m.name}: `old` occurs {n} times in {m.path} (must be exactly once):\n    {m.old!r}")
        if m.old == m.new:
            problems.append(f"{m.name}: `new` equals `old`")
    return problems


def apply(tree: Path, m: Mutant) -> int:
    """Apply mutant m to the copy at tree -> the 1-based line of the change."""
    f = tree / m.path
    text = f.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"run_mutants: {m.name}: `old` does not occur exactly once in {m.path}")
    f.write_text(text.replace(m.old, m.new))
    return text[:text.index(m.old)].count("\n") + 1


def spot(tree: Path, m: Mutant) -> str:
    text = (tree / m.path).read_text()
    i = text.find(m.old)
    return f"{m.path}:{text[:i].count(chr(10)) + 1}" if i >= 0 else m.path


# --- which modules a mutation can reach through Numba's cache -----------------------------------------------------------

def module_of(tree: Path, path: Path) -> str:
    rel = path.relative_to(tree).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph(tree: Path, package: str = "pymoe") -> dict:
    """module -> set of pymoe modules it imports (any import statement, also inside functions)."""
    files = {module_of(tree, p): p for p in (tree / package).rglob("*.py")}
    graph = {m: set() for m in files}
    for mod, path in files.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # `from pkg import sub` depends on the submodule only; `from mod import name` on mod
                subs = [f"{base}.{a.name}" for a in node.names]
                targets = [t for t in subs if t in files]
                if len(targets) < len(subs):
                    targets.append(base)
            else:
                continue
            graph[mod].update(t for t in targets if t in files)
    return graph


def importers_of(graph: dict, module: str) -> set:
    """module and every module that imports it, directly or through others."""
    seen, todo = {module}, [module]
    while todo:
        m = todo.pop()
        for other, deps in graph.items():
            if m in deps and other not in seen:
                seen.add(other)
                todo.append(other)
    return seen


def numba_cache_subdir(cache: Path, source_dir: Path) -> Path:
    """Where Numba (UserProvidedCacheLocator) keeps the cache of functions defined in source_dir."""
    import hashlib

    d = os.path.abspath(source_dir)
    return cache / "_".join([os.path.split(d)[-1], hashlib.sha1(d.encode()).hexdigest()])


def seed_numba_cache(base_cache: Path, cache: Path, tree: Path, modules: set) -> int:
    """cache = base_cache minus the entries of `modules` -> the number of files left out."""
    shutil.copytree(base_cache, cache)
    dropped = 0
    for mod in modules:
        path = tree / (mod.replace(".", "/") + ".py")
        if not path.is_file():
            path = tree / mod.replace(".", "/") / "__init__.py"
        sub = numba_cache_subdir(cache, path.parent)
        stem = path.stem + "."
        if sub.is_dir():
            for f in sub.iterdir():
                if f.name.startswith(stem):
                    f.unlink()
                    dropped += 1
    return dropped


# --- running pytest in the copy ---------------------------------------------------------------------------------------

def env_for(tree: Path, numba_cache: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["NUMBA_CACHE_DIR"] = str(numba_cache)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYMOE_REQUIRE_ORACLE"] = "1"  # a missing llama.cpp oracle fails (is visible) instead of skipping
    for k in ("PYMOE_EXACT", "PYMOE_ACT_BITS", "PYTEST_ADDOPTS"):  # the default paths are what is being tested
        env.pop(k, None)
    return env


def check_import_location(tree: Path, env: dict) -> str:
    r = subprocess.run([sys.executable, "-c", "import pymoe; print(pymoe.__file__)"], cwd=tree, env=env,
                       capture_output=True, text=True)
    where = r.stdout.strip()
    if r.returncode != 0 or not Path(where).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"run_mutants: the copy's environment imports pymoe from {where or r.stderr!r}, not from "
                         f"{tree}: a mutant would not be tested")
    return where


def collect(tree: Path, env: dict, files: list[str]) -> list[str]:
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                       cwd=tree, env=env, capture_output=True, text=True)
    ids = [line.strip() for line in r.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if r.returncode not in (0, 5):
        raise SystemExit(f"run_mutants: collecting {files} failed (exit {r.returncode}):\n{r.stdout[-3000:]}"
                         f"{r.stderr[-2000:]}")
    return ids


def pattern_re(pattern: str):
    return re.compile("^" + ".*".join(re.escape(p) for p in pattern.split("*")) + "$")


def select(ids: list[str], patterns) -> dict:
    """pattern -> the collected node ids it matches, in collection order."""
    return {p: [i for i in ids if pattern_re(p).match(i)] for p in patterns}


@dataclass
class RunResult:
    rc: int
    seconds: float
    outcomes: dict = field(default_factory=dict)  # node id -> passed | failed | error | skipped
    tail: str = ""
    timed_out: bool = False

    def names(self, outcome: str) -> list[str]:
        return [i for i, o in self.outcomes.items() if o == outcome]


def junit_outcomes(xml_path: Path, tree: Path) -> dict:
    """node id -> outcome, from pytest's junit xml (classname 'tests.test_x', name 'test_y[param]')."""
    out = {}
    if not xml_path.is_file():
        return out
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        parts = cls.split(".")
        # the module path: the longest prefix of classname that is a file of the copy; the rest are classes
        for k in range(len(parts), 0, -1):
            f = "/".join(parts[:k]) + ".py"
            if (tree / f).is_file():
                node = "::".join([f] + parts[k:] + [name])
                break
        else:
            node = f"{cls}::{name}"
        kinds = {child.tag for child in case}
        outcome = ("failed" if "failure" in kinds else "error" if "error" in kinds
                   else "skipped" if "skipped" in kinds else "passed")
        if out.get(node) in ("failed", "error"):  # a teardown error after a failure: keep the failure
            continue
        out[node] = outcome
    return out


def run_pytest(tree: Path, env: dict, node_ids: list[str], work: Path, label: str, timeout: float,
               exitfirst: bool) -> RunResult:
    xml = work / f"junit-{label}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
           f"--basetemp={work / ('pytest-' + label)}", "-o", "junit_family=xunit1", "--tb=line", "-rfEs"]
    if exitfirst:
        cmd.append("-x")
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd + node_ids, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        rc, tail, timed_out = r.returncode, (r.stdout + r.stderr)[-4000:], False
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        rc, tail, timed_out = -9, (out.decode(errors="replace") if isinstance(out, bytes) else out)[-4000:], True
    res = RunResult(rc, time.perf_counter() - t0, junit_outcomes(xml, tree), tail, timed_out)
    (work / f"log-{label}.txt").write_text(tail)
    return res


# --- the report -------------------------------------------------------------------------------------------------------

def short(node: str) -> str:
    """tests/test_model.py::test_kv_cache_decode_equals_full_forward[f32-llama] -> test_model::test_kv_cache..."""
    f, _, rest = node.partition("::")
    return f"{Path(f).stem}::{rest}"


def summarize(nodes: list[str], limit: int = 3) -> str:
    """A few node ids, grouped by test function: 'test_model::test_x[4/8], test_y'."""
    groups: dict = {}
    for n in nodes:
        base = short(n).split("[")[0]
        groups.setdefault(base, []).append(n)
    parts = [f"{b} x{len(v)}" if len(v) > 1 else short(v[0]) for b, v in groups.items()]
    return ", ".join(parts[:limit]) + (f", +{len(parts) - limit} more" if len(parts) > limit else "")


def print_table(rows: list[tuple]) -> None:
    headers = ("mutant", "spot", "tests", "verdict", "failing tests", "s")
    widths = [max(len(str(r[i])) for r in rows + [headers]) for i in range(len(headers))]
    widths[4] = min(widths[4], 90)
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    print(line)
    print("-" * len(line))
    for r in rows:
        cells = [str(c) for c in r]
        cells[4] = cells[4] if len(cells[4]) <= 90 else cells[4][:87] + "..."
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths)))


def list_mutants(tree: Path, mutants: list[Mutant]) -> None:
    for m in mutants:
        print(f"{m.name}\n    {spot(tree, m)}: {m.why}\n    - {m.old!r}\n    + {m.new!r}")
        for p in m.tests:
            print(f"    test: {p}")


# --- main ---------------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print the mutants and their test selections, then exit")
    ap.add_argument("--check", action="store_true",
                    help="check the whole table against the tree (every `old` once, every test pattern matches a "
                         "collected test), run nothing, exit 0 if it is current (tests/test_mutant_table.py)")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="run only this mutant (repeatable; comma-separated names too)")
    ap.add_argument("--repo", type=Path, default=REPO, help="the repository to copy (default: this file's repo)")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per pytest run (default 1200)")
    ap.add_argument("-x", "--exitfirst", action="store_true",
                    help="stop a mutant's run at its first failing test (faster; the 'failing tests' column then "
                         "shows only the first)")
    ap.add_argument("--numba-cache", choices=("reuse", "fresh"), default="reuse",
                    help="reuse: mutant runs start from the baseline's Numba cache minus the mutated module and "
                         "its importers (default); fresh: an empty cache for every run")
    ap.add_argument("--allow-baseline-failures", action="store_true",
                    help="drop tests that fail or skip on the unmutated copy from the selections, instead of "
                         "stopping (the report says which)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, junit xml) and print its path")
    args = ap.parse_args(argv)

    only = [n for o in args.only for n in o.split(",") if n]
    unknown = sorted(set(only) - {m.name for m in MUTANTS})
    if unknown:
        ap.error(f"unknown mutant(s): {', '.join(unknown)} (see --list)")
    chosen = [m for m in MUTANTS if not only or m.name in only or args.check]

    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="pymoe-mutants-"))
    try:
        pristine, tree, work = tmp / "pristine", tmp / "repo", tmp / "work"
        work.mkdir()
        n_files = snapshot(args.repo.resolve(), pristine)
        shared = args.repo.resolve().parent / "shared"
        if shared.is_dir():  # data some tests read from beside the checkout (../shared/data): the same for the copy
            (tmp / "shared").symlink_to(shared)
        problems = check_table(pristine, MUTANTS)  # the whole table, not just the chosen: it must stay true
        if problems:
            print("run_mutants: the mutant table is stale:\n  " + "\n  ".join(problems), file=sys.stderr)
            return 2
        if args.list:
            list_mutants(pristine, chosen)
            return 0
        print(f"copied {n_files} files of {args.repo} to {pristine} (a snapshot: later edits are not seen)")

        # Baseline: the unmutated copy, at the path every run uses.
        shutil.copytree(pristine, tree)
        base_cache = tmp / "numba-baseline"
        env = env_for(tree, base_cache)
        print(f"pymoe imported from {check_import_location(tree, env)}")
        files = sorted({p.split("::")[0] for m in chosen for p in m.tests})
        ids = collect(tree, env, files)
        selections = {m.name: select(ids, m.tests) for m in chosen}
        stale = [f"{name}: {p!r} matches no collected test" for name, sel in selections.items()
                 for p, hit in sel.items() if not hit]
        if stale:
            print("run_mutants: test selections are stale:\n  " + "\n  ".join(stale), file=sys.stderr)
            return 2
        if args.check:
            print(f"the mutant table is current: {len(chosen)} mutants, "
                  f"{sum(len(m.tests) for m in chosen)} test patterns over {len(files)} files, {len(ids)} tests")
            return 0
        node_ids = {name: list(dict.fromkeys(i for hit in sel.values() for i in hit))
                    for name, sel in selections.items()}
        union = list(dict.fromkeys(i for v in node_ids.values() for i in v))
        print(f"baseline: {len(union)} selected tests on the unmutated copy (Numba compiles from scratch) ...",
              flush=True)
        base = run_pytest(tree, env, union, work, "baseline", args.timeout, exitfirst=False)
        bad = {i: o for i, o in base.outcomes.items() if o != "passed"}
        missing = [i for i in union if i not in base.outcomes]
        print(f"baseline: exit {base.rc}, {len(base.names('passed'))} passed, {len(base.names('failed'))} failed, "
              f"{len(base.names('error'))} errors, {len(base.names('skipped'))} skipped, "
              f"{len(missing)} not reported, {base.seconds:.0f} s")
        if base.rc != 0 or bad or missing:
            for i, o in sorted(bad.items()):
                print(f"  baseline {o}: {i}")
            for i in missing:
                print(f"  baseline not run: {i}")
            if not args.allow_baseline_failures or base.timed_out or not base.outcomes:
                print(base.tail, file=sys.stderr)
                print("run_mutants: the baseline does not pass: no mutant verdict would mean anything "
                      "(--allow-baseline-failures drops the failing tests instead)", file=sys.stderr)
                return 2
            drop = set(bad) | set(missing)
            node_ids = {n: [i for i in v if i not in drop] for n, v in node_ids.items()}
            print(f"  --allow-baseline-failures: {len(drop)} tests dropped from the selections")

        graph = import_graph(tree)
        rows, verdicts = [], {}
        for m in chosen:
            sel = node_ids[m.name]
            where = spot(pristine, m)
            if not sel:
                rows.append((m.name, where, 0, "error", "no test left to run", 0))
                verdicts[m.name] = "error"
                continue
            shutil.rmtree(tree)
            shutil.copytree(pristine, tree)
            apply(tree, m)
            cache = work / f"numba-{m.name}"
            if args.numba_cache == "reuse":
                seed_numba_cache(base_cache, cache, tree, importers_of(graph, module_of(tree, tree / m.path)))
            print(f"{m.name}: {where} ({m.why}); {len(sel)} tests ...", flush=True)
            res = run_pytest(tree, env_for(tree, cache), sel, work, m.name, args.timeout, args.exitfirst)
            failing = res.names("failed") + res.names("error")
            if res.timed_out:
                verdict, detail = "error", f"timeout after {args.timeout:.0f} s"
            elif res.rc == 1 and failing:
                verdict, detail = "killed", f"{len(failing)}/{len(sel)}: {summarize(failing)}"
                if res.names("error"):
                    detail += f" ({len(res.names('error'))} as errors)"
            elif res.rc == 0:
                verdict, detail = "SURVIVED", f"all {len(res.names('passed'))} passed"
                if res.names("skipped"):
                    detail += f", {len(res.names('skipped'))} skipped"
            else:
                verdict = "error"
                last = [l for l in res.tail.strip().splitlines() if l.strip()]
                detail = f"pytest exit {res.rc}: {last[-1][:80] if last else ''}"
            print(f"  -> {verdict} ({detail}), {res.seconds:.0f} s", flush=True)
            if verdict != "killed":
                print("     " + "\n     ".join(res.tail.strip().splitlines()[-8:]))
            rows.append((m.name, where, len(sel), verdict, detail, f"{res.seconds:.0f}"))
            verdicts[m.name] = verdict
            shutil.rmtree(cache, ignore_errors=True)

        total = time.perf_counter() - t_start
        print()
        print_table(rows)
        counts = {v: list(verdicts.values()).count(v) for v in ("killed", "SURVIVED", "error")}
        print(f"\n{counts['killed']} killed, {counts['SURVIVED']} survived, {counts['error']} errors, "
              f"of {len(chosen)} mutants; baseline {base.seconds:.0f} s; total {total:.0f} s")
        return 0 if counts["killed"] == len(chosen) else 1
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
