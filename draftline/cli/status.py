"""`make` helpers: write every stage's stamps, say which stages are stale and why, accept.

    python -m draftline.cli.status stamp tiny -- train.lr=1e-3
    python -m draftline.cli.status show runs/tiny
    python -m draftline.cli.status accept runs/tiny extract
    python -m draftline.cli.status waits kimi-k2.5 -- model.path=/models/kimi

Each stage has two stamps, rewritten only when their content changes, so their mtimes tell
Make when to rerun it: ``config.json`` (its resolved config) and ``deps.json`` (what the run
imported, draftline.pipeline.deps: project files, package versions, patch queues, Python, named files,
as they are now). When ``deps.json`` matches what the manifest recorded it carries the
manifest's own mtime, so only a real difference makes the stage stale. ``accept`` records in
the manifest that a user kept the outputs across such a difference.

Stamping composes the config once for all stages and writes only under the run dir, since it
runs under `make -n` and `make status` too; ``assets`` (a Make rule of its own, run before
stamping and skipped by a dry run and by status) builds the project's own inputs (tiny
targets, the embedded conversation set) when they are missing. Make runs ``waits``, ``assets``
and ``stamp`` on every call through when_changed.sh, which skips each while nothing it read
changed (its arguments, conf/, the code, and the files it names in runs/<exp>/.<step>-inputs):
a no-op `make all` starts no Python.

``waits`` answers the Makefile when it parses: which targets wait for the rehearsal (the
stages that load a target whose weights exceed rehearse.min_target_gb).

``show`` reads and builds nothing. Given Make's setup rule it says whether `make setup` would
run first and why, and which stages its re-applied patch queues and the lock's pins would then
make stale; given the trained target's rule, whether it would be retrained.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path


def _environment_files() -> list[Path]:
    """Stats that move when packages are installed or removed, or a patch queue re-applied."""
    import sysconfig

    from draftline.patchq.state import record_path

    site = Path(sysconfig.get_paths()["purelib"])
    return [site] + [path for pkg in ("speculators", "vllm") if (path := record_path(pkg)) is not None]


def write_inputs(exp: str, step: str, inputs: list[str]) -> Path:
    """What ``step`` read besides conf/ and the code, one path a line, for when_changed.sh:
    the installed packages and patch records, and ``inputs``. Make skips the step while
    their stats stay as they were after this run."""
    from draftline.pipeline import artifacts

    path = Path("runs") / exp / f".{step}-inputs"
    with artifacts.atomic_path(path) as tmp:
        tmp.write_text("".join(f"{p}\n" for p in [*map(str, _environment_files()), *inputs]))
    return path


class NotAProjectPath(ValueError):
    """A path the project would write (a built tiny target) that names a place outside its
    assets: a user's directory, which the project never writes."""


def check_owned_paths(cfg) -> None:
    """Refuse a config whose project-built inputs point at a user's path (before any write)."""
    from draftline.public import assets as public
    from draftline.tiny import embedded

    if cfg.data.build == public.PROMPTS_BUILD:
        public.check_under_assets(cfg.data.path, cfg.assets_dir, cfg.data.build)
    elif cfg.data.build:
        embedded.check_data_path(cfg.data.path, cfg.assets_dir, str(cfg.data.build))
    model_dir, assets = Path(cfg.model.path).resolve(), Path(cfg.assets_dir).resolve()
    if cfg.model.build and assets not in model_dir.parents:
        raise NotAProjectPath(
            f"model.path={cfg.model.path} is set, but the model is the project-built "
            f"{cfg.model.build}, which lives only under {cfg.assets_dir}/: for a model of your own "
            "give it a conf/model/<name>.yaml with build: null")


def ensure_assets(cfg) -> None:
    """Build project-made inputs that do not exist yet (deterministic builders), only at the
    project's own paths (``check_owned_paths``)."""
    check_owned_paths(cfg)
    model_dir = Path(cfg.model.path)
    if cfg.model.build == "smollm2":
        from draftline.public import smollm2

        smollm2.build(model_dir, cfg.assets_dir)
    elif cfg.model.build and not (model_dir / "config.json").exists():
        from draftline.tiny import builders, kimi_k25

        build = {"tiny_llama": builders.build_tiny_llama, "tiny_deepseek_v3": builders.build_tiny_deepseek_v3,
                 "tiny_kimi_k25": kimi_k25.build_tiny_kimi_k25,
                 "tiny_kimi_k25_thinking": functools.partial(kimi_k25.build_tiny_kimi_k25, chat="kimi")}
        build[cfg.model.build](model_dir, num_layers=int(cfg.model.num_layers))
    if cfg.data.build == "public_prompts":
        from draftline.public import assets

        from omegaconf import OmegaConf

        assets.ensure_prompts(cfg.data, cfg.assets_dir, int(cfg.seed), cfg.model.path,
                              OmegaConf.to_container(cfg.tokenize.chat_template_kwargs))
    elif cfg.data.build:
        from draftline.tiny import embedded

        embedded.ensure_conversations(cfg.data.path, cfg.assets_dir, max_bytes=int(cfg.data.max_bytes),
                                      build=str(cfg.data.build))


def _asset_inputs(cfg) -> list[str]:
    return [str(cfg.data.path), str(Path(cfg.model.path) / "config.json")]


def build_assets(exp: str, overrides: list[str]) -> None:
    """Build the experiment's project-made inputs (Make's own step, never a dry run's or
    status's: the stamp step only reads). Its inputs record is the Makefile's $(EXP_ASSETS)."""
    from draftline.pipeline import config

    cfg = config.compose(config.experiment_overrides(exp, overrides))
    config.check(cfg)
    ensure_assets(cfg)
    write_inputs(exp, "assets", _asset_inputs(cfg))


def write_stamps(exp: str, overrides: list[str]) -> list[Path]:
    """Compose once, rewrite the stamps that changed, record what was read. Builds nothing
    and writes nothing outside the run dir: it runs under `make -n` and `make status` too
    (``build_assets`` builds)."""
    from draftline.pipeline import artifacts, config

    cfg = config.compose(config.experiment_overrides(exp, overrides))
    config.check(cfg)
    check_owned_paths(cfg)
    changed, stamps = [], []
    for stage in config.STAGES:
        path = config.stage_dir(cfg, stage) / artifacts.STAMP
        stamps += [str(path), str(path.parent / DEPS_STAMP)]
        if artifacts.write_stamp(path, config.stage_config(cfg, stage)):
            changed.append(path)
        if sync_deps_stamp(path.parent, config.stage_files(cfg, stage)):
            changed.append(path.parent / DEPS_STAMP)
    # The stamps too: one deleted must be written again.
    write_inputs(exp, "stamp", [*_asset_inputs(cfg), *(f for s in config.STAGES for f in config.stage_files(cfg, s)),
                                *stamps])
    return changed


DEPS_STAMP = "deps.json"


# --------------------------------------------------------------------------- the rehearsal's wait

REHEARSE_MODES = ("auto", True, False)
WAITS_ANSWER = ".waits-answer"  # in the run dir: the Makefile's $(RUN)/.waits, when_changed.sh --answer


def rehearsed_targets(cfg) -> list[str]:
    """The Make targets that wait for the rehearsal (order-only): the stages that load the
    target, when rehearse.enabled is true, or auto and the target's weights exceed
    rehearse.min_target_gb."""
    from draftline import target

    mode = cfg.rehearse.enabled
    if mode not in REHEARSE_MODES:
        raise ValueError(f"rehearse.enabled={mode!r}: expected auto, true or false")
    if mode is False:
        return []
    if mode == "auto" and target.weight_bytes(cfg.model.path) <= float(cfg.rehearse.min_target_gb) * 1e9:
        return []
    run = Path(cfg.run_dir)
    loading = ["extract"] + (["regenerate"] if cfg.regenerate.replies == "target" else [])
    loading += ["evaluate"] if cfg.evaluate.vllm.enabled else []
    # extract-slice: one host's share of a multi-host extraction loads the target too.
    return sorted(str(run / stage / "manifest.json") for stage in loading) + ["extract-slice", "serve"]


def write_waits(exp: str, overrides: list[str]) -> list[str]:
    """``rehearsed_targets`` for the experiment, and what it read (the model directory, the
    data): Make asks when it parses, through when_changed.sh, which keeps the answer in
    runs/<exp>/.waits-answer. Writes only under runs/<exp>/ (a dry run asks too). Refuses what
    config.check does, so a config mistake stops Make at its parse."""
    from draftline.pipeline import config

    cfg = config.compose(config.experiment_overrides(exp, overrides))
    config.check(cfg)  # Make stops at its parse on the same mistakes the stamping step refuses
    check_owned_paths(cfg)  # ... and on a user's path given to a project-built input
    model_dir = str(cfg.model.path)
    targets = rehearsed_targets(cfg)
    # The data path too: config.check refused it when missing, so must a cached answer.
    write_inputs(exp, "waits", [model_dir, str(Path(model_dir) / "config.json"), str(cfg.data.path)])
    return targets


def recorded_deps(manifest: dict) -> dict | None:
    """What a stage's run depended on, as its manifest recorded it (None: made before
    draftline recorded dependencies)."""
    return manifest.get("provenance", {}).get("deps")


def _expected_deps(recorded: dict | None, files: list[str]) -> dict | None:
    from draftline.pipeline import deps

    if recorded is None:
        return None
    # A file the config names now but the run did not (a wait added later) is a difference.
    return deps.current({**recorded, "files": {**dict.fromkeys(files), **recorded.get("files", {})}})


def sync_deps_stamp(stage_dir: Path, files: list[str]) -> bool:
    """Rewrite ``deps.json`` when its content changes; give it the manifest's mtime when it
    equals what the manifest recorded, so Make reruns the stage only for a real difference."""
    from draftline.pipeline import artifacts

    stamp, manifest_path = stage_dir / DEPS_STAMP, stage_dir / artifacts.MANIFEST
    if not manifest_path.exists():
        return artifacts.write_stamp(stamp, {"recorded": None, "why": "the stage has not run"})
    recorded = recorded_deps(artifacts.read_json(manifest_path))
    now = _expected_deps(recorded, files)
    if now is None:
        return artifacts.write_stamp(stamp, {"recorded": None, "why": "manifest has no dependency record"})
    changed = artifacts.write_stamp(stamp, now)
    if now == recorded:
        built = manifest_path.stat().st_mtime_ns
        os.utime(stamp, ns=(built, built))
    return changed


def _config_differences(recorded: dict, now: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(recorded) | set(now)):
        old, new = recorded.get(key), now.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            out += _config_differences(old, new, f"{prefix}{key}.")
        elif old != new:
            out.append(f"config {prefix}{key}: {json.dumps(old)} -> {json.dumps(new)}")
    return out


def stale_reasons(stage_dir: Path, upstream: Path | None, files: list[str]) -> list[str]:
    """Why ``stage_dir``'s outputs are stale, each reason named; [] when up to date."""
    from draftline.pipeline import artifacts, deps

    manifest_path = stage_dir / artifacts.MANIFEST
    if not manifest_path.exists():
        return ["never run (no manifest)"]
    manifest = artifacts.read_json(manifest_path)
    built = manifest_path.stat().st_mtime_ns
    reasons = []
    if upstream is not None and (not (upstream / artifacts.MANIFEST).exists()
                                 or (upstream / artifacts.MANIFEST).stat().st_mtime_ns > built):
        reasons.append(f"{upstream.name}'s outputs are newer")
    stamp = stage_dir / artifacts.STAMP
    if stamp.exists():
        reasons += _config_differences(manifest["provenance"]["config"], artifacts.read_json(stamp))
    recorded = recorded_deps(manifest)
    if recorded is None:
        reasons.append("no dependency record in the manifest (made before draftline recorded them)")
    else:
        reasons += deps.differences(recorded, _expected_deps(recorded, files))
    return reasons


def stage_files(run_dir: Path, stage: str) -> list[str]:
    """The extra files the stage's stamped config names: config.stage_files of the stamp, in
    this run dir (without a stamp, only what follows from the run dir: report's file)."""
    from omegaconf import OmegaConf

    from draftline.pipeline import artifacts, config

    stamp = run_dir / stage / artifacts.STAMP
    recorded = artifacts.read_json(stamp) if stamp.exists() else {}
    return config.stage_files(OmegaConf.create({**recorded, "run_dir": str(run_dir)}), stage)


def not_required(run_dir: Path) -> bool:
    """The rehearsal never ran and the last answer Make kept (``write_waits``'s,
    runs/<exp>/.waits-answer) made nothing wait."""
    from draftline.pipeline import artifacts

    answer = run_dir / WAITS_ANSWER
    return (not (run_dir / "rehearse" / artifacts.MANIFEST).exists() and answer.exists()
            and not answer.read_text().split())


def show_status(run_dir: Path, later: dict[str, list[str]] | None = None) -> list[str]:
    """One line per stage in pipeline order, with every reason it is stale; ``later``: the
    reasons a step Make runs first would add (``before_stages``)."""
    from draftline.pipeline import config

    lines, stale, later = [], set(), later or {}
    for stage in config.STAGES:
        upstream = config.UPSTREAM.get(stage)
        if stage == "rehearse" and not_required(run_dir):
            lines.append(f"{stage:>10}: not run (no stage waits for it: the target's weights are "
                         "under rehearse.min_target_gb, or rehearse.enabled=false)")
            continue
        reasons = stale_reasons(run_dir / stage, upstream and run_dir / upstream, stage_files(run_dir, stage))
        reasons += later.get(stage, [])
        if upstream in stale and not reasons:
            reasons = ["an upstream stage is stale"]
        if reasons:
            stale.add(stage)
        lines.append(f"{stage:>10}: " + ("STALE - " + "; ".join(reasons) if reasons else "up to date"))
    return lines


def summary(run_dir: Path, exp: str, lines: list[str], setup_stale: bool = False) -> list[str]:
    """After the stage lines (``show_status``): where the draft is, its tau and the gate's
    verdict from evaluate's manifest, and the command to run next (a stage's target runs a
    stale setup first)."""
    from draftline.evaluate import gate
    from draftline.pipeline import artifacts

    from draftline.tokenize import generated

    out = []
    tokenized = run_dir / "tokenize" / artifacts.MANIFEST
    if tokenized.exists():  # which reasoning the samples train (tokenize.reasoning)
        regenerated = run_dir / "regenerate" / artifacts.MANIFEST
        rows = generated.describe(artifacts.read_json(tokenized),
                                  artifacts.read_json(regenerated) if regenerated.exists() else None)
        out += [f"{'reasoning:' if i == 0 else '':>11} {what}: {value}" for i, (what, value) in enumerate(rows)]
    draft = run_dir / "draft"
    out.append(f"     draft: {draft} -> {os.readlink(draft)}" if draft.is_symlink()
               else "     draft: not trained yet")
    evaluated = run_dir / "evaluate" / artifacts.MANIFEST
    if evaluated.exists():
        manifest = artifacts.read_json(evaluated)
        tau = manifest.get("offline", {}).get("eagle3", {})
        verdict = manifest.get("gate", {})
        if tau:
            out.append(f"       tau: {tau['tau']:.3f} [{tau['tau_ci'][0]:.3f}, {tau['tau_ci'][1]:.3f}] "
                       f"(offline, 95% CI; {run_dir / 'evaluate' / 'results.json'})")
        out += [f"      gate: {line}" for line in gate.lines(verdict)]
    elif (stamp := run_dir / "evaluate" / artifacts.STAMP).exists():
        out.append(f"      gate: {gate.planned(artifacts.read_json(stamp).get('evaluate', {}))}")
    stale = [line.split(":")[0].strip() for line in lines if ": STALE" in line]
    first = next((stage for stage in stale if stage != "rehearse"), None)
    if first:
        out.append(f"      next: make {first} EXP={exp}")
    elif setup_stale:
        out.append("      next: make setup (no stage reruns for it)")
    else:
        out.append(f"      next: make report EXP={exp} (the page), make serve EXP={exp} (vLLM with the draft)")
    return out


# ------------------------------------------------ what Make would do before any stage (status)


def remade_because(rule: str) -> list[str]:
    """Why Make would remake the target of ``rule`` ("TARGET PREREQUISITE ...", as the
    Makefile passes it), judged by mtimes as Make judges them, without running anything:
    [] when it is up to date."""
    target, *prerequisites = map(Path, rule.split())
    if not target.exists():
        return [f"{target} is missing"]
    built = target.stat().st_mtime_ns
    return [f"{p} changed" for p in prerequisites if p.exists() and p.stat().st_mtime_ns > built]


def after_setup(run_dir: Path, lock: Path) -> dict[str, list[str]]:
    """Per stage that ran: the differences a re-run `make setup` would add (both queues
    re-applied as their folders hold them, the lock's pins installed) to those there are now.
    deps.json records what is installed, so an edited patch shows here until setup applies it."""
    from draftline.pipeline import artifacts, config, deps

    out = {}
    for stage in config.STAGES:
        manifest = run_dir / stage / artifacts.MANIFEST
        recorded = recorded_deps(artifacts.read_json(manifest)) if manifest.exists() else None
        if recorded is None:
            continue
        now = _expected_deps(recorded, stage_files(run_dir, stage))
        there = deps.differences(recorded, now)
        later = [d for d in deps.differences(recorded, deps.after_setup(now, lock)) if d not in there]
        if later:
            out[stage] = [f"after `make setup`: {d}" for d in later]
    return out


def reading(run_dir: Path, path: Path) -> list[str]:
    """The stages that ran whose stamped inputs (config.stage_config's fingerprints) are
    ``path`` or lie in it: building it gives them new mtimes, so they rerun."""
    from draftline.pipeline import artifacts, config

    out, path = [], path.resolve()
    for stage in config.STAGES:
        stamp = run_dir / stage / artifacts.STAMP
        inputs = artifacts.read_json(stamp).get("inputs", {}) if stamp.exists() else {}
        named = [Path(found["path"]).resolve() for found in inputs.values()]
        if (run_dir / stage / artifacts.MANIFEST).exists() and any(p == path or path in p.parents for p in named):
            out.append(stage)
    return out


def missing_assets(run_dir: Path) -> list[tuple[str, str]]:
    """(path, builder) of each project-built input (the assets step's: data.build,
    model.build) that tokenize's stamp found missing: `make` builds it before any stage."""
    from draftline.pipeline import artifacts

    stamp = run_dir / "tokenize" / artifacts.STAMP
    cfg = artifacts.read_json(stamp) if stamp.exists() else {}
    out = []
    for group, key in (("data", "data"), ("model", "model_config")):
        found, build = cfg.get("inputs", {}).get(key, {}), cfg.get(group, {}).get("build")
        if found.get("missing") and build:
            out.append((found["path"], build))
    return out


def before_stages(run_dir: Path, setup: str | None, target: str | None) -> tuple[list[str], dict, bool]:
    """What Make would do before any stage, for status to say instead of doing it: the lines,
    the reasons each stage would then be stale (``show_status``'s ``later``), and whether
    setup is stale. ``setup``, ``target``: Make's rules ("TARGET PREREQUISITE ...") of the
    setup stamp (the lock first) and of the trained tiny target (EXP=tiny-trained)."""
    lines, later, rewritten = [], {}, None
    if setup:
        line, later = _setup_said(run_dir, setup)
        lines.append(line)
        rewritten = setup.split()[0] if later is not None else None
    later = later or {}
    if target:
        line, rebuilt = _target_said(run_dir, target, rewritten)
        lines.append(line)
        for stage, reasons in rebuilt.items():
            later.setdefault(stage, []).extend(reasons)
    for path, build in missing_assets(run_dir):
        lines.append(f"    assets: {path} is missing: `make` of any stage builds it first ({build}, deterministic)")
        for stage in reading(run_dir, Path(path)):
            later.setdefault(stage, []).append(f"after `make`: {path} is built")
    return lines, later, rewritten is not None


def _setup_said(run_dir: Path, setup: str) -> tuple[str, dict | None]:
    """Setup's line, and what its rerun would make stale (None: it would not rerun)."""
    lock = setup.split()[1]
    why = remade_because(setup)
    if not why:
        return "     setup: up to date", None
    return (f"     setup: STALE - {', '.join(why)}: `make setup`, which every stage target runs first, would "
            f"re-sync the venv from {lock} and re-apply both patch queues"), after_setup(run_dir, Path(lock))


def _target_said(run_dir: Path, target: str, rewritten: str | None) -> tuple[str, dict]:
    """The trained target's line, and what its rebuild would make stale; ``rewritten``: the
    setup stamp when setup reruns first, which the target depends on."""
    built, *inputs = target.split()
    why = remade_because(target) or ([f"{rewritten} is rewritten by `make setup` first"]
                                     if rewritten in inputs else [])
    directory = Path(built).parent
    if not why:
        return "    target: up to date", {}
    return (f"    target: STALE - {', '.join(why)}: `make target`, which every stage target runs first, "
            f"would train {directory} (minutes)",
            {stage: [f"after `make target`: {directory} is rebuilt"] for stage in reading(run_dir, directory)})


def accept(run_dir: Path, stage: str) -> list[str]:
    """Keep ``stage``'s outputs across the dependency differences found now: record them, who
    and when in its manifest (``accepted``), and make the recorded dependencies the current
    ones. Config changes and newer upstream outputs cannot be accepted: they change the data."""
    import datetime
    import getpass
    import platform

    from draftline.pipeline import artifacts, config, deps

    if stage not in config.STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages: {config.STAGES}")
    stage_dir = run_dir / stage
    manifest_path = stage_dir / artifacts.MANIFEST
    manifest = artifacts.read_manifest(stage_dir)
    files = stage_files(run_dir, stage)
    recorded = recorded_deps(manifest)
    if recorded is None:
        raise ValueError(f"{manifest_path} has no dependency record to accept against: rerun the stage")
    now = _expected_deps(recorded, files)
    upstream = run_dir / config.UPSTREAM[stage] if stage in config.UPSTREAM else None
    differences = deps.differences(recorded, now)
    other = [r for r in stale_reasons(stage_dir, upstream, files) if r not in differences]
    if other:
        raise ValueError(f"{stage}: only code, package, patch, Python and file differences can be "
                         f"accepted; rerun the stage for: {'; '.join(other)}")
    if not differences:
        raise ValueError(f"{stage}: nothing to accept, its dependencies are unchanged")
    manifest.setdefault("accepted", []).append({
        "at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "by": getpass.getuser(), "host": platform.node(), "differences": differences,
        "previous": recorded})
    manifest["provenance"]["deps"] = now
    built = manifest_path.stat().st_mtime_ns
    artifacts.write_json(manifest_path, manifest)
    # Downstream stages compare their mtime with this manifest's: accepting must not rerun them.
    os.utime(manifest_path, ns=(built, built))
    sync_deps_stamp(stage_dir, files)
    return differences


def build_cli():
    import typer

    app = typer.Typer(add_completion=False, no_args_is_help=True)

    @app.command()
    def stamp(exp: str, overrides: list[str] = typer.Argument(None)) -> None:
        """Write <run_dir>/<stage>/config.json for every stage, only where it changed; name
        the changes that make a stage's earlier outputs stale (a stage that never ran is
        stale anyway, and `make status` says so: a fresh clone prints nothing here)."""
        from draftline.pipeline import artifacts

        for path in write_stamps(exp, overrides or []):
            if (path.parent / artifacts.MANIFEST).exists():
                typer.echo(f"config changed: {path}")

    @app.command()
    def assets(exp: str, overrides: list[str] = typer.Argument(None)) -> None:
        """Build the project-made inputs of EXP (tiny targets, the embedded set) when missing."""
        build_assets(exp, overrides or [])

    @app.command()
    def waits(exp: str, overrides: list[str] = typer.Argument(None)) -> None:
        """Print the Make targets that wait for EXP's rehearsal (none: no rehearsal needed)."""
        typer.echo(" ".join(write_waits(exp, overrides or [])))

    @app.command()
    def show(run_dir: Path, exp: str = typer.Option(None, help="the experiment, for the draft, tau and next lines"),
             setup: str = typer.Option(None, help="Make's setup rule: its stamp, the lock, its other inputs"),
             target: str = typer.Option(None, help="Make's rule of the trained tiny target: build.json, its inputs")) -> None:
        """One line per stage of RUN_DIR: up to date, or STALE with every reason; with --exp,
        the draft's path, its tau and gate, and the next command; with --setup and --target,
        what Make would redo before any stage, and what that would make stale. Builds nothing."""
        first, later, setup_stale = before_stages(run_dir, setup, target)
        lines = show_status(run_dir, later)
        for line in first + lines + (summary(run_dir, exp, lines, setup_stale) if exp else []):
            typer.echo(line)

    @app.command("accept")
    def accept_cmd(run_dir: Path, stage: str) -> None:
        """Keep STAGE's outputs across its current code/package/patch differences (recorded)."""
        for difference in accept(run_dir, stage):
            typer.echo(f"{stage}: accepted {difference}")

    return app


def main() -> None:
    argv = sys.argv[1:]
    from draftline import errors
    from draftline.tiny import embedded

    try:
        build_cli()()
    except (embedded.NotTheEmbeddedPath, NotAProjectPath, errors.UserConfigError) as error:
        # A config mistake, not a failure of the code: its message (and hint) is the whole
        # story, so no traceback. Make's parse reads the gate's stdout: one line there.
        errors.refuse(error, one_line=argv[:1] == ["waits"])


if __name__ == "__main__":
    main()
