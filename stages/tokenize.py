"""tokenize: conversations -> token ids, assistant loss masks, token frequencies, d2t/t2d.

    make tokenize EXP=tiny          # or: python -m stages.tokenize experiment=tiny

Run as a module: a script named tokenize.py would shadow the standard library's tokenize.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftline.pipeline.stage import refuse_mistakes, run_stage
from draftline.tokenize.run import run


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_stage("tokenize", cfg, run)


if __name__ == "__main__":
    refuse_mistakes()
    main()
