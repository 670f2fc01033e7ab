"""Driving a nonblocking collective while the rank computes (double buffering).

MPICH and Open MPI progress a nonblocking collective only inside MPI calls (measured in
docs/exchange.md, "Does MPI progress a nonblocking collective during compute?"): a rank that
computes the next half without calling MPI leaves its exchange where it was posted. Two ways to
call MPI meanwhile, chosen by exchange.progress:

  test    the spine calls ex.test() (MPI_Test) after each GEMM of the next half (DNN's
          `progress` hook): no thread, but nothing moves during one GEMM once the socket
          buffers are full.
  thread  a Poller thread calls MPI_Test every `interval_s` from ex.start() until ex.wait():
          NumPy's BLAS releases the GIL, so it runs during the GEMMs. Needs MPI_THREAD_MULTIPLE
          (the spine makes MPI calls at step boundaries while the exchange is in flight).
"""
import threading


class Poller:
    """A thread that calls req.Test() every interval_s until the request completes or stop()."""

    def __init__(self, interval_s=1e-3):
        from mpi4py import MPI
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError("exchange.progress=thread needs MPI_THREAD_MULTIPLE; this MPI "
                               "library provides less (use exchange.progress=test)")
        self.interval_s = float(interval_s)
        self._stop = threading.Event()
        self._thread = None

    def start(self, req):
        """Poll req (an mpi4py Request) from a fresh thread; one request at a time."""
        self.stop()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(req,), name="mpi-progress",
                                        daemon=True)
        self._thread.start()

    def _run(self, req):
        while not self._stop.wait(self.interval_s):
            if req.Test():   # completed: the owner's Wait then returns at once
                return

    def stop(self):
        """Stop polling (before the owner calls req.Wait(): one thread completes a request)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
