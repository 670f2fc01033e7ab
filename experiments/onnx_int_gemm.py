"""One weight GEMM of the so762 Conformer (100 steps x 144 -> 576: a 4 s utterance's
feed-forward input) in onnxruntime on one thread: float32 MatMul against com.microsoft's
MatMulIntegerToFloat with int8 weights and int8 or uint8 activations (MLAS's x86 integer
kernels are u8 x s8; onnxruntime's QDQ transformer converts a graph's int8 activations to
uint8, zero point + 128, before it fuses them: docs/benchmarks.md, the ONNX export). Each
operator's fastest of RUNS interleaved runs.

    OMP_NUM_THREADS=1 python experiments/onnx_int_gemm.py [M K N]
"""
import os
import sys
import time

import numpy as np

RUNS = int(os.environ.get("RUNS", 2000))


def session(kind, m, k, n, rng):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    if kind == "float32":
        x_type, inits = TensorProto.FLOAT, [numpy_helper.from_array(
            rng.standard_normal((k, n)).astype(np.float32), "w")]
        nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    else:
        signed = kind == "int8"
        x_type = TensorProto.INT8 if signed else TensorProto.UINT8
        zero = np.array(0, np.int8) if signed else np.array(128, np.uint8)
        inits = [numpy_helper.from_array(rng.integers(-127, 128, (k, n)).astype(np.int8), "w"),
                 numpy_helper.from_array(np.array(0.01, np.float32), "sa"),
                 numpy_helper.from_array(np.full(n, 0.02, np.float32), "sb"),
                 numpy_helper.from_array(zero, "za")]
        nodes = [helper.make_node("MatMulIntegerToFloat", ["x", "w", "sa", "sb", "za"], ["y"],
                                  domain="com.microsoft")]
    graph = helper.make_graph(nodes, "gemm", [helper.make_tensor_value_info("x", x_type, [m, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def main(m=100, k=144, n=576):
    m, k, n = int(m), int(k), int(n)
    rng = np.random.default_rng(0)
    inputs = {"float32": rng.standard_normal((m, k)).astype(np.float32),
              "int8": rng.integers(-127, 128, (m, k)).astype(np.int8),
              "uint8": rng.integers(0, 256, (m, k)).astype(np.uint8)}
    sessions = {kind: session(kind, m, k, n, rng) for kind in inputs}
    best = dict.fromkeys(sessions, np.inf)
    for _ in range(RUNS):
        for kind, s in sessions.items():
            t0 = time.perf_counter()
            s.run(None, {"x": inputs[kind]})
            best[kind] = min(best[kind], time.perf_counter() - t0)
    print(f"{m} x {k} -> {n}: float32 MatMul {best['float32'] * 1e6:.1f} us; "
          f"MatMulIntegerToFloat, int8 activations {best['int8'] * 1e6:.1f} us, uint8 "
          f"{best['uint8'] * 1e6:.1f} us ({best['float32'] / best['uint8']:.2f}x float32)")


if __name__ == "__main__":
    main(*sys.argv[1:])
