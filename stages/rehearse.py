"""rehearse: every engine code path of the run on a miniature of its target, and the run's cost.

    make rehearse EXP=kimi-k2.5     # or: python -m stages.rehearse experiment=kimi-k2.5

Runs after tokenize; regenerate (replies=target), extract, evaluate (in vLLM) and serve wait for
it when the target's weights exceed rehearse.min_target_gb (an order-only prerequisite: a
rerun of the rehearsal never makes their outputs stale). In order, each check logged with
PASS/FAIL and its seconds, the first failure ending the stage non-zero with its traceback:

  cost           the bytes extract will write, free disk where they go, the time at a known rate
  miniature      built from model.path's config.json and tokenizer (draftline/tiny/miniature.py)
  extraction     a few samples through extract's path, each slot against transformers
  speculative    the draft in vLLM (evaluate's measurement), greedy = the plain engine's
  serve          `vllm serve` of miniature + draft answers one completion

Writes runs/<EXP>/rehearse/: the miniature, its random draft, the shards, the server log and
the manifest (checks, what was rehearsed and what was not, and why, the cost).
"""

from __future__ import annotations

import logging
import shutil

import hydra
from omegaconf import DictConfig

from draftline import engine, formats
from draftline.pipeline import artifacts, config
from draftline.pipeline.stage import run_stage
from draftline.rehearse import checks, cost, scope

log = logging.getLogger("draftline.rehearse")


def build_draft(cfg: DictConfig, mini_cfg: DictConfig, out_dir) -> tuple[str, int]:
    """A random draft for the miniature, built as train builds its drafts (tokenize's vocab)."""
    import torch

    from draftline.train.draft import build_draft as build

    tokenize = artifacts.read_manifest(config.stage_dir(cfg, "tokenize"))
    d2t, t2d = formats.load_vocab_mapping(config.stage_dir(cfg, "tokenize") / tokenize["vocab"])
    k = int(cfg.train.ttt_steps)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(cfg.seed))
        draft = build(mini_cfg.model.path, list(mini_cfg.model.aux_layer_ids), d2t, t2d,
                      int(cfg.train.num_layers), num_speculative_tokens=k)
    with artifacts.atomic_dir(out_dir) as tmp:
        draft.save_pretrained(str(tmp))
    return str(out_dir.absolute()), k


def run(cfg: DictConfig) -> dict:
    from draftline import regenerate
    from draftline.tiny import miniature
    from stages.extract import make_generator

    out_dir = config.stage_dir(cfg, "rehearse")
    tokenize_dir = config.stage_dir(cfg, "tokenize")
    tokenized = artifacts.read_manifest(tokenize_dir)
    samples, masks = formats.read_samples(tokenize_dir / tokenized["samples"])
    count = int(cfg.rehearse.samples)
    samples, masks = samples[:count], masks[:count]
    on_gpu = engine.cuda_available()
    plan = scope.decide(cfg, on_gpu, scope.devices_here(on_gpu))
    rehearsal = checks.Rehearsal()

    def cost_check():
        estimate = cost.run_cost(cfg, tokenized)
        for line in estimate.lines():
            log.info("  cost: %s", line)
        if not estimate.fits:
            raise RuntimeError(f"extract would refuse to start: {estimate.lines()[1]}")
        return estimate, f"{cost.size(estimate.total_bytes)} of shards, disk fits"

    estimate = rehearsal.check("cost", cost_check)
    def build_miniature():
        built = miniature.build_miniature(
            cfg.model.path, out_dir / "miniature", list(cfg.model.aux_layer_ids), device=plan.device,
            tensor_parallel_size=plan.tensor_parallel_size, mla_disable=plan.mla_disable,
            seed=int(cfg.seed))
        return built, built.layers.describe()

    mini = rehearsal.check("miniature", build_miniature)
    mini_cfg = scope.miniature_config(cfg, plan, mini)
    records = {}
    shutil.rmtree(out_dir / "shards", ignore_errors=True)  # never reuse another miniature's shards
    (out_dir / "shards").mkdir(parents=True)
    if "extraction" not in plan.skip:
        records["extraction"] = rehearsal.check("extraction vs HF", lambda: checks.extraction(
            mini_cfg, make_generator, samples, masks, out_dir / "shards", miniature.load_reference(mini.path)))
    draft, k = build_draft(cfg, mini_cfg, out_dir / "draft")
    options = engine.engine_options(mini_cfg, mini_cfg.evaluate.vllm)
    prompts = checks.prompts_of(samples, masks, int(options.max_model_len or 2048) - int(cfg.rehearse.max_new_tokens) - 1)
    if "speculative" not in plan.skip:
        records["speculative"] = rehearsal.check("speculative decoding", lambda: checks.speculative(
            options, draft, k, prompts, int(cfg.rehearse.max_new_tokens), regenerate.stop_token_ids(mini.path),
            int(cfg.evaluate.vllm.max_text_mismatches)))
    if "serve" not in plan.skip:
        serve_options = engine.engine_options(mini_cfg, mini_cfg.serve)
        records["serve"] = rehearsal.check("vllm serve", lambda: checks.serving(
            serve_options, draft, k, prompts[0], int(cfg.rehearse.max_new_tokens), out_dir / "serve.log",
            float(cfg.rehearse.serve_timeout_s)))
    for item in plan.not_rehearsed + tuple(mini.dropped):
        log.info("  not rehearsed: %s: %s", item["what"], item["reason"])
    return {
        "checks": rehearsal.record(),
        "rehearsed": [r.name for r in rehearsal.results],
        "not_rehearsed": [*plan.not_rehearsed, *mini.dropped],
        "scope": plan.record(), "miniature": mini.record(), "draft": draft, "k": k,
        "engine_options": {"evaluate": options.__dict__}, "results": records,
        "cost": estimate.record(),
        "inputs": {"tokenize_manifest_sha256": artifacts.sha256_file(tokenize_dir / artifacts.MANIFEST)},
        "skipped": [{"what": f"check {name}", "reason": "rehearse.skip"} for name in plan.skip],
    }


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_stage("rehearse", cfg, run)


if __name__ == "__main__":
    main()
