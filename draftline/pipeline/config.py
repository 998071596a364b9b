"""Compose the Hydra config outside a stage, and cut out each stage's part of it.

Make needs each stage's *resolved* config before it decides what is stale; composing it here
with Hydra's compose API gives exactly what the stage's `@hydra.main` will see for the same
overrides.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from draftline.errors import UserConfigError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
STAGES = ("tokenize", "rehearse", "regenerate", "extract", "prepare", "train", "evaluate", "report")
# Each stage's upstream stage, whose manifest it is made from (the rehearsal is a side branch:
# stages that load the target wait for it, order-only, but are not made from it).
UPSTREAM = {"rehearse": "tokenize", "regenerate": "tokenize", "extract": "regenerate",
            "prepare": "extract", "train": "prepare", "evaluate": "train", "report": "evaluate"}
# The config groups each stage reads. Upstream changes reach a stage through the upstream
# manifest, so a stage's stamp holds only what it reads itself.
STAGE_KEYS = {
    "tokenize": ("model", "data", "tokenize", "seed", "numerics"),
    "rehearse": ("model", "rehearse", "extract", "regenerate", "train", "evaluate", "serve",
                 "seed", "numerics"),
    "regenerate": ("model", "regenerate", "seed", "numerics"),
    "extract": ("model", "extract", "numerics"),
    "prepare": ("prepare", "seed", "numerics"),
    "train": ("model", "train", "seed", "numerics"),
    "evaluate": ("model", "evaluate", "seed", "numerics"),
    "report": ("report", "numerics"),
}
# Groups a stage reads only a few keys of: the others (train.lr for the rehearsal) change
# nothing it runs, so they stay out of its stamp. The rehearsal reads the draft's shape and
# the training plan (cost), whether replies are regenerated, and the engine sections.
PARTIAL_KEYS = {"rehearse": {"train": ("num_layers", "ttt_steps", "steps", "max_tokens_per_step"),
                             "regenerate": ("replies",), "evaluate": ("vllm",),
                             "serve": ("max_model_len", "max_num_seqs", "gpu_memory_utilization",
                                       "cpu_kvcache_gib")}}
# Keys that say where and on how many processes a stage runs, not what it computes (a run
# resumes on another number of GPUs; shards are the same bytes whichever process made them):
# left out of the stage's stamp, recorded config and shard fingerprint, so switching GPUS=1 to
# GPUS=8, or one extraction engine to `extract.replicas=8` or `SHARD=i/N`, reruns nothing; the
# manifest records them apart (`launch`).
LAUNCH_KEYS = {"extract": ("replicas", "shard", "writer"),
               "train": ("gpus", "nodes", "rendezvous", "collective_timeout_s")}


LOCAL = "local.yaml"  # untracked: this machine's paths (model.path, data.path, ...)


def local_of(exp: str, conf_dir: Path = CONF_DIR) -> Path:
    """conf/local.<exp>.yaml (untracked): one experiment's paths, as `make init` writes them, so
    that a second target's init never meets the first one's paths in conf/local.yaml."""
    return conf_dir / f"local.{exp}.yaml"


# Maps whose keys are the user's to choose, so `+data.roles.narrator=assistant` may add one.
OPEN_MAPS = ("data.roles", "model.limit_mm_per_prompt", "evaluate.compare")


def is_hub_name(label: str) -> bool:
    """``owner/name``: read as a hub dataset when no such path exists."""
    return label.count("/") == 1 and not label.startswith((".", "/")) and not label.endswith("/")


def _hydra_compose(overrides: list[str], conf_dir: Path) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def compose(overrides: list[str], conf_dir: Path = CONF_DIR) -> DictConfig:
    """The root config for these overrides (the same tree a stage's @hydra.main gets, once
    ``fill_from_local`` has run on it). An override naming no config file or no key is a
    ``UserConfigError`` naming the nearest one; so is a `+key` that adds a key outside OPEN_MAPS,
    which Hydra would accept silently."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    groups = [o for o in parsed if _is_group(o, conf_dir)]
    for o in groups:  # Hydra composes `experiment=tinyy` silently: the experiment is optional
        if (conf_dir / o.key_or_group).is_dir() and isinstance(o.value(), str):
            check_option(o.key_or_group, o.value(), o.key_or_group, conf_dir)
    try:
        cfg = _hydra_compose(overrides, conf_dir)
    except ConfigCompositionException:
        check_keys(parsed, groups, conf_dir)
        raise  # not a mistake check_keys knows: Hydra's own message, with its traceback
    if any(o.is_add() or o.is_force_add() for o in parsed):
        check_keys(parsed, groups, conf_dir)
    return fill_from_local(cfg, conf_dir / LOCAL)


def _is_group(override, conf_dir: Path) -> bool:
    key = override.key_or_group
    return override.package is not None or "/" in key or (conf_dir / key).is_dir()


def check_keys(parsed: list, groups: list, conf_dir: Path) -> None:
    """Refuse a value override (parsed by Hydra) of a key that the config composed from the
    ``groups`` overrides alone does not have, naming the nearest key."""
    names = _names(OmegaConf.to_container(_hydra_compose([o.input_line for o in groups], conf_dir)))
    for o in parsed:
        key, line = o.key_or_group, o.input_line
        if o in groups or key.split(".")[0] == "hydra":
            continue
        parent, _, leaf = key.rpartition(".")
        if key in names:
            if o.is_add():
                raise UserConfigError(f"{line}: {key} is a config key already", f"set it without the +: {line[1:]}")
        elif parent in OPEN_MAPS and not o.is_add() and not o.is_force_add():
            raise UserConfigError(f"{line}: {parent} has no key {leaf}", f"add one with +{line}")
        elif parent not in OPEN_MAPS:
            raise UserConfigError(f"{line}: {key} is no config key", nearest_key(key, names))


def _names(tree: dict, prefix: str = "") -> list[str]:
    """Every dotted key of ``tree``, inner nodes and leaves."""
    out = []
    for key, value in tree.items():
        out.append(f"{prefix}{key}")
        if isinstance(value, dict):
            out += _names(value, f"{prefix}{key}.")
    return out


def nearest_key(key: str, names: list[str]) -> str:
    close = difflib.get_close_matches(key, names, n=1)
    if close:
        return f"did you mean {close[0]}?"
    return "no key is close; print the composed config: python -m stages.tokenize experiment=EXP --cfg job"


def check_option(group: str, option: str, spelled: str, conf_dir: Path = CONF_DIR) -> None:
    """Refuse ``spelled=option`` when conf/<group>/<option>.yaml does not exist."""
    if (conf_dir / group / f"{option}.yaml").exists():
        return
    known = sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))
    close = difflib.get_close_matches(option, known, n=1)
    raise UserConfigError(f"{spelled}={option}: there is no conf/{group}/{option}.yaml",
                          (f"did you mean {spelled}={close[0]}? " if close else "") + f"known: {', '.join(known)}")


def _leaves(tree: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def fill_from_local(cfg: DictConfig, local: Path = CONF_DIR / LOCAL) -> DictConfig:
    """Fill the values the composed config leaves required (``???``) from the experiment's own
    conf/local.<exp>.yaml first, then conf/local.yaml (beside it).

    Only required values: a path set there never changes an experiment that sets its own (the
    embedded runs, `make smoke`, the tests), and a command-line override still wins. A key that
    is no config key is refused, so a misspelled one cannot be silently ignored.
    """
    exp = OmegaConf.select(cfg, "exp")
    for path in ([local_of(exp, local.parent)] if exp else []) + [local]:
        if path.exists():
            _fill(cfg, path)
    return cfg


def _fill(cfg: DictConfig, local: Path) -> None:
    values = OmegaConf.to_container(OmegaConf.load(local), resolve=False) or {}
    for key, value in _leaves(values):
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if not isinstance(node, DictConfig) or leaf not in node.keys():  # `in` is False for ???
            raise UserConfigError(f"{local}: {key} is no config key",
                                  nearest_key(key, _names(OmegaConf.to_container(cfg))))
        if OmegaConf.is_missing(node, leaf):
            node[leaf] = value


def experiment_overrides(exp: str, extra: list[str]) -> list[str]:
    """`EXP=name` selects conf/experiment/name.yaml; free overrides follow."""
    check_option("experiment", exp, "EXP")
    return [f"experiment={exp}", *extra]


def check(cfg: DictConfig) -> None:
    """Refuse a config no run can start from, before any library reads it: a required value
    (``???``) left unset, or a model or data path of the user's that does not exist. Paths
    under assets_dir are the project's own, built before a stage needs them."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        them = "it" if len(missing) == 1 else "them"
        values = " ".join(f"{key}=..." for key in missing)
        raise UserConfigError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required and not set",
                              f'add {values} to the overrides (make: OVERRIDES="{values}"), '
                              f"or set {them} in the untracked conf/local.yaml")
    from draftline.evaluate import gate  # layer: evaluate owns its gate, config runs its check before any stage

    gate.check_config(cfg.evaluate.baseline_gate)

    if cfg.model.build is None and _users(cfg.model.path, cfg) and not Path(cfg.model.path).is_dir():
        raise UserConfigError(f"model.path={cfg.model.path}: no such directory",
                              "model.path is the target's directory on this machine (config.json, tokenizer, weights)")
    if cfg.model.build is None and _users(cfg.model.path, cfg):
        from draftline import target  # layer: the target's config.json, read before any stage trusts model.path

        target.check_model_config(cfg.model, cfg.exp)
    data = str(cfg.data.path)
    if cfg.data.build is None and _users(data, cfg) and not Path(data).exists() and not is_hub_name(data):
        raise UserConfigError(f"data.path={data}: no such file or directory",
                              "data.path is a JSON, JSONL or parquet file, a datasets save_to_disk "
                              "directory, or the owner/name of a dataset in the local HF cache")


def _users(path: str, cfg: DictConfig) -> bool:
    """A path outside assets_dir: the user's, which the project never builds."""
    assets, resolved = Path(cfg.assets_dir).resolve(), Path(path).resolve()
    return resolved != assets and assets not in resolved.parents


def input_fingerprint(path: str | Path) -> dict:
    """Path, size and mtime of an input file, as Make itself would judge it."""
    path = Path(path)
    if not path.exists():
        return {"path": str(path), "missing": True}
    stat = path.stat()
    return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def stage_config(cfg: DictConfig, stage: str) -> dict:
    """The resolved part of the config that ``stage`` reads, plus its input fingerprints."""
    if stage not in STAGE_KEYS:
        raise ValueError(f"unknown stage {stage!r}; stages: {STAGES}")
    resolved = {key: OmegaConf.to_container(cfg, resolve=True)[key] for key in STAGE_KEYS[stage]}
    for group, keys in launch_config(cfg, stage).items():
        resolved[group] = {key: value for key, value in resolved[group].items() if key not in keys}
    for group, keys in PARTIAL_KEYS.get(stage, {}).items():
        resolved[group] = {key: resolved[group][key] for key in keys}
    resolved["run_dir"] = str(cfg.run_dir)
    if stage == "regenerate":  # which layers extract captures does not change the replies
        del resolved["model"]["aux_layer_ids"]
    if stage == "tokenize":
        resolved["inputs"] = {
            "data": input_fingerprint(cfg.data.path),
            "model_config": input_fingerprint(Path(cfg.model.path) / "config.json"),
        }
    if stage in ("rehearse", "regenerate", "extract"):
        resolved["inputs"] = {"model_config": input_fingerprint(Path(cfg.model.path) / "config.json")}
    return resolved


def launch_config(cfg: DictConfig, stage: str) -> dict[str, dict]:
    """The launch keys (LAUNCH_KEYS) of the groups ``stage`` reads, with their values."""
    return {group: {key: OmegaConf.to_container(cfg, resolve=True)[group][key] for key in keys
                    if key in cfg[group]}
            for group, keys in LAUNCH_KEYS.items() if group in STAGE_KEYS[stage]}


def stage_files(cfg: DictConfig, stage: str) -> list[str]:
    """Files a stage reads that are neither data nor code: their hashes join its dependencies
    (one that does not exist yet counts as absent, and its appearing is a change)."""
    if stage == "evaluate":
        gate = OmegaConf.select(cfg, "evaluate.gate")  # a stamp from status.stage_files may lack it
        return [str(gate)] if gate else []
    if stage == "report":
        return [str(speedup_file(cfg.run_dir))]
    return []


def speedup_file(run_dir: str | Path) -> Path:
    """Where benchmarks.serve keeps its measurements of the run's drafts (the report shows them)."""
    return Path(run_dir) / "benchmarks" / "serve.json"


def stage_dir(cfg: DictConfig, stage: str) -> Path:
    return Path(cfg.run_dir) / stage


def mm_limits(cfg: DictConfig) -> dict[str, int] | None:
    """``model.limit_mm_per_prompt``: a multimodal target (Kimi-K2.5) run text-only."""
    limits = cfg.model.get("limit_mm_per_prompt")
    return None if limits is None else {str(k): int(v) for k, v in limits.items()}

