"""evaluate's stage: the held-out acceptance of the trained draft against its baselines, offline
and in vLLM, vLLM's load of the draft, then the gate (``draftline.evaluate.gate``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from draftline.evaluate import benchmarks, gate
from draftline.pipeline import artifacts, config

log = logging.getLogger("draftline.evaluate")


def draft_dir(cfg: DictConfig, train: dict) -> Path:
    return Path(cfg.evaluate.draft or train["draft"])


def check_features(draft: Path, extract: dict) -> list[int]:
    """The shards must hold the features the draft's config tells vLLM to feed it."""
    from draftline.evaluate.rollout import draft_aux_layer_ids

    wanted = draft_aux_layer_ids(draft)
    stored = [int(i) for i in extract["aux_layer_ids"]]
    if wanted != stored:
        raise ValueError(f"{draft}/config.json asks vLLM for aux layers {wanted}, the extracted "
                         f"shards hold {stored}: the offline estimate would not be what vLLM serves")
    return wanted


def measure_in_vllm(cfg: DictConfig, draft: Path, k: int, samples: list, proposer, stats: dict,
                    skipped: list, on_target_text: bool) -> dict | None:
    """vLLM's own greedy speculative decoding of the held-out prompts, step by step, against
    the offline walk of the same replies (draftline.evaluate.in_vllm.vllm_vs_offline)."""
    from draftline import engine
    from draftline.evaluate.in_vllm import vllm_vs_offline
    from draftline.evaluate.offline import held_out_replies
    from draftline.regenerate import greedy
    from draftline.speculative import jobs

    live = cfg.evaluate.vllm
    if not live.enabled:
        skipped.append({"what": "acceptance in vLLM", "reason": "evaluate.vllm.enabled=false"})
        return None
    replies = held_out_replies(samples, live.max_replies)
    options = engine.engine_options(cfg, live)
    measured = jobs.measure_replies(
        options, draft.absolute(), k, [s.input_ids[:a].tolist() for s, a, _ in replies],
        [b - a for _, a, b in replies], greedy.stop_token_ids(cfg.model.path))
    result = vllm_vs_offline(replies, measured["replies"], proposer, k, stats)
    result["counters"] = measured["counters"]
    result["on_target_text"] = on_target_text
    log.info("vLLM on %d held-out replies: tau %.3f (acceptance %s), offline on the same replies "
             "%.3f [%.3f, %.3f] (%s); %d replies decoded to other text; paired difference on "
             "the %d shared steps %.4f [%.4f, %.4f]; %s", result["replies"], result["vllm"]["tau"],
             [round(a, 3) for a in result["vllm"]["acceptance"]], result["offline"]["tau"],
             *result["offline"]["tau_ci"], [round(a, 3) for a in result["offline"]["acceptance"]],
             result["text_mismatches"], result["shared_steps"],
             result["paired_difference"]["difference"], *result["paired_difference"]["ci"],
             "agrees" if result["agrees"] else "DISAGREES")
    return result


def vllm_failures(cfg: DictConfig, measured: dict | None) -> list[str]:
    """On the target's own replies vLLM must reproduce them and agree with the offline walk."""
    if measured is None or not measured["on_target_text"]:
        return []
    live, failures = cfg.evaluate.vllm, []
    if measured["text_mismatches"] > int(live.max_text_mismatches):
        failures.append(f"vLLM decoded {measured['text_mismatches']} of {measured['replies']} "
                        f"stored replies to other text (evaluate.vllm.max_text_mismatches="
                        f"{live.max_text_mismatches}); first differences: {measured['mismatched'][:3]}")
    if live.require_agreement and not measured["agrees"]:
        failures.append(
            f"vLLM's tau {measured['vllm']['tau']:.3f} (acceptance {measured['vllm']['acceptance']}) "
            f"disagrees with the offline estimate {measured['offline']['tau']:.3f} "
            f"{measured['offline']['tau_ci']} (acceptance CIs {measured['offline']['acceptance_ci']}) "
            f"on the same replies; paired difference {measured['paired_difference']}: the offline "
            "number is not what vLLM serves (features from other layers, or another draft)")
    return failures


def compare_drafts(cfg: DictConfig, extract: dict, samples: list, k: int, stats: dict,
                   standard: dict | None) -> dict:
    """Each draft of ``evaluate.compare`` (label: speculators-format directory, e.g. one trained
    by speculators' own Trainer or a published one) measured as the run's draft is: offline on
    the held-out split and on the standard benchmarks in vLLM. No gate: they are references."""
    from draftline.evaluate.offline import evaluate_offline
    from draftline.evaluate.rollout import DraftRunner, Eagle3Draft, load_draft

    out = {}
    for label, path in (cfg.evaluate.compare or {}).items():
        other = Path(str(path))
        check_features(other, extract)
        proposer = Eagle3Draft(DraftRunner(load_draft(other, cfg.model.path)))
        log.info("compared draft %s (%s): offline and on the benchmarks", label, other)
        out[str(label)] = {
            "draft": str(other), "sha256": artifacts.sha256_tree(other),
            "offline": evaluate_offline([proposer], samples, k, **stats)["eagle3"],
            "benchmarks": benchmarks.run(cfg, other, k, [], stats, plain_from=standard)}
    return out


def run(cfg: DictConfig) -> dict:
    import torch

    from draftline.evaluate.in_vllm import check_vllm_load
    from draftline.evaluate.offline import (
        ALIGNMENT,
        baseline_drafts,
        count_tokens,
        evaluate_offline,
        greedy_coverage,
        load_heldout,
    )
    from draftline.evaluate.rollout import DraftRunner, Eagle3Draft, load_draft, num_speculative_tokens
    from draftline.formats import TRAIN, VALIDATION, load_split
    from draftline.train.draft import load_verifier_head, read_verifier

    out_dir = config.stage_dir(cfg, "evaluate")
    train = artifacts.read_manifest(config.stage_dir(cfg, "train"))
    extract = artifacts.read_manifest(config.stage_dir(cfg, "extract"))
    prepare_dir = config.stage_dir(cfg, "prepare")
    prepared = artifacts.read_manifest(prepare_dir)
    draft = draft_dir(cfg, train)
    aux_ids = check_features(draft, extract)
    for label, other in (cfg.evaluate.compare or {}).items():  # before the hours of measuring
        check_features(Path(str(other)), extract)
    k = int(cfg.evaluate.steps or num_speculative_tokens(draft))
    torch.manual_seed(int(cfg.seed))

    _, head = load_verifier_head(read_verifier(cfg.model.path))  # [V, H]
    index = prepare_dir / prepared["index"]
    samples = load_heldout(prepared["shards"], load_split(index, VALIDATION), head,
                                      cfg.evaluate.max_samples)
    unigram, bigram = count_tokens(prepared["shards"], load_split(index, TRAIN),
                                              head.shape[0])
    model = load_draft(draft, cfg.model.path)
    runner = DraftRunner(model)
    proposers = [Eagle3Draft(runner), *baseline_drafts(unigram, bigram)]
    stats = dict(resamples=int(cfg.evaluate.bootstrap), level=float(cfg.evaluate.confidence),
                 seed=int(cfg.seed))
    offline = evaluate_offline(proposers, samples, k, **stats)

    skipped: list[dict] = []
    regenerated = artifacts.read_manifest(config.stage_dir(cfg, "regenerate"))
    on_target_text = regenerated["replies"] == "target"
    measured = measure_in_vllm(cfg, draft, k, samples, proposers[0], stats, skipped, on_target_text)
    standard = benchmarks.run(cfg, draft, k, proposers[1:], stats)
    compared = compare_drafts(cfg, extract, samples, k, stats, standard)
    vllm = None
    if cfg.evaluate.vllm_check:
        vllm = check_vllm_load(draft, cfg.model.path, k,
                                          trust_remote_code=bool(cfg.model.trust_remote_code))
    else:
        skipped.append({"what": "vLLM load check", "reason": "evaluate.vllm_check=false"})

    results = {
        "draft": str(draft), "k": k, "aux_layer_ids": aux_ids,
        "replies": "the target's own (regenerated)" if on_target_text else "the data's",
        "held_out_samples": len(samples), "alignment": ALIGNMENT,
        "ci": {"method": "percentile bootstrap over held-out samples (replies for vLLM)",
               "resamples": stats["resamples"], "level": stats["level"]},
        "offline": offline,
        "versus_best_baseline": gate.versus_best_baseline(offline, **stats),
        "baselines_from": "training-split assistant-token counts "
                          "(unigram mode; bigram argmax with unigram back-off)",
        "draft_vocab_coverage_of_greedy": greedy_coverage(samples, model.t2d, k),
        "in_vllm": measured, "vllm_load": vllm, "benchmarks": standard, "compared": compared,
    }
    results["gate"] = gate.judge(gate.read_floor(cfg, k), offline, cfg.evaluate.gate, cfg.evaluate.baseline_gate)
    artifacts.write_json(out_dir / "results.json", results)  # kept even when a check fails
    failures = vllm_failures(cfg, measured)
    if failures:
        raise RuntimeError("; ".join(failures))
    failures = gate.failures(results["gate"])
    if failures:
        raise gate.GateFailed("; ".join(failures), f"every number and the verdict are in {out_dir / 'results.json'}")
    return {
        **results, "results": "results.json", "skipped": skipped,
        "inputs": {name: artifacts.sha256_file(config.stage_dir(cfg, name) / artifacts.MANIFEST)
                   for name in ("train", "extract", "prepare", "regenerate")},
    }
