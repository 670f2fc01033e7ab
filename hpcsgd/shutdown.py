"""How a run ends early: a stop signal all ranks agree on, and a watchdog for dead peers.

Stop signals. Slurm warns a job before its time limit or a preemption with a signal
(`#SBATCH --signal=B:USR1@300`, SIGTERM on scancel/preemption). The handler only sets a flag;
the training loop asks `StopSignal.agreed(comm)` at every step boundary, a one-int Allreduce
(MAX), so a signal on ANY rank stops ALL ranks at the same step: they write one checkpoint and
exit with EXIT_REQUEUE, which jobs/train.sbatch turns into `scontrol requeue`.

Watchdog. When a rank dies, the launcher (hydra's mpiexec, `srun --kill-on-bad-exit`) normally
ends the others. When it does not -- a rank stuck in a collective whose peer vanished, a hung
file system -- every survivor would wait forever. A daemon thread watches a heartbeat the main
thread gives at every step (and during CV and checkpoints); after `timeout` seconds without
one, it names this rank and the phase it was stuck in, and calls MPI_Abort, which ends every
rank of the job with EXIT_WATCHDOG. (mpi4py initialises MPI_THREAD_MULTIPLE, so calling Abort
from this thread while the main thread is inside MPI is allowed.)
"""
import os
import signal
import socket
import sys
import threading
import time

import numpy as np

EXIT_REQUEUE = 75    # sysexits EX_TEMPFAIL: checkpointed on a signal, run me again
EXIT_WATCHDOG = 4    # a rank made no progress for train.watchdog_s seconds

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopSignal:
    """SIGUSR1/SIGTERM set a flag; `agreed` turns the flags of all ranks into one decision."""

    def __init__(self):
        self.received = None   # the name of the first signal, e.g. "SIGUSR1"
        self._flag = np.zeros(1, np.int32)
        self._any = np.zeros(1, np.int32)
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum, frame):
        if self.received is None:
            self.received = signal.Signals(signum).name

    def agreed(self, comm, world):
        """Collective (every rank, every step boundary): True when any rank got a signal."""
        self._flag[0] = self.received is not None
        if world == 1:
            return bool(self._flag[0])
        from mpi4py import MPI
        comm.Allreduce(self._flag, self._any, op=MPI.MAX)   # cross-rank sync point
        return bool(self._any[0])

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Watchdog:
    """Aborts the job when this rank's main thread gives no heartbeat for `timeout` s.

    The thread also writes `heartbeat_dir/rankNNNN.heartbeat` (the main thread's last beat,
    wall clock, and its phase) a few times per timeout, so the rank that aborts can name the
    peer that went silent: a dead or stopped rank's file stops changing. The directory is the
    run's logs/ (a shared file system on a cluster); a few small writes per timeout per rank."""

    def __init__(self, timeout, rank, world, comm, heartbeat_dir, log=None):
        self.timeout, self.rank, self.world, self.comm = timeout, rank, world, comm
        self.dir, self.log = heartbeat_dir, log
        self.phase, self.last = "start", time.time()
        self.write_every = min(max(timeout / 4, 1.0), 60.0)
        self._stop = threading.Event()
        self._thread = None
        if timeout > 0:
            self._thread = threading.Thread(target=self._watch, name="hpcsgd-watchdog",
                                            daemon=True)
            self._thread.start()

    def beat(self, phase):
        """Main thread: alive, now entering `phase` (words for the abort message)."""
        self.phase, self.last = phase, time.time()

    def _path(self, rank):
        return os.path.join(self.dir, f"rank{rank:04d}.heartbeat")

    def _write(self, now):
        path = self._path(self.rank)
        try:
            with open(path + ".tmp", "w") as f:
                f.write(f"{now:.3f} {self.last:.3f} {os.getpid()} {socket.gethostname()} "
                        f"{self.phase}\n")
            os.replace(path + ".tmp", path)
        except OSError:   # a full or vanished file system must not kill training
            pass

    def silent_peers(self, now):
        """Peers that made no progress for the timeout, the likely culprits first:
        [(rank, 'not running' | 'blocked', seconds, 'pid P on H, last in X')]. A peer whose
        file is no longer rewritten (3 write periods) is dead or stopped; one whose file is
        fresh but whose main thread gave no beat is alive and waiting -- usually for the
        dead one, like this rank."""
        out = []
        for r in range(self.world):
            if r == self.rank:
                continue
            try:
                with open(self._path(r)) as f:
                    written, last, pid, host, phase = f.read().split(" ", 4)
                what = f"pid {pid} on {host}, last in {phase.strip()}"
                if now - float(written) > 3 * self.write_every:
                    out.append((r, "not running", now - float(written), what))
                elif now - float(last) > self.timeout:
                    out.append((r, "blocked", now - float(last), what))
            except (OSError, ValueError):
                out.append((r, "not running", float("inf"), "no heartbeat file"))
        return sorted(out, key=lambda p: (p[1] != "not running", -p[2]))

    def _watch(self):
        self._write(time.time())
        written = time.time()
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            now = time.time()
            if now - written >= self.write_every:
                self._write(now)
                written = now
            idle = now - self.last
            if idle > self.timeout:
                silent = self.silent_peers(now)
                peers = "; ".join(f"rank {r} {state} for {age:.0f} s ({what})"
                                  for r, state, age, what in silent) or "no peer is silent"
                message = (f"rank {self.rank}: no progress for {idle:.0f} s in {self.phase} "
                           f"(train.watchdog_s={self.timeout:g}): {peers} -- aborting the job")
                print(f"hpcsgd train: {message}", file=sys.stderr, flush=True)
                if self.log is not None:
                    try:
                        self.log.info(message)
                    except ValueError:   # the log was closed meanwhile
                        pass
                self.comm.Abort(EXIT_WATCHDOG)

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
