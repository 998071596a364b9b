"""evaluate: acceptance of the trained draft on the held-out split, baselines, live loop, vLLM load.

    make evaluate EXP=tiny-trained          # or: python -m stages.evaluate experiment=tiny-trained

Writes ``results.json`` (all numbers) and then checks the tau gate recorded for this experiment
(``evaluate.gate``, tests/assets/tau_gate.json): below the floor the stage fails and leaves no
manifest, so ``make`` stops, while results.json still shows what was measured.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig

from draftline import artifacts, config
from draftline.stage import run_stage

log = logging.getLogger("draftline.evaluate")


def draft_dir(cfg: DictConfig, train: dict) -> Path:
    return Path(cfg.evaluate.draft or train["draft"])


def check_features(draft: Path, extract: dict) -> list[int]:
    """The shards must hold the features the draft's config tells vLLM to feed it."""
    from draftline.evaluation import draft_aux_layer_ids

    wanted = draft_aux_layer_ids(draft)
    stored = [int(i) for i in extract["aux_layer_ids"]]
    if wanted != stored:
        raise ValueError(f"{draft}/config.json asks vLLM for aux layers {wanted}, the extracted "
                         f"shards hold {stored}: the offline estimate would not be what vLLM serves")
    return wanted


def target_gib(model_dir: str | Path) -> float:
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors")) / 2**30


def live_check(cfg: DictConfig, runner, samples: list, aux_ids: list[int], k: int,
               stats: dict, skipped: list, on_target_text: bool) -> dict | None:
    """The real loop (target in transformers), unless switched off or the target is too big here.

    ``stored_replies``: the loop from every held-out reply's prompt vs the offline walk through
    the stored reply.  On the target's own replies (regenerate.replies=target) the two must
    agree, or the stage fails: then the offline number is not what serving would measure.
    On the data's replies the offline number is teacher-forced beyond the first position;
    ``heldout_contexts`` then measures that gap with one real step per sampled context.
    """
    from draftline import evaluation, regeneration

    live = cfg.evaluate.live
    if not live.enabled:
        skipped.append({"what": "live loop", "reason": "evaluate.live.enabled=false"})
        return None
    size = target_gib(cfg.model.path)
    if size > float(live.max_target_gib):
        skipped.append({"what": "live loop", "reason": f"target is {size:.1f} GiB > "
                        f"evaluate.live.max_target_gib={live.max_target_gib}"})
        return None
    target = evaluation.load_target(cfg.model.path)
    stops = regeneration.stop_token_ids(cfg.model.path)
    stored = evaluation.live_vs_offline(target, runner, samples, aux_ids, k, stops, stats,
                                        live.max_replies)
    log.info("live loop on %d held-out replies: tau %.3f, offline on the same replies %.3f "
             "[%.3f, %.3f]; %d replies generated other text; %s", stored["replies"],
             stored["live"]["tau"], stored["offline"]["tau"], *stored["offline"]["tau_ci"],
             stored["text_mismatches"], "agree" if stored["agrees"] else "DISAGREE")
    result = {"on_target_text": on_target_text, "stored_replies": stored}
    if on_target_text:
        if live.require_agreement and not stored["agrees"]:
            raise AssertionError(
                f"live tau {stored['live']['tau']:.3f} vs offline {stored['offline']['tau']:.3f} "
                f"{stored['offline']['tau_ci']} on the target's own held-out replies: they must "
                f"agree (paired difference {stored['paired_difference']}); the stored features "
                "are not what the draft sees at serving time")
    else:
        contexts = evaluation.live_heldout_contexts(
            target, runner, samples, aux_ids, k, int(live.context_stride), stops, stats)
        log.info("live held-out contexts: tau %.3f vs offline %.3f on the same %d steps (the "
                 "data's replies: teacher-forced beyond position 1)", contexts["live"]["tau"],
                 contexts["offline"]["tau"], contexts["live"]["steps"])
        result["heldout_contexts"] = contexts
    return result


def read_gate(cfg: DictConfig, k: int) -> dict | None:
    """This experiment's entry of the gate file, or None; its k must be the evaluated k."""
    if not cfg.evaluate.gate:
        return None
    entries = artifacts.read_json(cfg.evaluate.gate)
    entry = entries.get(str(cfg.exp))
    if entry is None:
        return None
    if int(entry["k"]) != k:
        raise ValueError(f"{cfg.evaluate.gate}: the {cfg.exp} floor was set for k={entry['k']}, "
                         f"this evaluation drafts k={k}")
    return entry


def apply_gate(gate: dict | None, tau: float, gate_file: str | None) -> dict:
    if gate is None:
        return {"checked": False, "file": gate_file}
    verdict = {"checked": True, "file": gate_file, "tau_min": float(gate["tau_min"]), "tau": tau,
               "passed": tau >= float(gate["tau_min"])}
    if not verdict["passed"]:
        raise AssertionError(f"tau {tau:.3f} of the trained draft is below the floor "
                             f"{gate['tau_min']} recorded in {gate_file}: the draft regressed")
    return verdict


def run(cfg: DictConfig) -> dict:
    import torch

    from draftline import evaluation
    from draftline.train_data import load_split
    from draftline.train_model import load_verifier_head, read_verifier

    out_dir = config.stage_dir(cfg, "evaluate")
    train = artifacts.read_manifest(config.stage_dir(cfg, "train"))
    extract = artifacts.read_manifest(config.stage_dir(cfg, "extract"))
    prepare_dir = config.stage_dir(cfg, "prepare")
    prepared = artifacts.read_manifest(prepare_dir)
    draft = draft_dir(cfg, train)
    aux_ids = check_features(draft, extract)
    k = int(cfg.evaluate.steps or evaluation.num_speculative_tokens(draft))
    torch.manual_seed(int(cfg.seed))

    _, head = load_verifier_head(read_verifier(cfg.model.path))  # [V, H]
    index = prepare_dir / prepared["index"]
    samples = evaluation.load_heldout(prepared["shards"], load_split(index, "validation"), head,
                                      cfg.evaluate.max_samples)
    unigram, bigram = evaluation.count_tokens(prepared["shards"], load_split(index, "train"),
                                              head.shape[0])
    model = evaluation.load_draft(draft, cfg.model.path)
    runner = evaluation.DraftRunner(model)
    proposers = [evaluation.Eagle3Draft(runner), *evaluation.baseline_drafts(unigram, bigram)]
    stats = dict(resamples=int(cfg.evaluate.bootstrap), level=float(cfg.evaluate.confidence),
                 seed=int(cfg.seed))
    offline = evaluation.evaluate_offline(proposers, samples, k, **stats)

    skipped: list[dict] = []
    regenerated = artifacts.read_manifest(config.stage_dir(cfg, "regenerate"))
    on_target_text = regenerated["replies"] == "target"
    live = live_check(cfg, runner, samples, aux_ids, k, stats, skipped, on_target_text)
    vllm = None
    if cfg.evaluate.vllm_check:
        vllm = evaluation.check_vllm_load(draft, cfg.model.path, k,
                                          trust_remote_code=bool(cfg.model.trust_remote_code))
    else:
        skipped.append({"what": "vLLM load check", "reason": "evaluate.vllm_check=false"})

    results = {
        "draft": str(draft), "k": k, "aux_layer_ids": aux_ids,
        "replies": "the target's own (regenerated)" if on_target_text else "the data's",
        "held_out_samples": len(samples), "alignment": evaluation.ALIGNMENT,
        "ci": {"method": "percentile bootstrap over held-out samples (prompts for live)",
               "resamples": stats["resamples"], "level": stats["level"]},
        "offline": offline,
        "baselines_from": "training-split assistant-token counts "
                          "(unigram mode; bigram argmax with unigram back-off)",
        "draft_vocab_coverage_of_greedy": evaluation.greedy_coverage(samples, model.t2d, k),
        "live": live, "vllm": vllm,
    }
    artifacts.write_json(out_dir / "results.json", results)  # kept even when the gate fails
    gate = apply_gate(read_gate(cfg, k), offline["eagle3"]["tau"], cfg.evaluate.gate)
    return {
        **results, "gate": gate, "results": "results.json", "skipped": skipped,
        "inputs": {name: artifacts.sha256_file(config.stage_dir(cfg, name) / artifacts.MANIFEST)
                   for name in ("train", "extract", "prepare", "regenerate")},
    }


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_stage("evaluate", cfg, run)


if __name__ == "__main__":
    main()
