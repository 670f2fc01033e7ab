"""How a run ends early: a stop signal all ranks agree on, and a watchdog for dead peers.

Stop signals. Slurm warns a job before its time limit or a preemption with a signal
(`#SBATCH --signal=B:USR1@300`, SIGTERM on scancel/preemption); a user presses Ctrl-C
(SIGINT, which mpiexec forwards to every rank). The handler only sets a flag; the training
loop agrees on it at every step boundary (`agree`, one small Allreduce: MAX), so a signal on
ANY rank stops ALL ranks at the same step: they write one checkpoint and exit, with
EXIT_REQUEUE (75, which jobs/train.sbatch turns into `scontrol requeue`) for SIGUSR1/SIGTERM
and EXIT_INTERRUPTED (130, the shell's code for Ctrl-C) for SIGINT. The first SIGINT also
restores the default action, so a second Ctrl-C ends the process at once (no traceback, no
checkpoint: the previous one is intact).

The same per-step Allreduce carries rank 0's clock: when train.log_every_seconds have passed
since its last log line, every rank writes one at this step (the line needs a collective).

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

EXIT_REQUEUE = 75      # sysexits EX_TEMPFAIL: checkpointed on a signal, run me again
EXIT_INTERRUPTED = 130  # 128 + SIGINT: checkpointed on Ctrl-C
EXIT_WATCHDOG = 4      # a rank made no progress for train.watchdog_s seconds
ABORT_FORWARD_S = 0.5  # between a rank's last words on stderr and its MPI_Abort

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
HEARTBEAT_BYTES = 512       # a heartbeat file's fixed size (one record)
REQUEUE, INTERRUPT = 1, 2   # what a stop signal asks for (the larger wins across ranks)


class StopSignal:
    """SIGUSR1/SIGTERM/SIGINT set a flag; `agree` turns the flags of all ranks into one
    decision. `say` prints what a signal does, once, on the rank that got it."""

    def __init__(self, say=None):
        self.received = None   # the name of the first signal, e.g. "SIGUSR1"
        self.code = 0          # REQUEUE or INTERRUPT once a signal came
        self.say = say
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)   # a second Ctrl-C: end at once
            self.code = INTERRUPT
            if self.say:
                self.say("SIGINT: checkpointing at the next step, then stopping (Ctrl-C again "
                         "to abort at once, without a checkpoint)")
        else:
            self.code = max(self.code, REQUEUE)
        if self.received is None:
            self.received = name

    def exit_code(self, agreed):
        return EXIT_INTERRUPTED if agreed == INTERRUPT else EXIT_REQUEUE

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def agree(comm, stop_code, log_due, buffers=(np.zeros(2, np.int32), np.zeros(2, np.int32))):
    """Collective, every rank at every step boundary: (the largest stop code of any rank,
    whether rank 0 says a log line is due). One Allreduce (MAX) of two ints."""
    mine, agreed = buffers
    mine[0], mine[1] = stop_code, log_due if comm.Get_rank() == 0 else 0
    if comm.Get_size() == 1:
        return int(mine[0]), bool(mine[1])
    from mpi4py import MPI
    comm.Allreduce(mine, agreed, op=MPI.MAX)   # cross-rank sync point
    return int(agreed[0]), bool(agreed[1])


def process_exists(pid):
    """Whether `pid` is a live process. A killed rank stays a zombie until its launcher reaps
    it, and signal 0 still reaches a zombie: so its state in /proc decides where there is one."""
    try:
        os.kill(pid, 0)   # signal 0: does the process exist?
    except ProcessLookupError:
        return False
    except PermissionError:
        return True       # exists, not ours
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]   # the name may hold spaces
    except (OSError, IndexError):
        return True       # no /proc (macOS): signal 0 is all we know
    return state not in ("Z", "X")


def gone_peers(heartbeat_dir, rank, world):
    """Peers on this host whose process no longer exists, from their heartbeat files (pid and
    host): ["rank 1 (PID 123 on node7)", ...]. When an MPI call fails because a peer died,
    the launcher may or may not get to name it before this rank aborts the job; this does."""
    here, out = socket.gethostname(), []
    for r in range(world):
        if r == rank:
            continue
        try:
            with open(os.path.join(heartbeat_dir, f"rank{r:04d}.heartbeat")) as f:
                _, _, pid, host, _ = f.read().rstrip().split(" ", 4)
            if host == here and not process_exists(int(pid)):
                out.append(f"rank {r} (PID {pid} on {host})")
        except (OSError, ValueError):
            pass   # no file yet, another host's peer, or not ours to signal: cannot tell
    return out


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
        """One write at offset 0 of a fixed-size record, in place: no temporary file to leave
        behind when the job is killed, and a reader sees a whole record or an old one (a
        record that does not parse is taken as not written yet)."""
        line = f"{now:.3f} {self.last:.3f} {os.getpid()} {socket.gethostname()} {self.phase}"
        record = line.encode()[:HEARTBEAT_BYTES - 1].ljust(HEARTBEAT_BYTES - 1) + b"\n"
        try:
            fd = os.open(self._path(self.rank), os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, record, 0)
            finally:
                os.close(fd)
        except OSError:   # a full or vanished file system must not kill training
            pass

    def silent_peers(self, now):
        """Peers that made no progress, the likely culprits first:
        [(rank, 'not running' | 'blocked', seconds, 'pid P on H, last in X')]. A peer whose
        file is no longer rewritten (3 write periods) is dead or stopped; one whose file is
        fresh but whose main thread gave no beat for a write period is alive and waiting --
        usually for the dead one, like this rank. Not for the whole timeout: a peer that
        reached the wait a moment after this rank is as blocked, only not as long (a test
        on a loaded machine saw rank 0 left out at 3.9 of 4 s)."""
        out = []
        for r in range(self.world):
            if r == self.rank:
                continue
            try:
                with open(self._path(r)) as f:
                    written, last, pid, host, phase = f.read().rstrip().split(" ", 4)
                what = f"pid {pid} on {host}, last in {phase.strip()}"
                if now - float(written) > 3 * self.write_every:
                    out.append((r, "not running", now - float(written), what))
                elif now - float(last) > self.write_every:
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
                # MPI_Abort makes the launcher kill every rank at once: give it a moment to
                # forward the message first (it was lost from the console in one of a few
                # runs on a loaded machine)
                time.sleep(ABORT_FORWARD_S)
                self.comm.Abort(EXIT_WATCHDOG)

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
