"""GGML tensor types that llama.cpp knows and the installed gguf-py does not yet: taught to gguf-py at import.

What this is: a minimal, explicit registration of extra GGML type ids in the two tables gguf-py reads when it meets
a tensor: the `GGMLQuantizationType` enum (`GGUFReader` turns each tensor's type field into a member with
`GGMLQuantizationType(raw_id)`, an unknown id raises ValueError) and `GGML_QUANT_SIZES` (member -> (weights per
block, bytes per block), which the reader uses to size the tensor's bytes and the writer to check row sizes). With
both entries, `GGUFReader` reads files holding such tensors and `GGUFWriter.add_tensor(..., raw_dtype=...)` writes
them, with no parsing of GGUF by pymoe. Imported first by `pymoe.quant` (so any code that imports pymoe's quant
registry, the loader included, sees the extended enum).
What this is not: a dequantizer. gguf-py's own `gguf.quantize` / `gguf.dequantize` still do not know these types
(their per-type classes are not touched); pymoe's `QuantFormat` for the type (e.g. `q2_0.py`) is the code, and
llama.cpp's ggml (through llama-cpp-python) is the oracle in the tests.

Why extend an enum in place: Python enums are closed by design, but the reader looks types up by value in the one
class gguf-py ships, so a subclass or a second enum would not be seen. Adding a member means putting one new
instance into the three maps Enum itself keeps (`_member_map_`, `_value2member_map_`, `_member_names_`), exactly
what `EnumType.__new__` does for the members declared in the class body (the same recipe as `aenum.extend_enum`).
A newer gguf-py that already declares a type is left alone (its sizes are checked against ours), so this module
becomes a no-op, and can be deleted, once gguf-py catches up.

Source of the numbers: llama.cpp's ggml/include/ggml.h (`GGML_TYPE_Q2_0 = 42`), ggml-common.h (`QK2_0 64`,
`block_q2_0` = fp16 d + 16 bytes of codes) and include/llama.h (`LLAMA_FTYPE_MOSTLY_Q2_0 = 41`), as vendored by
llama-cpp-python 0.3.36; tests/test_q2_0.py checks the sizes against that library's `ggml_blck_size` /
`ggml_type_size` / `ggml_type_name`.
"""
from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# name -> (ggml type id, weights per block, bytes per block)
EXTRA_TYPES = {
    "Q2_0": (42, 64, 2 + 64 // 4),  # fp16 d + 2 bits per weight: 2.25 bits per weight
}

# llama.h's `llama_ftype` of a file whose weights are mostly Q2_0 (written as general.file_type; gguf-py's
# LlamaFileType stops at MOSTLY_Q1_0 = 40).
LLAMA_FTYPE_MOSTLY_Q2_0 = 41


def extend_ggml_type(name: str, value: int, block_size: int, type_size: int) -> GGMLQuantizationType:
    """Make `GGMLQuantizationType.<name>` (= value) exist with GGML_QUANT_SIZES (block_size, type_size); idempotent."""
    enum_cls = GGMLQuantizationType
    if name in enum_cls.__members__:  # gguf-py (or an earlier call) already has it: check it is the same type
        member = enum_cls[name]
        if int(member) != value or GGML_QUANT_SIZES.get(member) != (block_size, type_size):
            raise RuntimeError(f"gguf-py's {name} (id {int(member)}, sizes {GGML_QUANT_SIZES.get(member)}) differs "
                               f"from llama.cpp's (id {value}, sizes {(block_size, type_size)})")
        return member
    if value in enum_cls._value2member_map_:
        raise RuntimeError(f"ggml type id {value} is {enum_cls(value).name} in gguf-py, not {name}")
    member = int.__new__(enum_cls, value)  # an IntEnum member is an int subclass instance ...
    member._name_, member._value_ = name, value  # ... with these two attributes set by EnumType
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    enum_cls._member_map_[name] = member  # QType.Q2_0, QType["Q2_0"], iteration (with _member_names_)
    enum_cls._value2member_map_[value] = member  # QType(42): the lookup GGUFReader does
    enum_cls._member_names_.append(name)
    GGML_QUANT_SIZES[member] = (block_size, type_size)
    return member


for _name, (_value, _block_size, _type_size) in EXTRA_TYPES.items():
    extend_ggml_type(_name, _value, _block_size, _type_size)
