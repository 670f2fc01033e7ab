"""Every real Numba compile of every Python process, for finding where a clean clone's
compile time goes (cache loads do not fire the event). Put this directory on PYTHONPATH:

    mkdir -p /tmp/complog
    CI=true PYTHONPATH=$PWD/experiments/compile_log COMPILE_LOG=/tmp/complog bash .ci/run

then sum /tmp/complog/<pid>.tsv (function, seconds, argument types) per function. Importing
numba.core.event at every start makes each process slower: use it for the attribution only,
not the suite's time."""
import os
import time

if os.environ.get("COMPILE_LOG"):
    try:
        from numba.core import event

        class _Log(event.Listener):
            depth = 0

            def on_start(self, ev):
                if self.depth == 0:
                    self.t0 = time.perf_counter()
                self.depth += 1

            def on_end(self, ev):   # the outermost compile only (callees are inside it)
                self.depth -= 1
                if self.depth == 0:
                    fn = getattr(ev.data["dispatcher"], "py_func", None)
                    name = f"{fn.__module__}.{fn.__qualname__}" if fn else "?"
                    path = os.path.join(os.environ["COMPILE_LOG"], f"{os.getpid()}.tsv")
                    with open(path, "a") as f:
                        f.write(f"{name}\t{time.perf_counter() - self.t0:.3f}\t"
                                f"{ev.data['args']}\n")

        event.register("numba:compile", _Log())
    except ImportError:   # a Python without numba (bin/setup's system python)
        pass
