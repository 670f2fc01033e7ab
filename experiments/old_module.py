"""Load an older version of a module from a file (e.g. `git show REV:hpcsgd/codecs/kbit.py >
/tmp/kbit_old.py`), to time it beside the package's in one process (the *_ab.py scripts)."""
import importlib.util
import sys


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # its cached Numba kernels name their module on load
    spec.loader.exec_module(module)
    return module
