"""The evaluate gate in one place: the verdict on a trained draft (``judge``: its tau CI above
every baseline's, and at or above the experiment's floor where one is recorded), why a
verdict failed (``gate_failures``), the config check of ``evaluate.baseline_gate``
(``check_config``, run by ``config.check`` before any stage starts) and the gate's words in
``make status`` (``lines``, ``planned``). Light to import: Make's parse reaches it."""

from __future__ import annotations

from omegaconf import DictConfig

from draftline import errors
from draftline.errors import UserConfigError
from draftline.pipeline import artifacts


def read_floor(cfg: DictConfig, k: int) -> dict | None:
    """This experiment's entry of the floor file (``evaluate.gate``), or None; its k must be
    the evaluated k."""
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


class GateFailed(errors.UserError, RuntimeError):
    """The trained draft does not beat its baselines, or is below its experiment's tau floor."""


DRAFT = "eagle3"  # the trained draft's name among the offline results; the others are baselines


def best_baseline(offline: dict) -> str:
    """The baseline with the highest tau."""
    return max((name for name in offline if name != DRAFT), key=lambda name: offline[name]["tau"])


def judge(floor: dict | None, offline: dict, floor_file: str | None, baseline_gate: DictConfig | dict) -> dict:
    """The gate's verdict on the offline results; it raises nothing (``gate_failures`` says why
    a checked verdict failed).

    * baseline (on by default, every experiment): the draft's tau CI lies wholly above every
      baseline's tau CI on the same held-out samples, so a draft that learned no more than
      token counts fails on any machine. An experiment turns it off only with a reason
      (``evaluate.baseline_gate.off_because``, required by config.check), kept in the verdict.
    * floor (where ``evaluate.gate`` records one for the experiment): tau at or above it.
    """
    draft, best = offline[DRAFT], best_baseline(offline)
    highest = max(result["tau_ci"][1] for name, result in offline.items() if name != DRAFT)
    beats = draft["tau_ci"][0] > highest
    baseline = {"checked": bool(baseline_gate["enabled"]), "best": best, "best_tau": offline[best]["tau"],
                "best_tau_ci": offline[best]["tau_ci"], "tau_ci": draft["tau_ci"],
                "highest_baseline_ci_bound": highest}
    if baseline["checked"]:
        baseline["passed"] = beats
    else:
        baseline.update(off_because=str(baseline_gate["off_because"]), would_pass=beats)
    floor_verdict = {"checked": floor is not None, "file": floor_file}
    if floor is not None:
        floor_verdict.update(tau_min=float(floor["tau_min"]), tau=draft["tau"],
                             passed=draft["tau"] >= float(floor["tau_min"]))
    checked = [v for v in (baseline, floor_verdict) if v["checked"]]
    return {"checked": bool(checked), "passed": all(v["passed"] for v in checked),
            "baseline": baseline, "floor": floor_verdict}


def failures(verdict: dict) -> list[str]:
    """Why a checked verdict failed, one sentence per failed check."""
    failures, baseline, floor = [], verdict["baseline"], verdict["floor"]
    if baseline["checked"] and not baseline["passed"]:
        low, high = baseline["tau_ci"]
        best_low, best_high = baseline["best_tau_ci"]
        failures.append(
            f"the draft's tau CI [{low:.3f}, {high:.3f}] does not lie above the {baseline['best']} "
            f"baseline's CI [{best_low:.3f}, {best_high:.3f}] on the same held-out samples: it predicts "
            "no better than token counts (too little training or data, or features from other layers); "
            "an experiment where that is expected may set evaluate.baseline_gate.enabled=false with "
            "evaluate.baseline_gate.off_because=<why>")
    if floor["checked"] and not floor["passed"]:
        failures.append(f"tau {floor['tau']:.3f} of the trained draft is below the floor "
                        f"{floor['tau_min']} recorded in {floor['file']}: the draft regressed")
    return failures


def versus_best_baseline(offline: dict, resamples: int, level: float, seed: int) -> dict:
    """The draft's tau minus the best baseline's, paired over the same held-out samples."""
    import torch

    from draftline.evaluate.stats import Counts, paired_difference

    best = best_baseline(offline)
    draft, base = (Counts(torch.tensor(offline[name]["counts_per_sample"], dtype=torch.long))
                   for name in (DRAFT, best))
    difference = paired_difference(draft, base, "tau", resamples, level, seed)
    return {"baseline": best, "difference": difference["difference"], "ci": difference["ci"]}


def check_config(gate: DictConfig) -> None:
    """evaluate.baseline_gate: a bool, and off only with a stated reason."""
    if not isinstance(gate.enabled, bool):
        raise UserConfigError(f"evaluate.baseline_gate.enabled={gate.enabled!r} is not true or false",
                              "the baseline gate is on (true) unless an experiment turns it off (false)")
    if not gate.enabled and not str(gate.off_because or "").strip():
        raise UserConfigError("evaluate.baseline_gate.enabled=false needs evaluate.baseline_gate.off_because",
                              "say why this experiment's draft may lose to token counts (a random tiny "
                              "target, for one); make status and the report show it")


def lines(gate: dict) -> list[str]:
    """evaluate's gate verdict (judge) in words: what it checked, and why a
    check is off."""
    baseline, floor = gate.get("baseline"), gate.get("floor") or {}
    if not isinstance(baseline, dict):  # a manifest from before the baseline gate
        return ["passed" if gate.get("passed") else "not checked"]
    best = f"{baseline['best']} [{baseline['best_tau_ci'][0]:.3f}, {baseline['best_tau_ci'][1]:.3f}]"
    lines = [f"{'passed' if gate['passed'] else 'FAILED'}" if gate["checked"] else "not checked"]
    lines.append(f"tau CI above the best baseline's, {best}" if baseline["checked"] else
                 f"baseline check off: {baseline['off_because']} (best baseline {best})")
    if floor.get("checked"):
        lines.append(f"floor {floor['tau_min']} ({floor['file']})")
    return ["; ".join(lines)]


def planned(evaluate: dict) -> str:
    """What evaluate will hold the draft to, from its stamped config (before it has run)."""
    baseline = evaluate.get("baseline_gate") or {}
    if baseline.get("enabled", True):
        return "evaluate fails unless the draft's tau CI lies above the baselines' (evaluate.baseline_gate)"
    return f"baseline check off: {baseline.get('off_because')}"
