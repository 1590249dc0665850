"""Import: ONNX file -> checked, shape-inferred, constant-folded :class:`Graph`.

Shapes come from ONNX's own shape inference (onnxruntime's symbolic shape inference for
models with contrib ops such as com.microsoft.MatMulNBits); other exporters' operators become
plain ONNX ops (``canon``); constants are folded with ONNX's reference evaluator. Weight-only subgraphs (transposes, casts, scale products) and shape
computations therefore disappear before any pass sees the graph.

The model is never held whole: a large initializer leaves the proto as a stub (its dims and
type) and its elements become a lazy constant (``ir.Mapped``), read from the external data
file when a pass or the lowering needs them; large folded values go to a temporary file
(``ir.Spill``). Small ones, shape constants among them, stay in the proto, where shape
inference propagates them.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, external_data_helper, helper, numpy_helper, shape_inference

from isa.files import check_readable
from isa.progress import SILENT, Progress
from dlegion_cc import canon
from dlegion_cc.canon.gqa import cache_head_dims
from dlegion_cc.errors import CompileError, UnsupportedNodes, node_error, not_supported
from dlegion_cc.ir import Graph, Lazy, Mapped, Node, Spill, Value
from dlegion_cc.ort_schemas import DEFAULT_DOMAINS, lent_to_onnx, missing_ops

NOT_FOLDED = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
              "Bernoulli"}
MAX_FOLD_ROUNDS = 8
SMALL_BYTES = 4096      # initializers up to this size keep their values in the proto
# Element types whose stored bytes are a numpy array as they are (not int4's packed nibbles).
MAPPABLE = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.INT8, TensorProto.UINT8,
            TensorProto.INT16, TensorProto.UINT16, TensorProto.INT32, TensorProto.UINT32, TensorProto.INT64,
            TensorProto.UINT64, TensorProto.BOOL}


def import_model(path: str | Path, dims: dict[str, int] | None = None, progress: Progress = SILENT) -> Graph:
    """Load ``path``, bind symbolic dims, infer shapes, fold constants and drop the Identities
    that only name a graph output."""
    source = str(path)
    with progress.task("importing", None) as advance:
        model = _parse(Path(path))
        given = {t.name for t in model.graph.initializer}
        spill = Spill()
        lazy = _unload(model, Path(path), spill)
        del model.graph.value_info[:]           # hints: inference makes them again (_check)
        _check(Path(path), source, model)
        _check_graph(model, source)
        advance()
        _bind_dims(model, dims or {}, source)
        _drop_unused(model)
        _check_domains(model, source)
        for _ in range(MAX_FOLD_ROUNDS):
            model = _infer(model, source, lazy)
            advance()
            if _fold(model, lazy, spill, source, Positions(given, dims or {})):
                continue
            model, changed = canon.canonicalize(model, lazy, source)  # exporters' ops -> plain ONNX ops
            if not changed:
                break
        else:
            model = _infer(model, source, lazy)  # the last round changed the model
        graph = _to_graph(model, lazy, source)
        _check_empty_outputs(graph, dims or {}, source)
        _check_nodes(graph, source)
    _drop_output_identities(graph)
    return graph


def _drop_output_identities(graph: Graph) -> None:
    """An Identity that only gives a computed value a graph output's name goes: the value's
    producer writes the output itself, instead of a copy through the vector unit."""
    for node in [n for n in graph.nodes if n.op == "Identity" and not n.domain]:
        src, dst = node.inputs[0], node.outputs[0]
        if dst not in graph.outputs or src in graph.outputs or src in graph.inputs or graph.producer(src) is None:
            continue
        graph.nodes.remove(node)
        for n in graph.nodes:
            n.inputs = [dst if i == src else i for i in n.inputs]
            n.outputs = [dst if o == src else o for o in n.outputs]
        del graph.values[src]


def peek(path: str | Path) -> tuple[dict[str, tuple | None], set[Path]]:
    """What a command line is checked against before the long work, read without the weights:
    each graph input's shape, weights aside (None when its rank is unknown; a dim is its size,
    the name of a symbolic dim, or None) and the external data files the model reads."""
    model = _parse(Path(path))
    shapes = {}
    weights = {t.name for t in model.graph.initializer}     # an old model lists them as inputs too
    for inp in model.graph.input:
        if inp.name in weights:
            continue
        tt = inp.type.tensor_type
        shapes[inp.name] = (tuple(d.dim_value if d.HasField("dim_value") else d.dim_param or None
                                  for d in tt.shape.dim) if tt.HasField("shape") else None)
    tensors = external_data_helper._get_all_tensors(model)
    files = {Path(path).parent / _info(t, Path(path)).location
             for t in tensors if external_data_helper.uses_external_data(t)}
    return shapes, files


def _parse(path: Path) -> onnx.ModelProto:
    try:
        check_readable(path)        # a FIFO or a device would block or never end
        # Protobuf whatever the name: onnx.load would pick a text format by the extension (.json).
        return onnx.load(str(path), format="protobuf", load_external_data=False)
    except FileNotFoundError:
        raise CompileError(f"{path}: no such file") from None
    except OSError as e:
        raise CompileError(f"{path}: cannot read ({e.strerror or e})") from None
    except Exception as e:  # protobuf decode errors have no common base class
        raise CompileError(f"{path}: not an ONNX model ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def _unload(model: onnx.ModelProto, path: Path, spill: Spill) -> dict[str, Lazy]:
    """Take the large initializers out of ``model``: each becomes a stub and its elements a
    lazy constant, read where they lie (external data) or from a temporary file (inline); small
    external tensors are read into the proto. External data must lie in the model's folder."""
    base, lazy = path.parent.resolve(), {}
    for t in model.graph.initializer:
        external = external_data_helper.uses_external_data(t)
        where = _external_file(t, path, base) if external else None
        if t.data_type not in MAPPABLE or _nbytes(t) <= SMALL_BYTES:
            if external:
                _read_into(t, path, base)
            _elements(t, path)      # read again when folding; here, to find one that does not fill its dims
            continue
        shape, dtype = tuple(t.dims), np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).newbyteorder("<")
        lazy[t.name] = (Mapped(str(where), _in_bounds(t, path, where), shape, dtype) if external
                        else spill.keep(_elements(t, path)))
        _stub(t)
    for t in external_data_helper._get_all_tensors(model):     # in subgraphs and attributes
        if external_data_helper.uses_external_data(t):
            _external_file(t, path, base)
            _read_into(t, path, base)
    return lazy


def _elements(t: TensorProto, path: Path) -> np.ndarray:
    """An initializer's elements; a count of stored elements that is not its dims' is an error
    (numpy's reshape would be a traceback)."""
    try:
        return numpy_helper.to_array(t)
    except (ValueError, TypeError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CompileError(f"{path}: initializer '{t.name}': invalid ONNX model: {why}") from None


def _nbytes(t: TensorProto) -> int:
    return math.prod(t.dims) * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize


def _stub(t: TensorProto) -> None:
    """Leave ``t`` its name, dims and type: what shape inference needs of a weight."""
    kept = (t.name, list(t.dims), t.data_type)
    t.Clear()
    t.name, t.data_type = kept[0], kept[2]
    t.dims.extend(kept[1])


def _info(t: TensorProto, path: Path) -> external_data_helper.ExternalDataInfo:
    """``t``'s external data fields, checked before onnx reads them (its int() would fail with a
    traceback on a non-numeric or overlong offset or length, the file system on a NUL)."""
    for e in t.external_data:
        if e.key in ("offset", "length") and not re.fullmatch(r"[0-9]{1,19}", e.value):
            raise CompileError(f"{path}: external data of tensor '{t.name}': {e.key} {e.value!r} "
                               f"is not a non-negative integer")
    info = external_data_helper.ExternalDataInfo(t)
    if not info.location or "\0" in info.location:
        raise CompileError(f"{path}: external data of tensor '{t.name}': bad location {info.location!r}")
    return info


def _external_file(t: TensorProto, path: Path, base: Path) -> Path:
    """The file holding ``t``'s data, which must be a regular file in the model's folder."""
    info = _info(t, path)
    where = (base / info.location).resolve()
    if Path(info.location).is_absolute() or base not in where.parents:
        raise CompileError(f"{path}: external data {info.location!r} of tensor '{t.name}' "
                           f"lies outside the model's folder")
    if not where.exists():
        raise CompileError(f"{path}: external data file {info.location!r} of tensor '{t.name}' is missing")
    try:
        check_readable(where)
    except OSError as e:
        raise CompileError(f"{path}: external data file {info.location!r} of tensor '{t.name}': "
                           f"{e.strerror}") from None
    return where


def _in_bounds(t: TensorProto, path: Path, where: Path) -> int:
    """The byte offset of ``t``'s data, which must lie wholly in its file."""
    info = _info(t, path)
    offset, need, size = info.offset or 0, _nbytes(t), where.stat().st_size
    if info.length is not None and info.length != need:
        problem = f"holds {info.length} bytes where its shape needs {need}"
    elif offset + need > size:
        problem = f"needs bytes {offset}..{offset + need} but the file has {size}"
    else:
        return offset
    raise CompileError(f"{path}: external data file {info.location!r} of tensor '{t.name}': {problem}")


def _read_into(t: TensorProto, path: Path, base: Path) -> None:
    info = _info(t, path)
    try:
        external_data_helper.load_external_data_for_tensor(t, str(base))
    except (OSError, ValueError) as e:  # a truncated file: ValueError naming only the tensor
        raise CompileError(f"{path}: external data file {info.location!r} of tensor '{t.name}': "
                           f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _check(path: Path, source: str, model: onnx.ModelProto) -> None:
    """The checker's full rules: its own (it reads the file itself, without the weights: no copy
    of the model is made), then strict shape inference, on ``model``, whose declared shapes of
    intermediate values are gone: onnxruntime lets one that inference contradicts go (the
    inferred one wins; onnxruntime-genai's builder declares a 1-D constant as a scalar), and so
    does the compiler. Operators onnxruntime defines in the default domain and ONNX does not are
    checked against onnxruntime's schemas."""
    try:
        with lent_to_onnx(model):
            onnx.checker.check_model(str(path))
            shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError, ValueError) as e:
        # one line, all of it: the checker names the culprit node on the lines after the first
        raise CompileError(f"{source}: invalid ONNX model: {' '.join(str(e).split())}") from None


def _check_graph(model: onnx.ModelProto, source: str) -> None:
    """What the checker lets through of a graph: an opset ONNX does not define (its nodes would
    be read with the newest one's meaning), no outputs, two nodes of one name."""
    newest = onnx.defs.onnx_opset_version()
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx") and not 1 <= o.version <= newest:
            raise CompileError(f"{source}: invalid ONNX model: opset {o.version} of the default domain "
                               f"(this ONNX defines 1..{newest})")
    if not model.graph.output:
        raise CompileError(f"{source}: invalid ONNX model: the graph has no outputs; nothing to compute")
    seen = set()
    for n in model.graph.node:
        if n.name and n.name in seen:
            raise node_error(source, n.name, n.op_type, "invalid ONNX model: a second node of this name")
        seen.add(n.name)


def _check_nodes(graph: Graph, source: str) -> None:
    """What shape inference lets through, with every culprit named: their results would be wrong
    without a word (a Reshape's missing elements zero, a Gather's index taken modulo the rows)."""
    problems = []
    for n in graph.nodes:
        check = None if n.domain else NODE_CHECKS.get(n.op)
        why = check and check(n, graph.values) or _size_problem(n, graph.values)
        if why:
            problems.append((n.name, n.op, why))
    for name in graph.inputs:
        v = graph.values.get(name)
        if v is not None and _nbytes_of(v) > host_memory():
            raise CompileError(f"{source}: input '{name}' {v.text()} is larger than this host's memory "
                               f"({host_memory() / 2**30:.0f} GiB)")
    if problems:
        raise UnsupportedNodes(source, problems)


def _check_empty_outputs(graph: Graph, dims: dict[str, int], source: str) -> None:
    """A dim bound to 0 may empty an input (a decode step's empty cache: a prefill), but one that
    empties a graph output leaves nothing to compute: a slip (``--dim sequence=0``)."""
    zeros = sorted(name for name, size in dims.items() if size == 0)
    if not zeros:
        return
    for name in graph.outputs:
        v = graph.values.get(name)
        if v is not None and not math.prod(v.shape):
            raise CompileError(f"{source}: graph output '{name}' {v.text()} is empty with "
                               f"{', '.join(f'{z}=0' for z in zeros)}; nothing to compute")


def host_memory() -> int:
    """Bytes of this host's physical memory: no tensor the compiler lays out, nor the emulator
    holds, can be larger (an Expand to 2**40 elements would otherwise be tiled for hours)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _nbytes_of(v: Value) -> int:
    return math.prod(v.shape) * np.dtype(v.dtype).itemsize


def _size_problem(node: Node, values: dict[str, Value]) -> str | None:
    for name in node.outputs:
        v = values.get(name)
        if v is not None and v.stored is None and _nbytes_of(v) > host_memory():
            return (f"output '{name}' {v.text()} would take {_nbytes_of(v) / 2**30:,.0f} GiB, more than "
                    f"this host's memory ({host_memory() / 2**30:.0f} GiB)")
    return None


def _reshape_problem(node: Node, values: dict[str, Value]) -> str | None:
    x, y = values.get(node.inputs[0]), values.get(node.outputs[0])
    if x is None or y is None or math.prod(x.shape) == math.prod(y.shape):
        return None
    return (f"invalid ONNX model: reshapes {list(x.shape)} ({math.prod(x.shape)} elements) "
            f"to {list(y.shape)} ({math.prod(y.shape)})")


def _gather_problem(node: Node, values: dict[str, Value]) -> str | None:
    data, indices = values.get(node.inputs[0]), values.get(node.inputs[1])
    if data is None or indices is None or indices.const is None or not data.shape:
        return None
    axis = node.attrs.get("axis", 0)
    rows = data.shape[axis]
    given = np.asarray(indices.const)
    outside = given[(given < -rows) | (given >= rows)]
    if not outside.size:
        return None
    return f"invalid ONNX model: index {outside.flat[0]} is outside axis {axis} of size {rows}"


NODE_CHECKS = {"Reshape": _reshape_problem, "Gather": _gather_problem}


def _bind_dims(model: onnx.ModelProto, dims: dict[str, int], source: str) -> None:
    unbound: dict[str, list[str]] = {}      # dim -> the inputs it shapes, in order
    dims = cache_head_dims(model) | dims    # a given size wins; shape inference then checks it
    for inp in model.graph.input:
        for d in inp.type.tensor_type.shape.dim:
            if d.HasField("dim_value"):
                continue
            name = d.dim_param or "?"
            size = _dim_size(name, dims, source)
            if size is None:
                unbound.setdefault(name, []).append(inp.name)
                continue
            d.dim_value = size
    if unbound:
        # one entry a dim, however many inputs it shapes (a cache: two a layer)
        where = ", ".join(f"'{n}' of {_some_inputs(list(dict.fromkeys(inputs)))}" for n, inputs in unbound.items())
        raise CompileError(f"{source}: unbound symbolic dimension {where}; "
                           f"pass {' '.join(f'--dim {n}=N' for n in _to_give(unbound, dims))} or --inputs")


def _to_give(unbound: dict, dims: dict[str, int]) -> list[str]:
    """The dims to bind, sorted: a sum of dims ('past_sequence_length + sequence_length') is
    computed from its terms, so its unbound terms are named instead of it."""
    terms = lambda n: [t.strip() for t in n.split("+")] if SUM_OF_DIMS.match(n) else [n]  # noqa: E731
    return sorted({t for n in unbound for t in terms(n) if not t.isdigit() and t not in dims})


SUM_OF_DIMS = re.compile(r"^\s*[A-Za-z_][\w.]*(\s*\+\s*([A-Za-z_][\w.]*|\d+))+\s*$")


def _dim_size(name: str, dims: dict[str, int], source: str) -> int | None:
    """The size of a symbolic dim: bound by name, or a sum of bound dims and integers as Optimum
    and torch.onnx name a mask's length ('past_sequence_length + sequence_length'), computed
    from its terms; a bound sum must equal that; None while unbound."""
    terms = [t.strip() for t in name.split("+")] if SUM_OF_DIMS.match(name) else []
    total = None
    if terms and all(t.isdigit() or t in dims for t in terms):
        total = sum(int(t) if t.isdigit() else int(dims[t]) for t in terms)
    if name not in dims:
        return total
    if total is not None and total != int(dims[name]):
        raise CompileError(f"{source}: dim '{name}' is bound to {dims[name]}, but its terms give {total}")
    return int(dims[name])


def _some_inputs(names: list[str]) -> str:
    if len(names) == 1:
        return f"input '{names[0]}'"
    more = f" and {len(names) - 1} more" if len(names) > 2 else f" and '{names[1]}'"
    return f"inputs '{names[0]}'{more}"


def _drop_unused(model: onnx.ModelProto) -> None:
    """Nodes no graph output depends on go before shape inference, whatever their op: they are
    never computed, so never a culprit (the passes' ``Graph.remove_dead`` treats them alike)."""
    g = model.graph
    live, kept = {o.name for o in g.output}, []
    for node in reversed(g.node):
        if any(o in live for o in node.output):
            kept.append(node)
            live |= _reads(node)
    if len(kept) < len(g.node):
        kept.reverse()
        del g.node[:]
        g.node.extend(kept)


def _check_domains(model: onnx.ModelProto, source: str) -> None:
    """Nodes of a domain nothing here lowers, all named at once, before shape inference: it
    cannot infer their shapes and would fail without naming them."""
    from dlegion_cc.lower.graph import LOWERINGS
    known = {"", "ai.onnx"} | {domain for domain, _ in LOWERINGS}
    problems = [(n.name or f"{n.op_type}_{k}", n.op_type, not_supported(n.op_type, n.domain))
                for k, n in enumerate(model.graph.node) if n.domain not in known]
    if problems:
        raise UnsupportedNodes(source, problems)


def _reads(node: onnx.NodeProto) -> set[str]:
    """The values ``node`` reads, those its subgraphs (If, Loop, Scan) read included."""
    names = set(node.input)
    for a in node.attribute:
        for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            for n in sub.node:
                names |= _reads(n)
    return names


def _has_contrib_ops(model: onnx.ModelProto) -> bool:
    """Whether ``model`` has operators only onnxruntime defines (its shape inference knows them)."""
    return any(n.domain not in DEFAULT_DOMAINS for n in model.graph.node) or bool(missing_ops(model))


def _infer(model: onnx.ModelProto, source: str, lazy: dict | None = None) -> onnx.ModelProto:
    try:
        if _has_contrib_ops(model):
            return _stubs_as_inputs(model, set(lazy or ()),
                                    lambda m: _onnxruntime_inference().infer_shapes(m, auto_merge=True))
        return shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except Exception as e:  # shape inference raises InferenceError and plain exceptions (an assert's is empty)
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CompileError(f"{source}: shape inference failed: {why}") from None


def _stubs_as_inputs(model: onnx.ModelProto, lazy: set[str], infer) -> onnx.ModelProto:
    """``infer(model)`` with the lazy constants' stubs (a type and a shape, no elements) shown
    to it as graph inputs: onnxruntime's inference reads every initializer's elements, and a
    stub's are elsewhere (a GroupQueryAttention prompt's causal mask past 64 positions)."""
    stubs = [t for t in model.graph.initializer if t.name in lazy]
    if not stubs:
        return infer(model)
    kept = [t for t in model.graph.initializer if t.name not in lazy]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    model.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in stubs)
    try:
        inferred = infer(model)
    finally:
        _restore_stubs(model, stubs)
    _restore_stubs(inferred, stubs)
    return inferred


def _restore_stubs(model: onnx.ModelProto, stubs: list) -> None:
    names = {t.name for t in stubs}
    inputs = [i for i in model.graph.input if i.name not in names]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    model.graph.initializer.extend(stubs)


def _onnxruntime_inference():
    """onnxruntime's symbolic shape inference, silenced: its log lines would come before the
    one-line error the user reads (its failures are raised, and reported as ours)."""
    import logging
    import onnxruntime
    from onnxruntime.tools import symbolic_shape_infer
    onnxruntime.set_default_logger_severity(4)      # fatal only
    logging.getLogger(symbolic_shape_infer.__name__).setLevel(logging.CRITICAL + 1)
    return symbolic_shape_infer.SymbolicShapeInference


def _static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    out = {}
    for vi in [*model.graph.input, *model.graph.value_info, *model.graph.output]:
        dims = vi.type.tensor_type.shape.dim
        if vi.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            out[vi.name] = tuple(d.dim_value for d in dims)
    return out


@dataclass(frozen=True)
class Positions:
    """What tells a table of positions read past its end because of the bound dims (rotary cos/sin
    caches gathered at past .. past + sequence) from an invalid model: the model's own constants
    and the dims the command line bound."""

    given: set[str]
    dims: dict[str, int]

    def check(self, node, known, source: str) -> None:
        """A Gather of a constant table at indices computed from the bound dims, past its rows:
        one line naming the dims, before any work (the model is not at fault)."""
        if node.op_type != "Gather" or not self.dims or node.input[1] in self.given:
            return
        if not all(i in known for i in node.input):
            return
        table, indices = known[node.input[0]], np.asarray(known[node.input[1]])
        axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
        rows = table.shape[axis] if table.ndim else 0
        if not indices.size or (-rows <= indices.min() and indices.max() < rows):
            return
        bound = ", ".join(f"{k}={v}" for k, v in sorted(self.dims.items()))
        raise CompileError(f"{source}: node '{node.name}' (Gather): {bound} reach position {int(indices.max())}, "
                           f"past the model's {rows} positions (the rows of '{node.input[0]}')")


def _fold(model: onnx.ModelProto, lazy: dict[str, Lazy], spill: Spill, source: str, positions: Positions) -> bool:
    """Evaluate every node whose inputs are all known; True when anything was folded. Large
    results join ``lazy`` (spilled) and stay stubs in the proto."""
    g = model.graph
    known = {t.name: lazy[t.name] if t.name in lazy else numpy_helper.to_array(t) for t in g.initializer}
    shapes = _static_shapes(model)
    kept, folded = [], False
    for node in g.node:
        positions.check(node, known, source)
        values = _evaluate(node, known, shapes, source)
        if values is None:
            kept.append(node)
            continue
        known.update({k: spill.keep(v) if v.nbytes > SMALL_BYTES and v.dtype.kind in "biuf" else v
                      for k, v in values.items()})
        folded = True
    if not folded:
        return False
    used = {i for n in kept for i in n.input} | {o.name for o in g.output}
    del g.node[:]
    g.node.extend(kept)
    del g.initializer[:]
    g.initializer.extend(_initializer(k, v, lazy) for k, v in known.items() if k in used)
    graph_outputs = {o.name for o in g.output}
    for name in graph_outputs & set(known):
        raise CompileError(f"{source}: graph output '{name}' is a constant; nothing to compute")
    del g.value_info[:]
    return True


def _initializer(name: str, value, lazy: dict[str, Lazy]) -> TensorProto:
    """A small value with its elements; a lazy one as a stub, its elements in ``lazy``."""
    if not isinstance(value, Lazy):
        return numpy_helper.from_array(np.asarray(value), name)
    lazy[name] = value
    t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(np.dtype(value.dtype)))
    t.dims.extend(value.shape)
    return t


def _evaluate(node, known, shapes, source) -> dict[str, np.ndarray] | None:
    if node.op_type == "Shape" and node.input[0] in shapes:
        return {node.output[0]: _shape_value(node, shapes[node.input[0]])}
    if node.domain not in ("", "ai.onnx") or node.op_type in NOT_FOLDED:
        return None
    if not all(i == "" or i in known for i in node.input):
        return None
    from onnx.reference import ReferenceEvaluator
    try:
        results = ReferenceEvaluator(node).run(None, {i: np.asarray(known[i]) for i in node.input if i})
    except Exception as e:  # the evaluator raises whatever numpy raises
        raise CompileError(f"{source}: node '{node.name}' ({node.op_type}): cannot fold constant "
                           f"inputs: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return {o: np.asarray(r) for o, r in zip(node.output, results) if o}


def _shape_value(node, shape: tuple[int, ...]) -> np.ndarray:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    start, end = attrs.get("start", 0), attrs.get("end", len(shape))
    return np.array(shape[slice(start, end)], dtype=np.int64)


def _to_graph(model: onnx.ModelProto, lazy: dict[str, Lazy], source: str) -> Graph:
    g = model.graph
    values: dict[str, Value] = {}
    for t in g.initializer:
        arr = lazy[t.name] if t.name in lazy else numpy_helper.to_array(t)
        values[t.name] = Value(t.name, tuple(arr.shape), np.dtype(arr.dtype), arr)
    shapes = _static_shapes(model)
    for vi in [*g.input, *g.value_info, *g.output]:
        if vi.name in values or vi.name not in shapes:
            continue
        dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        values[vi.name] = Value(vi.name, shapes[vi.name], np.dtype(dtype))
    nodes = [Node(n.op_type, n.name or f"{n.op_type}_{k}", list(n.input), list(n.output),
                  {a.name: helper.get_attribute_value(a) for a in n.attribute}, n.domain)
             for k, n in enumerate(g.node)]
    _check_static(nodes, values, source)
    inputs = [i.name for i in g.input if i.name not in values or values[i.name].const is None]
    origins = {n.name: n.outputs[0] for n in nodes if n.outputs}
    return Graph(g.name or "main", source, values, nodes, inputs, [o.name for o in g.output], origins)


def _check_static(nodes: list[Node], values: dict[str, Value], source: str) -> None:
    """The passes need every shape. When one is missing, report it with every node Legalize
    would reject for its operator, one line each: the user sees all the culprits at once."""
    from dlegion_cc.lower.graph import LOWERINGS
    if all(o in values for n in nodes for o in n.outputs if o):
        return
    problems = []
    for n in nodes:
        absent = [o for o in n.outputs if o and o not in values]
        if (n.domain, n.op) not in LOWERINGS:
            problems.append((n.name, n.op, not_supported(n.op, n.domain)))
        elif absent:
            problems.append((n.name, n.op, f"output '{absent[0]}' has no static shape after shape inference"))
    raise UnsupportedNodes(source, problems)
