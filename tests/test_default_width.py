"""The CPU backend's default activation width is chosen per file (backends/cpu.py `default_width`): two 8-bit planes
(15) when every routed expert matrix has 8-row tiles, else 16; a width given on the command line, in the API or in
PYMOE_ACT_BITS always holds."""
from types import SimpleNamespace

import pytest

from pymoe.backends.cpu import CPUBackend, default_width
from pymoe.quant import QType


def _file(types, rows=512, cols=1024):
    """A stand-in for a loaded GGUF file: two MoE layers whose experts are [8, rows, cols] of these types."""
    def layer_tensor(i, name):
        proj = name.split("_")[1]  # ffn_<proj>_exps.weight
        return SimpleNamespace(qtype=types[(i, proj)], shape=(8, rows, cols))

    return SimpleNamespace(config=SimpleNamespace(moe_layers=range(2)), layer_tensor=layer_tensor)


def _types(qtype, odd=None):
    t = {(i, p): qtype for i in range(2) for p in ("gate", "up", "down")}
    if odd is not None:
        t[(1, "down")] = odd
    return t


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q2_K, QType.Q6_K, QType.MXFP4, QType.IQ4_XS])
def test_tiled_experts_default_to_two_planes(qtype):
    assert default_width(_file(_types(qtype))) == "15"


@pytest.mark.parametrize("qtype", [QType.Q2_0, QType.IQ2_XXS, QType.IQ1_M, QType.F16])
def test_experts_without_tiles_default_to_16(qtype):
    assert default_width(_file(_types(qtype))) == "16"


def test_one_untiled_matrix_is_enough_for_16():
    assert default_width(_file(_types(QType.Q4_K, odd=QType.Q2_0))) == "16"
    assert default_width(_file(_types(QType.Q4_K), rows=500)) == "16"  # rows not whole tiles of 8


def test_a_given_width_holds(monkeypatch):
    monkeypatch.delenv("PYMOE_ACT_BITS", raising=False)
    tiled, untiled = _file(_types(QType.Q4_K)), _file(_types(QType.Q2_0))
    b = CPUBackend()
    b.fit_width(tiled)
    assert (b.act_bits, b.dense_bits, b.expert_bits, b.repack) == (15, 15, 15, True)
    b.fit_width(untiled)
    assert (b.act_bits, b.repack) == (16, False)
    b = CPUBackend(act_bits=16)
    b.fit_width(tiled)
    assert b.act_bits == 16
    monkeypatch.setenv("PYMOE_ACT_BITS", "8")
    b = CPUBackend()
    b.fit_width(untiled)
    assert b.act_bits == 8
