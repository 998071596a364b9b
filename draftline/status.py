"""`make` helpers: write every stage's config stamp, and say which stages are stale and why.

    python -m draftline.status stamp tiny -- train.lr=1e-3
    python -m draftline.status show tokenize=runs/tiny/tokenize/manifest.json:dep,dep ...

Stamping composes the config once for all stages (one interpreter start keeps a no-op
`make all` fast) and builds the project's own inputs (tiny targets, the embedded
conversation set) when they are missing, since the stamps fingerprint them.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True)


def ensure_assets(cfg) -> None:
    """Build project-made inputs that do not exist yet (deterministic builders)."""
    model_dir = Path(cfg.model.path)
    if cfg.model.build and not (model_dir / "config.json").exists():
        from draftline import tiny

        builders = {"tiny_llama": tiny.build_tiny_llama, "tiny_deepseek_v3": tiny.build_tiny_deepseek_v3}
        builders[cfg.model.build](model_dir, num_layers=int(cfg.model.num_layers))
    data_path = Path(cfg.data.path)
    if cfg.data.build and not data_path.exists():
        from draftline.conversations import write_default_conversations

        write_default_conversations(data_path, max_bytes=int(cfg.data.max_bytes))


@app.command()
def stamp(exp: str, overrides: list[str] = typer.Argument(None)) -> None:
    """Write <run_dir>/<stage>/config.json for every stage, only where it changed."""
    from draftline import artifacts, config

    cfg = config.compose(config.experiment_overrides(exp, overrides or []))
    ensure_assets(cfg)
    for stage in config.STAGES:
        path = config.stage_dir(cfg, stage) / artifacts.STAMP
        if artifacts.write_stamp(path, config.stage_config(cfg, stage)):
            typer.echo(f"config changed: {path}")


def stale_reasons(target: Path, deps: list[Path]) -> list[str]:
    if not target.exists():
        return ["never run (no manifest)"]
    built = target.stat().st_mtime_ns
    return [f"{dep} is newer" for dep in deps if not dep.exists() or dep.stat().st_mtime_ns > built]


@app.command()
def show(specs: list[str]) -> None:
    """Each SPEC is STAGE=MANIFEST:DEP,DEP,... in pipeline order; prints one line per stage."""
    upstream_stale = False
    for spec in specs:
        stage, rest = spec.split("=", 1)
        target, deps = rest.split(":", 1)
        reasons = stale_reasons(Path(target), [Path(d) for d in deps.split(",") if d])
        if upstream_stale and not reasons:
            reasons = ["an upstream stage is stale"]
        upstream_stale = upstream_stale or bool(reasons)
        typer.echo(f"{stage:>9}: " + ("STALE - " + "; ".join(reasons) if reasons else "up to date"))


if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    app()
