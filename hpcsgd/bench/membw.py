"""This machine's memory bandwidth, measured by fused Numba loops: the limit codec kernels are
judged against. Bytes counted = bytes read + bytes written (no write-allocate traffic).

    copy:  a[i] = b[i]              8 bytes per element
    triad: a[i] = b[i] + s * c[i]   12 bytes per element (STREAM's triad, fused: no temporaries)
"""
import time

import numba
import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True)
def _copy(a, b):
    for i in prange(a.size):
        a[i] = b[i]


@njit(parallel=True, cache=True)
def _triad(a, b, c, s):
    for i in prange(a.size):
        a[i] = b[i] + s * c[i]


def best_time(fn, repeats):
    """Seconds of the fastest of `repeats` calls: the least-disturbed run on a shared machine."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def set_threads(threads):
    """Numba worker threads for this and later kernels (None: leave as is). Returns the count."""
    if threads:
        numba.set_num_threads(int(threads))
    return numba.get_num_threads()


def copy_bandwidth(nbytes=200 << 20, threads=None, repeats=5):
    """GB/s (1e9 bytes/s) of a parallel float32 copy of `nbytes` per array."""
    set_threads(threads)
    n = nbytes // 4
    a, b = np.zeros(n, np.float32), np.ones(n, np.float32)
    _copy(a, b)  # compile + first touch
    return 8 * n / best_time(lambda: _copy(a, b), repeats) / 1e9


def add_loss_bench_arguments(parser, shapes):
    """The options every loss kernel benchmark takes (bench ctc, bench rnnt)."""
    parser.add_argument("--small", action="store_true", help="tiny shapes, for a CI smoke test")
    parser.add_argument("--threads", type=int, default=None, help="Numba threads (default: all)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs, best kept")
    parser.add_argument("--shapes", default=None,
                        help=f"comma-separated subset of {','.join(shapes)}")


def loss_bench_settings(args, shapes, small_shapes, name):
    """A loss kernel benchmark's (threads, repeats, {name: shape}) from --threads, --small,
    --repeats and --shapes (bench ctc, bench rnnt); an unknown shape stops it, naming them."""
    threads = set_threads(args.threads)
    repeats = args.repeats or (2 if args.small else 10)
    table = small_shapes if args.small else shapes
    names = args.shapes.split(",") if args.shapes else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"hpcsgd bench {name}: unknown shapes {unknown}; known: {list(table)}")
    return threads, repeats, {n: table[n] for n in names}


def triad_timer(nbytes=200 << 20):
    """(run, bytes): one fused triad over preallocated arrays, to interleave with other timings."""
    n = nbytes // 4
    a, b, c = np.zeros(n, np.float32), np.ones(n, np.float32), np.ones(n, np.float32)
    s = np.float32(0.5)
    _triad(a, b, c, s)  # compile + first touch
    return (lambda: _triad(a, b, c, s)), 12 * n


def triad_bandwidth(nbytes=200 << 20, threads=None, repeats=5):
    """GB/s (1e9 bytes/s) of a fused parallel float32 triad with `nbytes` per array."""
    set_threads(threads)
    n = nbytes // 4
    a, b, c = np.zeros(n, np.float32), np.ones(n, np.float32), np.ones(n, np.float32)
    _triad(a, b, c, np.float32(0.5))
    return 12 * n / best_time(lambda: _triad(a, b, c, np.float32(0.5)), repeats) / 1e9
