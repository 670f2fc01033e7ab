"""Does an MPI-3 nonblocking collective progress while this rank computes?

    mpiexec -n 2 python tests/mpi/double_buffering_progress.py [--values 11000000] [--reps 5]
    MPIR_CVAR_ASYNC_PROGRESS=1 mpiexec -n 2 python tests/mpi/double_buffering_progress.py

Times, per rank 0 (median of --reps, after a warm-up), on a float32 buffer of --values:
  comm     blocking Allreduce alone (in place)              = T_comm
  compute  float32 GEMMs of a DNN layer's shape alone       = T_comp (sized to ~T_comm)
  serial   compute, then blocking Allreduce                 ~ T_comp + T_comm
  nb       Iallreduce, compute, Wait                        = T_comp + T_wait
  nb+test  Iallreduce, compute with req.Test() after each GEMM, Wait
  nb+thr   Iallreduce, compute while a Python thread calls req.Test() every --poll-ms
           (NumPy's GEMM releases the GIL), stop the thread, Wait
and the same for Ialltoallv of bytes (the striped exchange's first collective).
Overlap pays when nb < serial; the ideal is max(T_comp, T_comm). On one machine the
"network" is memory copies done by the CPU, so progress costs compute time.
The measurement behind docs/exchange.md ("Double buffering: does MPI progress?").
"""
import argparse
import threading
import time

import numpy as np
from mpi4py import MPI

p = argparse.ArgumentParser()
p.add_argument("--values", type=int, default=11_000_000)   # ~ a quarter of the 46M model
p.add_argument("--reps", type=int, default=5)
p.add_argument("--gemm", type=int, default=384)            # square GEMM size
p.add_argument("--poll-ms", type=float, default=1.0)
a = p.parse_args()
comm = MPI.COMM_WORLD
rank, K = comm.Get_rank(), comm.Get_size()
buf = np.ones(a.values, np.float32)
nbytes = a.values * 4 // K // 8 * 8   # bytes to each peer: a 1-bit-ish / float payload
send = np.ones(nbytes * K, np.uint8)
recv = np.zeros(nbytes * K, np.uint8)
counts = np.full(K, nbytes, np.int64)
displs = np.arange(K, dtype=np.int64) * nbytes
A = np.random.default_rng(rank).standard_normal((a.gemm, a.gemm)).astype(np.float32)
C = np.empty_like(A)


def med(f):
    f()
    times = []
    for _ in range(a.reps):
        comm.Barrier()
        t = time.perf_counter()
        extra = f()
        times.append((time.perf_counter() - t, extra))
    times.sort(key=lambda x: x[0])
    return times[len(times) // 2]


def compute(n, req=None):
    for _ in range(n):
        np.matmul(A, A, out=C)
        if req is not None:
            req.Test()   # drive MPICH's progress engine between GEMMs


def start(kind):
    if kind == "allreduce":
        return comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return comm.Ialltoallv([send, (counts, displs), MPI.BYTE], [recv, (counts, displs), MPI.BYTE])


def blocking(kind):
    if kind == "allreduce":
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    else:
        comm.Alltoallv([send, (counts, displs), MPI.BYTE], [recv, (counts, displs), MPI.BYTE])


t_gemm = med(lambda: compute(3))[0] / 3
for kind in ("allreduce", "alltoallv"):
    t_comm = med(lambda: blocking(kind))[0]
    n = max(1, int(round(1.2 * t_comm / t_gemm)))   # compute a bit longer than the comm
    t_comp = med(lambda: compute(n))[0]
    t_serial = med(lambda: (compute(n), blocking(kind)))[0]

    def overlapped(test, thread=False):
        req = start(kind)
        if thread:
            stop = threading.Event()

            def poll():
                while not stop.wait(a.poll_ms / 1e3):
                    req.Test()
            th = threading.Thread(target=poll)
            th.start()
        compute(n, req if test else None)
        if thread:
            stop.set()
            th.join()
        t = time.perf_counter()
        req.Wait()
        return time.perf_counter() - t
    nb, nb_wait = med(lambda: overlapped(False))
    nbt, nbt_wait = med(lambda: overlapped(True))
    nbth, nbth_wait = med(lambda: overlapped(False, True))
    if rank == 0:
        print(f"{kind:9s} K={K} {a.values * 4 / 1e6:.0f} MB: comm {1e3 * t_comm:6.1f} ms  "
              f"compute {1e3 * t_comp:6.1f} ms ({n} GEMMs)  serial {1e3 * t_serial:6.1f}  "
              f"nb {1e3 * nb:6.1f} (wait {1e3 * nb_wait:5.1f})  nb+test {1e3 * nbt:6.1f} "
              f"(wait {1e3 * nbt_wait:5.1f})  nb+thr {1e3 * nbth:6.1f} "
              f"(wait {1e3 * nbth_wait:5.1f})", flush=True)
