"""evaluate: acceptance of the trained draft on the held-out split, baselines, in vLLM, vLLM load.

    make evaluate EXP=tiny-trained          # or: python -m stages.evaluate experiment=tiny-trained

Writes ``results.json`` (all numbers and the gate's verdict) and then applies the gate: the
draft's tau CI must lie above every baseline's (``evaluate.baseline_gate``, on unless an
experiment turns it off with a reason) and at or above the experiment's floor where
``evaluate.gate`` records one (tests/assets/tau_gate.json: the embedded run). A failed check
fails the stage and leaves no manifest, so ``make`` stops, while results.json still shows what
was measured.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftline.evaluate.run import run
from draftline.pipeline.stage import refuse_mistakes, run_stage


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_stage("evaluate", cfg, run)


if __name__ == "__main__":
    refuse_mistakes()
    main()
