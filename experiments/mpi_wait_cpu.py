"""CPU a waiting MPICH rank burns: rank 0 sleeps 5 s before a barrier, every rank prints its
wall time and CPU. Compare MPICH's heavy yield (what tests/conftest.py sets for every job) with
its default busy-poll:
    MPIR_CVAR_ENABLE_HEAVY_YIELD=1 mpiexec -n 2 python experiments/mpi_wait_cpu.py
    MPIR_CVAR_ENABLE_HEAVY_YIELD=0 mpiexec -n 2 python experiments/mpi_wait_cpu.py
"""
import resource
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
t = time.time()
if comm.rank == 0:
    time.sleep(5)
comm.Barrier()
ru = resource.getrusage(resource.RUSAGE_SELF)
print(f"rank {comm.rank}: wall {time.time() - t:.2f} s, user {ru.ru_utime:.2f} s, "
      f"system {ru.ru_stime:.2f} s", flush=True)
