"""The rehearsal in order: cost, miniature, extraction, speculative decoding, `vllm serve`.

``run(cfg)`` is the stage's work. Extraction starts exactly as `make extract` starts it
(draftline.extract's generator and writer). Every engine
starts through draftline.engine's builder on the run's config with the model group pointed at
the miniature (draftline.rehearse.scope). The first failing check raises.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

from omegaconf import DictConfig

from draftline import engine, formats
from draftline.pipeline import artifacts, config
from draftline.rehearse import checks, cost, scope

log = logging.getLogger("draftline.rehearse")


def build_draft(cfg: DictConfig, mini_cfg: DictConfig, out_dir: Path) -> tuple[str, int]:
    """A random draft for the miniature, built as train builds its drafts (tokenize's vocab;
    ``train.method=parallel``: a parallel one, which vLLM then drafts with parallel_drafting)."""
    import torch

    from draftline.train.draft import build_draft as build
    from draftline.train.parallel import draft_class

    tokenize_dir = config.stage_dir(cfg, "tokenize")
    d2t, t2d = formats.load_vocab_mapping(tokenize_dir / artifacts.read_manifest(tokenize_dir)["vocab"])
    k = int(cfg.train.ttt_steps)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(cfg.seed))
        draft = build(mini_cfg.model.path, list(mini_cfg.model.aux_layer_ids), d2t, t2d,
                      int(cfg.train.num_layers), num_speculative_tokens=k,
                      draft_class=draft_class(str(cfg.train.method)))  # vLLM drafts as the run will train
    with artifacts.atomic_dir(out_dir) as tmp:
        draft.save_pretrained(str(tmp))
    return str(out_dir.absolute()), k


def cost_check(cfg: DictConfig, tokenized: dict) -> tuple[cost.Cost, str]:
    estimate = cost.run_cost(cfg, tokenized)
    for line in estimate.lines():
        log.info("  cost: %s", line)
    if not estimate.fits:
        raise RuntimeError(f"extract would refuse to start: {estimate.lines()[1]}")
    return estimate, f"{cost.size(estimate.total_bytes)} of shards, disk fits"


def miniature_check(cfg: DictConfig, plan: scope.Scope, out_dir: Path):
    from draftline.rehearse import miniature

    built = miniature.build_miniature(
        cfg.model.path, out_dir, list(cfg.model.aux_layer_ids), device=plan.device,
        tensor_parallel_size=plan.tensor_parallel_size, mla_disable=plan.mla_disable,
        seed=int(cfg.seed))
    return built, built.layers.describe()


def run(cfg: DictConfig) -> dict:
    """Every check in order (logged with PASS/FAIL and seconds); the manifest's fields."""
    from draftline.regenerate import greedy
    from draftline.rehearse import reference

    out_dir, tokenize_dir = config.stage_dir(cfg, "rehearse"), config.stage_dir(cfg, "tokenize")
    tokenized = artifacts.read_manifest(tokenize_dir)
    samples, masks = formats.read_samples(tokenize_dir / tokenized["samples"])
    samples, masks = samples[:int(cfg.rehearse.samples)], masks[:int(cfg.rehearse.samples)]
    on_gpu = engine.cuda_available()
    plan = scope.decide(cfg, on_gpu, scope.devices_here(on_gpu))
    run = checks.Rehearsal()
    estimate = run.check("cost", lambda: cost_check(cfg, tokenized))
    mini = run.check("miniature", lambda: miniature_check(cfg, plan, out_dir / "miniature"))
    not_rehearsed = [*plan.not_rehearsed, *mini.dropped]
    for item in not_rehearsed:  # before the engines start: a failure below still shows them
        log.info("  not rehearsed: %s: %s", item["what"], item["reason"])
    mini_cfg = scope.miniature_config(cfg, plan, mini)
    shards_dir, records = out_dir / "shards", {}
    shutil.rmtree(shards_dir, ignore_errors=True)  # never reuse another miniature's shards
    shards_dir.mkdir(parents=True)
    if "extraction" not in plan.skip:
        records["extraction"] = run.check("extraction vs HF", lambda: checks.extraction(
            mini_cfg, samples, masks, shards_dir, reference.load_reference(mini.path)))
    draft, k = build_draft(cfg, mini_cfg, out_dir / "draft")
    options = engine.engine_options(mini_cfg, mini_cfg.evaluate.vllm)
    new_tokens = int(cfg.rehearse.max_new_tokens)
    prompts = checks.prompts_of(samples, masks, int(options.max_model_len or 2048) - new_tokens - 1)
    if "speculative" not in plan.skip:
        records["speculative"] = run.check("speculative decoding", lambda: checks.speculative(
            options, draft, k, prompts, new_tokens, greedy.stop_token_ids(mini.path),
            int(cfg.evaluate.vllm.max_text_mismatches)))
    if "serve" not in plan.skip:
        served = engine.engine_options(mini_cfg, mini_cfg.serve)
        records["serve"] = run.check("vllm serve", lambda: checks.serving(
            served, draft, k, prompts[0], new_tokens, out_dir / "serve.log", float(cfg.rehearse.serve_timeout_s)))
    return {
        "checks": run.record(), "rehearsed": [r.name for r in run.results],
        "not_rehearsed": not_rehearsed, "scope": plan.record(), "miniature": mini.record(),
        "draft": draft, "k": k, "engine_options": dataclasses.asdict(options), "results": records,
        "cost": estimate.record(),
        "inputs": {"tokenize_manifest_sha256": artifacts.sha256_file(tokenize_dir / artifacts.MANIFEST)},
        "skipped": [{"what": f"check {name}", "reason": "rehearse.skip"} for name in plan.skip],
    }
