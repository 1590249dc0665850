"""Exact int8 x small-integer products through onnxruntime's MatMulInteger.

The matrix array's products are int32 sums of int8 activations times weights of a few bits.
onnxruntime's integer kernels compute them in int32 several times faster than an fp32 BLAS
product, and exactly: every kernel adds whole products in int32, which wraps like the
accumulator does, except that kernels without a 4-way int8 dot instruction first add pairs of
uint8 x int8 products in int16 with saturation. A pair is at most 2 * 255 * ``w_max``, so
the path is taken only where that fits int16 (``exact_int8``), and the result then does not
depend on the kernel.

The activations go in as uint8 with zero point 128 (``a ^ 0x80`` is ``a + 128``): uint8 x int8
is the pair of operand types every onnxruntime CPU build runs with its fast kernels.
"""
from __future__ import annotations

from functools import cache

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

_INT16_MAX = 2 ** 15 - 1
_U8_MAX = 255


def exact_int8(w_max: int) -> bool:
    """Whether weights of magnitude up to ``w_max`` take this path exactly on any kernel."""
    return 2 * _U8_MAX * w_max <= _INT16_MAX


@cache
def _session() -> ort.InferenceSession:
    node = helper.make_node("MatMulInteger", ["A", "B", "a_zero"], ["Y"])
    graph = helper.make_graph(
        [node], "int8_matmul",
        [helper.make_tensor_value_info("A", TensorProto.UINT8, None),
         helper.make_tensor_value_info("B", TensorProto.INT8, None),
         helper.make_tensor_value_info("a_zero", TensorProto.UINT8, [])],
        [helper.make_tensor_value_info("Y", TensorProto.INT32, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    options = ort.SessionOptions()
    # The emulator runs on one thread; so do its products.
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


_ZERO = np.array(128, np.uint8)
_SIGN = np.uint8(0x80)


def int8_matmul(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """int8 ``a`` (... x M x K) times int8 ``w`` (... x K x N) as int32, wrapped (leading
    axes: a batch, as np.matmul); ``w``'s magnitudes must pass :func:`exact_int8`."""
    shifted = np.bitwise_xor(a.view(np.uint8), _SIGN)
    return _session().run(None, {"A": shifted, "B": np.ascontiguousarray(w), "a_zero": _ZERO})[0]
