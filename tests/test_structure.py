"""The package's shape: importing deft loads no benchmark, test or transformers module;
no module imports its way back into itself; no file is a sprawl."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "deft"


def test_import_deft_loads_no_benchmark_test_or_transformers_module():
    code = ("import sys, deft, deft.engine, deft.model, deft.cli; "
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('benchmarks', 'tests', 'conftest', 'transformers', 'pytest', 'hypothesis'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The deft modules ``path`` imports, at module level or inside functions."""
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
    return {m for m in found if m.split(".")[0] == "deft"}


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
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for m, p in modules.items():
        # A package's __init__ and its own submodules import each other by design.
        graph[m] = {i for i in _imports(p) if i in modules and i != m
                    and not i.startswith(m + ".") and not m.startswith(i + ".")}
    assert _cycles(graph) == []


def test_no_module_over_about_600_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*")
            if p.suffix in (".py", ".c") and (n := len(p.read_text().splitlines())) > 625}
    assert long == {}
