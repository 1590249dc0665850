"""``dlegion-run --check-all``: every graph value the program keeps in DRAM against onnxruntime's.

A value computed from an approximation the program records (an int8 attention product, a
quantized matmul) is judged at that approximation's tolerance, as ``--check`` judges the
outputs; every other value at the tolerance given. So the first divergence named is where the
program leaves the model by more than what it approximates, not the first approximated value.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from runtime.check import REL_L2_TOLERANCE, Comparison, approximation_tolerance, compare_one, session

REWRITTEN = "the program writes its tensor again in place after a reader: the run leaves another value there"
# An approximation whose values cannot be found in the graph (one recorded without them, or by
# an older compiler) may have reached any value.
EVERYWHERE = None


def compare_intermediates(model, inputs, result, tol: float = REL_L2_TOLERANCE,
                          reference: str = "onnxruntime", approximations: dict | None = None) -> list[Comparison]:
    """Each surviving intermediate against onnxruntime's, in program order; one computed from
    ``approximations`` (Program.approximations) at their tolerance (``Comparison.tolerance``)."""
    ours = intermediates(result.program, result.machine)
    ref = onnx_intermediates(model, inputs, list(ours), reference)
    rewritten = written_after_read(result.program)
    reached = approximated_values(model, approximations or {})
    rows = []
    for name, value in ours.items():
        if name not in ref:
            continue
        want = ref[name]
        why = REWRITTEN if name in rewritten else not_the_value(value, want)
        if why:
            rows.append(Comparison(name, str(want.dtype), False, float("nan"), float("nan"), 0, True,
                                   not_the_value=why))
            continue
        kinds = reached.get(name, reached.get(EVERYWHERE, []))
        at = approximation_tolerance(kinds, tol) if kinds else tol
        row = compare_one(name, value.astype(want.dtype, copy=False).reshape(want.shape), want, at)
        row.tolerance, row.approximated = at, kinds
        if kinds:   # quantized codes an approximation reaches move by whole steps: judged by distance
            row.ok = row.within_tolerance = row.rel_l2 <= at and row.nonfinite == 0
        rows.append(row)
    return rows


def approximated_values(model: str | Path, approximations: dict[str, list[str]]) -> dict:
    """Per graph value computed from an approximation, the approximations it is computed from:
    the values each names (an attention product's output, or a quantized node's outputs by the
    node's name), or for one naming none, every MatMulNBits' output (the activations quantized
    for it), and all that is computed from them. Under ``EVERYWHERE``: those found nowhere."""
    import onnx
    graph = onnx.load(str(model), load_external_data=False).graph
    by_name = {n.name: list(n.output) for n in graph.node if n.name}
    nbits = [o for n in graph.node if n.op_type == "MatMulNBits" for o in n.output[:1]]
    consumers: dict[str, list[str]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).extend(n.output)
    values = {o for n in graph.node for o in n.output}
    out: dict = {}
    for kind, named in approximations.items():
        seeds = [v for x in named for v in ([x] if x in values else by_name.get(x, []))] if named else nbits
        if not seeds:
            out.setdefault(EVERYWHERE, []).append(kind)
        for v in _downstream(seeds, consumers):
            out.setdefault(v, []).append(kind)
    return out


def _downstream(seeds: list[str], consumers: dict[str, list[str]]) -> set[str]:
    seen, todo = set(), list(seeds)
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo += consumers.get(v, [])
    return seen


def written_after_read(program) -> set[str]:
    """Graph values whose DRAM tensor a store writes where a load of it has already read (in
    program order): written in place after a reader, what the run leaves there is not the value
    its producer left, so it cannot be compared as that value."""
    from isa.expand import DRAM_FIELD, dram_of
    from isa.instructions import DmaLoad, DmaStore
    read = {i: np.zeros(t.numel, np.bool_) for i, t in enumerate(program.tensors)
            if t.kind == "scratch" and t.io_name}
    out = set()
    for ins in getattr(program.instrs, "source", program.instrs):
        field = DRAM_FIELD.get(type(ins))
        if field is None or getattr(ins, field).tensor not in read:
            continue
        seen = read[getattr(ins, field).tensor]
        for rank in range(getattr(ins, "span", None) or 1):
            if not isinstance(ins, (DmaLoad, DmaStore)):       # a gather: rows chosen by the data
                seen[:] = True
                continue
            ref = dram_of(ins, rank)
            at = ref.offset + np.arange(ins.rows)[:, None] * ref.rs + np.arange(ins.cols)
            if isinstance(ins, DmaLoad):
                seen[at] = True
            elif seen[at].any():
                out.add(program.tensors[ref.tensor].io_name)
    return out


def intermediates(program, machine) -> dict[str, np.ndarray]:
    """Every DRAM tensor the compiler bound to a graph value, as the run left it."""
    out = {}
    for t in program.tensors:
        if t.kind == "scratch" and t.io_name:
            out[t.io_name] = machine.get(t.name)
    return out


def onnx_intermediates(model: str | Path, inputs: dict[str, np.ndarray], names: list[str],
                       reference: str = "onnxruntime") -> dict:
    """onnxruntime's values of ``names``: the model is run with them added as graph outputs."""
    sess = session(model, reference, names)
    wanted = [n for n in names if n in {o.name for o in sess.get_outputs()}]
    feeds = {i.name: inputs[i.name] for i in sess.get_inputs()}
    return dict(zip(wanted, sess.run(wanted, feeds)))


def not_the_value(ours: np.ndarray, ref: np.ndarray) -> str | None:
    """Why a DRAM tensor bound to a model value cannot hold it, if it cannot: integer storage of
    a float value that is not all integers (codes of it, such as a quantized copy)."""
    if ours.dtype.kind in "iu" and np.issubdtype(ref.dtype, np.floating) and not np.array_equal(ref, np.round(ref)):
        return f"the program holds it as {ours.dtype} while the model's values are not integers"
    return None


