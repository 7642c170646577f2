"""The Python API readers and tests use: `pymoe.load(path)` -> an `Engine` with logits(), generate(), tokenizer.

    m = pymoe.load("model.gguf")        # backend="auto": cuda when a GPU is present, else cpu
    m.logits(ids)                       # float32 [n_tokens, n_vocab], one forward from an empty KV cache
    m.tokenizer.encode("hello")         # token ids
    for t in m.generate("def f(", max_tokens=20): ...   # new token ids (greedy unless temperature > 0)
    m.last_stats.prompt_line()          # the per-request telemetry of the last generate()

What this is: the wiring of loader -> backend -> expert cache -> model -> tokenizer -> sampler in one place.
What this is not: math (model.py, moe.py) or I/O (cli.py).
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence, Union

import numpy as np

from .backends import get_backend
from .experts.cache import PassThroughCache
from .errors import PymoeError
from .engine.generate import RequestStats, generate_tokens, stream_text
from .engine.multimodal import MEDIA_MARKER
from .gguf.loader import EXPERT_PROJ, load_gguf
from .engine.kv import check_kv_fits
from .engine.model import Model
from .experts.policies import DEFAULT_POLICY, check_engine_policy, make_admission, make_warm_rule
from .experts.probe import NO_GPU_PCIE_FRAC
from .engine.sampler import Sampler, SamplingParams


class Engine:
    def __init__(self, path: str, backend: str = "auto", threads: Optional[int] = None, n_ctx: Optional[int] = None,
                 progress: bool = False, cache_slots: Optional[int] = None, cache_gib: Optional[float] = None,
                 policy: str = DEFAULT_POLICY, profile: Optional[str] = None, pcie_frac: Optional[float] = None,
                 cache: str = "auto", chunk: int = 512, reserve_mib: float = 700, log=lambda line: None,
                 backend_options: Optional[dict] = None, admit: str = "all", max_inserts: int = 0,
                 warm_set: int = 0, warm_inserts: int = 0, act_bits=None, devices: Optional[str] = None,
                 sequences: int = 1, speculation: bool = False):
        """`cache_slots` / `cache_gib` size an expert slot pool; else `cache` = "auto" sizes it from the device's free
        memory (CUDA; on the CPU backend auto means no pool: every expert is read in place) or "none".
        `profile` (a path or a profile.Profile) pre-fills it; `pcie_frac` (None: measured by the PCIe probe on CUDA,
        0 on the CPU, as the probe says with no GPU) splits the misses; `chunk` is the most prompt tokens per
        forward call; `log` receives the start-up lines (sizing, pre-fill). `backend_options`: extra arguments of
        the backend (tests). `admit` ("all" or "second-miss") and `max_inserts` (per layer per step, 0: no cap):
        the slot pool's admission control (experts/policies.Admission). `warm_set` N, `warm_inserts` M: at the end of
        each prompt, copy the experts of its last N tokens into the pool, at most M (0: no cap; policies.WarmSet).
        `act_bits` (8, 15, 16, 0 or "auto"; None: the backend's default): the CPU backend's activation width
        (quant/qact.py; "auto": 8 bits for the routed experts, 16 for the rest, backends/cpu.py ACT_MODES).
        `devices` ("0,1", or a count): the CUDA backend on several devices, the layers split by ranges, one slot
        pool per device (backends/multi_device.py). `sequences`: how many sequences decode at once (`pymoe serve
        -np`): CUDA gives each a device KV cache of n_ctx positions, as many as fit before the slot pool
        (`_keep_for_pool`); the others keep host KV caches. `speculation`: the engine will decode with
        `generate(spec=...)` (`pymoe run --spec`): CUDA then gives each device KV cache of a hybrid (qwen3next,
        qwen35moe) a device snapshot of its Gated DeltaNet state, as large as the state, what a rejected draft's
        rollback goes back to without PCIe (backends/cuda.py `DeviceKVCache.snapshot_recurrent`). Without it,
        `generate(spec=...)` still works (the same tokens), saving the state on the host instead: before each verify
        forward it comes to the host (one copy, one synchronisation) and goes back to the device for the forward
        (one copy), and a rollback's redo copies the saved state there again."""
        from .engine.tokenizer import Tokenizer

        if chunk < 1:
            raise PymoeError(f"--chunk must be >= 1, got {chunk}")
        if cache not in ("auto", "none"):
            raise PymoeError(f"--cache must be auto or none, got {cache!r}")
        check_engine_policy(policy)  # a bad option is an error with or without a pool to apply it to
        self.admission = make_admission(admit, max_inserts)
        self.warm = make_warm_rule(warm_set, warm_inserts)
        self.file = load_gguf(path)
        self.config = self.file.config
        if act_bits is not None:
            backend_options = {**(backend_options or {}), "act_bits": act_bits if act_bits == "auto" else int(act_bits)}
        if devices is not None:
            self.backend = _multi_device_backend(backend, devices, threads, int(reserve_mib * 2**20), backend_options)
        else:
            self.backend = get_backend(backend, threads=threads, reserve=int(reserve_mib * 2**20),
                                       **(backend_options or {}))
        log(f"backend {self.backend.name}")
        if getattr(self.backend, "note", None):  # CUDA in the simulator: the device size it stands for
            log(self.backend.note)
        if hasattr(self.backend, "fit_width"):  # CPU: the width a file runs at by default (backends/cpu.py)
            self.backend.fit_width(self.file)
        if getattr(self.backend, "repack", False):  # CPU, 8-bit dots (backends/cpu.py, quant/repack.py)
            from .quant.repack import TILE_BYTES
            tiled = ", ".join(q.name for q in TILE_BYTES)
            budget = getattr(self.backend, "expert_budget", 0) / 2**30
            log(f"--act-bits {self.backend.act_bits} (8-bit dots): {tiled} weights are repacked 8 rows at a time, "
                "the dense ones now, an expert "
                f"when it first runs (a copy beside the memory map, at most {budget:.1f} GiB of experts' copies, "
                "then read in place: PYMOE_REPACK_MIB; PYMOE_REPACK=0: off)")
        if hasattr(self.backend, "attach"):  # CUDA: pin and map the model file
            self.backend.attach(self.file)
        self.profile = profile
        if isinstance(profile, (str, bytes)) or hasattr(profile, "__fspath__"):
            from .experts.profile import Profile

            self.profile = Profile.load(profile)
            log(self.profile.log_line(profile))
        # n_ctx: a number, a rule (a function of the config: pymoe serve's default_ctx), or None (the trained context)
        self.n_ctx = int(n_ctx(self.config) if callable(n_ctx) else n_ctx or self.config.n_ctx_train)
        if self.n_ctx <= 0:
            raise PymoeError(f"context size must be > 0, got {self.n_ctx}")
        check_kv_fits(self.config, self.n_ctx)  # before anything is allocated for it (a corrupt context_length)
        if self.n_ctx > self.config.n_ctx_train:
            scaled = self.config.rope_scaling != "none"
            log(f"warning: context {self.n_ctx} is beyond the {self.config.n_ctx_train} positions the model was "
                f"trained on ({f'RoPE scaling {self.config.rope_scaling} x{self.config.rope_scale:g} in the file' if scaled else 'no RoPE scaling in the file'}): "
                "expect worse output past that point")
        self.model = Model(self.file, self.backend, None, progress=progress)  # dense weights land on the device
        self.model.chunk = int(chunk)
        if hasattr(self.backend, "prepare"):  # CUDA: activation buffers, RoPE tables, one sequence's KV cache
            self.backend.prepare(chunk, self.n_ctx, device_kv=not self.model.host_attention, sequences=sequences,
                                 keep_free=self._keep_for_pool(cache, cache_slots, cache_gib),
                                 speculation=speculation)
            for line in self.backend.memory_line().splitlines():  # (several devices: one line each)
                log(line)
        self.free_at_sizing = None  # device bytes free when --cache auto sized the pool (telemetry), if it did
        if pcie_frac is None:  # measured on a GPU; with none, the probe's answer without one (every miss on the CPU)
            pcie_frac = self._probe_pcie_frac(log) if self.backend.name == "cuda" else NO_GPU_PCIE_FRAC
        self.cache = self._make_cache(cache, cache_slots, cache_gib, policy, pcie_frac, log)
        self.model.cache = self.cache
        self.backend.warm_up((t.qtype for t in self.file.tensors.values()), progress=progress)
        if hasattr(self.backend, "warm_up_experts"):  # the fused expert kernel, once per gate/up/down type triple
            triples = {tuple(lay.types[p] for p in EXPERT_PROJ): lay.types for lay in self.file.expert_layouts()
                       if lay is not None}
            for types in triples.values():  # (layers may differ: llama.cpp's Q4_K_M has ffn_down Q4_K or Q6_K)
                self.backend.warm_up_experts(types)
        self.tokenizer = Tokenizer(self.file)
        for warning in self.tokenizer.warnings:
            log(f"warning: {warning}")
        if self.tokenizer.n_vocab != self.config.n_vocab:  # llama.cpp: "token_embd.weight has wrong shape"
            raise PymoeError(f"{path}: tokenizer.ggml.tokens has {self.tokenizer.n_vocab} tokens but the model has "
                             f"{self.config.n_vocab} (token_embd.weight rows)")
        self.last_stats = RequestStats()

    def _keep_for_pool(self, mode: str, cache_slots, cache_gib) -> int:
        """Device bytes the sequences' extra KV caches leave for the expert slot pool: a pool of a given size
        (--cache-slots, --cache-gib) keeps its bytes; one sized by --cache auto gets what the KV caches leave, one
        slot at least (KV first, as llama.cpp allocates it); --cache none keeps nothing."""
        if cache_slots is not None:
            return int(cache_slots) * self.file.slot_bytes
        if cache_gib is not None:
            return int(cache_gib * 2**30)
        return self.file.slot_bytes if mode == "auto" else 0

    def _probe_pcie_frac(self, log) -> float:
        from .experts.probe import probe

        result = probe(self.file, getattr(self.backend, "devices", [self.backend])[0])  # (several: the first's)
        log(result.line())
        return result.pcie_frac

    def _make_cache(self, mode, cache_slots, cache_gib, policy, pcie_frac, log):
        from .experts.cache import SlotCache

        cuda = self.backend.name == "cuda"
        n_total = len(self.config.moe_layers) * self.config.n_expert  # leading dense layers have no experts
        if hasattr(self.backend, "shards") and (cache_slots is not None or cache_gib is not None or mode == "auto"):
            return self._device_caches(cache_slots, cache_gib, policy, pcie_frac, log)
        if cache_slots is None and cache_gib is None and mode == "auto" and cuda:
            from .experts.plan import auto_line, slots_for

            free, reserve = self.backend.free_for_cache(), self.backend.reserve
            self.free_at_sizing = free
            cache_slots = slots_for(free, reserve, self.file.slot_bytes, cap=n_total)
            log(auto_line(free, reserve, cache_slots))
            if cache_slots == 0:
                raise PymoeError("expert cache auto: no room on the device for one expert slot; use --cache none "
                                 "(every expert read over PCIe) or free device memory")
        if cache_slots is None and cache_gib is None:
            if self.profile is not None:
                raise PymoeError("--profile pre-fills a slot pool, and there is none: give --cache-slots N or "
                                 "--cache-gib X (the cuda backend sizes one by itself with --cache auto)")
            cache = PassThroughCache(self.file, miss_path="spill" if cuda else None)
            log(cache.describe())
            return cache
        if cache_gib is not None:
            if cache_gib <= 0:
                raise PymoeError(f"--cache-gib must be > 0, got {cache_gib}")
            slots = int(cache_gib * 2**30 // self.file.slot_bytes)
            log(f"expert cache: {cache_gib:g} GiB / {self.file.slot_bytes} bytes per slot -> {slots} slots")
            cache_slots = max(1, min(slots, n_total))
        cache = SlotCache(self.file, int(cache_slots), policy=policy, profile=self.profile, pcie_frac=pcie_frac,
                          new_pool=getattr(self.backend, "new_pool", None), gpu=cuda, admission=self.admission,
                          warm=self.warm)
        self.backend.cache_pool = cache.pool
        log(cache.describe())
        log(cache.fill())  # every slot, from the profile and then in a stated order: slots never sit empty
        return cache

    def _device_caches(self, cache_slots, cache_gib, policy, pcie_frac, log):
        """Several devices (backends/multi_device.py): one SlotCache per device over its layers. Slots per device:
        --cache auto sizes each from its own free memory; a total (--cache-slots, --cache-gib) is split by the
        devices' budgets (largest remainder, as `pymoe simulate --devices` splits it), each at most its layers'
        experts."""
        from .experts.device_caches import DeviceCaches
        from .experts.multi import split_count
        from .experts.plan import auto_line, slots_for

        b, E, S = self.backend, self.config.n_expert, self.file.slot_bytes
        caps = [len([i for i in self.config.moe_layers if i in r]) * E for r in b.ranges]
        if cache_slots is None and cache_gib is None:
            free = b.free_for_cache()
            self.free_at_sizing = sum(free)
            slots = [slots_for(f, b.reserve, S, cap=c) for f, c in zip(free, caps)]
            for i, f, n in zip(b.ids, free, slots):
                log(f"cuda:{i}: {auto_line(f, b.reserve, n)}")
        else:
            if cache_gib is not None:
                if cache_gib <= 0:
                    raise PymoeError(f"--cache-gib must be > 0, got {cache_gib}")
                cache_slots = int(cache_gib * 2**30 // S)
            slots = split_count(int(cache_slots), [d.mem.limit if c else 0 for d, c in zip(b.devices, caps)])
            slots = [min(n, c) for n, c in zip(slots, caps)]
        if min(n for n, c in zip(slots, caps) if c) < 1:  # (a device with only dense layers has no pool)
            raise PymoeError(f"expert cache: {slots} slots per device: every device with experts needs one at least")
        cache = DeviceCaches(self.file, b, slots, policy=policy, profile=self.profile, pcie_frac=pcie_frac,
                             admission=self.admission, warm=self.warm)
        for line in (*cache.describe().splitlines(), *cache.fill().splitlines()):
            log(line)
        return cache

    def use_chat_template(self, source: str) -> None:
        """`--chat-template`: a Jinja template instead of the file's own, given as a file path or as the text."""
        import os

        self.tokenizer.chat_template = open(source, encoding="utf-8").read() if os.path.isfile(source) else source

    def record_trace(self, meta_extra: Optional[dict] = None):
        """Start recording routing (every token, every MoE layer) -> the TraceRecorder; save it with .save(path)."""
        from .experts.trace import TraceRecorder

        cfg = self.config
        meta = dict(model=cfg.name or self.file.path, arch=cfg.arch, n_layers=len(cfg.moe_layers),
                    first_moe_layer=cfg.moe_layers.start, n_experts=cfg.n_expert, k=cfg.n_expert_used,
                    **(meta_extra or {}))
        self.model.trace = TraceRecorder(meta)
        return self.model.trace

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """float32 [n_tokens, n_vocab]: one forward over `ids` from an empty KV cache."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        return self.model.prefill(ids, self.model.new_kv(max(self.n_ctx, ids.size)))

    def encode_prompt(self, prompt: Union[str, Sequence[int]], chat: bool = False, images: Sequence = ()
                      ) -> list[int]:
        """Token ids of a prompt. images: bytes of image files (or encoded ImageEmbeddings), placed at the
        prompt's <__media__> markers, or before the text when it has none; the ids then carry them (ImagePrompt)."""
        if isinstance(prompt, str):
            if images and MEDIA_MARKER not in prompt:
                prompt = MEDIA_MARKER * len(images) + prompt
            if chat:
                prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            if images:
                return self.prompt_with_images(prompt, images)
            return self.tokenizer.encode(prompt)
        if images:
            raise PymoeError("images go with a text prompt (token ids have no place marked for them)")
        return [int(t) for t in prompt]

    # --- images (pymoe/vision/, engine/multimodal.py) --------------------------------------------------------
    vision = None  # the loaded mmproj file (vision/mmproj.MMProj), after attach_mmproj

    def attach_mmproj(self, path: Optional[str] = None, log=lambda line: None) -> None:
        """Load the vision tower: `path`, else the one mmproj*.gguf beside the model (vision/mmproj.find_mmproj)."""
        from .vision.mmproj import find_mmproj, load_mmproj

        path = path or find_mmproj(self.file.path)
        if path is None:
            raise PymoeError(f"{self.file.path}: images need the model's mmproj file: pass --mmproj FILE (there is "
                             "no mmproj*.gguf beside the model)")
        if not self.config.rope_sections:
            raise PymoeError(f"{self.file.path}: {self.config.arch} has no rope.dimension_sections (M-RoPE); "
                             "pymoe places images in qwen35moe and qwen3vlmoe models")
        if getattr(self.backend, "name", "").startswith("cuda"):
            raise PymoeError("images run on the CPU backends for now (--backend cpu): the CUDA backend's rope "
                             "tables are one position per row")
        self.vision = load_mmproj(path, self.config.n_embd, self.file.path, self.config.n_deepstack)
        self._encoded: dict = {}  # sha256 of image bytes -> ImageEmbeddings (the last few)
        log(f"mmproj {path}: {self.vision.config.projector}, {self.vision.config.n_layers} blocks")

    def encode_image(self, data: bytes, where: str = "image"):
        """Image file bytes -> engine/multimodal.ImageEmbeddings (kept by the bytes' sha256 for reuse)."""
        from .engine.multimodal import ImageEmbeddings, image_key
        from .vision.encoder import encode
        from .vision.preprocess import preprocess

        if self.vision is None:
            raise PymoeError(f"{where}: this model was loaded without an mmproj file (--mmproj): it takes no images")
        key = image_key(data)
        if key not in self._encoded:
            c = self.vision.config
            pixels = preprocess(data, c, where)  # [3, H, W]
            step = c.patch_size * c.merge
            self._encoded[key] = ImageEmbeddings(encode(pixels, self.vision), pixels.shape[1] // step,
                                                 pixels.shape[2] // step, key)
            while len(self._encoded) > 16:
                self._encoded.pop(next(iter(self._encoded)))
        return self._encoded[key]

    def prompt_with_images(self, text: str, images: Sequence) -> list[int]:
        """A rendered prompt with one <__media__> per image -> ids that carry the images (ImagePrompt)."""
        from .engine.multimodal import ImageEmbeddings, tokens_with_images

        encoded = [im if isinstance(im, ImageEmbeddings) else self.encode_image(im, f"image {i + 1}")
                   for i, im in enumerate(images)]
        return tokens_with_images(self.tokenizer, text, encoded)

    def generate(self, prompt: Union[str, Sequence[int]], max_tokens: int = 128, chat: bool = False,
                 stop_at_eos: bool = True, spec=None, grammar=None, images: Sequence = (),
                 **sampling) -> Iterator[int]:
        """New token ids after the prompt (text or ids). `sampling`: SamplingParams fields (temperature, seed...).
        spec: a Speculator (`speculator`), for speculative decoding. grammar: an engine/grammar.Grammar the output
        follows."""
        self.last_stats = RequestStats()
        is_stop = self.tokenizer.is_eog if stop_at_eos else (lambda t: False)
        return generate_tokens(self.model, self.encode_prompt(prompt, chat, images), max_tokens,
                               self._sampler(sampling, grammar, spec), is_stop, self.n_ctx, self.last_stats, spec)

    def stream(self, prompt: Union[str, Sequence[int]], max_tokens: int = 128, chat: bool = False,
               stop: Sequence[str] = (), spec=None, grammar=None, images: Sequence = (), **sampling
               ) -> Iterator[str]:
        """Text pieces of the answer, stop strings applied; telemetry in `last_stats`."""
        self.last_stats = RequestStats()
        return stream_text(self.model, self.tokenizer, self.encode_prompt(prompt, chat, images), max_tokens,
                           self._sampler(sampling, grammar, spec), stop, self.n_ctx, self.last_stats, spec)

    def _sampler(self, sampling: dict, grammar, spec) -> Sampler:
        if grammar is not None and spec is not None:
            raise PymoeError("speculative decoding does not take a grammar (a draft would move its position)")
        return Sampler(SamplingParams(**sampling), constraint=grammar.constraint(self.tokenizer) if grammar else None)

    def speculator(self, spec: str, k: int = 4, **draft_options):
        """`spec` "ngram", "mtp", "mtp:FILE" or "draft:FILE" -> an engine/speculative.Speculator for generate/stream (one per request:
        it holds that request's counters). draft_options: `load` options of the draft model (threads, backend)."""
        from .engine.speculative import make_speculator

        return make_speculator(spec, k, self.model, self.n_ctx,
                               lambda path: load(path, n_ctx=self.n_ctx, **draft_options))


def _multi_device_backend(backend: str, devices: str, threads, reserve: int, options: Optional[dict]):
    """`--devices`: the CUDA backend on several devices (a GPU's, or the simulator's several CUDABackends)."""
    from .backends.cuda import cuda_available, simulated
    from .backends.multi_device import MultiDeviceBackend, parse_device_ids
    from .experts.multi import split_layers

    if backend not in ("auto", "cuda") or (backend == "auto" and not (cuda_available() or simulated())):
        raise PymoeError(f"--devices runs the cuda backend on several devices; the backend here is {backend!r}"
                         + (" (no CUDA GPU found)" if backend == "auto" else ""))
    return MultiDeviceBackend(parse_device_ids(devices), threads=threads, reserve=reserve, split=split_layers,
                              **(options or {}))  # the planner's layer split: plan, simulate and engine agree


def load(path: str, backend: str = "auto", threads: Optional[int] = None, n_ctx: Optional[int] = None,
         progress: bool = False, **cache_options) -> Engine:
    """cache_options: cache, cache_slots, cache_gib, policy, profile, pcie_frac, chunk, reserve_mib, log,
    backend_options (see Engine). backend: "cpu", "cuda", or "auto" (cuda when a GPU is present)."""
    return Engine(path, backend=backend, threads=threads, n_ctx=n_ctx, progress=progress, **cache_options)
