"""The package layout: the numerics never import the trainer, and no minifloat modules import
each other in a loop. Data flows one way: formats -> quantize -> recipes -> linear -> convert ->
train (DESIGN.md)."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import minifloat
from scripts import BENCHMARKS

PACKAGE = Path(minifloat.__file__).parent
TRAIN = "minifloat.train"

# Everything the numerics are: imported in a fresh interpreter, none may pull in the trainer.
NUMERICS = [
    "minifloat",
    "minifloat.formats",
    "minifloat.quantize",
    "minifloat.packing",
    "minifloat.recipes",
    "minifloat.dge",
    "minifloat.occ",
    "minifloat.linear",
    "minifloat.convert",
    "minifloat.kernels",
    "minifloat.kernels.emulated",
    "minifloat.sqnr",
    "minifloat.diagnostics",
    "minifloat.amp",
    "minifloat.distributed",
    "minifloat.blocks",
    "minifloat.optim",
    "minifloat.models",
    "minifloat.data",
]

# Lazy imports (inside functions) that would close a loop, each with the reason it is tolerated.
KNOWN_LAZY_EDGES: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path) -> set[str]:
    """minifloat modules that ``path`` imports, at module level or inside functions (blocks
    under ``if TYPE_CHECKING:`` are left out: they never run)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.split(".")[0] == "minifloat")
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                for alias in child.names if child.module.split(".")[0] == "minifloat" else ():
                    full = f"{child.module}.{alias.name}"  # `from pkg import module`: the module
                    found.add(full if full in MODULES else child.module)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


def _is_train(name: str) -> bool:
    return name == TRAIN or name.startswith(TRAIN + ".")


def test_no_module_outside_the_trainer_imports_it() -> None:
    """Static: no import of minifloat.train anywhere outside it, lazy imports included."""
    offenders = {
        name: sorted(t for t in _imports(path) if _is_train(t))
        for name, path in MODULES.items()
        if not _is_train(name) and name != "minifloat.__main__"
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_importing_the_numerics_loads_no_trainer_module() -> None:
    """At run time, in a fresh interpreter: importing every numerics module leaves
    ``sys.modules`` free of minifloat.train."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {NUMERICS!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('minifloat'))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    assert set(NUMERICS) <= set(loaded)
    assert [m for m in loaded if _is_train(m)] == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every loop a depth-first search meets (each as its modules, first repeated at the end)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    found: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_no_import_cycles() -> None:
    graph = {
        name: {t for t in _imports(path) if t in MODULES and (name, t) not in KNOWN_LAZY_EDGES}
        for name, path in MODULES.items()
    }
    assert _cycles(graph) == []


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    """The cycle search finds a loop, and _imports sees lazy imports but not TYPE_CHECKING ones."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from minifloat import formats\n"
        "if TYPE_CHECKING:\n"
        "    from minifloat.recipes import Recipe\n"
        "def f():\n"
        "    from minifloat.train.config import TrainConfig\n"
        "    import minifloat.kernels.emulated\n"
    )
    assert _imports(source) == {
        "minifloat.formats",
        "minifloat.train.config",
        "minifloat.kernels.emulated",
    }


def test_trainer_modules_stay_small() -> None:
    """torchtitan-style readability: no trainer file over 600 lines, no function over 80."""
    long_files, long_functions = [], []
    for name, path in MODULES.items():
        if not _is_train(name):
            continue
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > 600:
            long_files.append(name)
        for node in ast.walk(ast.parse(text)):
            is_function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if is_function and node.end_lineno - node.lineno + 1 > 80:
                long_functions.append(f"{name}.{node.name}")
    assert long_files == [] and long_functions == []


def _shadowing(folder: Path) -> list[str]:
    """The scripts in `folder` named like a standard-library module or a top-level module of an
    installed distribution."""
    taken = set(sys.stdlib_module_names) | set(importlib.metadata.packages_distributions())
    return sorted(path.name for path in folder.glob("*.py") if path.stem in taken)


def test_no_script_on_sys_path_shadows_an_installed_module() -> None:
    """benchmarks/ lands first on sys.path (each script inserts it; pytest inserts tests/), so a
    script named like an installed module replaces it for every later import in that process:
    benchmarks/kernels.py hid Hugging Face's `kernels`, which transformers 5 imports, and 33 CI
    tests failed (session 88; the script is quantizer_bandwidth.py now)."""
    assert _shadowing(BENCHMARKS) == []
    assert _shadowing(Path(__file__).parent) == []


def test_the_shadowing_check_finds_a_clash(tmp_path: Path) -> None:
    """A script named like the standard library's `json` or like torch is caught."""
    for name in ("json.py", "torch.py", "bench_ok.py"):
        (tmp_path / name).write_text("")
    assert _shadowing(tmp_path) == ["json.py", "torch.py"]
