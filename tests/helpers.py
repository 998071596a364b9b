"""Plumbing shared by the tests that run Make in a subprocess."""

import subprocess
from pathlib import Path

from conftest import REPO


def run_make(*args: str, cwd: Path = REPO, timeout: float | None = None,
             expect: int | None = None) -> subprocess.CompletedProcess:
    """`make --no-print-directory *args` in ``cwd`` (the repository unless given), stdout and
    stderr captured as text; ``timeout`` as subprocess.run's (seconds, then TimeoutExpired).
    With ``expect``, asserts that Make exited with that status, showing the output's tail."""
    result = subprocess.run(["make", "--no-print-directory", *args], cwd=cwd, capture_output=True,
                            text=True, timeout=timeout)
    if expect is not None:
        assert result.returncode == expect, \
            f"make {' '.join(args)} exited {result.returncode}, not {expect}:\n" + \
            (result.stdout + result.stderr)[-6000:]
    return result
