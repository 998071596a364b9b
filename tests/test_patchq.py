"""Tests for draftline.patchq on synthetic site-packages dirs (never the real install)."""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from draftline.patchq.commands import apply_queue, check_queue, restore_queue, status_text
from draftline.patchq.diff import list_patch_files, load_patches
from draftline.patchq.errors import ModifiedOutOfBand, PatchFailed, PatchSetChanged, VersionMismatch
from draftline.patchq.packages import PACKAGES, PATCH_ROOT, RECORD_NAME
from draftline.patchq.state import APPLIER_VERSION

from conftest import REPO
WORKER = "speculators/data_generation/custom_worker.py"
GEN = "speculators/data_generation/generator.py"
NEWFILE = "speculators/data_generation/extra/helpers.py"

WORKER_V0 = "".join(f"line {i}\n" for i in range(1, 21))
WORKER_V1 = WORKER_V0.replace("line 5\n", "line 5\npatched one\n")
WORKER_V2 = WORKER_V1.replace("patched one\n", "patched one\npatched two\n")
GEN_V0 = "def generate():\n    return 1\n\n\ndef other():\n    return 2\n"
GEN_V1 = GEN_V0.replace("return 2", "return 3")
HELPERS = "def helper():\n    return 'new'\n"


def udiff(path: str, old: str | None, new: str) -> str:
    """A git-style diff of one file, as difflib writes it."""
    fromfile = "/dev/null" if old is None else f"a/{path}"
    lines = difflib.unified_diff((old or "").splitlines(True), new.splitlines(True), fromfile, f"b/{path}")
    return f"diff --git a/{path} b/{path}\n" + "".join(lines)


def write_patch(patch_dir: Path, name: str, *diffs: str) -> Path:
    """A patch file: free-text header, then the diffs."""
    patch_dir.mkdir(parents=True, exist_ok=True)
    path = patch_dir / name
    path.write_text(f"What: test patch {name}\nWhy:  --- not a diff line, still header\n\n" + "".join(diffs))
    return path


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A fake site-packages holding speculators 0.3.0."""
    return make_site(tmp_path / "site-packages")


def make_site(root: Path, version: str = "0.3.0") -> Path:
    pkg = root / "speculators" / "data_generation"
    pkg.mkdir(parents=True)
    (root / "speculators" / "__init__.py").write_text("")
    (pkg / "custom_worker.py").write_text(WORKER_V0)
    (pkg / "generator.py").write_text(GEN_V0)
    dist = root / f"speculators-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: speculators\nVersion: {version}\n")
    return root


def make_queue(patch_dir: Path) -> Path:
    """Two patches; the second's context only exists after the first."""
    write_patch(patch_dir, "0001-one.diff", udiff(WORKER, WORKER_V0, WORKER_V1), udiff(GEN, GEN_V0, GEN_V1))
    write_patch(patch_dir, "0002-two.diff",
                udiff(WORKER, WORKER_V1, WORKER_V2), udiff(NEWFILE, None, HELPERS))
    return patch_dir


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Bytes and mtime of every file under root, to prove nothing was written."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def sha(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def test_two_patch_queue_applies_and_records(site: Path, tmp_path: Path) -> None:
    patches = make_queue(tmp_path / "patches")
    message = apply_queue(patches, site)
    assert "applied 2 patches" in message
    assert (site / WORKER).read_text() == WORKER_V2
    assert (site / GEN).read_text() == GEN_V1
    assert (site / NEWFILE).read_text() == HELPERS
    record = json.loads((site / "speculators" / RECORD_NAME).read_text())
    assert record["package_version"] == "0.3.0"
    assert record["applier_version"] == APPLIER_VERSION
    assert record["patches"] == [{"name": p.name, "sha256": sha(p.read_bytes())}
                                 for p in sorted(patches.iterdir())]
    files = {f["path"]: f for f in record["files"]}
    assert files[WORKER]["sha256"] == sha(WORKER_V2) and files[WORKER]["pristine_sha256"] == sha(WORKER_V0)
    assert files[NEWFILE]["sha256"] == sha(HELPERS) and files[NEWFILE]["pristine_sha256"] is None
    pristine = site / "speculators" / ".draftline-pristine"
    assert (pristine / WORKER).read_text() == WORKER_V0
    assert not (pristine / NEWFILE).exists()
    assert json.loads((pristine / "MANIFEST.json").read_text())["files"][NEWFILE] is None


def test_second_apply_is_noop(site: Path, tmp_path: Path) -> None:
    patches = make_queue(tmp_path / "patches")
    apply_queue(patches, site)
    before = snapshot(site)
    assert "already applied" in apply_queue(patches, site)
    assert snapshot(site) == before


def test_broken_upstream_changes_nothing(site: Path, tmp_path: Path) -> None:
    patches = make_queue(tmp_path / "patches")
    (site / GEN).write_text(GEN_V0.replace("return 2", "return 22"))  # 0001 breaks on its 2nd file
    write_patch(tmp_path / "p2", "0001-ok.diff", udiff(WORKER, WORKER_V0, WORKER_V1))
    write_patch(tmp_path / "p2", "0002-bad.diff", udiff(GEN, GEN_V0, GEN_V1))
    for patch_dir, name in ((patches, "0001-one.diff"), (tmp_path / "p2", "0002-bad.diff")):
        before = snapshot(site)
        with pytest.raises(PatchFailed) as err:
            apply_queue(patch_dir, site)
        text = str(err.value)
        assert name in text and GEN in text and "hunk #1" in text
        assert "expected '    return 2\\n', found '    return 22\\n'" in text
        assert err.value.exit_code == 1
        assert snapshot(site) == before
        assert not (site / "speculators" / ".draftline-pristine").exists()


def test_changed_patch_set_detected_and_replaced(site: Path, tmp_path: Path) -> None:
    old = make_queue(tmp_path / "old")
    apply_queue(old, site)
    new = tmp_path / "new"
    write_patch(new, "0001-one.diff", udiff(WORKER, WORKER_V0, WORKER_V1))  # edited: GEN dropped
    write_patch(new, "0003-three.diff", udiff(WORKER, WORKER_V1, WORKER_V1 + "tail\n"))
    before = snapshot(site)
    with pytest.raises(PatchSetChanged) as err:
        apply_queue(new, site)
    assert err.value.exit_code == 3
    for part in ("added: 0003-three.diff", "removed: 0002-two.diff", "edited: 0001-one.diff", "--replace"):
        assert part in str(err.value)
    assert snapshot(site) == before

    apply_queue(new, site, replace=True)
    fresh = make_site(tmp_path / "fresh")
    apply_queue(new, fresh)
    assert (site / GEN).read_text() == GEN_V0  # restored: the new set does not touch it
    assert not (site / NEWFILE).exists()  # created by the old set only
    for rel in (WORKER, GEN):
        assert (site / rel).read_bytes() == (fresh / rel).read_bytes()
    record = json.loads((site / "speculators" / RECORD_NAME).read_text())
    fresh_record = json.loads((fresh / "speculators" / RECORD_NAME).read_text())
    assert record["patches"] == fresh_record["patches"] and record["files"] == fresh_record["files"]


def test_replace_is_all_or_nothing(site: Path, tmp_path: Path) -> None:
    apply_queue(make_queue(tmp_path / "old"), site)
    bad = tmp_path / "bad"
    write_patch(bad, "0001-bad.diff", udiff(GEN, GEN_V1, GEN_V0))  # wants patched text, pristine has V0
    before = snapshot(site)
    with pytest.raises(PatchFailed, match="0001-bad.diff"):
        apply_queue(bad, site, replace=True)
    assert snapshot(site) == before


def test_version_mismatch(tmp_path: Path) -> None:
    site = make_site(tmp_path / "sp", version="0.3.1")
    before = snapshot(site)
    with pytest.raises(VersionMismatch) as err:
        apply_queue(make_queue(tmp_path / "patches"), site)
    assert "0.3.1" in str(err.value) and "0.3.0" in str(err.value) and err.value.exit_code == 2
    assert snapshot(site) == before
    with pytest.raises(VersionMismatch):
        check_queue(tmp_path / "patches", site)
    assert apply_queue(tmp_path / "patches", site, expect_version="0.3.1").startswith("applied")


def test_new_file_patch(site: Path, tmp_path: Path) -> None:
    write_patch(tmp_path / "p", "0001-new.diff", udiff(NEWFILE, None, HELPERS))
    apply_queue(tmp_path / "p", site)
    assert (site / NEWFILE).read_text() == HELPERS
    restore_queue(site)
    assert not (site / NEWFILE).exists()
    (site / NEWFILE).write_text("already here\n")
    with pytest.raises(PatchFailed, match="already exists"):
        apply_queue(tmp_path / "p", site)


def test_out_of_band_edit_detected(site: Path, tmp_path: Path) -> None:
    patches = make_queue(tmp_path / "patches")
    apply_queue(patches, site)
    (site / GEN).write_text("edited by hand\n")
    for replace in (False, True):
        with pytest.raises(ModifiedOutOfBand, match=GEN) as err:
            apply_queue(patches, site, replace=replace)
        assert err.value.exit_code == 4
    assert "MODIFIED" in status_text(site)
    with pytest.raises(ModifiedOutOfBand):
        restore_queue(site)
    restore_queue(site, force=True)
    assert (site / GEN).read_text() == GEN_V0 and not (site / "speculators/.draftline-pristine").exists()


def test_check_reports_per_patch(site: Path, tmp_path: Path) -> None:
    patches = make_queue(tmp_path / "patches")
    assert check_queue(patches, site) == [("0001-one.diff", None), ("0002-two.diff", None)]
    apply_queue(patches, site)
    assert all(why is None for _, why in check_queue(patches, site))  # against pristine copies
    broken = make_site(tmp_path / "broken")
    (broken / WORKER).write_text(WORKER_V0.replace("line 6\n", "line six\n"))
    report = dict(check_queue(patches, broken))
    assert WORKER in report["0001-one.diff"] and "found 'line six\\n'" in report["0001-one.diff"]
    assert report["0002-two.diff"] is not None  # depends on 0001


def test_offset_no_newline_and_multiple_hunks(site: Path, tmp_path: Path) -> None:
    (site / WORKER).write_text("extra 1\nextra 2\n" + WORKER_V0 + "last")  # drifted, no final newline
    diff = (f"--- a/{WORKER}\n+++ b/{WORKER}\n"
            "@@ -2,3 +2,3 @@\n line 2\n-line 3\n+LINE 3\n line 4\n"
            "@@ -19,3 +19,3 @@\n line 19\n line 20\n-last\n\\ No newline at end of file\n+last\n")
    write_patch(tmp_path / "p", "0001-offset.diff", diff)
    apply_queue(tmp_path / "p", site)
    expected = "extra 1\nextra 2\n" + WORKER_V0.replace("line 3\n", "LINE 3\n") + "last\n"
    assert (site / WORKER).read_text() == expected


def test_malformed_patch_rejected(site: Path, tmp_path: Path) -> None:
    diff = f"--- a/{WORKER}\n+++ b/{WORKER}\n@@ -1,2 +1,2 @@\n line 1\n-line 2\n+LINE 2\n+stray\n"
    write_patch(tmp_path / "p", "0001-bad.diff", diff)
    with pytest.raises(PatchFailed, match="more lines than its header"):
        apply_queue(tmp_path / "p", site)
    write_patch(tmp_path / "q", "0001-out.diff", udiff("speculators/../evil.py", None, "x\n"))
    with pytest.raises(PatchFailed, match="not a file inside"):
        load_patches(tmp_path / "q")


def test_interrupted_apply_needs_replace(site: Path, tmp_path: Path) -> None:
    patches = make_queue(tmp_path / "patches")
    apply_queue(patches, site)
    (site / "speculators" / RECORD_NAME).unlink()  # as if killed before the record
    with pytest.raises(PatchSetChanged, match="interrupted"):
        apply_queue(patches, site)
    apply_queue(patches, site, replace=True)
    assert (site / WORKER).read_text() == WORKER_V2
    assert "0002-two.diff" in status_text(site)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftline.patchq", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_cli_exit_codes(site: Path, tmp_path: Path) -> None:
    patches = str(make_queue(tmp_path / "patches"))
    common = ["--patches-dir", patches, "--site-packages", str(site)]
    (site / GEN).write_text("broken\n")
    failed = cli("apply", *common)
    assert failed.returncode == 1 and "0001-one.diff" in failed.stderr and GEN in failed.stderr
    assert cli("check", *common).returncode == 1
    (site / GEN).write_text(GEN_V0)
    assert cli("apply", *common).returncode == 0
    again = cli("apply", *common)
    assert again.returncode == 0 and "already applied" in again.stdout
    status = cli("status", "--site-packages", str(site))
    assert status.returncode == 0 and "0002-two.diff" in status.stdout
    assert cli("apply", *common, "--expect-version", "9.9").returncode == 2
    write_patch(Path(patches), "0003-three.diff", udiff(GEN, GEN_V1, GEN_V0))
    changed = cli("apply", *common)
    assert changed.returncode == 3 and "0003-three.diff" in changed.stderr


def test_each_package_queue_is_its_own_folder_under_patches():
    """patches/speculators/ and patches/vllm/ side by side, named after the package; no diff
    lies loose in patches/."""
    assert {name: pkg.patch_dir for name, pkg in PACKAGES.items()} == \
        {name: PATCH_ROOT / name for name in PACKAGES}
    for pkg in PACKAGES.values():
        assert list_patch_files(pkg.patch_dir), pkg.patch_dir
    assert not list(PATCH_ROOT.glob("*.diff"))


def test_every_test_a_patch_header_names_exists() -> None:
    """A patch's header names the tests that prove it: each tests/ file it names must exist, and
    each test it names as file::test must be defined in that file (0008 named
    tests/test_cuda_engine.py::test_shard_writer_on_cuda, a test of tests/test_cuda_capture.py)."""
    named = re.compile(r"\btests/[\w/.-]+\.py(?:::(\w+))?")
    wrong = []
    for package, pkg in PACKAGES.items():
        for patch in load_patches(pkg.patch_dir, package):
            for ref in named.finditer(patch.header):
                path = REPO / ref[0].split("::")[0]
                if not path.is_file():
                    wrong.append(f"{package}/{patch.name}: {ref[0]}: no such file")
                elif ref[1] and not re.search(rf"^\s*def {ref[1]}\(", path.read_text(), re.M):
                    wrong.append(f"{package}/{patch.name}: {ref[0]}: no such test in that file")
    assert wrong == [], "\n".join(wrong)


def test_every_patch_of_both_queues_has_its_row_in_docs_patches_md() -> None:
    """docs/patches.md is where a user reads what the image changes in vLLM and speculators: a
    patch added to a queue without its row there (vLLM's 0004 was, for two sessions) is named."""
    page = (REPO / "docs/patches.md").read_text()
    rows = {line.split("|")[1].strip() for line in page.splitlines() if line.startswith("| ")}
    missing = [f"{queue.name}/{patch.stem}" for queue in sorted((REPO / "patches").iterdir()) if queue.is_dir()
               for patch in sorted(queue.glob("*.diff"))
               if patch.stem not in rows and f"{queue.name}/{patch.stem}" not in rows]
    assert missing == [], f"no row in docs/patches.md for: {missing}"
