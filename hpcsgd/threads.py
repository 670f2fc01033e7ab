"""Threads per rank: decided once per process, before NumPy's BLAS or Numba start a thread.

K ranks x BLAS threads x Numba threads on the same cores oversubscribe them: a rank's BLAS
threads spin after a GEMM while its Numba kernel waits for a thread, and a rank waiting in
MPICH busy-polls a core another rank needs (measured: the so762 model trained at 190-250
frames/s on 2 ranks with the defaults, at about 2,000 with one thread each). So every compute
command decides its threads itself, in this order:

  1. train.threads (or bench --threads): an explicit number;
  2. OMP_NUM_THREADS in the environment: the standard knob, set by a user or a site;
  3. SLURM_CPUS_PER_TASK under Slurm: the CPUs the allocation gives each task;
  4. the cores this rank may run on (its affinity mask) shared by the ranks on this node whose
     masks overlap it: a launcher that binds ranks to disjoint cores gives each its own
     mask, one that does not gives all of them the node's cores, to be divided.

and sets OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, MKL_NUM_THREADS and NUMBA_NUM_THREADS to it
before numpy or numba is imported (the thread pools start with those numbers).

With more than one thread both pools are told to sleep rather than spin once their work is
done (SLEEP_BETWEEN, unless the environment sets them): Numba's kernels run on the OpenMP pool
(libgomp), whose threads otherwise spin for a while after every parallel loop on the cores
OpenBLAS needs for the next GEMM, and OpenBLAS's threads spin after every GEMM on the cores
the next Numba kernel needs. Measured, one process with 2 threads: the so762 model
(440-1024x4-40, minibatch 256) 2,150 frames/s spinning, 9,090 with OpenMP passive, against
9,220 for the step's GEMMs alone; the paper's 46M model 94-96% of its GEMM roofline with
OpenMP passive, 97-100% with OpenBLAS's short timeout too (experiments/benchmarks_history.md).
`describe` says what was chosen and why for the log; `check` reads back what the pools really use.
When more ranks than cores share a node, each gets one thread and the run is still
oversubscribed: MPICH ranks then need MPIR_CVAR_ENABLE_HEAVY_YIELD=1 (a waiting rank yields
its core), which must be set before MPI starts -- bin/demo and jobs/ set it; the trainer warns.
"""
import os
import sys

VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
# the pools' threads sleep when their work is done instead of spinning on the other's cores:
# libgomp (Numba's kernels) passive; OpenBLAS's threads wait 2^4 cycles before they sleep
SLEEP_BETWEEN = {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_THREAD_TIMEOUT": "4"}


def affinity():
    """The CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # not Linux
        return set(range(os.cpu_count() or 1))


def plan(mask, sharers, override=0, env=None):
    """(threads, why, oversubscribed): mask = this rank's CPUs, sharers = ranks on this node
    whose masks overlap it (itself included), override = train.threads (0 = decide)."""
    env = os.environ if env is None else env
    cores = max(len(mask), 1)
    oversubscribed = sharers > cores
    if override:
        return int(override), "train.threads", oversubscribed
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"]), "OMP_NUM_THREADS in the environment", oversubscribed
    if env.get("SLURM_JOB_ID") and env.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return int(env["SLURM_CPUS_PER_TASK"]), "SLURM_CPUS_PER_TASK", oversubscribed
    why = (f"{cores} core(s) in this rank's affinity mask" +
           (f", shared by {sharers} ranks on this node" if sharers > 1 else ""))
    return max(1, cores // sharers), why, oversubscribed


def sharers_on_node(node_comm, mask):
    """How many ranks of node_comm (this node's ranks) have masks overlapping this rank's
    (itself included). Collective over node_comm."""
    masks = node_comm.allgather(sorted(mask))   # lowercase: a few ints per rank, once
    return sum(1 for other in masks if mask & set(other))


def environment(threads, env=None):
    """The variables that give a process `threads` threads (see the module docstring)."""
    env = os.environ if env is None else env
    out = dict.fromkeys(VARIABLES, str(threads))
    if threads > 1:
        for name, value in SLEEP_BETWEEN.items():
            if name not in env:
                out[name] = value
    return out


def apply(threads):
    """Set the thread variables, before numpy/numba start their pools (it is too late for a
    pool that has started: enforce() does what can still be done)."""
    os.environ.update(environment(threads))
    if "numba" in sys.modules:
        # imported already (the config of an encoder model checks its layers with the
        # kernels' modules): Numba read the variables at its import and re-reads them at
        # every compile, where a count other than its started pool's is an error (a cold
        # cache's first CTC run failed so). Read them now, while no pool has started.
        from numba.core import config as numba_config
        from numba.np.ufunc import parallel
        if parallel._is_initialized:   # too late: keep the pool's count (enforce lowers it)
            os.environ["NUMBA_NUM_THREADS"] = str(numba_config.NUMBA_NUM_THREADS)
        else:
            numba_config.reload_config()


CHOSEN = None   # what choose() decided in this process: (threads, message for the log)


def choose(override=0, comm=None):
    """Decide, apply and describe this process's threads. comm: the job's communicator (its
    node split finds the ranks sharing this node); None = a single process."""
    mask = affinity()
    sharers = 1
    if comm is not None and comm.Get_size() > 1:
        from mpi4py import MPI
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        try:
            sharers = sharers_on_node(node, mask)
        finally:
            node.Free()
    threads, why, oversubscribed = plan(mask, sharers, override)
    apply(threads)
    message = f"{threads} thread(s) per rank ({why})"
    if oversubscribed:
        message += (f"; warning: {sharers} ranks share {len(mask)} core(s): oversubscribed"
                    + ("" if os.environ.get("MPIR_CVAR_ENABLE_HEAVY_YIELD") == "1" else
                       " and MPICH ranks busy-poll while they wait: export "
                       "MPIR_CVAR_ENABLE_HEAVY_YIELD=1 before mpiexec, or run fewer ranks"))
    global CHOSEN
    CHOSEN = (threads, message)
    return CHOSEN


def for_train(argv):
    """`hpcsgd train ARGS`, before hpcsgd.train (numpy, numba) is imported: train.threads from
    the config and overrides in argv if they give one (a bad config is reported later, by the
    trainer), then choose() over the job's ranks (MPI starts here if it has not)."""
    import argparse

    from hpcsgd import config
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config")
    known, rest = parser.parse_known_args(argv)
    override = 0
    try:
        cfg = config.load(known.config, [a for a in rest if "=" in a and not a.startswith("-")])
        override = cfg["train.threads"]
    except Exception:   # noqa: BLE001 -- the trainer loads the config again and says what is wrong
        pass
    from mpi4py import MPI
    return choose(override, MPI.COMM_WORLD)


def enforce(threads):
    """The decision on pools that may have started already (a trainer not started by the
    CLI): Numba's count lowered at run time (its pool cannot grow), OpenBLAS's set. Returns
    what the pools use now: {"numba": n, "blas": n or None}."""
    import numba
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    blas_threads(threads)
    return {"numba": numba.get_num_threads(), "blas": blas_threads()}


_BLAS = None


def _blas():
    """numpy's bundled OpenBLAS (scipy-openblas wheel), or None if it cannot be found."""
    global _BLAS
    if _BLAS is None:
        import ctypes
        import glob

        import numpy as np
        libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
        found = glob.glob(os.path.join(libs, "libscipy_openblas*.so*"))
        _BLAS = ctypes.CDLL(found[0]) if found else False
    return _BLAS or None


def blas_threads(n=None):
    """Set OpenBLAS's thread count at run time (if n) and return it (None: not an OpenBLAS we
    know). For one process measuring 1 thread and all cores (bench machine)."""
    lib = _blas()
    if lib is None:
        return None
    if n:
        lib.scipy_openblas_set_num_threads64_(int(n))
    return int(lib.scipy_openblas_get_num_threads64_())
