"""The Llama-style decoders quantized by onnxruntime's tools compile onto the systolic arrays and
agree with onnxruntime; the BitNet models still do.

References. onnxruntime's uint8 x int8 kernels on x86 CPUs without VNNI sum pairs of products in
saturating int16 (pmaddubsw); with the full-range int8 weights of the dynamic and QDQ int8
models that changes their logits by about 5 % on such machines, and not on others. Those two
models are therefore compared with a fresh onnxruntime run of the same model that cannot
saturate: the int8 MatMulInteger weights shifted to uint8 with zero point 128 (the same numbers,
a uint8 x uint8 kernel) and optimizations at ORT_ENABLE_BASIC (no QDQ fusion into
QLinearMatMul). That run equals ONNX's reference evaluator bit for bit, and the stored goldens
of models with integer operators are made with it (``models.golden.run``).
"""
from __future__ import annotations

from collections import Counter
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from isa import arch as arch_mod
from isa.instructions import MatMul
from dlegion_cc.pipeline import Options, compile_model
from models.golden import read_npz
from runtime.check import onnx_reference
from runtime.emulator import run

ROOT = Path(__file__).parent.parent
ARCH = arch_mod.load("dlegion-tiny")
# model: (tolerance on the logits' relative L2 error, weight mode of every projection)
LLAMA = {
    "llama_tiny_dynamic_int8": (1e-4, "w8"),
    "llama_tiny_qdq": (1e-4, "w8"),
    "llama_tiny_qdq_int4": (1e-4, "w4"),
    "llama_tiny_nbits4": (3e-2, "w4"),     # float activations are quantized to int8 per row
}
PROJECTIONS = 15                           # 7 per layer, 2 layers, and lm_head
# Matmuls left after fusing those that share their input (per layer Q/K/V as one, O, gate/up
# as one, down). The dynamic int8 projections keep their own per-row multipliers (activation
# scale times their weight scale, rounded once as onnxruntime does), so they stay apart.
FUSED = {"llama_tiny_dynamic_int8": PROJECTIONS, "llama_tiny_qdq": 9, "llama_tiny_qdq_int4": 9,
         "llama_tiny_nbits4": 9}


def model_path(name: str) -> Path:
    return ROOT / "models" / f"{name}.onnx"


def golden(name: str) -> dict[str, np.ndarray]:
    return read_npz(ROOT / "tests" / "golden" / f"{name}.npz")


@cache
def compiled(name: str, seq: int | None = None):
    dims = {} if seq is None else {"sequence": seq}
    graph, program = compile_model(model_path(name), Options(ARCH, dims, attention="fp32"))
    outputs = run(program, ARCH, {"input_ids": golden(name)["input_ids"]}).outputs
    return graph, program, outputs


def unsaturated_reference(name: str) -> np.ndarray:
    """onnxruntime's logits for ``name`` with kernels that compute the operators' definition."""
    return onnx_reference(model_path(name), {"input_ids": golden(name)["input_ids"]}, "exact")["logits"]


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


@pytest.mark.parametrize("name", LLAMA)
def test_llama_logits_match_onnxruntime(name):
    tol, _ = LLAMA[name]
    logits = compiled(name)[2]["logits"]
    err = rel_l2(logits, unsaturated_reference(name))
    print(f"{name}: logits rel L2 {err:.3g} (stored golden: {rel_l2(logits, golden(name)['logits']):.3g})")
    assert err <= tol


@pytest.mark.parametrize("name", LLAMA)
def test_llama_projections_run_on_the_arrays(name):
    graph, program, _ = compiled(name)
    ops = Counter(n.op for n in graph.nodes)
    assert ops["QMatMul"] == FUSED[name]
    assert sum(len(n.outputs) for n in graph.nodes if n.op == "QMatMul") == PROJECTIONS
    assert ops["MatMul"] == 4                           # QK^T and PV stay float
    assert not {"MatMulInteger", "MatMulNBits"} & set(ops)
    assert projection_modes(program) == {LLAMA[name][1]}


def projection_modes(program) -> set[str]:
    """Modes of the passes over activation rows (not the zero-point correction's broadcast row)."""
    return {i.mode for i in program.instrs if isinstance(i, MatMul) and i.act.rs != 0}


def test_dynamic_int8_keeps_one_quantization_per_input():
    ops = Counter(n.op for n in compiled("llama_tiny_dynamic_int8")[0].nodes)
    assert ops["DynamicQuantizeLinear"] == 9            # 4 per layer and the final norm


def test_nbits_quantizes_each_input_once():
    ops = Counter(n.op for n in compiled("llama_tiny_nbits4")[0].nodes)
    assert ops["AbsmaxQuantize"] == 9


BITNET = ["bitnet_tiny_relu2", "bitnet_tiny_silu_mha", "bitnet_tiny_sparse", "bitnet_tiny_gqa"]


@pytest.mark.parametrize("name", BITNET)
def test_bitnet_still_matches(name):
    seq = golden(name)["input_ids"].shape[1] if name == "bitnet_tiny_gqa" else None
    graph, program, outputs = compiled(name, seq)
    matmuls = [n for n in graph.nodes if n.op == "QMatMul"]
    # Q/K/V and gate/up fused; a ReLU^2 MLP's gate/up drains their product, one output (passes/gated.py)
    gated = sum(n.attrs.get("gated") is not None for n in matmuls)
    assert gated == (2 if name in ("bitnet_tiny_relu2", "bitnet_tiny_sparse") else 0)
    assert len(matmuls) == 8 and sum(len(n.outputs) for n in matmuls) == 14 - gated
    assert projection_modes(program) == {"w2"}
    assert rel_l2(outputs["logits"], golden(name)["logits"]) <= 1e-4
