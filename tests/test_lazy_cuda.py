"""numba.cuda is imported at a GPU path's first use (hpcsgd/lazy_cuda.py): a CPU run never
pays its 0.4 s, and the first use leaves every module with the real module and dispatchers."""
import subprocess
import sys

import pytest

from conftest import CUDA_ENV, REAL_GPU, REPO, make_archive
from hpcsgd import lazy_cuda


def python(code, env=None):
    import os
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=dict(os.environ, **(env or {})))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def test_a_cpu_training_run_never_imports_numba_cuda(tmp_path):
    make_archive(str(tmp_path / "arch"), num_shards=1, utts_per_shard=4, max_len=100)
    code = f"""
import sys
from hpcsgd import cli
try:
    cli.main(["train", "data.train={tmp_path / 'arch'}", "model.hidden=[8]", "train.epochs=1",
              "train.minibatch=32", "exchange.aggregation=striped",
              "train.run_dir={tmp_path / 'run'}"])
except SystemExit as e:
    assert not e.code, e.code
print("numba.cuda" in sys.modules)
"""
    assert python(code) == "False"


def test_the_first_use_rebinds_cuda_and_every_kernel_in_their_modules():
    code = """
import numpy as np
from hpcsgd.codecs import common, dettmers as D
from hpcsgd import lazy_cuda
assert type(D.encode_cuda).__name__ == "_Deferred" and type(D.cuda).__name__ == "_Cuda"
real = lazy_cuda.load()
import numba.cuda
assert real is numba.cuda and D.cuda is numba.cuda and common.cuda is numba.cuda
# the dispatchers themselves (the simulator's or, with HPCSGD_TEST_GPU=1, the real ones)
assert all(type(k).__module__.startswith("numba") and hasattr(k, "py_func")
           for k in (D.encode_cuda, D._code_cuda, common.lane_tree_cuda))
out = numba.cuda.to_device(np.zeros(300, np.float32))
from hpcsgd.device import fill
fill(out, 2.5)   # a kernel made before load() launches
import sys
print(float(out.copy_to_host().sum()), sys.getswitchinterval())
"""
    total, interval = python(code, CUDA_ENV).split()
    assert total == "750.0"
    # the simulator's Python threads get the GIL every 0.2 ms, not 5 (lazy_cuda's comment);
    # a real GPU's process keeps CPython's default
    want = 0.005 if CUDA_ENV == {} else lazy_cuda.SIMULATOR_SWITCH_INTERVAL_S
    assert abs(float(interval) - want) < 1e-6 * want   # (CPython keeps it in microseconds)



def test_every_thread_of_a_block_gets_the_same_shared_array():
    """The simulator's shared-array lookup is locked (hpcsgd/lazy_cuda.py). The window between
    its lookup and its store is widened here to 10 ms (a slow np.empty): unlocked, each of 8
    threads asking for the array of one source line got an array of its own."""
    if REAL_GPU:
        pytest.skip("the simulator's shared memory (a real GPU has its own)")
    code = """
import threading, time
import numpy as np
from hpcsgd import lazy_cuda
lazy_cuda.load()
from numba.cuda.simulator.kernelapi import FakeCUDAShared
shared, real_empty, got = FakeCUDAShared(0), np.empty, []

def slow_empty(*args, **kwargs):
    time.sleep(0.01)
    return real_empty(*args, **kwargs)

def take():
    got.append(shared.array(16, np.float64))   # one source line for every thread

np.empty = slow_empty
threads = [threading.Thread(target=take) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
np.empty = real_empty
print(len(got), len({id(a) for a in got}))
"""
    assert python(code, CUDA_ENV) == "8 1"


def test_a_simulated_launch_runs_on_the_local_ranks_core_and_gives_the_core_back():
    """Under the simulator each launch (and so each simulated CUDA thread, a Python thread it
    starts) runs on one core of the process's mask, the local rank's (hpcsgd/lazy_cuda.py),
    and the launching thread gets its whole mask back afterwards."""
    if REAL_GPU:
        pytest.skip("the simulator's threads (a real GPU launch starts none)")
    code = """
import os
import numpy as np
from hpcsgd.lazy_cuda import cuda, load
seen = []

@cuda.jit
def record(a):
    seen.append(tuple(sorted(os.sched_getaffinity(0))))

load()
before = sorted(os.sched_getaffinity(0))
record[2, 3](np.zeros(4))
print(before == sorted(os.sched_getaffinity(0)), ",".join(map(str, before)),
      len(seen), ";".join(sorted({",".join(map(str, mask)) for mask in seen})))
"""
    for local_rank in (0, 1):
        same, mask, threads, masks = python(code, dict(CUDA_ENV, MPI_LOCALRANKID=str(local_rank))).split()
        mask = mask.split(",")
        assert same == "True" and threads == "6"   # 2 blocks x 3 threads
        assert masks == (mask[local_rank % len(mask)] if len(mask) > 1 else ",".join(mask))
