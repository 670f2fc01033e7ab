"""One MPI job that runs `hpcsgd train` again and again, for the test suite (conftest.run_train).

    mpiexec -n K python -m mpi4py tests/mpi/train_jobs.py

Rank 0 reads one request per line on stdin, {"argv": [...], "stdout": path, "stderr": path},
and every rank runs `hpcsgd train` with that argv, its fd 1 and 2 sent to the two files (opened
to append, as a pipe shared by the ranks would be). When all ranks are done rank 0 answers the
exit code on the job's own stdout. An empty line or end of input ends the job; so does a
non-zero exit (the trainer has finalized MPI then), and a failing run aborts the job as it
would any job.

Why: a new job spends about 1.3 s per rank starting Python, NumPy, MPI and Numba's CPU target
and loading cached kernels before its first step, for runs of a fraction of a second; the
suite has about 180 trainer runs. The trainer keeps no state between runs (its bits are a
fresh process's, tests/test_exchange.py checks), and start-up itself is still run by every
test that launches `mpiexec` directly.
"""
import json
import os
import sys
import time

from mpi4py import MPI

from hpcsgd import cli

REQUEST_BYTES = 1 << 16


def wait(request):
    """Wait for a non-blocking MPI call sleeping between polls: a blocking wait busy-polls a
    core (MPICH), and idle jobs of this kind wait while other tests run."""
    pause = 0.0005
    while not request.Test():
        time.sleep(pause)
        pause = min(2 * pause, 0.02)


def next_request(comm, buf):
    if comm.rank == 0:
        line = sys.stdin.buffer.readline().strip()
        if len(line) > REQUEST_BYTES - 4:
            raise ValueError(f"train_jobs: a request of {len(line)} bytes")
        buf[:4] = len(line).to_bytes(4, "little")
        buf[4:4 + len(line)] = line
    wait(comm.Ibcast([buf, MPI.BYTE], root=0))
    n = int.from_bytes(buf[:4], "little")
    return json.loads(bytes(buf[4:4 + n])) if n else None


def run(request):
    """`hpcsgd train` with fd 1 and 2 sent to the request's files; its exit code."""
    saved = os.dup(1), os.dup(2)
    files = [os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
             for name in ("stdout", "stderr")]
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(files[0], 1), os.dup2(files[1], 2)
    try:
        return cli.main(request["argv"])
    except SystemExit as stop:   # argparse's usage errors
        return stop.code if isinstance(stop.code, int) else 1
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        for fd, saved_fd in zip((1, 2), saved):
            os.dup2(saved_fd, fd)
            os.close(saved_fd)
        for fd in files:
            os.close(fd)


def main():
    comm = MPI.COMM_WORLD
    buf = bytearray(REQUEST_BYTES)
    while (request := next_request(comm, buf)) is not None:
        code = run(request)
        if code:   # the job ends (sys.exit would make `python -m mpi4py` call MPI_Abort)
            if comm.rank == 0:
                print(code, flush=True)
            return
        wait(comm.Ibarrier())   # every rank's files are written before the answer
        if comm.rank == 0:
            print(0, flush=True)


if __name__ == "__main__":
    main()
