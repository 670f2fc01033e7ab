"""The Conformer-CTC ONNX graph of this checkout against the one an earlier commit wrote, in
onnxruntime on one thread: the so762 recipe's shape (jobs/configs/so762_conformer_ctc.yaml:
the Conv2d front end, 8 blocks of 144), untrained weights (the speed does not depend on them),
one utterance of 3 s and of 6 s of features, each graph's fastest of RUNS interleaved runs;
the outputs must be equal bit for bit (the graphs compute the same arithmetic).

    OMP_NUM_THREADS=1 python experiments/onnx_graph_ab.py [REV]   (default 608c2e6)

REV's hpcsgd/export_onnx.py is loaded beside this checkout's package (its other modules are
this checkout's). docs/benchmarks.md, the ONNX export section, has the figures.
"""
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from hpcsgd import export_onnx
from hpcsgd.model import build

RUNS = int(os.environ.get("RUNS", 100))


def module_at(rev):
    """hpcsgd/export_onnx.py as of commit rev, imported under another name."""
    text = subprocess.run(["git", "show", f"{rev}:hpcsgd/export_onnx.py"], check=True,
                          capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "export_onnx_then.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("export_onnx_then", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(rev="608c2e6"):
    import onnxruntime as ort
    enc = ["conv2d 64 144"] + ["conformer 144 h4 f576 k15"] * 8
    model = build({"type": "ctc", "input_dim": 40, "encoder": enc, "num_tokens": 40,
                   "activation": "relu"}, max_batch=8192)
    params = model.new_params()
    model.init(params, np.random.default_rng(1))
    sessions = {}
    for name, module in ((rev, module_at(rev)), ("this checkout", export_onnx)):
        proto = module.graph(model, params, np.zeros(40, np.float32), np.ones(40, np.float32))
        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        sessions[name] = ort.InferenceSession(proto.SerializeToString(), so,
                                              providers=["CPUExecutionProvider"])
        print(f"{name}: {len(proto.graph.node)} nodes")
    rng = np.random.default_rng(0)
    for frames in (300, 600):
        feed = {"x": rng.standard_normal((1, frames, 40)).astype(np.float32),
                "x_lens": np.array([frames], np.int64)}
        outs = [s.run(None, feed)[0] for s in sessions.values()]
        assert np.array_equal(outs[0], outs[1]), "the graphs' outputs differ"
        best = dict.fromkeys(sessions, np.inf)
        for _ in range(RUNS):
            for name, s in sessions.items():
                t0 = time.perf_counter()
                s.run(None, feed)
                best[name] = min(best[name], time.perf_counter() - t0)
        print(f"{frames / 100:g} s of features: " + ", ".join(
            f"{name} {t * 1e3:.2f} ms" for name, t in best.items())
            + f" (equal outputs; {best[rev] / best['this checkout']:.2f}x)")


if __name__ == "__main__":
    main(*sys.argv[1:])
