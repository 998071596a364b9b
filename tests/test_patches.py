"""The real patch queue against a pristine copy of the installed speculators 0.3.0."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PATCHES = sorted((REPO / "patches").glob("*.diff"))
WORKER = "speculators/data_generation/custom_worker.py"


def _installed_package() -> Path:
    return Path(importlib.util.find_spec("speculators").origin).parent


@pytest.fixture
def pristine_site(tmp_path) -> Path:
    """A site-packages dir holding speculators 0.3.0 as the wheel installed it."""
    package = _installed_package()
    site = tmp_path / "site-packages"
    shutil.copytree(package, site / "speculators", ignore=shutil.ignore_patterns(
        ".draftline-pristine", "DRAFTLINE_PATCHES.json", "__pycache__"))
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
    record = json.loads((pristine_site / "speculators/DRAFTLINE_PATCHES.json").read_text())
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
    assert not (pristine_site / "speculators/DRAFTLINE_PATCHES.json").exists()
