"""prepare: validate the extracted shards, split by sample, write the trainer's index.

    make prepare EXP=tiny          # or: python -m stages.prepare experiment=tiny
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftline.pipeline.stage import refuse_mistakes, run_stage
from draftline.prepare.run import run


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_stage("prepare", cfg, run)


if __name__ == "__main__":
    refuse_mistakes()
    main()
