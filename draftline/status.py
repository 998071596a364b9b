"""`make` helpers: write every stage's config stamp, and say which stages are stale and why.

    python -m draftline.status stamp tiny -- train.lr=1e-3
    python -m draftline.status show tokenize=runs/tiny/tokenize/manifest.json:dep,dep ...

Stamping composes the config once for all stages and builds the project's own inputs (tiny
targets, the embedded conversation set) when they are missing, since the stamps fingerprint
them. A no-op `make all` must stay under a second, so `stamp` first checks a cache key made
of file stats alone (conf/, the code that resolves it, the inputs the last compose named)
and skips Hydra entirely when nothing changed.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _stat_key(paths: list[Path]) -> list:
    key = []
    for path in paths:
        stat = path.stat() if path.exists() else None
        key.append([str(path), stat.st_size if stat else -1, stat.st_mtime_ns if stat else -1])
    return key


def _cache_key(argv: list[str], inputs: list[str]) -> str:
    watched = sorted((REPO / "conf").rglob("*.yaml")) + [REPO / "draftline/config.py"]
    blob = json.dumps([argv, _stat_key(watched), _stat_key([Path(p) for p in inputs])])
    return hashlib.sha256(blob.encode()).hexdigest()


def _cache_path(exp: str) -> Path:
    return Path("runs") / exp / ".stamp-cache.json"


def stamp_is_fresh(exp: str, argv: list[str]) -> bool:
    cache = _cache_path(exp)
    if not cache.exists():
        return False
    saved = json.loads(cache.read_text())
    stamps_exist = all(Path(p).exists() for p in saved["stamps"])
    return stamps_exist and saved["key"] == _cache_key(argv, saved["inputs"])


def ensure_assets(cfg) -> None:
    """Build project-made inputs that do not exist yet (deterministic builders)."""
    model_dir = Path(cfg.model.path)
    if cfg.model.build and not (model_dir / "config.json").exists():
        from draftline import tiny

        builders = {"tiny_llama": tiny.build_tiny_llama, "tiny_deepseek_v3": tiny.build_tiny_deepseek_v3,
                    "tiny_kimi_k25": tiny.build_tiny_kimi_k25}
        builders[cfg.model.build](model_dir, num_layers=int(cfg.model.num_layers))
    if cfg.data.build:
        from draftline import embedded

        embedded.ensure_conversations(cfg.data.path, max_bytes=int(cfg.data.max_bytes))


def write_stamps(exp: str, overrides: list[str], argv: list[str]) -> list[Path]:
    """Compose once, build missing assets, rewrite the stamps that changed, save the key."""
    from draftline import artifacts, config

    cfg = config.compose(config.experiment_overrides(exp, overrides))
    ensure_assets(cfg)
    changed, stamps = [], []
    for stage in config.STAGES:
        path = config.stage_dir(cfg, stage) / artifacts.STAMP
        stamps.append(str(path))
        if artifacts.write_stamp(path, config.stage_config(cfg, stage)):
            changed.append(path)
    inputs = [str(cfg.data.path), str(Path(cfg.model.path) / "config.json")]
    artifacts.write_json(_cache_path(exp), {"key": _cache_key(argv, inputs), "inputs": inputs,
                                            "stamps": stamps})
    return changed


def stale_reasons(target: Path, deps: list[Path]) -> list[str]:
    if not target.exists():
        return ["never run (no manifest)"]
    built = target.stat().st_mtime_ns
    return [f"{dep} is newer" for dep in deps if not dep.exists() or dep.stat().st_mtime_ns > built]


def build_cli():
    import typer

    app = typer.Typer(add_completion=False, no_args_is_help=True)

    @app.command()
    def stamp(exp: str, overrides: list[str] = typer.Argument(None)) -> None:
        """Write <run_dir>/<stage>/config.json for every stage, only where it changed."""
        for path in write_stamps(exp, overrides or [], sys.argv[1:]):
            typer.echo(f"config changed: {path}")

    @app.command()
    def show(specs: list[str]) -> None:
        """Each SPEC is STAGE=MANIFEST:DEP,DEP,... in pipeline order; one line per stage."""
        upstream_stale = False
        for spec in specs:
            stage, rest = spec.split("=", 1)
            target, deps = rest.split(":", 1)
            reasons = stale_reasons(Path(target), [Path(d) for d in deps.split(",") if d])
            if upstream_stale and not reasons:
                reasons = ["an upstream stage is stale"]
            upstream_stale = upstream_stale or bool(reasons)
            typer.echo(f"{stage:>9}: " + ("STALE - " + "; ".join(reasons) if reasons else "up to date"))

    return app


def main() -> None:
    argv = sys.argv[1:]
    if len(argv) >= 2 and argv[0] == "stamp" and stamp_is_fresh(argv[1], argv):
        return  # nothing that feeds a stamp changed since the last compose
    build_cli()()


if __name__ == "__main__":
    main()
