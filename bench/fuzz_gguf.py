"""Mutation fuzzer for every way pymoe opens a model file: broken GGUFs must give one line and exit 2, never more.

What this is: seeded, reproducible mutants of valid files (tiny random models of every family and quant mix that
pymoe's writer makes, files llama.cpp's own quantizer made from them, the embedded demo model), each run through
the three ways in: `pymoe inspect` (describe_model), `pymoe.load` (the engine, CPU backend) and `pymoe run` (two
generated tokens), in worker processes under a time and an address-space limit. Every outcome is classified:

    valid      the mutant still loads and runs (a flipped bit in a weight, a renamed optional key, ...)
    error      a PymoeError: the one-line message `pymoe: error: ...` the CLI prints before exiting 2
    traceback  any other exception: what a user would see as a Python traceback (a bug)
    oom        MemoryError, or killed past the memory limit (a size taken from the file and not checked)
    timeout    past --timeout seconds (a loop sized by the file)
    signal     the worker died (a crash in native code)

Mutations are located with gguf-py's reader (each field's parts are views into the file, so their byte offsets are
known without parsing GGUF here) and are of three kinds: byte flips in the header / metadata / tensor-info area,
truncations, and targeted corruptions of one field (counts, string and array lengths, value and element types, dims
zero / huge / overflowing, tensor type ids, data offsets past EOF / misaligned / overlapping, alignment 0 / odd,
numeric hyper-parameters inf / NaN / negative / zero / huge, invalid UTF-8 in strings, token types outside the enum,
expert counts inconsistent with top-k). The mutant of (seed, i) is always the same bytes.

    PYTHONPATH=. python bench/fuzz_gguf.py --mutants 10000 --seed 0 [--jobs 2] [--stages inspect,load,run]
    PYTHONPATH=. python bench/fuzz_gguf.py --replay 0:1234      # one mutant, in this process, with its traceback

Exit status 1 when any outcome is traceback / oom / timeout / signal (the list is printed with how to replay each).
tests/test_fuzz_gguf.py runs a seeded subset in CI. What this is not: the server's hostile-input tests
(tests/test_server_hostile.py) or a coverage-guided fuzzer (atheris is not a dependency; see docs/testing.md).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAD = ("traceback", "oom", "timeout", "signal")

# The base files: (name, arch, mix) for pymoe's writer; ("llama:<ftype>", arch, source mix) for llama.cpp's quantizer.
TINY = [(f"{arch}-{mix}", arch, mix) for arch, mix in (
    ("qwen3moe", "f32"), ("qwen3moe", "q2_k"), ("qwen2moe", "q2_k"), ("llama", "f32"), ("olmoe", "q2_0"),
    ("glm4moe", "q2_k"), ("gpt-oss", "f32"), ("qwen3next", "q2_k"), ("qwen35moe", "q2_0"), ("deepseek2", "q2_k"))]
LLAMA = [("qwen3moe-Q4_K_M", "qwen3moe", "Q4_K_M"), ("gpt-oss-MXFP4_MOE", "gpt-oss", "MXFP4_MOE"),
         ("deepseek2-IQ4_XS", "deepseek2", "IQ4_XS"), ("qwen3next-Q2_0", "qwen3next", "Q2_0"),
         # the other ftype families, one file each: float, legacy, K, IQ (with an importance matrix), ternary
         ("qwen2moe-F16", "qwen2moe", "F16"), ("glm4moe-BF16", "glm4moe", "BF16"), ("olmoe-Q8_0", "olmoe", "Q8_0"),
         ("llama-Q5_1", "llama", "Q5_1"), ("qwen35moe-Q6_K", "qwen35moe", "Q6_K"),
         ("deepseek2-IQ1_S", "deepseek2", "IQ1_S"), ("qwen3moe-IQ2_XXS", "qwen3moe", "IQ2_XXS"),
         ("gpt-oss-IQ3_S", "gpt-oss", "IQ3_S"), ("glm4moe-TQ1_0", "glm4moe", "TQ1_0")]
CI_BASES = ("qwen3moe-q2_k", "deepseek2-q2_k", "qwen3next-q2_k", "gpt-oss-f32", "qwen3moe-Q4_K_M", "demo")


def make_bases(workdir: str, names=None) -> dict:
    """name -> path of each base file under workdir (written on first use; llama.cpp's are skipped, with a line on
    stderr, when llama-cpp-python is not installed)."""
    from pymoe import demo
    from pymoe.demo.tinymodel import write_model

    os.makedirs(workdir, exist_ok=True)
    out = {}
    for name, arch, mix in TINY:
        if names is None or name in names:
            path = os.path.join(workdir, f"tiny-{name}.gguf")
            if not os.path.exists(path):
                write_model(path + ".part", arch, "tiny", mix, seed=0)
                os.replace(path + ".part", path)
            out[name] = path
    for name, arch, ftype in LLAMA:
        if names is None or name in names:
            path = os.path.join(workdir, f"llama-{name}.gguf")
            if not os.path.exists(path):
                src = os.path.join(workdir, f"tiny-{arch}-f32-src.gguf")
                try:
                    sys.path.insert(0, os.path.join(ROOT, "tests"))
                    from llama_quantize import llama_quantize
                    if not os.path.exists(src):
                        write_model(src, arch, "tiny", "f32", seed=0)
                    llama_quantize(src, path + ".part", ftype)
                except BaseException as e:  # llama-cpp-python missing (pytest's skip is a BaseException)
                    print(f"fuzz: skipping base {name}: llama.cpp's quantizer unavailable ({e})", file=sys.stderr)
                    continue
                os.replace(path + ".part", path)
            out[name] = path
    if names is None or "demo" in names:
        out["demo"] = demo.demo_model()
    return out


# --- where things are in a file ----------------------------------------------------------------------------------
class Layout:
    """The byte sites of one valid file, found with gguf-py's reader: each is (kind, offset, size, detail)."""

    def __init__(self, path: str):
        from gguf import GGUFReader, GGUFValueType

        r = GGUFReader(path)
        base = r.data.ctypes.data
        at = lambda part: int(part.ctypes.data - base)  # noqa: E731 (a part is a view into the memory map)
        self.size = len(r.data)
        self.data_start = min((int(t.data_offset) for t in r.tensors), default=self.size)
        self.sites = collections.defaultdict(list)
        for name, f in r.fields.items():
            if name.startswith("GGUF."):  # the version and the tensor and key counts
                self.sites["count"].append((at(f.parts[0]), f.parts[0].dtype.itemsize, name))
                continue
            key_len, key, vtype = f.parts[0], f.parts[1], f.parts[2]
            self.sites["key_len"].append((at(key_len), 8, name))
            self.sites["key"].append((at(key), key.size, name))
            self.sites["value_type"].append((at(vtype), 4, name))
            t = f.types[0]
            if t == GGUFValueType.STRING:
                self.sites["str_len"].append((at(f.parts[3]), 8, name))
                self.sites["str"].append((at(f.parts[4]), f.parts[4].size, name))
            elif t == GGUFValueType.ARRAY:
                self.sites["elem_type"].append((at(f.parts[3]), 4, name))
                self.sites["array_len"].append((at(f.parts[4]), 8, name))
                if len(f.types) > 1 and f.types[1] == GGUFValueType.STRING and len(f.data):
                    for j in f.data[:64]:  # the first strings (tokens): their lengths and bytes
                        self.sites["str_len"].append((at(f.parts[j - 1]), 8, name))
                        self.sites["str"].append((at(f.parts[j]), f.parts[j].size, name))
                elif len(f.data):
                    part = f.parts[f.data[0]]
                    self.sites["array_elem"].append((at(part), part.dtype.itemsize, name, part.dtype.str,
                                                     min(len(f.data), 4096)))
            else:
                part = f.parts[3]
                self.sites["number"].append((at(part), part.dtype.itemsize, name, part.dtype.str))
        offsets = sorted(int(t.field.parts[5][0]) for t in r.tensors)
        self.tensor_offsets = offsets
        for t in r.tensors:
            p = t.field.parts  # name length, name, n_dims, dims, type id, offset
            self.sites["tensor_name"].append((at(p[1]), p[1].size, t.name))
            self.sites["n_dims"].append((at(p[2]), 4, t.name))
            self.sites["dims"].append((at(p[3]), 8 * p[3].size, t.name, int(p[3].size)))
            self.sites["type_id"].append((at(p[4]), 4, t.name))
            self.sites["offset"].append((at(p[5]), 8, t.name))


HUGE_U64 = (0, 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63, 2**64 - 1)
NUMBERS = (0.0, -1.0, float("inf"), float("-inf"), float("nan"), 1e30, -1e30, 2.0**31, 2.0**63, 1e-30)
INTS = (0, 1, -1, 2**15, 2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1, 2**63, 2**64 - 1)
BAD_UTF8 = (b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80", b"\xf8\x88\x80\x80\x80")


def _pack(dtype: str, value) -> bytes:
    """value in the numpy dtype `dtype` (e.g. '<u4', '<f4'), wrapped into range for integers."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return np.array(value, dtype=dt).tobytes()
    if dt.kind == "b":
        return bytes([int(value) & 0xFF])
    bits = 8 * dt.itemsize
    v = int(value) % (1 << bits) if not (isinstance(value, float) and not np.isfinite(value)) else 0
    return v.to_bytes(dt.itemsize, "little")


def mutate(data: bytes, layout: Layout, rng: np.random.Generator) -> tuple:
    """-> (mutant bytes, a description of what changed). One mutation, chosen by rng."""
    buf = bytearray(data)
    kinds = ["flip", "flips", "truncate", "count", "key_len", "key", "value_type", "str_len", "str", "elem_type",
             "array_len", "array_elem", "number", "tensor_name", "n_dims", "dims", "type_id", "offset", "alignment",
             "token_type", "expert_counts"]
    kind = kinds[rng.integers(len(kinds))]
    S = layout.sites

    def pick(name):
        return S[name][rng.integers(len(S[name]))] if S.get(name) else None

    def put(off, value: bytes):
        buf[off:off + len(value)] = value

    if kind in ("flip", "flips"):
        for _ in range(1 if kind == "flip" else int(rng.integers(2, 16))):
            off = int(rng.integers(min(layout.data_start, len(buf))))
            buf[off] ^= int(rng.integers(1, 256))
        return bytes(buf), f"{kind} in header"
    if kind == "truncate":
        end = int(rng.integers(layout.data_start)) if rng.random() < 0.7 else int(rng.integers(len(buf)))
        return bytes(buf[:end]), f"truncate at {end}"
    if kind in ("count", "key_len", "str_len", "array_len", "offset") and pick(kind):
        off, size, name = pick(kind)[:3]
        old = int.from_bytes(buf[off:off + size], "little")
        new = [old + 1, old - 1, old * 2, *HUGE_U64][rng.integers(3 + len(HUGE_U64))]
        if kind == "offset" and rng.random() < 0.5:  # another tensor's offset, or a misaligned one
            new = int(layout.tensor_offsets[rng.integers(len(layout.tensor_offsets))]) + int(rng.integers(0, 3))
        put(off, (new % (1 << (8 * size))).to_bytes(size, "little"))
        return bytes(buf), f"{kind} of {name}: {old} -> {new}"
    if kind in ("value_type", "elem_type", "type_id", "n_dims") and pick(kind):
        off, size, name = pick(kind)[:3]
        new = int(rng.choice([rng.integers(0, 16), rng.integers(16, 64), 2**31, 2**32 - 1]))
        put(off, new.to_bytes(4, "little"))
        return bytes(buf), f"{kind} of {name} -> {new}"
    if kind in ("key", "str", "tensor_name") and pick(kind):
        off, size, name = pick(kind)[:3]
        if size == 0:
            return bytes(buf), f"{kind} of {name}: empty, unchanged"
        if kind == "key" or (kind == "tensor_name" and rng.random() < 0.5):
            i = off + int(rng.integers(size))  # a renamed key / tensor: "missing", or an unknown one
            buf[i] = ord("x") if buf[i] != ord("x") else ord("y")
            return bytes(buf), f"rename {kind} {name}"
        bad = BAD_UTF8[rng.integers(len(BAD_UTF8))]
        i = off + int(rng.integers(max(1, size - len(bad) + 1)))
        put(i, bad[:size])
        return bytes(buf), f"invalid UTF-8 in {kind} of {name}"
    if kind == "dims" and pick("dims"):
        off, size, name, n = pick("dims")
        j = int(rng.integers(n))
        old = int.from_bytes(buf[off + 8 * j:off + 8 * j + 8], "little")
        new = [0, 1, old + 1, old * 2, 2**31, 2**32, 2**62, 2**63, 2**64 - 1][rng.integers(9)]
        put(off + 8 * j, (new % 2**64).to_bytes(8, "little"))
        return bytes(buf), f"dim {j} of {name}: {old} -> {new}"
    if kind == "number" and pick("number"):
        off, size, name, dtype = pick("number")
        pool = NUMBERS if np.dtype(dtype).kind == "f" else INTS
        new = pool[rng.integers(len(pool))]
        put(off, _pack(dtype, new))
        return bytes(buf), f"{name} = {new}"
    if kind == "array_elem" and pick("array_elem"):
        off, size, name, dtype, n = pick("array_elem")
        j = int(rng.integers(n))
        pool = NUMBERS if np.dtype(dtype).kind == "f" else INTS
        new = pool[rng.integers(len(pool))]
        put(off + size * j, _pack(dtype, new))
        return bytes(buf), f"{name}[{j}] = {new}"
    if kind == "alignment" or kind == "token_type" or kind == "expert_counts":
        want = {"alignment": "general.alignment", "token_type": "tokenizer.ggml.token_type",
                "expert_counts": ".expert_"}[kind]
        sites = [s for s in S["number"] + S["array_elem"] if want in s[2]]
        if not sites:  # no general.alignment key in this file: corrupt another number instead
            sites = S["number"]
        off, size, name, dtype = sites[rng.integers(len(sites))][:4]
        if kind == "alignment":
            new = int(rng.choice([0, 1, 3, 7, 2**31, 2**32 - 1]))
        elif kind == "token_type":
            n = sites[0][4] if len(sites[0]) > 4 else 1
            off += size * int(rng.integers(n))
            new = int(rng.choice([0, 7, 99, -5, 2**31 - 1]))
        else:
            new = int(rng.choice([0, 1, 2, 3, 7, 8, 9, 64, 1000, 2**31]))
        put(off, _pack(dtype, new))
        return bytes(buf), f"{name} = {new}" + (" (token type)" if kind == "token_type" else "")
    return mutate(data, layout, rng)  # the site kind is absent from this file: draw again


def mutant(bases: dict, layouts: dict, contents: dict, seed: int, i: int) -> tuple:
    """-> (base name, bytes, description) of mutant i of `seed`: the same every time."""
    rng = np.random.default_rng([seed, i])
    names = sorted(bases)
    name = names[rng.integers(len(names))]
    data, what = mutate(contents[name], layouts[name], rng)
    return name, data, what


# --- one mutant through pymoe, in a worker ---------------------------------------------------------------------
class _Timeout(BaseException):
    """Raised by the worker's alarm: a BaseException, so no `except Exception` in pymoe can swallow it."""


def _alarm(signum, frame):
    raise _Timeout()


def try_file(path: str, stages: tuple) -> dict:
    """Run one file through `stages` of (inspect, load, run) -> {"outcome", "stage", "detail"}."""
    import traceback

    from pymoe.errors import PymoeError

    stage = None
    try:
        engine = None
        for stage in stages:
            if stage == "inspect":
                from pymoe.gguf.inspect import describe_model
                describe_model(path)
            elif stage == "load" or engine is None:
                import pymoe
                engine = pymoe.load(path, backend="cpu", threads=1)
            if stage == "run":
                list(engine.generate("Hello", max_tokens=2))
        return {"outcome": "valid", "stage": None, "detail": ""}
    except PymoeError as e:
        msg = str(e)
        if "MemoryError" in msg:
            return {"outcome": "oom", "stage": stage, "detail": msg[:300]}
        if "\n" in msg:
            return {"outcome": "traceback", "stage": stage, "detail": "multi-line error: " + msg[:300]}
        return {"outcome": "error", "stage": stage, "detail": msg[:300]}
    except BaseException as e:  # noqa: BLE001 - this is what the fuzzer looks for
        if isinstance(e, KeyboardInterrupt):
            raise
        outcome = "timeout" if isinstance(e, _Timeout) else "oom" if isinstance(e, MemoryError) else "traceback"
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if f.filename.startswith(ROOT) and f.filename != os.path.abspath(__file__)] or [None]
        where = f"{os.path.relpath(frames[-1].filename, ROOT)}:{frames[-1].lineno}" if frames[-1] else "?"
        return {"outcome": outcome, "stage": stage, "where": f"{type(e).__name__} at {where}",
                "detail": f"{type(e).__name__} at {where}: {str(e)[:200]}"}


def worker(timeout: float, mem_gib: float) -> None:
    """Read tasks (one JSON line each: path, stages) from stdin; answer one JSON line each on stdout."""
    import resource

    from numba.core import event

    class CompileClock(event.Listener):
        """Stops the alarm while Numba compiles: a mutant that turns a tensor into a type no other file used must
        not spend its 10 s compiling a kernel (a one-time cost, cached on disk after), which is not a hang."""

        depth, left = 0, 0.0

        def on_start(self, ev):
            if self.depth == 0:
                self.left = signal.setitimer(signal.ITIMER_REAL, 0)[0]
            self.depth += 1

        def on_end(self, ev):
            self.depth -= 1
            if self.depth == 0 and self.left > 0:
                signal.setitimer(signal.ITIMER_REAL, self.left)

    event.register("numba:compile", CompileClock())
    limit = int(mem_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGALRM, _alarm)
    out = sys.stdout
    sys.stdout = sys.stderr  # pymoe's own prints must not mix with the answers
    for line in sys.stdin:
        task = json.loads(line)
        t0 = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            result = try_file(task["path"], tuple(task["stages"]))
        except _Timeout:
            result = {"outcome": "timeout", "stage": None, "detail": "in the fuzzer's own code"}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        result["seconds"] = round(time.perf_counter() - t0, 3)
        out.write(json.dumps(result) + "\n")
        out.flush()


class Worker:
    """A `fuzz_gguf.py --worker` process; restarted when a task kills it or hangs past the hard limit."""

    def __init__(self, timeout: float, mem_gib: float):
        self.args = [sys.executable, os.path.abspath(__file__), "--worker", "--timeout", str(timeout),
                     "--mem-gib", str(mem_gib)]
        self.timeout = timeout
        self.proc, self.fresh = None, True

    def run(self, path: str, stages: tuple) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True, env=env)
            self.fresh = True
        self.proc.stdin.write(json.dumps({"path": path, "stages": list(stages)}) + "\n")
        self.proc.stdin.flush()
        # the first task of a worker also waits for its start (imports); any task may compile kernels (not timed)
        hard = self.timeout + (600 if self.fresh else 300)
        self.fresh = False
        ready, _, _ = select.select([self.proc.stdout], [], [], hard)
        line = self.proc.stdout.readline() if ready else ""
        if line:
            return json.loads(line)
        if self.proc.poll() is None:  # hung where the alarm cannot reach (native code)
            self.proc.kill()
            self.proc.wait()
            return {"outcome": "timeout", "stage": None, "detail": f"no answer in {hard:.0f} s; killed"}
        code = self.proc.wait()
        outcome = "oom" if code == -signal.SIGKILL else "signal"
        return {"outcome": outcome, "stage": None, "detail": f"worker exited with {code}"}

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def fuzz(bases: dict, seed: int, n: int, stages: tuple, jobs: int = 2, timeout: float = 10.0, mem_gib: float = 4.0,
         log=None, progress: bool = True) -> list:
    """Run mutants 0..n-1 of `seed` -> a list of result dicts (base, index, what, outcome, stage, detail)."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import local

    from tqdm import tqdm

    layouts = {name: Layout(path) for name, path in bases.items()}
    contents = {name: open(path, "rb").read() for name, path in bases.items()}
    tmp = tempfile.mkdtemp(prefix="pymoe-fuzz-")
    mine, workers = local(), []

    def one(i):
        if not hasattr(mine, "w"):
            mine.w = Worker(timeout, mem_gib)
            workers.append(mine.w)
        name, data, what = mutant(bases, layouts, contents, seed, i)
        path = os.path.join(tmp, f"m{i}.gguf")
        with open(path, "wb") as f:
            f.write(data)
        try:
            result = mine.w.run(path, stages)
        finally:
            os.unlink(path)
        return {"base": name, "index": i, "what": what, **result}

    results = []
    try:
        with ThreadPoolExecutor(jobs) as pool:
            for r in tqdm(pool.map(one, range(n)), total=n, desc="mutants", unit="file", disable=not progress):
                results.append(r)
                if log is not None:
                    log.write(json.dumps(r) + "\n")
    finally:
        for w in workers:
            w.close()
        os.rmdir(tmp)
    return results


def summary(results: list, seed: int, replay: str = "") -> str:
    """The outcome counts, per base file, and one line per distinct failure with how to replay it."""
    by_outcome = collections.Counter(r["outcome"] for r in results)
    lines = [f"{len(results)} mutants (seed {seed}) of {len({r['base'] for r in results})} files: "
             + ", ".join(f"{k} {by_outcome.get(k, 0)}" for k in ("valid", "error", *BAD))]
    per_base = collections.defaultdict(collections.Counter)
    for r in results:
        per_base[r["base"]][r["outcome"]] += 1
    for base in sorted(per_base):
        c = per_base[base]
        lines.append(f"  {base:<22} " + "  ".join(f"{k} {c[k]}" for k in ("valid", "error", *BAD) if c[k]))
    groups = collections.defaultdict(list)  # (outcome, where) -> results: one line per distinct failure
    for r in results:
        if r["outcome"] in BAD:
            groups[r["outcome"], r.get("where") or r["detail"].strip().splitlines()[-1][:80]].append(r)
    for (outcome, _), rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        r = rs[0]
        lines.append(f"  {len(rs):>4} x {outcome}: {r['detail'].strip().splitlines()[-1][:150]}")
        lines.append(f"         e.g. {r['base']}: {r['what']}  (replay: {replay} --replay {seed}:{r['index']})")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mutants", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--stages", default="inspect,load,run", help="comma list of inspect, load, run")
    ap.add_argument("--bases", default=None, help="comma list of base names (default: all; 'ci': the CI subset)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "pymoe-fuzz-bases"))
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per mutant (all its stages)")
    ap.add_argument("--mem-gib", type=float, default=4.0, help="address-space limit of a worker")
    ap.add_argument("--log", default=None, help="write every result as a JSON line here")
    ap.add_argument("--replay", default=None, help="SEED:INDEX: run one mutant here, showing any traceback")
    ap.add_argument("--keep", default=None, help="with --replay: also write the mutant to this path")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.timeout, a.mem_gib)
        return 0
    names = None if a.bases is None else (CI_BASES if a.bases == "ci" else tuple(a.bases.split(",")))
    bases = make_bases(a.workdir, names)
    stages = tuple(a.stages.split(","))
    if a.replay:
        seed, i = (int(x) for x in a.replay.split(":"))
        layouts = {n: Layout(p) for n, p in bases.items()}
        contents = {n: open(p, "rb").read() for n, p in bases.items()}
        name, data, what = mutant(bases, layouts, contents, seed, i)
        path = a.keep or os.path.join(tempfile.gettempdir(), f"pymoe-fuzz-{seed}-{i}.gguf")
        with open(path, "wb") as f:
            f.write(data)
        print(f"mutant {seed}:{i} of {name}: {what} -> {path}")
        print(json.dumps(try_file(path, stages)))
        return 0
    log = open(a.log, "w") if a.log else None
    t0 = time.time()
    results = fuzz(bases, a.seed, a.mutants, stages, a.jobs, a.timeout, a.mem_gib, log=log)
    print(summary(results, a.seed, f"--bases {a.bases}" if a.bases else ""))
    print(f"{time.time() - t0:.0f} s, stages {','.join(stages)}, timeout {a.timeout:g} s, {a.mem_gib:g} GiB")
    return 1 if any(r["outcome"] in BAD for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
