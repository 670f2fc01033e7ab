"""Saying when Numba compiles. Every CPU kernel is compiled with cache=True, so it is compiled
once per machine and Python version and loaded from `__pycache__` beside its source (or
Numba's user cache when that is not writable) afterwards; a first run on a new machine spends
a minute or two compiling, which the user should be told instead of seeing nothing.

    compiles = announce(log.info)    # says "compiling kernels ..." at the first cache miss
    ...
    compiles.summary()               # "compiled N kernels in S s" once, if any were compiled

Numba's event API reports "numba:compile" only for real compilations (a cache hit loads
without it), so a warm run says nothing.
"""
import time

from numba.core import event


class _Compiles(event.Listener):
    def __init__(self, say):
        self.say, self.count, self.seconds, self.depth, self.reported = say, 0, 0.0, 0, False
        self._t0 = 0.0

    def on_start(self, ev):
        if self.count == 0:
            self.say("compiling kernels with Numba (first run on this machine: a minute or two; "
                     "they are cached on disk for the next runs)")
        if self.depth == 0:
            self._t0 = time.perf_counter()
        self.depth += 1
        self.count += 1

    def on_end(self, ev):
        self.depth -= 1
        if self.depth == 0:
            self.seconds += time.perf_counter() - self._t0

    def summary(self):
        """Says once how many kernels were compiled and how long it took (if any)."""
        if self.count and not self.reported:
            self.reported = True
            self.say(f"compiled {self.count} kernel(s) in {self.seconds:.0f} s")


def announce(say):
    """Register a listener that calls say(message) at the first compilation."""
    listener = _Compiles(say)
    event.register("numba:compile", listener)
    return listener
