"""The command line (typer), run by ``python -m draftline.patchq``; typer is imported here
only, never on the library's import path."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import typer

from draftline import patchq
from draftline.patchq.commands import apply_queue, check_queue, restore_queue, status_text
from draftline.patchq.errors import PatchError
from draftline.patchq.packages import PACKAGES


def build_cli() -> typer.Typer:
    """Typer app wrapping the library functions; PatchError becomes message + exit code."""
    app = typer.Typer(add_completion=False, no_args_is_help=True, help=patchq.__doc__.split("\n\n")[0])
    package_opt = typer.Option("speculators", "--package",
                               help=f"Patched package: {' or '.join(PACKAGES)}.")
    patches_opt = typer.Option(None, "--patches-dir",
                               help="Directory of NNNN-slug.diff files (default: the package's queue).")
    site_opt = typer.Option(None, "--site-packages",
                            help="Dir holding the package (default: found via the import system).")
    version_opt = typer.Option(None, "--expect-version",
                               help="Pinned package version (default: the queue's pin).")

    def run(func: Callable[..., str], **kwargs) -> None:
        try:
            typer.echo(func(**kwargs))
        except PatchError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(err.exit_code)

    @app.command()
    def apply(package: str = package_opt, patches_dir: Optional[Path] = patches_opt,
              site_packages: Optional[Path] = site_opt, expect_version: Optional[str] = version_opt,
              replace: bool = typer.Option(False, "--replace",
                                           help="Replace a different applied patch set.")) -> None:
        """Dry-run the whole queue, then apply it atomically and write the record."""
        run(apply_queue, patch_dir=patches_dir, site_packages=site_packages,
            expect_version=expect_version, replace=replace, package=package)

    @app.command()
    def check(package: str = package_opt, patches_dir: Optional[Path] = patches_opt,
              site_packages: Optional[Path] = site_opt, expect_version: Optional[str] = version_opt) -> None:
        """Dry-run the queue against pristine content and report per patch."""
        run(_check_report, patch_dir=patches_dir, site_packages=site_packages,
            expect_version=expect_version, package=package)

    @app.command()
    def status(package: str = package_opt, site_packages: Optional[Path] = site_opt) -> None:
        """Print the applied patch record, or "unpatched"."""
        run(status_text, site_packages=site_packages, package=package)

    @app.command()
    def restore(package: str = package_opt, site_packages: Optional[Path] = site_opt,
                force: bool = typer.Option(False, "--force", help="Discard out-of-band edits.")) -> None:
        """Put back the pristine files and remove draftline's state."""
        run(restore_queue, site_packages=site_packages, force=force, package=package)

    return app


def _check_report(**kwargs) -> str:
    """Format check_queue's report; any failure becomes a PatchError for the exit code."""
    report = check_queue(**kwargs)
    lines = [f"{name}: {'ok' if why is None else 'fails: ' + why}" for name, why in report]
    print("\n".join(lines) if lines else "no patches")
    failed = [name for name, why in report if why is not None]
    if failed:
        raise PatchError(f"{len(failed)} of {len(report)} patches do not apply: {', '.join(failed)}")
    return f"all {len(report)} patches apply"


def main() -> None:
    """Entry point for ``python -m draftline.patchq``."""
    build_cli()()
