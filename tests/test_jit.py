"""hpcsgd.jit: processes that reach the same uncached kernel together compile it once (the
others wait on its lock file and load what the first saved); a compile that fails releases the
lock; and a run says when it compiles."""
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from hpcsgd import jit

# A module of our own (its name starts with "hpcsgd": the lock covers hpcsgd's kernels only)
# with a kernel that takes about a second to compile (a prange loop: Numba's parfor lowering)
KERNEL = textwrap.dedent('''
    import numpy as np
    from numba import njit, prange

    @njit(parallel=True, cache=True)
    def scaled_sum(x, a):
        total = 0.0
        for i in prange(x.size):
            total += a * x[i] + np.sin(x[i])
        return total
''')

# One process: import, say ready, wait for "go", call the kernel, print its compiles and result
WORKER = textwrap.dedent('''
    import os, sys, time
    import numpy as np
    from numba.core import event
    sys.path.insert(0, sys.argv[1])
    import hpcsgd_locktest_kernel as k

    compiles = []
    class Count(event.Listener):
        def on_start(self, ev):   # the kernel's own compile (not its inner parfor's)
            if ev.data["dispatcher"].py_func is k.scaled_sum.py_func:
                compiles.append(1)
        def on_end(self, ev):
            pass
    event.register("numba:compile", Count())
    open(os.path.join(sys.argv[1], f"ready.{os.getpid()}"), "w").close()
    while not os.path.exists(os.path.join(sys.argv[1], "go")):
        time.sleep(0.005)
    x = np.arange(10.0)
    assert abs(k.scaled_sum(x, 2.0) - (2.0 * x + np.sin(x)).sum()) < 1e-9
    print(len(compiles))
''')


def start_together(tmp_path, n, env=None):
    """n workers released at one moment, once all have imported: how many compiles each ran."""
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(n)]
    deadline = time.monotonic() + 60
    while len([f for f in os.listdir(tmp_path) if f.startswith("ready.")]) < n:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.01)
    (tmp_path / "go").touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return [int(out.split()[0]) for out, _ in outs]


def test_ranks_that_reach_an_uncached_kernel_together_compile_it_once(tmp_path):
    (tmp_path / "hpcsgd_locktest_kernel.py").write_text(KERNEL)
    compiles = start_together(tmp_path, 3)
    assert sorted(compiles) == [0, 0, 1], compiles   # one compiled; two loaded its save
    assert start_together(tmp_path, 1) == [0]        # cached now


def test_without_the_lock_they_each_compile(tmp_path):
    """The same start with the entry point's hook undone: the case the lock exists for (and
    evidence that the first test's workers really overlap)."""
    (tmp_path / "hpcsgd_locktest_kernel.py").write_text(KERNEL)
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent('''
        from numba.core import entrypoints
        entrypoints._already_initialized = True   # no numba_extensions: no hpcsgd lock
    '''))
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    assert start_together(tmp_path, 3, env) == [1, 1, 1]


def test_a_failed_compile_releases_its_lock(tmp_path):
    """A typing error in this process, then another process compiles the same kernel: it must
    not wait for a lock nobody will release."""
    (tmp_path / "hpcsgd_locktest_kernel.py").write_text(KERNEL)
    sys.path.insert(0, str(tmp_path))
    try:
        import hpcsgd_locktest_kernel as k
        from numba.core.errors import TypingError
        with pytest.raises(TypingError):
            k.scaled_sum("not an array", 2.0)
        assert not jit._held
        assert start_together(tmp_path, 1) == [1]
        assert k.scaled_sum(np.arange(10.0), 2.0) > 0 and not jit._held   # loads that save
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("hpcsgd_locktest_kernel", None)


def test_a_file_system_without_flock_compiles_without_the_lock(tmp_path, monkeypatch):
    """Lustre mounted without -o flock refuses flock(): the kernel compiles as if unlocked."""
    import errno

    def refuse(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(jit.fcntl, "flock", refuse)
    (tmp_path / "hpcsgd_locktest_kernel.py").write_text(KERNEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "hpcsgd_locktest_kernel", raising=False)
    import hpcsgd_locktest_kernel as k
    x = np.arange(10.0)
    assert abs(k.scaled_sum(x, 2.0) - (2.0 * x + np.sin(x)).sum()) < 1e-9
    assert not jit._held
    sys.modules.pop("hpcsgd_locktest_kernel", None)


def test_a_closed_announcer_stops_listening(tmp_path, monkeypatch):
    """A second run in one process (a notebook, the suite's train jobs) has its own announcer:
    the first run's, closed with its log, must not be called at the next compile."""
    said = []
    first = jit.announce(lambda message: said.append(("first", message)))
    first.close()
    second = jit.announce(lambda message: said.append(("second", message)))
    (tmp_path / "hpcsgd_announce_kernel.py").write_text(KERNEL.replace("cache=True", "cache=False"))
    monkeypatch.syspath_prepend(str(tmp_path))
    import hpcsgd_announce_kernel as k
    try:
        k.scaled_sum(np.arange(4.0), 2.0)
    finally:
        second.close()
        sys.modules.pop("hpcsgd_announce_kernel", None)
    assert [who for who, _ in said] == ["second"] and "compiling kernels" in said[0][1]
