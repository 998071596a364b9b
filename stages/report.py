"""report: one self-contained HTML page of a run, plus its PNG figures.

    make report EXP=tiny-trained          # or: python -m stages.report experiment=tiny-trained

Reads only manifests (and the training data's vocab counts, the train log for per-TTT curves);
writes <run_dir>/report/index.html with the figures embedded, and the same figures as PNGs.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftline.pipeline.stage import refuse_mistakes, run_stage
from draftline.report.run import run


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_stage("report", cfg, run)


if __name__ == "__main__":
    refuse_mistakes()
    main()
