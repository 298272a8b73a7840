"""The package's structure: no import cycle between sparsecc's modules, layers that import only
downward, and no import inside a function except of optional or heavy dependencies."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: where each part of the package lives in the repository (passes/ installs as sparsecc.passes)
SOURCES = {"sparsecc": ROOT / "sparsecc", "sparsecc.passes": ROOT / "passes"}
#: modules a function may import when it runs (with their submodules): optional dependencies, or
#: ones whose import is slow and only some calls need (Inductor and Dynamo load only when a graph is compiled)
LAZY = {"torch._inductor.compile_fx", "torch._inductor", "torch._dynamo.backends.registry", "torch._dynamo.source", "torch.utils.cpp_extension",
        "transformers", "cutlass_library"}
#: the layers, lowest first: a module may import its own layer and those below
LAYERS = [("sparsecc._version", "sparsecc.errors", "sparsecc.config"), ("sparsecc.ir",), ("sparsecc.pruning", "sparsecc.quantization"),
          ("sparsecc.codegen",), ("sparsecc.runtime",), ("sparsecc.passes", "sparsecc.frontend"),
          ("sparsecc.kernels",), ("sparsecc.planner",),
          ("sparsecc.compiler", "sparsecc.backend", "sparsecc.models", "sparsecc.cli", "sparsecc")]


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


MODULES = modules()


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def resolve(module: str, node: ast.ImportFrom) -> list[str]:
    """The sparsecc modules a ``from ... import ...`` names (a name may be a submodule)."""
    if node.level:
        base = module.split(".") if is_package(module) else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    names = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in MODULES]
    return names + ([target] if target in MODULES and len(names) < len(node.names) else [])


def imports(name: str) -> tuple[set[str], list[tuple[int, str]]]:
    """(sparsecc modules imported at module level, the parents they load included; imports
    made inside functions as (line, module))."""
    tree = ast.parse(MODULES[name].read_text())
    top, inner = set(), []
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    nested = {id(inside) for f in functions for inside in ast.walk(f) if inside is not f}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            targets = resolve(name, node) if (node.level or (node.module or "").startswith("sparsecc")) \
                else [node.module]
        if id(node) in nested:
            inner += [(node.lineno, t) for t in targets]
            continue
        for target in targets:            # a package outside this one runs its __init__ first
            parts = target.split(".")
            top |= {prefix for prefix in (".".join(parts[:i]) for i in range(2, len(parts) + 1))
                    if prefix in MODULES and (prefix == target or not name.startswith(prefix + "."))}
    return top - {name}, inner


GRAPH = {name: imports(name)[0] for name in MODULES}


def test_there_is_no_import_cycle():
    """Depth-first search over the module-level imports: a cycle is an edge back to a module on
    the current path."""
    state: dict[str, int] = {}
    cycles = []

    def visit(name, path):
        state[name] = 1
        for target in sorted(GRAPH[name]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def layer(name: str) -> int:
    matches = [(len(prefix), index) for index, prefixes in enumerate(LAYERS) for prefix in prefixes
               if name == prefix or name.startswith(prefix + ".")]
    assert matches, f"{name} belongs to no layer"
    return max(matches)[1]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_module_imports_only_its_layer_and_those_below(name):
    upward = sorted(t for t in GRAPH[name] if t != "sparsecc" and layer(t) > layer(name))
    assert not upward, f"{name} (layer {layer(name)}) imports {upward} from layers above"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_functions_import_only_optional_or_heavy_dependencies(name):
    inner = [(line, target) for line, target in imports(name)[1]
             if not any(target == lazy or target.startswith(lazy + ".") for lazy in LAZY)]
    assert not inner, f"{MODULES[name]} imports inside functions: {inner}"


def test_the_check_finds_a_cycle(tmp_path, monkeypatch):
    """The cycle test can fail: two modules that import each other form one."""
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("from .a import x\n")
    (tmp_path / "__init__.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "MODULES",
                        {"pkg": tmp_path / "__init__.py", "pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py"})
    graph = {n: imports(n)[0] for n in ("pkg.a", "pkg.b")}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}}
