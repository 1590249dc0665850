"""Comparing emulated outputs with onnxruntime on the same inputs."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.quantized64 import BOUNDS as QUANTIZE_BOUNDS

REL_L2_TOLERANCE = 1e-4


# A float output that is not within the tolerance of onnxruntime still passes when it is no
# farther from the graph evaluated in float64 than FP64_MULTIPLE times onnxruntime's own fp32
# output is, both in relative L2 and in the count of positions (rows along the last axis) farther
# than the tolerance from it (at least FP64_MULTIPLE positions are allowed). Models whose
# initializers pass FP64_MAX_PARAMETER_BYTES are not evaluated in float64 unless asked.
FP64_MULTIPLE = 2.0
FP64_MAX_PARAMETER_BYTES = 1 << 30
# The compiler's own approximations (reference64.APPROXIMATIONS) are modelled in a second
# float64 evaluation; the distance they put between it and the graph's may be at most this.
APPROXIMATION_BOUND = 3e-2
# onnxruntime's fp32 distance from fp64 is one sample of fp32's noise, and on an output of few
# rows (a decode step's logits) it can be small by chance. The spread is at least FP32_FLOOR times
# r, the relative L2 distance of the float64 yardstick from its own float32 rounding (what fp32
# loses merely storing the output). Measured on the committed models (seeds 0-9; fp32, int8 and
# int8x2 attention; decode steps after 11 and 15 tokens), where only fp32's rounding separates them
# from the yardstick (no int8 rounding gone the other way): onnxruntime's distance is 1.0 r at the
# least, 4-7 r typically and 15 r at most; dlegion's correct programs 4 r typically and 13 r at most.
# One flipped weight moves an output 3e5 r or more. Doubled by FP64_MULTIPLE, the floor passes 16 r.
FP32_FLOOR = 8.0

# What a program computes instead of its model's semantics, as the compiler records it
# (Program.approximations), and the relative L2 distance from onnxruntime each is documented to
# stay within on a float output. By default ``--check`` judges float outputs at the sum of the
# tolerances of the approximations a program records (distances add at most), and says so.
# int8_attention: 3.1e-2 at most on the committed models' logits (their random weights pass
# every perturbation through each later layer's int8 activations; README, "Attention in int8").
# int8_activations: the bound above (llama_tiny_nbits4: 1.2e-2).
PROGRAM_APPROXIMATIONS = {
    "int8_attention": ("attention's float products (QK^T, PV) on the arrays in int8: Q, K (smoothed) and P "
                       "quantized per row, V per channel", 5e-2),
    # int8x2_attention: 2.3e-2 at most on the committed models' logits at their golden inputs
    # (llama_tiny_qdq, whose static QDQ steps turn any perturbation into whole steps; the BitNet
    # ones 1.1e-5 at most), so int8's allowance stands.
    "int8x2_attention": ("attention's float products (QK^T, PV) on the arrays in two int8 pieces per operand "
                         "(hi.hi + lo.hi + hi.lo): Q, K (smoothed) and P per row, V per channel", 5e-2),
    "int8_activations": ("float activations of weight-only quantized matmuls quantized to int8 per row",
                         APPROXIMATION_BOUND),
    # dlegion-cc --quantize (runtime/quantized64.py; README, "Float models onto the arrays").
    **{f"quantized_{mode}": (f"float MatMul/Gemm weights quantized to {what}, their activations to int8 per token",
                             QUANTIZE_BOUNDS[mode]) for mode, what in (
        ("w8", "int8 per output channel"), ("w4", "int4 per block of 32 rows"), ("w2", "ternary (absmean)"))},
}


# The program approximations the float64 evaluation applies too (reference64.float64_model): a
# program recording only these is measured from fp64 with them, at the tolerance as given.
MODELLED = frozenset({"int8_activations", "int8_attention", "int8x2_attention", "quantized_w8", "quantized_w4",
                      "quantized_w2"})


def approximation_tolerance(names: list[str], tol: float = REL_L2_TOLERANCE, fp64: bool = False) -> float:
    """The tolerance ``--check`` applies by default to a program recording ``names``: with
    ``fp64`` (the graph is evaluated in float64), loosened only for those it does not model."""
    loose = [n for n in names if n in PROGRAM_APPROXIMATIONS and not (fp64 and n in MODELLED)]
    return max(tol, sum(PROGRAM_APPROXIMATIONS[n][1] for n in loose))


def describe_approximations(names: list[str]) -> list[str]:
    """One phrase per approximation a program records."""
    from runtime.quantized64 import describe
    return [f"{n}: {PROGRAM_APPROXIMATIONS[n][0]} (tolerance {PROGRAM_APPROXIMATIONS[n][1]:g})"
            if n in PROGRAM_APPROXIMATIONS else describe(n) or f"{n}: not known to this version" for n in names]


@dataclass
class Fp64:
    """One float output measured against the float64 evaluation of the graph (relative L2, and
    positions farther than the tolerance), for dlegion and for onnxruntime's fp32 run."""
    ours: float
    reference: float
    off_ours: int
    off_reference: int
    positions: int
    approximation: float | None     # the compiler's approximations' distance from fp64, if any
    ok: bool
    bound: float = APPROXIMATION_BOUND     # the most ``approximation`` may be
    floor: float = 0.0              # FP32_FLOOR x the yardstick's distance from its float32 rounding


@dataclass
class Top1:
    """Positions of a language model's logits where the largest logit is the same token."""
    agree: int
    positions: int
    differing: list[int]            # flat indices over the leading dimensions


@dataclass
class Comparison:
    name: str
    dtype: str
    exact: bool          # compared bit for bit (integer outputs)
    rel_l2: float
    max_abs: float
    # elements that differ: integers (and integers carried in floats) unequal; other floats
    # non-finite in one only or farther apart than the tolerance times the reference's RMS
    mismatches: int
    ok: bool
    within_tolerance: bool = False  # the tolerance alone would pass it
    nonfinite: int = 0              # elements finite in one only
    fp64: Fp64 | None = None
    top1: Top1 | None = None
    # an intermediate not compared: why the program's tensor under this name is not its value
    not_the_value: str | None = None
    # an intermediate: the tolerance it is judged at, and the approximations it is computed from
    tolerance: float | None = None
    approximated: list[str] | None = None

    def as_json(self) -> dict:
        finite = lambda x: x if x is None or np.isfinite(x) else None     # noqa: E731 (JSON has no inf)
        out = {"name": self.name, "dtype": self.dtype, "exact": self.exact, "rel_l2": finite(self.rel_l2),
               "max_abs_diff": finite(self.max_abs), "mismatches": self.mismatches,
               "within_tolerance": self.within_tolerance, "ok": self.ok}
        if self.fp64:
            f = self.fp64
            out["fp64"] = {"rel_l2_dlegion": f.ours, "rel_l2_onnxruntime": f.reference,
                           "positions_off_dlegion": f.off_ours, "positions_off_onnxruntime": f.off_reference,
                           "positions": f.positions, "approximation_rel_l2": f.approximation,
                           "approximation_bound": f.bound, "spread_floor": f.floor, "ok": f.ok}
        if self.top1:
            out["top1"] = {"agree": self.top1.agree, "positions": self.top1.positions,
                           "differing": self.top1.differing}
        return out


# What ``--check`` compares with: onnxruntime as it comes, or onnxruntime made to compute the
# integer operators' definition. On x86 CPUs without VNNI its uint8 x int8 kernels (the dynamic
# int8 MatMulInteger, and QDQ int8 matmuls it fuses into QLinearMatMul) sum pairs of products in
# saturating int16 (pmaddubsw), which full-range int8 weights overflow; "exact" shifts constant
# int8 MatMulInteger weights to uint8 with zero point + 128 (the same products, a uint8 x uint8
# kernel that cannot saturate) and optimizes at ORT_ENABLE_BASIC (no QDQ fusion). That run
# equals ONNX's reference evaluator.
# "fp64": the default judgement (onnxruntime's fp32 run, "exact" on graphs with integer
# operators, and the float64 evaluation) whatever the model's size.
REFERENCES = ("onnxruntime", "exact", "fp64")
INTEGER_OPS = {"MatMulInteger", "QLinearMatMul", "DynamicQuantizeLinear", "QuantizeLinear", "DequantizeLinear"}


def session(model: str | Path, reference: str = "onnxruntime", extra_outputs: list[str] = (),
            threads: int | None = None):
    """An onnxruntime session of ``model`` (``reference``: see REFERENCES), with
    ``extra_outputs`` that are values of the model added as graph outputs (the compiler's own
    values, such as a reshape a pass put in, are not); ``threads``: its intra- and inter-op
    thread counts (default: onnxruntime's)."""
    import onnx
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads is not None:
        opts.intra_op_num_threads = opts.inter_op_num_threads = threads
    if reference == "onnxruntime" and not extra_outputs:
        return ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
    m = onnx.load(str(model))
    present, made = {o.name for o in m.graph.output}, {o for n in m.graph.node for o in n.output}
    m.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in extra_outputs
                          if n in made and n not in present)
    if reference == "exact":
        unsigned_integer_weights(m)
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def unsigned_integer_weights(model) -> None:
    """Rewrite each constant int8 B operand of MatMulInteger and its zero point (0 when absent)
    as uint8 + 128, in place: the same differences B - zero point."""
    from onnx import TensorProto, numpy_helper
    inits = {t.name: t for t in model.graph.initializer}
    shifted: set[str] = set()

    def shift(name: str) -> None:
        if name not in shifted:
            a = numpy_helper.to_array(inits[name]).astype(np.int16) + 128
            inits[name].CopyFrom(numpy_helper.from_array(a.astype(np.uint8), name))
            shifted.add(name)

    for node in model.graph.node:
        if node.op_type != "MatMulInteger":
            continue
        b = node.input[1]
        if b not in shifted and (b not in inits or inits[b].data_type != TensorProto.INT8):
            continue                                    # a computed or unsigned B
        zp = node.input[3] if len(node.input) > 3 else ""
        if zp and zp not in inits:
            continue                                    # a computed zero point: left as it is
        shift(b)
        if zp:
            shift(zp)
        else:                                           # the default zero point 0, shifted
            zp = f"{b}_zero_point_128"
            if zp not in inits:
                inits[zp] = numpy_helper.from_array(np.array(128, np.uint8), zp)
                model.graph.initializer.append(inits[zp])
            node.input.extend([""] * (4 - len(node.input)))
            node.input[3] = zp


def integer_ops(model: str | Path) -> bool:
    """Whether ``model`` has quantized integer operators (where the two references can differ)."""
    import onnx
    m = onnx.load(str(model), load_external_data=False)
    return any(n.op_type in INTEGER_OPS for n in m.graph.node)


def onnx_reference(model: str | Path, inputs: dict[str, np.ndarray],
                   reference: str = "onnxruntime") -> dict[str, np.ndarray]:
    """Run onnxruntime on ``model`` with ``inputs``; every graph output by name."""
    sess = session(model, reference)
    feeds = {i.name: _fed(inputs[i.name], i.type) for i in sess.get_inputs() if i.name in inputs}
    missing = [i.name for i in sess.get_inputs() if i.name not in inputs]
    if missing:
        raise ValueError(f"{model}: the model takes input(s) {', '.join(missing)}, which the program has not "
                         f"(program inputs: {', '.join(sorted(inputs)) or 'none'})")
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def _fed(array: np.ndarray, onnx_type: str) -> np.ndarray:
    """An input as onnxruntime takes it: a bool input is u8 in the program, 0 or 1 (other
    values are left for onnxruntime to refuse)."""
    if onnx_type == "tensor(bool)" and array.dtype == np.uint8 and array.max(initial=0) <= 1:
        return array.astype(np.bool_)
    return array


def compare_one(name: str, ours: np.ndarray, ref: np.ndarray, tol: float = REL_L2_TOLERANCE) -> Comparison:
    if ours.shape != ref.shape:
        return Comparison(name, str(ref.dtype), False, float("inf"), float("inf"), ref.size, False)
    if not np.issubdtype(ref.dtype, np.floating):
        diff = int(np.count_nonzero(ours != ref))
        big = np.abs(ours.astype(np.float64) - ref.astype(np.float64))
        return Comparison(name, str(ref.dtype), True, 0.0 if diff == 0 else float("inf"),
                          float(big.max(initial=0.0)), diff, diff == 0, diff == 0)
    a, b = ours.astype(np.float64), ref.astype(np.float64)
    nonfinite = int(np.count_nonzero(np.isfinite(a) != np.isfinite(b)))
    fin = np.isfinite(a) & np.isfinite(b)
    diff = np.abs(a[fin] - b[fin])
    err = np.linalg.norm(diff)
    norm = np.linalg.norm(b[fin])
    rel = float(err / norm) if norm > 0 else float(err)
    max_abs = float(diff.max(initial=0.0))
    if b.size and np.array_equal(b, np.round(b)):      # integers carried in floats (quantized values)
        differing = nonfinite + int(np.count_nonzero(a != b))
        within = rel <= tol and differing == 0
    else:   # rel > tol puts at least one element past tol x RMS: a MISMATCH never shows 0 here
        differing = nonfinite + int(np.count_nonzero(diff > tol * norm / np.sqrt(max(diff.size, 1))))
        within = rel <= tol and nonfinite == 0
    return Comparison(name, str(ref.dtype), False, rel, max_abs, differing, within, within, nonfinite)


def compare(ours: dict[str, np.ndarray], ref: dict[str, np.ndarray],
            tol: float = REL_L2_TOLERANCE) -> list[Comparison]:
    missing = sorted(set(ref) - set(ours))
    if missing:
        raise ValueError(f"the program does not produce graph output(s) {', '.join(missing)}")
    # a different shape is a program built for another model, not a numerical mismatch
    for n in ref:
        if ours[n].shape != ref[n].shape:
            raise ValueError(f"output {n!r}: the program's shape {list(ours[n].shape)} is not "
                             f"the model's {list(ref[n].shape)}")
    return [compare_one(n, ours[n], ref[n], tol) for n in ref]


# --- the verdict of ``dlegion-run --check`` ----------------------------------------------------

@dataclass
class Verdict:
    rows: list[Comparison]
    reference: str                  # the fp32 run compared with: "onnxruntime" or "exact"
    fp64: str                       # "evaluated", or why not
    approximations: list[str]       # what the compiler computes instead of some operators
    approximation_bound: float = APPROXIMATION_BOUND    # the most they may move an output from fp64

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def as_json(self, tol: float) -> dict:
        return {"reference": self.reference, "tolerance": tol, "fp64": self.fp64,
                "fp64_multiple": FP64_MULTIPLE, "approximations": self.approximations,
                "approximation_bound": self.approximation_bound, "ok": self.ok,
                "outputs": [r.as_json() for r in self.rows]}


def judge(model: str | Path, inputs: dict[str, np.ndarray], ours: dict[str, np.ndarray],
          reference: str | None = None, tol: float = REL_L2_TOLERANCE,
          program_approximations: dict[str, list[str]] | None = None) -> Verdict:
    """``ours`` against onnxruntime's fp32 run of ``model`` and, unless ``reference`` names an
    fp32 run alone or the model is too large (FP64_MAX_PARAMETER_BYTES, unless ``reference`` is
    "fp64"), against the graph evaluated in float64. Graphs with integer operators are compared
    with the "exact" run unless ``reference`` says "onnxruntime": the float64 evaluation computes
    the operators' definition, as that run does. ``program_approximations``: those the program
    records (Program.approximations); the float64 evaluation applies the ones it models
    (MODELLED), int8_attention to exactly the products the program names, and ``ours`` is
    measured from it."""
    from runtime.reference64 import approximations
    fp32 = reference if reference in ("onnxruntime", "exact") else "exact" if integer_ops(model) else "onnxruntime"
    ref = onnx_reference(model, inputs, fp32)
    rows = compare(ours, ref, tol)
    vocab = vocabulary(model)
    for r in rows:
        r.top1 = top1(ours[r.name], ref[r.name]) if is_logits(r.name, ref[r.name], vocab) else None
    why = _fp64_skipped(model, reference)
    if why:
        return Verdict(rows, fp32, why, [])
    from runtime.quantized64 import quantization
    kind, products, pieces = attention_products(program_approximations or {})
    attention = products is not None
    quant = quantization(program_approximations or {})  # --quantize: its own yardstick
    approx = approximations(model, attention, pieces)
    bound = approximation_bound(len(approx) - attention, kind) + (quant.bound if quant else 0.0)
    approx += [quant.phrase] if quant else []
    try:
        f64, f64a, spread = _float64(model, inputs, approx, products or [], quant, pieces)
    except Exception as e:  # onnxruntime raises its own exception types
        if reference == "fp64":
            raise
        return Verdict(rows, fp32, f"failed ({str(e).splitlines()[0]}); judged at the tolerance alone", approx, bound)
    for r in rows:
        if r.exact or r.name not in f64 or not np.issubdtype(ref[r.name].dtype, np.floating):
            continue
        r.fp64 = fp64_distances(ours[r.name], ref[r.name], f64[r.name], f64a[r.name], tol, bound,
                                None if spread is None else tuple(x[r.name] for x in spread))
        r.ok = r.within_tolerance or (r.fp64.ok and r.nonfinite == 0)
    return Verdict(rows, fp32, "evaluated", approx, bound)


# The attention approximations a program may record, each with the int8 pieces per operand.
ATTENTION_PIECES = {"int8_attention": 1, "int8x2_attention": 2}


def attention_products(program_approximations: dict) -> tuple[str | None, list[str] | None, int]:
    """The attention approximation a program records (one at most: its --attention), the
    products it names and the pieces per operand; (None, None, 1) when it records none."""
    kind = next((k for k in ATTENTION_PIECES if k in program_approximations), None)
    return (kind, program_approximations[kind], ATTENTION_PIECES[kind]) if kind else (None, None, 1)


def approximation_bound(operator_kinds: int, attention: str | None) -> float:
    """The most the modelled approximations may move an output from fp64: APPROXIMATION_BOUND
    for operators the compiler approximates (reference64.APPROXIMATIONS), the ``attention``
    approximation's own documented bound for the attention products (distances add at most)."""
    return (APPROXIMATION_BOUND if operator_kinds or not attention else 0.0) + \
        (PROGRAM_APPROXIMATIONS[attention][1] if attention else 0.0)


def fp64_evaluated(model, reference: str | None) -> bool:
    """Whether ``judge`` evaluates ``model`` in float64 given ``reference``."""
    return _fp64_skipped(model, reference) is None


def _fp64_skipped(model, reference: str | None) -> str | None:
    from runtime.reference64 import parameter_bytes
    if reference in ("onnxruntime", "exact"):
        return f"not evaluated (--reference {reference}: the fp32 run alone, at the tolerance)"
    size = parameter_bytes(model)
    if reference is None and size > FP64_MAX_PARAMETER_BYTES:
        return (f"skipped: the model's parameters take {size / 2**30:.2f} GiB, over the "
                f"{FP64_MAX_PARAMETER_BYTES / 2**30:g} GiB evaluated in float64 by default (--reference fp64 "
                f"forces it); judged at the tolerance alone")
    return None


def _float64(model, inputs, approx: list[str], int8_attention: list[str], quant=None, pieces: int = 1):
    """The graph's outputs in float64, and those of the graph as the compiler computes it
    (``int8_attention``: the products it quantized, in ``pieces`` int8 pieces per operand;
    ``quant``: the model quantized as ``--quantize`` does, runtime/quantized64.py)."""
    from runtime.reference64 import float64_outputs
    plain = float64_outputs(model, inputs)
    if not approx:
        return plain, plain, None
    if quant is None:
        approximated = float64_outputs(model, inputs, approximations=True, int8_attention=int8_attention,
                                       pieces=pieces)
        # The graph as the compiler computes it has its own fp32 spread, which onnxruntime's run
        # of the model cannot show: fp32's rounding before each int8 rounding moves the values it
        # rounds (a second int8 piece's steps are 254 times finer than the first's), as it moves
        # the program's. It is measured as a --quantize program's is.
        from runtime.reference64 import approximated_float32_outputs
        return plain, approximated, (approximated_float32_outputs(model, inputs, int8_attention, pieces), approximated)
    from runtime.quantized64 import quantized_file
    with quantized_file(model, quant) as path:
        # The quantized graph's own fp32 spread (onnxruntime's run of it from its float64 values):
        # its per-token rounding flips as any fp32 program's do, which onnxruntime's run of the float
        # model cannot show.
        spread = onnx_reference(path, inputs), float64_outputs(path, inputs)
        return plain, float64_outputs(path, inputs, approximations=True, int8_attention=int8_attention,
                                      pieces=pieces), spread


def positions_rel_l2(x: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Relative L2 distance of each row along the last axis (absolute where ``ref``'s row is 0)."""
    last = ref.shape[-1] if ref.ndim else 1
    a = np.asarray(x, np.float64).reshape(-1, last)
    b = np.asarray(ref, np.float64).reshape(-1, last)
    err, norm = np.linalg.norm(a - b, axis=1), np.linalg.norm(b, axis=1)
    return np.where(norm > 0, err / np.where(norm > 0, norm, 1.0), err)


def fp64_distances(ours: np.ndarray, fp32: np.ndarray, f64: np.ndarray, f64_approx: np.ndarray,
                   tol: float, bound: float = APPROXIMATION_BOUND, spread=None) -> Fp64:
    """dlegion's distance from the float64 evaluation of the graph as the compiler computes it
    (``f64_approx``, ``f64`` when it makes no approximation) beside onnxruntime's from ``f64``
    (or, where larger, ``spread``'s fp32 output from its float64 one: a --quantize program's), that
    distance raised to FP32_FLOOR times ``f64_approx``'s own float32 rounding distance at least."""
    from runtime.reference64 import rel_l2
    ours_d, ref_d = rel_l2(ours, f64_approx), rel_l2(fp32, f64)
    off_ours = int(np.count_nonzero(~(positions_rel_l2(ours, f64_approx) <= tol)))     # NaN counts as off
    off_ref = int(np.count_nonzero(~(positions_rel_l2(fp32, f64) <= tol)))
    if spread is not None:
        ref_d = max(ref_d, rel_l2(*spread))
        off_ref = max(off_ref, int(np.count_nonzero(~(positions_rel_l2(*spread) <= tol))))
    approx = None if f64_approx is f64 else rel_l2(f64_approx, f64)
    floor = FP32_FLOOR * float32_rounding(f64_approx)
    ok = (ours_d <= FP64_MULTIPLE * max(ref_d, floor) and off_ours <= FP64_MULTIPLE * max(off_ref, 1)
          and (approx is None or approx <= bound))
    positions = ours.size // ours.shape[-1] if ours.ndim and ours.shape[-1] else 1
    return Fp64(ours_d, ref_d, off_ours, off_ref, positions, approx, bool(ok), bound, floor)


def float32_rounding(f64: np.ndarray) -> float:
    """Relative L2 distance of ``f64`` from its float32 rounding (0 where it is all 0)."""
    from runtime.reference64 import rel_l2
    a = np.asarray(f64, np.float64)
    fin = np.isfinite(a) & (np.abs(a) <= np.finfo(np.float32).max)
    return rel_l2(a[fin].astype(np.float32), a[fin]) if fin.any() else 0.0


def vocabulary(model: str | Path) -> int | None:
    """Rows of the embedding table: an initializer that a Gather indexes by a graph input."""
    import onnx
    m = onnx.load(str(model), load_external_data=False)
    inputs, inits = {i.name for i in m.graph.input}, {t.name: t for t in m.graph.initializer}
    for n in m.graph.node:
        if n.op_type == "Gather" and n.input[1] in inputs and n.input[0] in inits and inits[n.input[0]].dims:
            return int(inits[n.input[0]].dims[0])
    return None


def is_logits(name: str, ref: np.ndarray, vocab: int | None) -> bool:
    """A language model's logits: a float output named so whose last dimension is the vocabulary."""
    return ("logits" in name.lower() and np.issubdtype(ref.dtype, np.floating) and ref.ndim >= 2
            and ref.shape[-1] > 1 and (vocab is None or ref.shape[-1] == vocab))


def top1(ours: np.ndarray, ref: np.ndarray) -> Top1:
    """Per position (rows along the last axis): whether the largest logits are the same token."""
    a, b = ours.reshape(-1, ref.shape[-1]), ref.reshape(-1, ref.shape[-1])
    same = a.argmax(axis=1) == b.argmax(axis=1)
    return Top1(int(same.sum()), int(same.size), [int(i) for i in np.flatnonzero(~same)])


WEIGHTS = ("w2", "w4", "w8", "i8")         # the integer weights of quantized matmuls


def flip_one_weight(data: bytes, program, among: str = "") -> tuple[bytes, str]:
    """A deliberately wrong program's data, to show the check catches one: ``data`` with the
    first nonzero weight of the program's largest integer weight tensor (of those whose name
    contains ``among``) negated (made 0 where its negation does not fit), and which weight that
    is. A gate's weight may change nothing: its column's ReLU can be 0 either way."""
    from isa.program import pack, unpack
    t = max((t for t in program.tensors if t.kind == "const" and t.dtype in WEIGHTS and among in t.name),
            key=lambda t: t.nbytes)
    raw = bytearray(data)
    w = unpack(np.frombuffer(bytes(raw[t.offset:t.offset + t.nbytes]), np.uint8), t.dtype)[:t.numel]
    w = w.astype(np.int64)
    i = int(np.flatnonzero(w)[0])
    lo = -128 if t.dtype in ("w8", "i8") else -(1 << (int(t.dtype[1]) - 1))
    w[i] = -w[i] if lo <= -w[i] < -lo else 0
    raw[t.offset:t.offset + t.nbytes] = pack(w, t.dtype).view(np.uint8).tobytes()
    return bytes(raw), f"{t.name}[{i}]"
