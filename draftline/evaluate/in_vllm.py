"""The draft in vLLM itself: vLLM's speculative decoding of the held-out prompts against the
offline walk of the same replies (``vllm_vs_offline``), and vLLM's own config parser and Eagle3
loader reading the saved draft in a child process (``check_vllm_load``, what evaluate checks;
the parser alone, what training checks right after saving, is ``draftline.train.vllm_parse``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file

from draftline.train import vllm_parse

if TYPE_CHECKING:
    from draftline.evaluate.offline import Sample


def first_difference(stored: Sequence[int], produced: Sequence[int]) -> dict:
    """Where two token sequences part: the position and both tokens (None past an end)."""
    for i in range(max(len(stored), len(produced))):
        a = stored[i] if i < len(stored) else None
        b = produced[i] if i < len(produced) else None
        if a != b:
            return {"position": i, "stored": a, "vllm": b, "stored_length": len(stored),
                    "vllm_length": len(produced)}
    return {}


def vllm_vs_offline(replies: Sequence[tuple[Sample, int, int]], measured: Sequence[dict],
                    proposer, k: int, stats: dict) -> dict:
    """vLLM's own speculative decoding of each held-out prompt vs the offline walk of its reply.

    ``measured[i]`` is vLLM's decode of reply i's prompt
    (draftline.speculative.jobs.measure_replies): its tokens and the accepted draft tokens of every verification step.  Where the stored
    reply is the target's own greedy reply (``regenerate.replies=target``) vLLM reproduces it
    token for token (``text_mismatches`` counts and locates the replies where it did not) and
    verifies exactly the contexts the offline walk scores, so on the steps both take (vLLM
    also takes a last step that would run past the stored reply, which the walk cannot score)
    they give the same verdicts.  They agree when vLLM's tau and its acceptance at every
    position lie inside the offline CIs and the paired tau difference on the shared steps has
    a CI containing 0.  ``divergences`` lists, per reply, the first step where the verdicts
    differ (a near-tie in the draft's numerics flips one; from there on the two walks visit
    other positions, so later steps are not compared one to one).
    """
    from draftline.evaluate.offline import simulate
    from draftline.evaluate.stats import Counts, bootstrap, paired_difference

    if len(replies) != len(measured):
        raise ValueError(f"{len(measured)} vLLM decodes for {len(replies)} replies")
    full, shared, offline, mismatches, divergences = [], [], [], [], []
    for index, ((sample, a, b), decoded) in enumerate(zip(replies, measured, strict=True)):
        mask = torch.zeros_like(sample.loss_mask)
        mask[a:b] = True
        sim = simulate(proposer, [dataclasses.replace(sample, loss_mask=mask)], k)[0]
        walk_steps = sim.accepted[sim.steps]
        steps = torch.tensor(decoded["accepted"], dtype=torch.long)
        n = min(len(steps), len(walk_steps))
        differ = (steps[:n] != walk_steps[:n]).nonzero().flatten()
        if len(differ):  # after one other verdict the two visit other positions
            j = int(differ[0])
            divergences.append({"reply": index, "step": j, "of_steps": n,
                                "vllm_accepted": int(steps[j]), "offline_accepted": int(walk_steps[j])})
        full.append(steps)
        shared.append(steps[:n])
        offline.append(walk_steps[:n])
        stored = sample.input_ids[a:b].tolist()
        if decoded["tokens"] != stored:
            mismatches.append({"reply": index, **first_difference(stored, decoded["tokens"])})
    vllm_counts = Counts.from_lengths(full, k)
    shared_counts, off_counts = Counts.from_lengths(shared, k), Counts.from_lengths(offline, k)
    vllm_result, off_result = bootstrap(vllm_counts, **stats), bootstrap(off_counts, **stats)
    paired = paired_difference(shared_counts, off_counts, "tau", **stats)
    positions = [paired_difference(shared_counts, off_counts, f"p{j}", **stats)
                 for j in range(1, k + 1)]
    inside = off_result["tau_ci"][0] <= vllm_result["tau"] <= off_result["tau_ci"][1]
    # A position no vLLM step reached has no rate (NaN): nothing there to compare. Whether it
    # was reached is the position before's rate (0 in vLLM), which is compared; a deep draft
    # (k = 7) that never gets past position 4 must not read as disagreeing at 5, 6 and 7.
    inside_by_position = [math.isnan(rate) or lo <= rate <= hi for rate, (lo, hi) in
                          zip(vllm_result["acceptance"], off_result["acceptance_ci"], strict=True)]
    totals = vllm_counts.at_least.sum(0)
    return {"replies": len(full), "text_mismatches": len(mismatches), "mismatched": mismatches,
            "diverging_replies": len(divergences), "divergences": divergences,
            "shared_steps": int(shared_counts.at_least[:, 0].sum()),
            "vllm": vllm_result, "offline": off_result,
            # accepted at position j per verification step: vLLM's own per-position rate
            "vllm_unconditional": [float(totals[j]) / max(int(totals[0]), 1) for j in range(1, k + 1)],
            "offline_unconditional": [float(off_counts.at_least[:, j].sum()) /
                                      max(int(off_counts.at_least[:, 0].sum()), 1) for j in range(1, k + 1)],
            "paired_difference": paired, "paired_by_position": positions,
            # stats.Counts per reply ([replies][k + 1]: steps, steps with >= j accepted):
            # what a comparison of two drafts on the same replies pairs
            "counts_per_reply": vllm_counts.at_least.tolist(),
            "vllm_tau_inside_offline_ci": inside, "vllm_acceptance_inside_offline_ci": inside_by_position,
            "agrees": inside and all(inside_by_position) and paired["agrees"]}


# --------------------------------------------------------------------------- vLLM loadability


def vllm_name(name: str) -> tuple[str, str]:
    """Where vLLM 0.16's Eagle3LlamaForCausalLM.load_weights puts a saved tensor.

    Returns (parameter name, kind): the replica of its mapping --
    t2d skipped, d2t -> draft_id_to_target_id, lm_head kept, the rest under ``model.``
    with q/k/v stacked into qkv_proj and gate/up into gate_up_proj.
    """
    if "t2d" in name:
        return "", "ignored"
    if name == "mask_hidden":  # a parallel draft's: a buffer of the model itself, [1, 3H]
        return name, "direct"
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id"), "direct"
    if "lm_head" not in name:
        name = "model." + name
    for part, stacked in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                          (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):
        if part in name:
            return name.replace(part, stacked), part.strip(".")
    return name, "direct"


def compare_loaded(params: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> dict:
    """Check every saved tensor landed (by value) in vLLM's parameters and every parameter was filled."""
    filled: set[str] = set()
    placed, ignored = [], []
    stacks: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in sorted(saved.items()):
        target, kind = vllm_name(name)
        if kind == "ignored":
            ignored.append(name)
            continue
        if target not in params:
            raise ValueError(f"saved tensor {name} maps to {target}, which vLLM's draft does not have")
        if kind == "direct":
            # Vocab-parallel layers may pad rows to a multiple of 64: compare the saved rows.
            held = params[target][: tensor.shape[0]] if tensor.dim() else params[target]
            if not torch.equal(held, tensor):  # by value (torch.equal promotes dtypes)
                raise ValueError(f"{name}: vLLM holds other values")
            filled.add(target)
        else:
            stacks.setdefault(target, []).append((kind, tensor))
        placed.append(name)
    order = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}
    for target, parts in stacks.items():
        stacked = torch.cat([t for _, t in sorted(parts, key=lambda p: order[p[0]])])
        if not torch.equal(params[target], stacked):
            raise ValueError(f"{target}: vLLM holds other values")
        filled.add(target)
    unfilled = sorted(set(params) - set(filled))
    if unfilled:
        raise ValueError(f"vLLM draft parameters no saved tensor filled: {unfilled}")
    return {"placed": placed, "ignored_by_vllm": ignored, "parameters": sorted(filled)}


# pragma: no mutate start  (vLLM's loader: the vLLM tier runs it, `make mutation` does not)
def _vllm_load_in_process(draft_dir: str, target_dir: str, k: int, trust_remote_code: bool) -> dict:
    """vLLM's own path: EngineArgs -> VllmConfig (speculators config parsing), get_model(draft)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model

    from draftline import engine as engines

    parsed = vllm_parse.read_with_vllm(draft_dir)
    # the speculative config evaluate and serve run: parallel_drafting for a parallel draft
    engine = EngineArgs(model=target_dir, speculative_config=engines.speculative_config(draft_dir, k),
                        trust_remote_code=trust_remote_code, enforce_eager=True)
    vllm_config = engine.create_engine_config()
    with tempfile.TemporaryDirectory() as rendezvous:
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{rendezvous}/init")
        ensure_model_parallel_initialized(1, 1)
        with set_current_vllm_config(vllm_config):
            model = get_model(vllm_config=vllm_config,
                              model_config=vllm_config.speculative_config.draft_model_config)
    params = {n: p.detach().cpu() for n, p in model.named_parameters()}
    if getattr(model, "use_parallel_drafting", False):  # loaded into a buffer, not a parameter
        params["mask_hidden"] = model.mask_hidden.detach().cpu().view(-1)
    saved = load_file(str(Path(draft_dir) / "model.safetensors"))
    # vLLM casts to its model dtype when loading; compare in that dtype.
    saved = {k: v.to(params[vllm_name(k)[0]].dtype) if vllm_name(k)[0] in params else v
             for k, v in saved.items()}
    return {
        "model_class": type(model).__name__,
        **parsed,
        "num_speculative_tokens": int(vllm_config.speculative_config.num_speculative_tokens),
        "method": vllm_config.speculative_config.method,
        **compare_loaded(params, saved),
    }


def check_vllm_load(draft_dir: str | Path, target_dir: str | Path, k: int, *,
                    trust_remote_code: bool = False, timeout: float = 900) -> dict:
    """Run the vLLM load check in a child process (vLLM sets up process-global state).

    Raises with the child's output when vLLM cannot parse or load the draft.
    """
    command = [sys.executable, "-m", "draftline.evaluate.in_vllm", "vllm-load",
               str(Path(draft_dir).absolute()), str(Path(target_dir).absolute()), str(k)]
    if trust_remote_code:
        command.append("--trust-remote-code")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
                            cwd=Path(__file__).resolve().parents[2])
    if result.returncode != 0:
        raise RuntimeError(f"vLLM could not load {draft_dir}:\n{result.stderr[-6000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    """``python -m draftline.evaluate.in_vllm vllm-load DRAFT TARGET K [--trust-remote-code]``: one JSON line."""
    if len(argv) < 4 or argv[0] != "vllm-load":
        raise SystemExit(main.__doc__)
    report = _vllm_load_in_process(argv[1], argv[2], int(argv[3]), "--trust-remote-code" in argv[4:])
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
# pragma: no mutate end
