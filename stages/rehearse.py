"""rehearse: every engine code path of the run on a miniature of its target, and the run's cost.

    make rehearse EXP=kimi-k2.5     # or: python -m stages.rehearse experiment=kimi-k2.5

Runs after tokenize; regenerate (replies=target), extract, evaluate (in vLLM) and serve wait for
it when the target's weights exceed rehearse.min_target_gb (an order-only prerequisite: a
rerun of the rehearsal never makes their outputs stale). In order, each check logged with
PASS/FAIL and its seconds, the first failure ending the stage non-zero with its traceback:

  cost           the bytes extract will write, free disk where they go, the time at a known rate
  miniature      built from model.path's config.json and tokenizer (draftline/rehearse/miniature.py)
  extraction     a few samples through extract's path, each slot against transformers
  speculative    the draft in vLLM (evaluate's measurement), greedy = the plain engine's
  serve          `vllm serve` of miniature + draft answers one completion

Writes runs/<EXP>/rehearse/: the miniature, its random draft, the shards, the server log and
the manifest (checks, what was rehearsed and what was not, and why, the cost).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftline.pipeline.stage import refuse_mistakes, run_stage
from draftline.rehearse.run import run


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_stage("rehearse", cfg, run)


if __name__ == "__main__":
    refuse_mistakes()
    main()
