"""Exporters' operators rewritten into the plain ONNX ops the passes know, before folding.

Each exporter spells the same computation its own way: onnxruntime's contrib operators
(com.microsoft, and a few in the default domain, as onnxruntime-genai's builder writes them),
ONNX's newer function operators (opset 23's RMSNormalization, RotaryEmbedding, Attention;
LayerNormalization; Gelu). Here each becomes plain ONNX ops, so the passes and the lowering
meet one form:

- an operator of another exporter has a handler (``@expands``) that returns its replacement;
- an ONNX operator the compiler has no lowering for, whose schema defines it as a function of
  other operators, is inlined by ONNX's own inliner.

This runs on the proto once shape inference and constant folding have nothing left to do (a
handler may read its inputs' shapes and the constants folding made), and both run again on
what it leaves.
"""
from __future__ import annotations

from typing import Callable

import onnx
import onnx.inliner
from onnx import helper

from dlegion_cc.canon.builder import Builder
from dlegion_cc.errors import UnsupportedNodes
from dlegion_cc.ort_schemas import DEFAULT_DOMAINS, default_opset

Handler = Callable[[onnx.NodeProto, Builder], None]
EXPANSIONS: dict[tuple[str, str], Handler] = {}


def expands(*ops: str, domain: str = ""):
    """Register a handler: it adds, through the builder, nodes computing the node's outputs."""
    def register(fn: Handler) -> Handler:
        for op in ops:
            EXPANSIONS[(domain, op)] = fn
        return fn
    return register


def canonicalize(model: onnx.ModelProto, lazy: dict, source: str) -> tuple[onnx.ModelProto, bool]:
    """``model`` with every handled operator replaced and ONNX's functions inlined (and what
    the functions' bodies write replaced in turn), and whether anything changed. It runs once
    folding has nothing left to do: a handler sees the constants folding makes (GatherND's
    indices), and no function is inlined that folding removes (Range). ``lazy``: the large
    constants' elements."""
    changed = _rewrite(model, lazy, source)
    inlined = _inlined(model)
    if inlined:
        model = _inline(model, inlined)
        _rewrite(model, lazy, source)
    if changed or inlined:
        # inference makes them again; onnxruntime's took GroupQueryAttention's present for its past
        del model.graph.value_info[:]
        for out in model.graph.output:
            out.type.tensor_type.ClearField("shape")
    return model, changed or bool(inlined)


def _rewrite(model: onnx.ModelProto, lazy: dict, source: str) -> bool:
    if not any(_handler(n) for n in model.graph.node):
        return False
    b = Builder(model, lazy)
    problems = []
    for node in model.graph.node:
        handler = _handler(node)
        if handler is None:
            b.keep(node)
            continue
        try:
            b.at(node)
            handler(node, b)
        except ValueError as e:
            problems.append((node.name or node.op_type, node.op_type, str(e)))
    if problems:
        raise UnsupportedNodes(source, problems)
    b.finish()
    return b.changed


def _handler(node: onnx.NodeProto) -> Handler | None:
    domain = "" if node.domain in DEFAULT_DOMAINS else node.domain
    return EXPANSIONS.get((domain, node.op_type))


def _inlined(model: onnx.ModelProto) -> set[str]:
    """Default-domain operators of ``model`` with no lowering that ONNX defines as functions."""
    from dlegion_cc.lower.graph import LOWERINGS
    opset, ops = default_opset(model), set()
    for n in model.graph.node:
        if (n.domain not in DEFAULT_DOMAINS or ("", n.op_type) in LOWERINGS or n.op_type in NOT_INLINED
                or not onnx.defs.has(n.op_type, opset, "")):
            continue
        schema = onnx.defs.get_schema(n.op_type, opset, "")
        if schema.has_function or schema.has_context_dependent_function:
            ops.add(n.op_type)
    return ops


# Functions whose bodies hold control flow, which nothing lowers: left whole, the error names them.
NOT_INLINED = {"Range"}


def _inline(model: onnx.ModelProto, ops: set[str]) -> onnx.ModelProto:
    """ONNX's inliner, which needs every input's type: an initializer's is declared first."""
    g = model.graph
    typed = {v.name for v in [*g.input, *g.value_info, *g.output]}
    g.value_info.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                        for t in g.initializer if t.name not in typed)
    return onnx.inliner.inline_selected_functions(model, [("", op) for op in sorted(ops)],
                                                  inline_schema_functions=True)


from dlegion_cc.canon import gather_nd, gelu, gqa, norms, plain, rotary  # noqa: E402,F401  (registers the handlers)
