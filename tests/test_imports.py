"""No import circles in hpcsgd/: every module's imports, those inside functions included (a
lazy import hides a circle from Python, not from a reader), form a graph without cycles.

    python tests/test_imports.py      lists the cycles, if any
"""
import ast
import os
import sys

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hpcsgd")


def modules(root=PACKAGE):
    """{dotted module name: file} of every .py file under the package."""
    found = {}
    base = os.path.dirname(root)
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                parts = os.path.relpath(os.path.join(folder, name), base)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts.pop()
                found[".".join(parts)] = os.path.join(folder, name)
    return found


def imports_of(name, path, known):
    """The package's modules that `name` imports anywhere in its file: `from pkg import mod`
    names the submodule where there is one, else the package."""
    tree = ast.parse(open(path).read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:   # relative: from the package, up level - 1
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(up + ([source] if source else []))
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                       for alias in node.names]
        else:
            continue
        for target in targets:
            # `import a.b.c` names a.b.c; the nearest module the package has
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph(root=PACKAGE):
    known = modules(root)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph):
    """The graph's strongly connected components of more than one module (Tarjan), each as
    one cycle through it, sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(cycle_in(graph, component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def cycle_in(graph, component):
    """One cycle through the component's smallest name (a breadth-first path back to it)."""
    start = min(component)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(graph[path[-1]] & component):
            if w == start:
                return path + [start]
            if w not in seen:
                seen.add(w)
                paths.append(path + [w])
    raise AssertionError("a component without a cycle")


def test_the_package_has_no_import_circle():
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_checker_sees_a_circle_through_a_lazy_import(tmp_path):
    root = tmp_path / "p"
    (root / "sub").mkdir(parents=True)
    for name, text in {"__init__.py": "", "sub/__init__.py": "", "c.py": "import p.a\n",
                       "a.py": "from p.sub import b\n",
                       "sub/b.py": "def f():\n    from .. import a\n"}.items():
        (root / name).write_text(text)
    graph = import_graph(str(root))
    assert graph["p.sub.b"] == {"p.a"} and graph["p.c"] == {"p.a"}
    assert cycles(graph) == [["p.a", "p.sub.b", "p.a"]]
    (root / "sub/b.py").write_text("def f():\n    return 1\n")
    assert cycles(import_graph(str(root))) == []


if __name__ == "__main__":
    found = cycles(import_graph())
    for c in found:
        print(" -> ".join(c))
    print(f"{len(found)} import circle(s) in {PACKAGE}")
    sys.exit(1 if found else 0)
