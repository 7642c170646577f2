"""Copy a GGUF file with some tensors changed: the test-side way to make the odd files real converters write.

What this is: `rewrite_gguf(src, dst, change)` copies every metadata key and every tensor of `src` to `dst` with
gguf-py's GGUFWriter, passing each tensor through `change(name, qtype, data)`, which returns the tensor to write as
(data, qtype): `data` in NumPy order, float32 for F32, raw uint8 rows [..., row_bytes] for other types (the form
GGUFReader hands out). `change` returns its arguments unchanged for the tensors it leaves alone.
`write_mixed_down(src, dst)`: a file whose expert types change from layer to layer, as in llama.cpp's _M mixes.
What this is not: a quantizer (pymoe.quant) or a model writer (pymoe.demo.tinymodel).
"""
import numpy as np
from gguf import GGUFReader, GGUFWriter

from pymoe import quant
from pymoe.demo.tinymodel import copy_metadata


def keep(name, qtype, data):
    return data, qtype


def rewrite_gguf(src: str, dst: str, change=keep) -> None:
    r = GGUFReader(src)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    w = GGUFWriter(dst, arch)  # writes general.architecture itself
    copy_metadata(r, w)
    for t in r.tensors:
        data, qtype = change(t.name, t.tensor_type, np.array(t.data))
        if qtype == quant.QType.F32:
            w.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32))
        else:
            w.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


def requantize(data: np.ndarray, qtype, new_qtype) -> np.ndarray:
    """Raw rows of `qtype` -> raw rows of `new_qtype` (pymoe's reference dequantizer, then its quantizer)."""
    floats = data if qtype == quant.QType.F32 else quant.dequantize(data, qtype)
    return quant.quantize(floats, new_qtype)


def write_mixed_down(src: str, dst: str, layer: int = 1, qtype=quant.QType.Q6_K) -> str:
    """src with blk.{layer}.ffn_down_exps re-quantized to `qtype`: expert types that differ between layers (the
    tiny Q2_K mix has ffn_down Q3_K everywhere; llama.cpp's Q4_K_M has ffn_down Q4_K or Q6_K by layer)."""
    name = f"blk.{layer}.ffn_down_exps.weight"

    def change(n, qt, data):
        return (requantize(data, qt, qtype), qtype) if n == name else (data, qt)

    rewrite_gguf(src, dst, change)
    return dst
