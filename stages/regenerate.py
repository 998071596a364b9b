"""regenerate: the target's own greedy replies in place of the data's (optional), then d2t/t2d.

    make regenerate EXP=tiny-trained     # or: python -m stages.regenerate experiment=tiny-trained

``regenerate.replies``: ``data`` keeps tokenize's samples and vocabulary (the manifest points
at them, nothing is copied); ``target`` replaces every assistant reply with the target's greedy
reply through vLLM (draftline/regenerate/greedy.py) and recomputes the draft vocabulary from the
new replies.  Downstream stages read samples and vocabulary from this stage's manifest.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftline.pipeline.stage import refuse_mistakes, run_stage
from draftline.regenerate.run import run


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_stage("regenerate", cfg, run)


if __name__ == "__main__":
    refuse_mistakes()
    main()
