"""The layers point one way (docs/architecture.md draws them):
config -> {model, components, data} -> parallel -> analysis.memory -> {generate, export,
evaluate} -> train -> analysis (bench, roofline, check) -> cli, each arrow read "is imported by".
The memory estimator sits below train because the preflight checks host memory with it and an
out-of-memory error quotes it; generate, export and evaluate sit below train, which runs
eval.tasks through them; check runs a few training steps, so the analysis tools sit above train.

Every `import` of a scale_llm module inside scale_llm/ is read with `ast` (imports inside
`if TYPE_CHECKING:` are annotations only and do not count) and must point to its own package or
to a lower layer. Packages of one layer do not import each other.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "scale_llm"

# Lowest first. Each entry: (layer name, its units); a unit is a module or package prefix.
LAYERS = [
    (
        "config",  # the config tree, its loading and checks, the plan; file and error helpers
        [
            (
                "scale_llm.config",
                "scale_llm.errors",
                "scale_llm.files",
                "scale_llm.log",
                "scale_llm.version",
            )
        ],
    ),
    (
        "model / components / data",
        [("scale_llm.model",), ("scale_llm.components",), ("scale_llm.data",)],
    ),
    ("parallel", [("scale_llm.parallel",)]),
    ("the memory estimator", [("scale_llm.analysis.memory",)]),
    (
        "generate and the ecosystem bridges",
        [("scale_llm.generate", "scale_llm.export", "scale_llm.evaluate")],
    ),
    ("train", [("scale_llm.train",)]),
    ("analysis", [("scale_llm.analysis",)]),
    ("cli", [("scale_llm.cli", "scale_llm.__main__", "scale_llm")]),
]


def place(module: str) -> tuple[int, int]:
    """(layer index, unit index) of a module: the longest matching prefix wins."""
    best, best_len = None, -1
    for li, (_, units) in enumerate(LAYERS):
        for ui, prefixes in enumerate(units):
            for prefix in prefixes:
                matches = module == prefix or module.startswith(prefix + ".")
                if (
                    matches
                    and len(prefix) > best_len
                    and (prefix != "scale_llm" or module == prefix)
                ):
                    best, best_len = (li, ui), len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS in {__file__}"
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(source: str, module: str) -> list[tuple[int, str]]:
    """(line, imported scale_llm module) for every runtime import in `source`."""
    tree = ast.parse(source)
    skip: set[int] = set()
    for node in ast.walk(tree):  # `if TYPE_CHECKING:` bodies are annotations only
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("scale_llm")]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative import
                base = ".".join(module.split(".")[: -node.level] + [node.module])
            if base.startswith("scale_llm"):
                # `from scale_llm.analysis import memory` imports the module
                # scale_llm.analysis.memory; `from scale_llm.config import Config` the package
                subs = [
                    f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base
                    for a in node.names
                ]
                out += [(node.lineno, s) for s in subs]
    return out


def _is_module(name: str) -> bool:
    parts = name.split(".")[1:]
    path = PACKAGE.joinpath(*parts)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def upward_edges(module: str, source: str) -> list[str]:
    here = place(module)
    problems = []
    for line, target in imports(source, module):
        there = place(target)
        if there[0] > here[0] or (there[0] == here[0] and there[1] != here[1]):
            problems.append(
                f"{module}:{line} imports {target} ({LAYERS[there[0]][0]}) from "
                f"{LAYERS[here[0]][0]}"
            )
    return problems


def test_no_module_imports_a_layer_above_it():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        problems += upward_edges(module_name(path), path.read_text())
    assert not problems, "imports that point up:\n" + "\n".join(problems)


def test_the_check_sees_an_upward_or_sideways_edge():
    assert upward_edges("scale_llm.model.transformer", "from scale_llm.parallel import fsdp")
    assert upward_edges("scale_llm.components.optim", "import scale_llm.train.trainer")
    assert upward_edges("scale_llm.data.loader", "from scale_llm.components import loss")
    assert upward_edges("scale_llm.analysis.memory.plan", "from scale_llm.train.trainer import x")
    assert upward_edges("scale_llm.config", "def f():\n    from scale_llm.cli import main\n")
    typing_only = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from scale_llm.train import t\n"
    )
    assert not upward_edges("scale_llm.model.transformer", typing_only)
    assert not upward_edges("scale_llm.parallel.fsdp", "from scale_llm.parallel.backend import B")


# ----------------------------------------------------------------------------- the map

ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def documented_layers(text: str) -> list[list[tuple[str, ...]]]:
    """The units of each row of the `| layer | packages | ... |` table, in order: `;` separates
    the units of a layer, the modules of a unit are the backticked names between."""
    rows, in_table = [], False
    for line in text.splitlines():
        if line.startswith("| layer | packages |"):
            in_table = True
        elif in_table and not line.startswith("|"):
            break
        elif in_table and not set(line) <= set("|-: "):
            cell = line.split("|")[2]
            rows.append([tuple(re.findall(r"`([\w.]+)`", unit)) for unit in cell.split(";")])
    return rows


def test_docs_architecture_lists_the_layers_in_their_order():
    """docs/architecture.md's table of packages by layer is LAYERS: the same layers, units and
    modules, lowest first, so the map cannot drift from what this file enforces."""
    documented = documented_layers(ARCHITECTURE.read_text())
    assert documented == [units for _, units in LAYERS], (
        "docs/architecture.md's 'Packages by layer' table differs from LAYERS in "
        f"tests/test_layers.py:\n{documented}"
    )


def test_the_map_reader_sees_units_and_order():
    text = "| layer | packages | what |\n|---|---|---|\n| a | `x.a`, `x.b`; `x.c` | . |\n\nafter\n"
    assert documented_layers(text) == [[("x.a", "x.b"), ("x.c",)]]
