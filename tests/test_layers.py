"""Where a thing lives: the package's floors, lowest first, and the imports between them.

Every module sits on the floor of its longest prefix in FLOORS. An import (at the top of a
module or inside a function) may go to the same floor or below. One that runs back up needs
its reason on the import's own line, ``# layer: <why>``, and no module imports itself back
through others at import time (a circle).
"""

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from conftest import REPO

FLOORS = {
    # the ground: imports nothing of draftline
    "draftline.errors": 0, "draftline.patchq": 0,
    # config, artifacts, the stage wrapper, dependency records, launch, progress, numerics
    "draftline.pipeline": 1,
    # the formats on disk, the target's config, the project's own tiny inputs
    "draftline.formats": 2, "draftline.target": 2, "draftline.tiny.embedded": 2,
    "draftline.tiny": 2, "draftline.tiny.tokenizer": 2, "draftline.tiny.builders": 2,
    "draftline.tiny.kimi_k25": 2, "draftline.tiny.reference": 2,
    # packaged public data: a real pretrained target, benchmark and training prompts
    "draftline.public": 2,
    "draftline.engine": 3, "draftline.tokenize": 3,
    "draftline.regenerate": 4, "draftline.extract": 4, "draftline.prepare": 4,
    "draftline.serve": 4, "draftline.serve.jobs": 4,
    "draftline.train": 5,
    "draftline.evaluate": 6,
    "draftline.serve.server": 7, "draftline.report": 7, "draftline.tiny.trained": 7,
    "draftline.rehearse": 8,
    # Make's command-line tools
    "draftline.cli": 9,
    # entry points and harnesses
    "stages": 10, "harness": 10, "benchmarks": 10,
}
ROOMS = ("draftline", "stages", "harness", "benchmarks")


def modules() -> dict[str, Path]:
    found = {}
    for room in ROOMS:
        for path in (REPO / room).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            if name != "draftline":  # the package's face: one docstring line
                found[name] = path
    return found


def floor(module: str) -> int:
    prefixes = [p for p in FLOORS if module == p or module.startswith(p + ".")]
    if not prefixes:
        raise ValueError(f"{module} is on no floor: add it to FLOORS")
    return FLOORS[max(prefixes, key=len)]


def imports(path: Path, known: dict[str, Path]):
    """(imported module, line number, inside a function) for each project import in ``path``."""
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                yield name, node.lineno, node.col_offset > 0
                break


def edges():
    known = modules()
    for module, path in sorted(known.items()):
        lines = path.read_text().splitlines()
        for target, line, inner in imports(path, known):
            if target != module and not module.startswith(target + "."):
                yield module, target, lines[line - 1], inner, f"{path.relative_to(REPO)}:{line}"


def test_every_module_is_on_a_floor():
    for module in modules():
        floor(module)


def test_an_import_that_runs_back_up_says_why_on_its_line():
    upward = [f"{where}: {module} (floor {floor(module)}) imports {target} (floor {floor(target)})"
              for module, target, line, _, where in edges()
              if floor(target) > floor(module) and "# layer:" not in line]
    assert not upward, "\n".join(upward)


def test_the_reasons_given_are_for_imports_that_do_run_back_up():
    stale = [where for module, target, line, _, where in edges()
             if "# layer:" in line and floor(target) <= floor(module)]
    assert not stale, stale


def test_no_circle_at_import_time():
    graph = defaultdict(set)
    for module, target, _, inner, _ in edges():
        if not inner:
            graph[module].add(target)
    state: dict[str, int] = {}

    def visit(node, trail):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                pytest.fail("circle: " + " -> ".join(trail[trail.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
