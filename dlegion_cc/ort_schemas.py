"""Operators onnxruntime defines in the default ONNX domain and ONNX does not.

onnxruntime registers some contrib operators in the default domain (onnxruntime-genai's
builder writes ``SimplifiedLayerNormalization`` there), and older ones (``LayerNormalization``
before opset 17). ONNX's checker rejects them ("No Op registered"), though onnxruntime runs the
model. The compiler accepts what onnxruntime accepts: for as long as the checker runs, ONNX's
schema registry also holds onnxruntime's schemas of the operators a model uses that ONNX lacks.
"""
from __future__ import annotations

from contextlib import contextmanager

import onnx
from onnx import AttributeProto
from onnx.defs import OpSchema

DEFAULT_DOMAINS = ("", "ai.onnx")
MS = "com.microsoft"        # onnxruntime's contrib operators


def default_opset(model: onnx.ModelProto) -> int:
    return max((o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS), default=1)


def _nodes(graph: onnx.GraphProto):
    """Every node of ``graph`` and of its subgraphs (If, Loop, Scan)."""
    for node in graph.node:
        yield node
        for a in node.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield from _nodes(sub)


def missing_ops(model: onnx.ModelProto) -> set[str]:
    """Default-domain operators of ``model`` that ONNX does not define at its opset."""
    opset = default_opset(model)
    return {n.op_type for n in _nodes(model.graph)
            if n.domain in DEFAULT_DOMAINS and not onnx.defs.has(n.op_type, opset, "")}


def _ort_schemas() -> list:
    from onnxruntime.capi import onnxruntime_pybind11_state as ort
    return ort.get_all_operator_schema()


def lent_schemas(model: onnx.ModelProto) -> list[OpSchema]:
    """onnxruntime's schemas, as ONNX ones, of the operators ONNX lacks for ``model``: for each,
    the newest onnxruntime defines in the default domain at the model's opset."""
    missing, opset = missing_ops(model), default_opset(model)
    if not missing:
        return []
    newest = {}
    for s in _ort_schemas():
        if s.name in missing and s.domain in DEFAULT_DOMAINS and s.since_version <= opset and not s.deprecated:
            if s.name not in newest or s.since_version > newest[s.name].since_version:
                newest[s.name] = s
    return [_as_onnx(s) for s in newest.values()]


def _as_onnx(s) -> OpSchema:
    def param(p):
        return OpSchema.FormalParameter(p.name, p.typeStr, param_option=OpSchema.FormalParameterOption[p.option.name],
                                        is_homogeneous=p.isHomogeneous)
    return OpSchema(s.name, "", s.since_version, inputs=[param(p) for p in s.inputs],
                    outputs=[param(p) for p in s.outputs],
                    type_constraints=[(t.type_param_str, list(t.allowed_type_strs), "") for t in s.type_constraints],
                    attributes=[_attribute(a) for a in s.attributes.values()])


def _attribute(a) -> OpSchema.Attribute:
    if a._default_value:
        default = AttributeProto.FromString(a._default_value)
        if default.type != AttributeProto.UNDEFINED:
            return OpSchema.Attribute(a.name, default)
    return OpSchema.Attribute(a.name, OpSchema.AttrType[a.type.name], required=a.required)


@contextmanager
def lent_to_onnx(model: onnx.ModelProto):
    """ONNX's registry with onnxruntime's schemas for ``model`` (``lent_schemas``) while the block
    runs, and as it was after."""
    schemas = lent_schemas(model)
    for s in schemas:
        onnx.defs.register_schema(s)
    try:
        yield
    finally:
        for s in schemas:
            onnx.defs.deregister_schema(s.name, s.since_version, s.domain)
