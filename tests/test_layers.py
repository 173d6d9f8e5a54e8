"""The layers of DESIGN.md hold: every import in pyfast/**/*.py (read with ast, not run: imports
inside functions count too) goes to the importer's own layer or one below it, models import
nothing of parallel/, and no modules import each other in a circle.

kernels/*.py is scanned as pyfast.kernels. The table (bottom to top) is DESIGN.md's drawing, with the modules it does not name placed by
what they are: base holds the helpers that import no other layer (pyfast/__init__ loads its
submodules by name on first touch, PEP 562: no import statement). DESIGN's contracts add that
models do not import parallel/ (FORBIDDEN); its drawing puts models above parallel and hooks,
and nothing below models imports them.
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "pyfast"

LAYERS = [  # (layer, the modules in it: a name covers its submodules), bottom to top
    ("base", ["pyfast", "pyfast._dist", "pyfast._io", "pyfast._partition", "pyfast._patterns",
              "pyfast._ranges", "pyfast._sequence", "pyfast.errors", "pyfast.perf", "pyfast.netns",
              "pyfast.netns_nodes", "pyfast.hetero"]),
    ("kernels, csrc", ["pyfast.kernels", "pyfast._C"]),
    ("ops", ["pyfast.ops"]),
    ("optim", ["pyfast.optim"]),  # pyfast.optim.AdamW: a torch optimizer over ops.adamw_
    ("compress", ["pyfast.compress"]),
    ("comm", ["pyfast.comm"]),
    ("parallel", ["pyfast.parallel"]),
    ("hooks", ["pyfast.hooks"]),
    ("models, data", ["pyfast.models", "pyfast.data", "pyfast.tokens", "pyfast.prepare"]),
    ("train, ablate, plan", ["pyfast.train", "pyfast.ablate", "pyfast.plan", "pyfast.export",
                              "pyfast.export_peft"]),
    ("cli, benchmarks", ["pyfast.cli", "pyfast.__main__", "pyfast.info", "pyfast.benchmarks"]),
]
FORBIDDEN = [("pyfast.models", "pyfast.parallel"),  # DESIGN: "models do not import parallel/"
             # issue 25: ZeRO shares DataParallel's bucket engine through comm/, not its module
             ("pyfast.parallel.zero", "pyfast.parallel.data")]

# Imports that break the rules for now, each with why and who removes it. The test fails when
# one is no longer there, so the entry goes with the import.
PENDING: dict = {}


def modules() -> dict:
    """{dotted name: (path, is a package)} of every pyfast/**/*.py and kernels/*.py (installed
    as pyfast.kernels: setup.py's package_dir)."""
    out = {}
    for top, name in ((ROOT, "pyfast"), (ROOT.parent / "kernels", "pyfast.kernels")):
        for p in sorted(top.rglob("*.py")):
            parts = [name, *p.relative_to(top).with_suffix("").parts]
            pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if pkg else parts)] = (p, pkg)
    return out


def imports(mods: dict) -> dict:
    """{importer: {imported module: first line}}, pyfast's modules only; `from a import b`
    names module a.b when that is one, else a."""
    graph = {}
    for name, (path, pkg) in mods.items():
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if pkg else name.split(".")[:-1]
                    here = here[:len(here) - (node.level - 1)]
                    base = ".".join(here + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods or
                           f"{base}.{a.name}" == "pyfast._C" else base for a in node.names]
            else:
                continue
            for t in targets:
                if t == "pyfast" or t.startswith("pyfast."):
                    edges.setdefault(t, node.lineno)
    return graph


def layer_of(name: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    assert best is not None, f"{name} is in no layer of the table: place it"
    return best[0]


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(graph: dict) -> set:
    bad = set()
    for a, edges in graph.items():
        for b in edges:
            if layer_of(b) > layer_of(a) or any(under(a, x) and under(b, y)
                                                for x, y in FORBIDDEN):
                bad.add((a, b))
    return bad


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer_and_the_scan_sees_imports():
    mods = modules()
    graph = imports(mods)
    for name in mods:
        layer_of(name)
    # the scan itself: a relative import, a lazy one inside a function, `from pkg import mod`
    assert "pyfast.comm.collectives" in graph["pyfast.comm"]
    assert "pyfast.ops._backend" in graph["pyfast.ops.attention"]
    assert "pyfast.train.run" in graph["pyfast.train.launch"]  # inside a function
    assert "pyfast.perf" in graph["pyfast.benchmarks.cp"]  # from pyfast import perf


def test_no_import_runs_upward():
    graph = imports(modules())
    bad = violations(graph)
    found = {f"{a} -> {b} (line {graph[a][b]}): {LAYERS[layer_of(a)][0]} imports "
             f"{LAYERS[layer_of(b)][0]}" for a, b in bad - set(PENDING)}
    assert not found, "imports that run upward (DESIGN.md's layers):\n" + "\n".join(sorted(found))
    stale = set(PENDING) - bad
    assert not stale, f"PENDING entries no longer needed, remove them: {sorted(stale)}"


def test_no_import_cycles():
    found = cycles(imports(modules()))
    assert not found, "modules that import each other (move what they share below both): " + \
        "; ".join(" <-> ".join(c) for c in found)


def test_the_checks_catch_what_they_are_for():
    # an upward import, a sideways one that DESIGN forbids, and a circle of three
    graph = {"pyfast.ops.x": {"pyfast.parallel.y": 1}, "pyfast.models.m": {"pyfast.parallel.c": 1},
             "pyfast.comm.a": {"pyfast.comm.b": 1}, "pyfast.comm.b": {"pyfast.comm.c": 1},
             "pyfast.comm.c": {"pyfast.comm.a": 1}, "pyfast.train.t": {"pyfast.ops.x": 1}}
    assert violations(graph) == {("pyfast.ops.x", "pyfast.parallel.y"),
                                 ("pyfast.models.m", "pyfast.parallel.c")}
    assert cycles(graph) == [["pyfast.comm.a", "pyfast.comm.b", "pyfast.comm.c"]]


def test_fault_injection_stays_in_tests():
    # the ranks' test-only faults (PYFAST_FAULT, PYFAST_ABLATE_FAULT) live in
    # tests/faults/sitecustomize.py; no pyfast module reads them or names them
    named = [f"{name}:{node.lineno}" for name, (path, _) in modules().items()
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and "_FAULT" in node.value]
    assert not named, f"test-only fault hooks in production code: {named}"
    assert (pathlib.Path(__file__).parent / "faults" / "sitecustomize.py").is_file()
