"""Saying when Numba compiles. Every CPU kernel is compiled with cache=True, so it is compiled
once per machine and Python version and loaded from `__pycache__` beside its source (or
Numba's user cache when that is not writable) afterwards; a first run on a new machine spends
a minute or two compiling, which the user should be told instead of seeing nothing.

    compiles = announce(log.info)    # says "compiling kernels ..." at the first cache miss
    ...
    compiles.summary()               # "compiled N kernels in S s" once, if any were compiled
    compiles.close()                 # stops listening (a second run in this process has its own)

Numba's event API reports "numba:compile" only for real compilations (a cache hit loads
without it), so a warm run says nothing.

Each kernel is compiled by one process at a time: the K ranks of a node started on a cold
cache reach the same kernel within seconds of each other, and each compiled it (a 3-rank test
job compiled the 11 s owner pass three times over, on 2 cores; about 57 of the clean-clone
suite's 242 s of compiling were such repeats). A cache miss takes a lock file beside the
kernel's cache index, looks again, and compiles only if nobody saved it meanwhile; the save
releases the lock. Installed before Numba's first compile by its `numba_extensions` entry
point (pyproject.toml), for hpcsgd's kernels only.
"""
import fcntl
import os
import time

from numba.core import caching, event


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

    def close(self):
        event.unregister("numba:compile", self)


def announce(say):
    """Register a listener that calls say(message) at the first compilation."""
    listener = _Compiles(say)
    event.register("numba:compile", listener)
    return listener


_held = {}   # id(cache) -> lock file descriptor, from a miss until the save or a failed compile


def _ours(cache):
    return getattr(getattr(cache, "_py_func", None), "__module__", "").startswith("hpcsgd")


def _release(cache):
    fd = _held.pop(id(cache), None)
    if fd is not None:
        os.close(fd)   # closing the descriptor releases its flock


def _load_or_lock(cache, sig, target_context, _load=caching.Cache.load_overload):
    """Numba's load; on a miss, wait for the lock and look again, and keep the lock while this
    process compiles. Where no lock can be had (a read-only cache directory, a file system
    without flock, a Numba whose cache keeps its paths elsewhere), just the miss: each process
    compiles, as without this module."""
    cres = _load(cache, sig, target_context)
    if cres is not None or not _ours(cache) or id(cache) in _held:
        return cres
    try:
        path = os.path.join(cache._cache_path, cache._cache_file._index_name + ".lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except (AttributeError, OSError):   # another Numba's internals; a read-only directory
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:   # a file system without flock (Lustre mounted without -o flock)
        os.close(fd)
        return None
    try:
        cres = _load(cache, sig, target_context)   # whoever held the lock may have saved it
    except BaseException:
        os.close(fd)
        raise
    if cres is not None:
        os.close(fd)
        return cres
    _held[id(cache)] = fd
    return None


def _save_and_unlock(cache, sig, data, _save=caching.Cache.save_overload):
    try:
        _save(cache, sig, data)
    finally:
        _release(cache)


class _UnlockFailed(event.Listener):
    """A compile that raised saves nothing: release its lock at the compile's end (a success
    has added its overload by then, and releases at the save that follows)."""

    def on_start(self, ev):
        pass

    def on_end(self, ev):
        dispatcher = ev.data["dispatcher"]
        cache = getattr(dispatcher, "_cache", None)   # (a CUDA dispatcher's: never locked)
        if id(cache) in _held and tuple(ev.data["args"]) not in dispatcher.overloads:
            _release(cache)


def compile_once():
    """Numba's `numba_extensions` init hook (pyproject.toml): install the lock (once)."""
    if caching.Cache.load_overload is not _load_or_lock:
        caching.Cache.load_overload = _load_or_lock
        caching.Cache.save_overload = _save_and_unlock
        event.register("numba:compile", _UnlockFailed())
