"""A BLSTM layer's time loops: one launch per time step (both directions' steps in it) against
each direction's whole loop in one task (kernels_lstm._forward_sequences, what CPU ranks run
where kernels_lstm.whole_sequences holds): the forward and backward pass of bench train's CTC
model (so762_ctc.yaml: frames stacked by 3, BLSTM 256 x 3) at one of 2 ranks' rows (N = 2000
frames: 5 utterances of 400) and one rank's (4000), alternated in one process, ROUNDS rounds
(default 9); the median ms of each and the median of the rounds' ratios (this VM's speed
drifts between minutes). The bits are the same (tests/test_lstm.py).

    for t in 1 2; do NUMBA_NUM_THREADS=$t OPENBLAS_NUM_THREADS=$t OMP_NUM_THREADS=$t \\
        OMP_WAIT_POLICY=PASSIVE OPENBLAS_THREAD_TIMEOUT=4 python experiments/lstm_whole_sequences.py; done
"""
import os
import statistics
import time

import numba

from hpcsgd.bench.train import CTC, ctc_minibatch
from hpcsgd.model import kernels_lstm as KL


def main():
    whole_sequences = KL.whole_sequences
    for n in (2000, 4000):
        model, params, grads, x, y = ctc_minibatch(n)
        times = {"steps": [], "whole": []}
        for _ in range(int(os.environ.get("ROUNDS", 9))):
            for mode in times:
                KL.whole_sequences = (whole_sequences if mode == "whole"
                                      else (lambda nb, hc, dirs: False))
                model.forward_backward(params, grads, x, y, n)   # compiles, warms the caches
                t = time.perf_counter()
                model.forward_backward(params, grads, x, y, n)
                times[mode].append(time.perf_counter() - t)
        KL.whole_sequences = whole_sequences
        print(f"N = {n}, {numba.get_num_threads()} thread(s), whole sequences apply: "
              f"{whole_sequences(n // CTC['steps'], 256, 2)}; ms per forward+backward",
              {mode: round(statistics.median(v) * 1e3, 1) for mode, v in times.items()},
              "steps / whole (paired median):",
              round(statistics.median(a / b for a, b in zip(times["steps"], times["whole"])), 3),
              flush=True)


if __name__ == "__main__":
    main()
