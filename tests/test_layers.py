"""The layers point one way: cli -> train -> parallel -> {model, components, data} -> config
(memory, the estimator, sits between parallel and train / bench / generate; generate, export
and evaluate, below train, which runs eval.tasks through them).

Every `import` of a scale_llm module inside scale_llm/ is read with `ast` (imports inside
`if TYPE_CHECKING:` are annotations only and do not count) and must point to its own package or
to a lower layer. Packages of one layer do not import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "scale_llm"

# Lowest first. Each entry: (layer name, its units); a unit is a module or package prefix.
LAYERS = [
    (
        "config",  # one unit: the loading, the plan, and the section schemas beside their owners
        [
            (
                "scale_llm.config",
                "scale_llm.plan",
                "scale_llm.schema",
                "scale_llm.keys",
                "scale_llm.errors",
                "scale_llm.files",
                "scale_llm.log",
                "scale_llm.version",
                "scale_llm.parallel.options",
                "scale_llm.data.options",
                "scale_llm.train.options",
            )
        ],
    ),
    (
        "model / components / data",
        [("scale_llm.model",), ("scale_llm.components",), ("scale_llm.data",)],
    ),
    ("parallel", [("scale_llm.parallel",)]),
    ("memory (the estimator, read by train, bench and the cli)", [("scale_llm.memory",)]),
    (
        # generate and the ecosystem bridges (export, eval): they read a finished run, and the
        # loop runs eval.tasks through them
        "generate and the ecosystem bridges",
        [("scale_llm.generate", "scale_llm.export", "scale_llm.evaluate")],
    ),
    (
        "train and what sits beside it",
        [("scale_llm.train",), ("scale_llm.bench", "scale_llm.roofline")],
    ),
    ("cli", [("scale_llm.cli", "scale_llm.__main__", "scale_llm", "scale_llm.check")]),
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
                # `from scale_llm import memory` imports the module scale_llm.memory
                subs = [f"{base}.{a.name}" for a in node.names] if base == "scale_llm" else [base]
                out += [(node.lineno, s) for s in subs]
    return out


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
    assert upward_edges("scale_llm.memory.plan", "from scale_llm.train.trainer import x")
    assert upward_edges("scale_llm.config", "def f():\n    from scale_llm.cli import main\n")
    typing_only = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from scale_llm.train import t\n"
    )
    assert not upward_edges("scale_llm.model.transformer", typing_only)
    assert not upward_edges("scale_llm.parallel.fsdp", "from scale_llm.parallel.backend import B")
