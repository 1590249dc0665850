"""Compiler errors: each names the model and the culprit node, and exits with status 2."""
from __future__ import annotations

from dlegion_cc.ort_schemas import MS


class CompileError(Exception):
    """A model that cannot be compiled; the message is complete and user-facing."""


def node_error(source: str, node_name: str, op: str, reason: str) -> CompileError:
    return CompileError(f"{source}: node '{node_name}' ({op}): {reason}")


class UnsupportedNodes(CompileError):
    """Every node that cannot be compiled, reported at once."""

    def __init__(self, source: str, problems: list[tuple[str, str, str]]):
        self.problems = problems
        lines = [f"{source}: node '{n}' ({op}): {why}" for n, op, why in problems]
        super().__init__("\n".join(lines))


# onnxruntime's QOperator format (quantize_static(quant_format=QuantFormat.QOperator)) writes these
# contrib operators; its QDQ format writes the same computation in standard ops, which compile.
QOPERATOR_HINT = "onnxruntime's QOperator format: quantize with quant_format=QuantFormat.QDQ, which compiles"


def not_supported(op: str, domain: str = "") -> str:
    """Why a node of no lowering is rejected, with what to do where there is something."""
    if domain == MS and (op.startswith("QLinear") or op == "QGemm"):
        return f"operator not supported (domain {domain}; {QOPERATOR_HINT})"
    return "operator not supported" + (f" (domain {domain})" if domain else "")
