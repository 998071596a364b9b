"""serve: `vllm serve` of the run's target with its trained EAGLE-3 draft (OpenAI-compatible API).

    make serve EXP=tiny-trained           # or: python -m stages.serve experiment=tiny-trained
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \
         -d '{"model": "<target path>", "prompt": "def ", "max_tokens": 32}'

The patched vLLM (patches/vllm/) serves DeepseekV3 and Kimi-K2.5 targets and runs on the CPU
engine too, where it is slow: for trying the API, not for speed. The command is written to
runs/<EXP>/serve/command.json, then this process becomes the server.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from draftline.pipeline import artifacts, config

log = logging.getLogger("draftline.serve")


def server_command(cfg: DictConfig) -> tuple[list[str], dict[str, str]]:
    """The `vllm serve` argv and the environment it needs, checked before anything starts."""
    from draftline import serve
    from draftline.evaluate.rollout import num_speculative_tokens

    train = artifacts.read_manifest(config.stage_dir(cfg, "train"))
    draft = Path(cfg.serve.draft or train["draft"])
    if not (draft / "config.json").is_file():
        raise FileNotFoundError(f"{draft}/config.json missing: no trained draft to serve")
    k = int(cfg.serve.steps or num_speculative_tokens(draft))
    options = config.engine_options(cfg, cfg.serve)
    command = serve.serve_command(options, draft.absolute(), k, host=str(cfg.serve.host),
                                    port=int(cfg.serve.port), extra=list(cfg.serve.extra_args))
    # `vllm serve` through this interpreter: the venv's console script may not be on PATH.
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", *command[1:]]
    return command, options.environment()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    import torch

    command, env = server_command(cfg)
    if not torch.cuda.is_available():
        log.warning("no GPU: serving on vLLM's CPU engine, which is slow (for trying the API, "
                    "not for measuring speed)")
    artifacts.write_json(config.stage_dir(cfg, "serve") / "command.json",
                         {"command": command, "environment": env})
    log.info("exec: %s", " ".join(command))
    os.execve(sys.executable, command, {**os.environ, **env})


if __name__ == "__main__":
    main()
