"""A GGUF file's header as pymoe keeps it: every metadata value and where every tensor is, parsed by gguf-py once per
file and kept on disk for the next load of the same file.

What this is: `open_header(path, parse)` -> `Header` (`.fields`: key -> value, `.tensors`: [HeaderTensor], `.data`:
the file's memory map). `parse` is loader._open_reader: gguf-py's GGUFReader with pymoe's bounds checks. What it
finds is decoded once (strings as loader._field_value decodes them) and, when the parse took long enough to matter,
pickled under the cache folder (`cache_dir()`), keyed by the file's real path, size, modification time, inode,
device and first MiB, and gguf-py's version. A 151936-token vocabulary (Qwen3's) is ~456k values that gguf-py reads
one at a time in Python: 2.5-4 s of a load. The next load of the same, unchanged file reads the pickle instead
(~0.1 s), maps the file as gguf-py does, and makes each tensor's view from the offset, dtype and shape gguf-py found.
What this is not: a GGUF parser: nothing here interprets the header's bytes (its first MiB is hashed into the key).
A changed file has another key and is parsed again; an entry that cannot be read is parsed again and rewritten; the
folder keeps the MAX_ENTRIES entries used last; PYMOE_HEADER_CACHE=0 turns the cache off.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

FORMAT = 1  # the pickle's layout and loader._field_value's decoding: a change of either must raise it (new keys)
MIN_PARSE_S = 0.25  # a header gguf-py parses faster than this is not worth a file in the cache
MAX_ENTRIES = 32  # the cache keeps the entries used last (a few MiB each); older ones are deleted on a write


class HeaderTensor(NamedTuple):
    """gguf-py's ReaderTensor, less its `field` (the raw parts of the tensor's info)."""
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGML order (ne0, the contiguous axis, first), as gguf-py gives it
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # a view into `Header.data`: elements for float types, [.., row bytes] for quantized ones


@dataclass
class Header:
    path: str
    fields: dict  # metadata key -> value (scalar, str or list), GGUF.* (version, counts) included
    tensors: list  # [HeaderTensor], in the file's order
    data: np.ndarray  # the memory map of the whole file (np.memmap, read-only)
    from_cache: bool = False


def cache_dir() -> str:
    """$PYMOE_CACHE_DIR/gguf-headers, else $XDG_CACHE_HOME/pymoe/gguf-headers, else ~/.cache/pymoe/gguf-headers."""
    base = os.environ.get("PYMOE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pymoe")
    return os.path.join(base, "gguf-headers")


def cache_entry(path: str) -> str:
    """The cache file of `path` as it is now: another size, modification time, inode or first MiB (where the header
    starts: a file rewritten within the file system's clock tick) is another entry."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        reader_version = version("gguf")  # another gguf-py may parse differently
    except PackageNotFoundError:
        reader_version = ""
    st = os.stat(path)
    ident = "|".join(str(v) for v in (FORMAT, os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino,
                                      st.st_dev, reader_version))
    digest = hashlib.sha256(ident.encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
    return os.path.join(cache_dir(), digest.hexdigest()[:32] + ".pkl")


def from_reader(path: str, reader, field_value: Callable) -> Header:
    """The Header of a GGUFReader: every field decoded by `field_value(reader, key)`, every tensor's view kept."""
    fields = {key: field_value(reader, key) for key in reader.fields}
    tensors = [HeaderTensor(t.name, t.tensor_type, np.array(t.shape), int(t.n_elements), int(t.n_bytes),
                            int(t.data_offset), t.data) for t in reader.tensors]
    return Header(path, fields, tensors, reader.data)


def open_header(path: str, parse: Callable, field_value: Callable) -> Header:
    """The header of `path`: from the cache when it holds this file as it is now, else parsed (`parse(path)` ->
    GGUFReader; its errors propagate) and cached when that took MIN_PARSE_S or more."""
    entry = cache_entry(path) if os.environ.get("PYMOE_HEADER_CACHE", "1") != "0" else None
    if entry is not None and os.path.exists(entry):
        header = _read(entry, path)
        if header is not None:
            return header
    start = time.perf_counter()
    header = from_reader(path, parse(path), field_value)
    if entry is not None and time.perf_counter() - start >= MIN_PARSE_S:
        _write(entry, header)
    return header


def _write(entry: str, header: Header) -> None:
    """Pickle the header's fields and tensor places (not the views: offsets, dtypes, shapes) into `entry`, whole or
    not at all (a temporary file renamed over it). A folder that cannot be written costs only the next load's time."""
    record = {"fields": header.fields,
              "tensors": [(t.name, int(t.tensor_type), [int(n) for n in t.shape], t.n_elements, t.n_bytes,
                           t.data_offset, t.data.dtype.str, t.data.shape) for t in header.tensors]}
    try:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(entry), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(record, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, entry)
        _prune(os.path.dirname(entry))
    except OSError:
        pass


def _prune(folder: str) -> None:
    """Delete all but the MAX_ENTRIES entries used last (a read touches its entry): files that were rewritten or
    deleted leave entries that no key reaches again."""
    entries = sorted((e for e in os.scandir(folder) if e.name.endswith(".pkl")), key=lambda e: e.stat().st_mtime,
                     reverse=True)
    for e in entries[MAX_ENTRIES:]:
        try:
            os.remove(e.path)
        except OSError:
            pass


def _read(entry: str, path: str):
    """The Header pickled in `entry`, its views made over a new memory map of `path`; None if the entry cannot be
    read or does not fit the file (then the caller parses)."""
    from gguf import GGMLQuantizationType

    try:
        with open(entry, "rb") as f:
            record = pickle.load(f)
        data = np.memmap(path, mode="r")
        plain = data.view(np.ndarray)  # slicing np.memmap runs Python per view (loader._Reader._get)
        tensors = []
        for name, type_id, shape, n_elements, n_bytes, offset, dtype, data_shape in record["tensors"]:
            if offset + n_bytes > len(plain):
                return None
            view = plain[offset:offset + n_bytes].view(np.dtype(dtype)).reshape(data_shape)
            tensors.append(HeaderTensor(name, GGMLQuantizationType(type_id), np.array(shape, dtype=np.uint64),
                                        n_elements, n_bytes, offset, view))
        try:
            os.utime(entry)  # used now: the last to be pruned
        except OSError:
            pass
        return Header(path, record["fields"], tensors, data, from_cache=True)
    except Exception:  # a truncated, foreign or older entry: parse again (and rewrite it)
        return None
