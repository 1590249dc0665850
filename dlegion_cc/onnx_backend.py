"""ONNX's backend interface over the compiler and the emulator.

``DlegionBackend.prepare(model)`` returns a :class:`DlegionRep`; ``rep.run(inputs)`` compiles the
model for the shapes of ``inputs`` (symbolic dimensions bound from them, one program per
distinct set of shapes), emulates it, and returns the graph outputs in order with their ONNX
dtypes. This lets ONNX's own node test suite (``onnx.backend.test.BackendTest``) drive the
compiler.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference
from onnx.backend.base import Backend, BackendRep, namedtupledict

from isa import arch as arch_mod
from isa.arch import Arch
from isa.program import Program
from dlegion_cc.errors import CompileError
from dlegion_cc.pipeline import Options, compile_model
from runtime.emulator import run as emulate

DEFAULT_ARCH = "dlegion-tiny"
# Operands the compiler needs as constants: shapes, axes and slice bounds, and the weights (with
# their scales and zero points) of integer matmuls, which the systolic arrays hold packed. When
# a model takes them as graph inputs, the values given to ``run`` are baked into the model, like
# the input shapes; each distinct set of values compiles once.
PARAMETER_OPERANDS = {"Reshape": (1,), "Expand": (1,), "Slice": (1, 2, 3, 4), "Squeeze": (1,),
                      "Unsqueeze": (1,), "Split": (1,), "ReduceSum": (1,), "ReduceMean": (1,),
                      "ReduceMax": (1,), "ReduceMin": (1,),
                      "MatMulInteger": (1, 3), "QLinearMatMul": (1, 3, 4, 5, 6, 7)}
# Tensors above this many bytes go to a side file, so models past protobuf's 2 GiB limit load.
EXTERNAL_DATA_BYTES = 1 << 20


class DlegionRep(BackendRep):
    """A prepared model: compiled per distinct input shapes (and parameter values), emulated."""

    def __init__(self, model: onnx.ModelProto, arch: Arch):
        self.model, self.arch = model, arch
        inits = {t.name for t in model.graph.initializer}
        self.input_names = [i.name for i in model.graph.input if i.name not in inits]
        self.output_names = [o.name for o in model.graph.output]
        self.parameters = _parameter_inputs(model.graph, set(self.input_names))
        self.programs: dict[tuple, tuple[Program, list[np.dtype]]] = {}   # with the output dtypes
        declared = [i for i in model.graph.input if i.name in self.input_names]
        if not self.parameters and all(_static(i) for i in declared):    # compile now: fail early
            self._program({i.name: tuple(d.dim_value for d in i.type.tensor_type.shape.dim)
                           for i in declared}, {})

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        feeds = self._feeds(inputs)
        program, dtypes = self._program({n: a.shape for n, a in feeds.items()},
                                        {n: feeds[n] for n in self.parameters})
        wanted = {t.io_name for t in program.inputs()}
        # DRAM holds bool tensors as u8 bytes; every other dtype must already match the program's.
        given = {n: a.astype(np.uint8) if a.dtype == np.bool_ else a for n, a in feeds.items() if n in wanted}
        outputs = emulate(program, self.arch, given).outputs
        values = [np.asarray(outputs[n]).astype(d) for n, d in zip(self.output_names, dtypes)]
        return namedtupledict("Outputs", self.output_names)(*values)

    def _feeds(self, inputs: Any) -> dict[str, np.ndarray]:
        if isinstance(inputs, dict):
            missing = [n for n in self.input_names if n not in inputs]
            if missing:
                raise ValueError(f"no value for input(s) {', '.join(missing)}")
            return {n: np.asarray(inputs[n]) for n in self.input_names}
        inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        if len(inputs) != len(self.input_names):
            raise ValueError(f"the model takes {len(self.input_names)} input(s) "
                             f"({', '.join(self.input_names)}), got {len(inputs)}")
        return {n: np.asarray(a) for n, a in zip(self.input_names, inputs)}

    def _program(self, shapes: dict[str, tuple[int, ...]], params: dict[str, np.ndarray]):
        key = (tuple(tuple(shapes[n]) for n in self.input_names),
               tuple((a.dtype.str, a.shape, a.tobytes()) for a in params.values()))
        if key not in self.programs:
            model = _with_shapes(self.model, shapes, params)
            dtypes = [helper.tensor_dtype_to_np_dtype(o.type.tensor_type.elem_type) for o in model.graph.output]
            self.programs[key] = (_compile(model, self.arch), dtypes)
        return self.programs[key]


class DlegionBackend(Backend):
    """``prepare(model, device="CPU", arch="dlegion-tiny")``; ``arch`` is a preset name, a
    TOML file or an :class:`Arch`."""

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> DlegionRep:
        if not cls.supports_device(device):
            raise ValueError(f"device {device!r} is not supported (only CPU: the emulator)")
        arch = kwargs.get("arch", DEFAULT_ARCH)
        return DlegionRep(model, arch if isinstance(arch, Arch) else arch_mod.load(arch))

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info=None, **kwargs: Any) -> tuple[np.ndarray, ...]:
        """Run one node: a one-node model typed from ``inputs``, outputs by shape inference."""
        arrays = [np.asarray(a) for a in inputs]
        names = [n for n in node.input if n]
        graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                        for n, a in zip(names, arrays)]
        graph = helper.make_graph([node], "node", graph_inputs,
                                  [helper.make_empty_tensor_value_info(o) for o in node.output if o])
        opset = kwargs.pop("opset_version", onnx.defs.onnx_opset_version())
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid(node.domain or "", opset)])
        return cls.prepare(model, device, **kwargs).run(arrays)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device == "CPU"


def _static(vi: onnx.ValueInfoProto) -> bool:
    t = vi.type.tensor_type
    return t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim)


def _parameter_inputs(graph: onnx.GraphProto, inputs: set[str]) -> list[str]:
    used = {n.input[k] for n in graph.node if n.domain in ("", "ai.onnx")
            for k in PARAMETER_OPERANDS.get(n.op_type, ()) if k < len(n.input)}
    return sorted(used & inputs)


def _with_shapes(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]],
                 params: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``model`` whose inputs have the given concrete shapes, ``params`` made constants."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [vi for vi in out.graph.input if vi.name not in params]
    del out.graph.input[:]
    out.graph.input.extend(kept)
    out.graph.initializer.extend(numpy_helper.from_array(np.asarray(a), n) for n, a in params.items())
    for vi in out.graph.input:
        if vi.name in shapes:
            _set_shape(vi, shapes[vi.name])
    _complete_outputs(out)
    return out


def _complete_outputs(model: onnx.ModelProto) -> None:
    """Graph outputs declared without a type or shape take what shape inference finds (the
    checker, which the importer runs first, wants both)."""
    missing = [o for o in model.graph.output if not o.type.tensor_type.HasField("shape")]
    if not missing:
        return
    inferred = shape_inference.infer_shapes(model, data_prop=True)
    found = {vi.name: vi for vi in [*inferred.graph.output, *inferred.graph.value_info]
             if vi.type.tensor_type.HasField("shape")}
    for o in missing:
        if o.name in found:
            o.CopyFrom(found[o.name])


def _set_shape(vi: onnx.ValueInfoProto, shape: tuple[int, ...]) -> None:
    t = vi.type.tensor_type
    if t.HasField("shape") and len(t.shape.dim) != len(shape):
        raise ValueError(f"input '{vi.name}' has rank {len(t.shape.dim)}, got an array of shape {list(shape)}")
    t.shape.CopyFrom(onnx.TensorShapeProto())     # present even for a 0-d tensor
    for size in shape:
        t.shape.dim.add().dim_value = int(size)


def _compile(model: onnx.ModelProto, arch: Arch) -> Program:
    """Compile through a model file, as ``dlegion-cc`` does (the importer confines external data);
    messages name the graph, not the temporary file."""
    name = model.graph.name or "model"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location="model.onnx.data", size_threshold=EXTERNAL_DATA_BYTES)
        try:
            _, program = compile_model(path, Options(arch, {}))
        except CompileError as e:
            raise CompileError(str(e).replace(str(path), name)) from None
    program.source = name
    return program
