"""Compose the Hydra config outside a stage, and cut out each stage's part of it.

Make needs each stage's *resolved* config before it decides what is stale; composing it here
with Hydra's compose API gives exactly what the stage's `@hydra.main` will see for the same
overrides.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

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
LAUNCH_KEYS = {"extract": ("replicas", "shard"),
               "train": ("gpus", "nodes", "rendezvous", "collective_timeout_s")}


LOCAL = "local.yaml"  # untracked: this machine's paths (model.path, data.path, ...)


def compose(overrides: list[str], conf_dir: Path = CONF_DIR) -> DictConfig:
    """The root config for these overrides (the same tree a stage's @hydra.main gets, once
    ``fill_from_local`` has run on it)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=list(overrides))
    return fill_from_local(cfg, conf_dir / LOCAL)


def _leaves(tree: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def fill_from_local(cfg: DictConfig, local: Path = CONF_DIR / LOCAL) -> DictConfig:
    """Fill the values the composed config leaves required (``???``) from conf/local.yaml.

    Only required values: a path set there never changes an experiment that sets its own (the
    embedded runs, `make smoke`, the tests), and a command-line override still wins. A key that
    is no config key is refused, so a misspelled one cannot be silently ignored.
    """
    if not local.exists():
        return cfg
    values = OmegaConf.to_container(OmegaConf.load(local), resolve=False) or {}
    for key, value in _leaves(values):
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if not isinstance(node, DictConfig) or leaf not in node.keys():  # `in` is False for ???
            raise ValueError(f"{local}: {key} is no config key (see conf/ for the keys)")
        if OmegaConf.is_missing(node, leaf):
            node[leaf] = value
    return cfg


def experiment_overrides(exp: str, extra: list[str]) -> list[str]:
    """`EXP=name` selects conf/experiment/name.yaml; free overrides follow."""
    if not (CONF_DIR / "experiment" / f"{exp}.yaml").exists():
        known = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
        raise ValueError(f"unknown experiment {exp!r}; known: {known}")
    return [f"experiment={exp}", *extra]


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
    """Files a stage reads that are neither data nor code: their hashes join its dependencies."""
    if stage == "evaluate" and cfg.evaluate.gate:
        return [str(cfg.evaluate.gate)]
    return []


def stage_dir(cfg: DictConfig, stage: str) -> Path:
    return Path(cfg.run_dir) / stage


def mm_limits(cfg: DictConfig) -> dict[str, int] | None:
    """``model.limit_mm_per_prompt``: a multimodal target (Kimi-K2.5) run text-only."""
    limits = cfg.model.get("limit_mm_per_prompt")
    return None if limits is None else {str(k): int(v) for k, v in limits.items()}

