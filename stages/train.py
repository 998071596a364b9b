"""train: an EAGLE-3 draft with speculators' Eagle3DraftModel on the prepared shards.

    make train EXP=tiny          # or: python -m stages.train experiment=tiny
    make train EXP=tiny GPUS=2   # one process per GPU under torchrun (train.gpus=2)

Aux layer ids come from the extract manifest (what the data was made with), never from
config, so a draft cannot be trained on features from other layers than its config.json
names. Resumes from the latest complete checkpoint under <run_dir>/train/<key>/, where
the key hashes the train config (without the launch keys: a run resumes on another number
of GPUs) and the prepared data. The draft lands in <run_dir>/train/<key>/draft/, and
<run_dir>/draft is left a relative link to it (the latest run's draft; the manifest's
``draft`` names the key dir itself, which evaluate and serve read).

With ``train.gpus > 1`` or ``train.nodes > 1`` this process re-launches the stage under
torchrun (``draftline.pipeline.launch``) and exits with its status; rank 0 alone writes the stamp,
checkpoints, the draft and the manifest, so a run where any rank failed leaves no manifest.
"""

from __future__ import annotations

import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from draftline.pipeline import config, launch
from draftline.pipeline.stage import refuse_mistakes, run_stage
from draftline.train.run import link_draft, run, run_other_rank

log = logging.getLogger("draftline.train")


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    config.fill_from_local(cfg)  # every rank, not only the one that runs run_stage
    gpus, nodes = int(cfg.train.gpus), int(cfg.train.nodes)
    if (gpus > 1 or nodes > 1) and not launch.under_torchrun():
        overrides = list(HydraConfig.get().overrides.task)
        sys.exit(launch.relaunch("stages.train", overrides, gpus, nodes,
                                 cfg.train.rendezvous, run_id=f"draftline-{cfg.exp}"))
    world = launch.world()
    launch.quiet_other_ranks(world)
    if world.is_main:
        run_stage("train", cfg, lambda c: run(c, world))
        link = link_draft(cfg)
        log.info("draft: %s -> %s", link, link.readlink())
    else:
        run_other_rank(cfg, world)


if __name__ == "__main__":
    refuse_mistakes()
    main()
