"""serve's stage: the run's target with its trained draft under `vllm serve` (``server``'s
command line), written to serve/command.json; then this process becomes the server.

Unlike the other stages it leaves no manifest and does not return: ``run`` ends in
``os.execve`` of the server, which inherits this process's environment (and so the API key,
which is never written).
"""

from __future__ import annotations

import logging
import os
import sys

from omegaconf import DictConfig

from draftline.pipeline import config
from draftline.serve.server import API_KEY, server_command, write_command

log = logging.getLogger("draftline.serve")


def run(cfg: DictConfig) -> None:
    import torch

    config.fill_from_local(cfg)  # as `make` stamping composed it (run_stage does it for the others)
    command, env, differences = server_command(cfg)
    if not torch.cuda.is_available():
        log.warning("no GPU: serving on vLLM's CPU engine, which is slow (for trying the API, "
                    "not for measuring speed)")
    write_command(cfg, command, env, differences)
    if os.environ.get(API_KEY):
        log.info("requests need the API key in %s (not written anywhere)", API_KEY)
    os.execve(sys.executable, command, {**os.environ, **env})
