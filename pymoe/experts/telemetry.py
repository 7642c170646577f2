"""Telemetry files: one JSON line per request, and a resource sample every few seconds (`--telemetry FILE`).

What this is: the per-request record the reference article paired out of its engine's log lines by script (its
appendix B: 2,890 requests, each with a hit rate, a PCIe spill share and a decode speed), written directly as JSON
Lines, so that `pymoe report` (experts/report.py) can redo the article's analysis on pymoe's own runs:

    {"format": "pymoe-telemetry", "version": 1, "kind": "start",    ...the engine: model, backend, slots, ...}
    {"format": "pymoe-telemetry", "version": 1, "kind": "request",  ...one finished request...}
    {"format": "pymoe-telemetry", "version": 1, "kind": "rejected", ...a request turned away (HTTP 429)...}
    {"format": "pymoe-telemetry", "version": 1, "kind": "sample",   ...CPU %, RSS, GPU utilisation/memory/power...}

`pymoe run --telemetry FILE` appends a start line and one request line; `pymoe serve --telemetry FILE` a start line,
a request line per finished request, a rejected line per 429, and a sample line every `--telemetry-interval`
seconds. Every field is listed in docs/telemetry.md. `load` reads any version up to `VERSION` (older lines are
upgraded by `UPGRADES`) and refuses newer ones with a one-line error.

What this is not: the analysis (experts/report.py), Prometheus metrics (serve/metrics.py), or routing traces
(experts/trace.py: which experts each token chose; here only counts per request). It imports nothing of the engine:
the caller hands it the engine and a request's stats, read by attribute.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from pymoe.errors import PymoeError

FORMAT = "pymoe-telemetry"
VERSION = 1
KINDS = ("start", "request", "rejected", "sample")
DEFAULT_INTERVAL_S = 10.0


def _header(kind: str) -> dict:
    return {"format": FORMAT, "version": VERSION, "kind": kind, "time": round(time.time(), 3)}


# --- what is known of the engine once it is loaded ---------------------------------------------------------------
def engine_facts(engine, source: str) -> dict:
    """The engine's fixed facts, repeated in each request line so that one line stands alone (rounds are grouped by
    them: slots, cache bytes). `engine` is an api.Engine, read by attribute; `source` is "run" or "serve"."""
    cfg, cache = engine.config, engine.cache
    n_total = cfg.n_layers * cfg.n_expert  # as the slot cache counts coverage (experts/cache.py describe)
    slots = int(getattr(cache, "n_slots", 0))
    slot_bytes = int(engine.file.slot_bytes)
    return dict(source=source, model=os.path.basename(str(engine.file.path)), arch=cfg.arch,
                backend=engine.backend.name, policy=getattr(cache, "policy_name", "none"),
                n_layers=cfg.n_layers, n_moe_layers=len(cfg.moe_layers), n_expert=cfg.n_expert, k=cfg.n_expert_used,
                experts=n_total, slots=slots, slot_bytes=slot_bytes, cache_bytes=slots * slot_bytes,
                coverage=slots / n_total if n_total else 0.0, pcie_frac=getattr(cache, "pcie_frac", None),
                gpu=bool(getattr(cache, "gpu", False)), free_bytes_at_sizing=getattr(engine, "free_at_sizing", None),
                reserve_bytes=getattr(engine.backend, "reserve", None) if engine.backend.name == "cuda" else None,
                n_ctx=engine.n_ctx)


# --- one request -------------------------------------------------------------------------------------------------
def request_record(stats, facts: dict, t_start: float, t_end: float, queue_s: float = 0.0,
                   concurrency_at_start: int = 1, concurrency_mean: Optional[float] = None, spec=None,
                   status: str = "ok") -> dict:
    """A finished request -> its line. stats: engine/generate.RequestStats (read by attribute); t_start, t_end: Unix
    seconds of its arrival and end; queue_s: its wait for a slot; concurrency_at_start: requests in the engine
    (decoding, prefilling or queued) when it arrived, itself included; concurrency_mean: the same averaged over its
    lifetime; spec: its speculative decoding counters (engine/speculative.SpecStats) or None."""
    c = stats.decode or {}
    lookups = int(c.get("lookups", 0))
    rec = _header("request")
    rec.update(facts)
    rec.update(
        status=status, stop_reason=stats.stop_reason, t_start=round(t_start, 4), t_end=round(t_end, 4),
        queue_s=round(queue_s, 4), ttft_s=round(queue_s + stats.prompt_s, 4),
        prompt_tokens=int(stats.n_prompt), reused_tokens=int(stats.n_reused), generated_tokens=int(stats.n_generated),
        decoded_tokens=int(stats.n_decoded), prompt_s=round(stats.prompt_s, 5), decode_s=round(stats.decode_s, 5),
        prefill_tok_s=round(stats.prefill_tok_s, 3), decode_tok_s=round(stats.decode_tok_s, 3),
        pool=bool(stats.pool), lookups=lookups, hits=int(c.get("hits", 0)),
        misses={p: int(c.get(p, 0)) for p in ("spill", "cpu", "host")}, promoted=int(c.get("promoted", 0)),
        prefetched=int(c.get("prefetched", 0)), concurrency_at_start=int(concurrency_at_start),
        concurrency_mean=None if concurrency_mean is None else round(concurrency_mean, 3),
        spec_drafted=None if spec is None else int(spec.drafted),
        spec_accepted=None if spec is None else int(spec.accepted),
        spec_acceptance=None if spec is None or not spec.drafted else round(spec.accepted / spec.drafted, 4))
    if getattr(stats, "devices", None):  # several devices (backends/multi_device.py): each one's decode counters
        rec["devices"] = [dict(device=d["device"], layers=list(d["layers"]), slots=int(d["slots"]),
                               lookups=int(d["lookups"]), hits=int(d["hits"]),
                               misses={p: int(d.get(p, 0)) for p in ("spill", "cpu")},
                               promoted=int(d.get("promoted", 0))) for d in stats.devices]
    return rec


def rejected_record(facts: dict, queued: int, max_queue: int) -> dict:
    """A request turned away because the queue was full (the server answers 429)."""
    rec = _header("rejected")
    rec.update(facts)
    rec.update(queued=int(queued), max_queue=int(max_queue))
    return rec


# --- resource samples --------------------------------------------------------------------------------------------
def _rss_bytes() -> Optional[int]:
    """Resident set size of this process: /proc/self/statm's second field (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class _Nvml:
    """GPU 0's utilisation, memory and power through NVML, when pynvml imports and a GPU answers; else `ok` False."""

    def __init__(self):
        self.ok = False
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.handle, self.ok = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0), True
        except Exception:  # no pynvml, no driver, no GPU: samples carry no GPU fields
            pass

    def read(self) -> dict:
        n, h, out = self.nvml, self.handle, {}
        for key, get in (("gpu_util_pct", lambda: n.nvmlDeviceGetUtilizationRates(h).gpu),
                         ("gpu_mem_used_bytes", lambda: n.nvmlDeviceGetMemoryInfo(h).used),
                         ("gpu_mem_total_bytes", lambda: n.nvmlDeviceGetMemoryInfo(h).total),
                         ("gpu_power_w", lambda: n.nvmlDeviceGetPowerUsage(h) / 1e3)):  # NVML: milliwatts
            try:
                out[key] = get()
            except Exception:  # a field this GPU does not report (power on some boards)
                out[key] = None
        return out


class ResourceSampler:
    """CPU % of this process (100 = one core busy: CPU seconds / wall seconds since the last sample), its RSS, and
    the GPU's utilisation, memory and power when NVML is there."""

    def __init__(self):
        self.nvml = _Nvml()
        self._last = (time.monotonic(), sum(os.times()[:2]))

    def sample(self) -> dict:
        now, cpu = time.monotonic(), sum(os.times()[:2])
        (t0, c0), self._last = self._last, (now, cpu)
        rec = _header("sample")
        rec.update(cpu_pct=round(100.0 * (cpu - c0) / (now - t0), 1) if now > t0 else None, n_cpus=os.cpu_count(),
                   rss_bytes=_rss_bytes())
        if self.nvml.ok:
            rec.update(self.nvml.read())
        return rec


# --- the file ----------------------------------------------------------------------------------------------------
class TelemetryWriter:
    """Appends lines to a telemetry file from any thread; with interval > 0, a daemon thread adds a resource sample
    every `interval` seconds until `close()`."""

    def __init__(self, path: str, facts: dict, interval: float = DEFAULT_INTERVAL_S,
                 sampler: Optional[Callable[[], dict]] = None):
        if interval < 0:
            raise PymoeError(f"--telemetry-interval must be >= 0 (0: no resource samples), got {interval:g}")
        try:
            self.file = open(path, "a", encoding="utf-8", buffering=1)  # line-buffered: a crash loses no full line
        except OSError as e:
            raise PymoeError(f"--telemetry {path}: {e.strerror}") from None
        self.path, self.facts, self.lock = path, facts, threading.Lock()
        self.sampler = sampler or ResourceSampler().sample
        self._stop = threading.Event()
        start = _header("start")
        start.update(facts, interval_s=interval, pid=os.getpid())
        self.write(start)
        self.thread = None
        if interval > 0:
            self.thread = threading.Thread(target=self._sample_loop, args=(interval,), name="pymoe-telemetry",
                                           daemon=True)
            self.thread.start()

    def write(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":"))
        with self.lock:
            if not self.file.closed:
                self.file.write(line + "\n")

    def request(self, stats, **kw) -> None:
        self.write(request_record(stats, self.facts, **kw))

    def rejected(self, queued: int, max_queue: int) -> None:
        self.write(rejected_record(self.facts, queued, max_queue))

    def _sample_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.write(self.sampler())

    def close(self) -> None:
        """Stop sampling, with one last sample (a run shorter than the interval still has one), and close."""
        self._stop.set()
        if self.thread is not None:
            self.thread.join(5)
            self.write(self.sampler())
        with self.lock:
            self.file.close()


# --- reading -----------------------------------------------------------------------------------------------------
# Older versions -> the current one, one step each: UPGRADES[v](record) turns a version-v line into version v + 1.
# Version 1 is the first; a change of a field's meaning adds a step here and a row to docs/telemetry.md.
UPGRADES: dict = {}


def upgrade(rec: dict, where: str) -> dict:
    v = rec.get("version")
    if not isinstance(v, int) or v < 1:
        raise PymoeError(f"{where}: no telemetry version (expected an integer >= 1)")
    if v > VERSION:
        raise PymoeError(f"{where}: telemetry version {v} is newer than this pymoe reads (up to {VERSION}): "
                         "upgrade pymoe")
    while v < VERSION:
        rec = UPGRADES[v](rec)
        v += 1
        rec["version"] = v
    return rec


@dataclass
class Telemetry:
    """The lines of one telemetry file, by kind (each a dict, upgraded to the current version)."""

    path: str
    starts: list = field(default_factory=list)
    requests: list = field(default_factory=list)
    rejected: list = field(default_factory=list)
    samples: list = field(default_factory=list)
    lines: list = field(default_factory=list)  # every line, in file order
    skipped: int = 0  # a last line cut short (the writer was killed mid-line): left out, and counted


def load(path: str) -> Telemetry:
    """Read a telemetry file -> Telemetry. A line that is not a telemetry line is a one-line error naming the file and
    the line; only an unterminated last line (a writer killed mid-write) is skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise PymoeError(f"{path}: {e.strerror if isinstance(e, OSError) else 'not UTF-8 text'}") from None
    out = Telemetry(path)
    lines = text.split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):  # no newline after it: cut short
                out.skipped += 1
                continue
            raise PymoeError(f"{where}: not a JSON line") from None
        if not isinstance(rec, dict) or rec.get("format") != FORMAT:
            got = rec.get("format") if isinstance(rec, dict) else None
            raise PymoeError(f"{where}: not a {FORMAT} line (format {got!r})")
        rec = upgrade(rec, where)
        kind = rec.get("kind")
        if kind not in KINDS:
            raise PymoeError(f"{where}: unknown kind {kind!r} (expected one of {', '.join(KINDS)})")
        by_kind = {"start": out.starts, "request": out.requests, "rejected": out.rejected, "sample": out.samples}
        by_kind[kind].append(rec)
        out.lines.append(rec)
    return out
