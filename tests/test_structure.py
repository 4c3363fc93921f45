"""The package's shape: importing deft loads no benchmark, test or transformers module;
no module of deft or benchmarks imports its way back into itself; no file is a sprawl."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "deft"
PACKAGES = ("deft", "benchmarks")  # the import graph spans both: deft bench calls into benchmarks


def test_import_deft_loads_no_benchmark_test_or_transformers_module():
    code = ("import sys, deft, deft.engine, deft.model, deft.cli; "
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('benchmarks', 'tests', 'conftest', 'transformers', 'pytest', 'hypothesis'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_deft_imports_benchmarks_only_inside_functions():
    """``deft bench`` calls into benchmarks when it runs; importing any deft module does not."""
    eager = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        lazy = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                for n in ast.walk(f)}
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if id(node) not in lazy and any(n.split(".")[0] == "benchmarks" for n in names):
                eager.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert eager == []


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The modules of :data:`PACKAGES` ``path`` imports, at module level or inside functions,
    with the packages above each (importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[:len(up) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    found |= {m.rsplit(".", k)[0] for m in found for k in range(1, m.count(".") + 1)}
    return {m for m in found if m.split(".")[0] in PACKAGES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    cycles = []

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_import_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    modules = {_module_name(p): p for top in PACKAGES for p in (ROOT / top).rglob("*.py")}
    graph = {}
    for m, p in modules.items():
        # A module's own packages are initialised before it: importing them is no edge.
        graph[m] = {i for i in _imports(p) if i in modules and i != m and not m.startswith(i + ".")}
    assert _cycles(graph) == []


def test_no_module_over_about_600_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*")
            if p.suffix in (".py", ".c") and (n := len(p.read_text().splitlines())) > 625}
    assert long == {}
