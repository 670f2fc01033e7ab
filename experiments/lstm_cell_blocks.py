"""How finely one LSTM time step's launch should split each direction's cells among tasks
(hpcsgd/model/kernels_lstm.py: cell_block): the forward and backward pass of bench train's
CTC model (so762_ctc.yaml: frames stacked by 3, BLSTM 256 x 3) on N = 4000 frames (10
utterances of 400) with 1, 2, 4 and 8 blocks of cells per direction, alternated in one
process, 4 rounds; the median ms of each. The bits are the same for every split (the product's
column blocks start where one block's would; tests/test_lstm.py).

    for t in 1 2; do NUMBA_NUM_THREADS=$t OPENBLAS_NUM_THREADS=$t OMP_NUM_THREADS=$t \\
        OMP_WAIT_POLICY=PASSIVE OPENBLAS_THREAD_TIMEOUT=4 python experiments/lstm_cell_blocks.py; done
"""
import os
import statistics
import time

from hpcsgd.bench.train import ctc_minibatch
from hpcsgd.model import kernels_lstm as KL

N = 4000


def blocks_of(count):
    def cell_block(hc, dirs):
        per = -(-hc // count)
        return -(-per // 4) * 4
    return cell_block


def main():
    model, params, grads, x, y = ctc_minibatch(N)
    times = {count: [] for count in (1, 2, 4, 8)}
    for _ in range(4):
        for count in times:
            KL.cell_block = blocks_of(count)
            model.forward_backward(params, grads, x, y, N)   # compiles, warms the caches
            t = time.perf_counter()
            model.forward_backward(params, grads, x, y, N)
            times[count].append(time.perf_counter() - t)
    print(f"{os.environ.get('NUMBA_NUM_THREADS', 'all')} thread(s): ms per forward+backward, "
          "by blocks per direction:",
          {count: round(statistics.median(v) * 1e3, 1) for count, v in times.items()})


if __name__ == "__main__":
    main()
