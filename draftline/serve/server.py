"""`make serve`'s server: the `vllm serve` command line of the run's target and draft, the
refusal of an address beyond loopback without a key, and ``serve/command.json``.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from omegaconf import DictConfig

from draftline.pipeline import artifacts, config

log = logging.getLogger("draftline.serve")


API_KEY = "VLLM_API_KEY"  # vLLM reads it from the environment: it never enters argv or a file


# Inside the compose service the container's own network is private: its published port decides
# who can reach it (the host's loopback unless DRAFTLINE_SERVE_HOST says otherwise).
IN_CONTAINER = "DRAFTLINE_SERVE_IN_CONTAINER"


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def check_exposure(host: str, extra_args: list[str], environ=os.environ) -> None:
    """Refuse a server reachable beyond this machine without a key, and a key on the command
    line (it would land in serve/command.json, the log and the process list)."""
    if any(arg == "--api-key" or arg.startswith("--api-key=") for arg in extra_args):
        raise ValueError(f"serve.extra_args holds --api-key, which would be written to "
                         f"serve/command.json, the log and the process list: set {API_KEY} in the "
                         "environment instead (vLLM reads it there)")
    if is_loopback(host) or environ.get(IN_CONTAINER) == "1" or environ.get(API_KEY):
        return
    raise ValueError(f"serve.host={host} listens beyond this machine with no API key: set {API_KEY} "
                     f"in the environment (vLLM then requires it of every request), or keep "
                     f"serve.host=127.0.0.1")


def server_command(cfg: DictConfig) -> tuple[list[str], dict[str, str], list[dict]]:
    """The `vllm serve` argv, the environment it needs, and what it runs differently from
    the engine evaluate measured (with why), checked before anything starts."""
    from draftline import engine
    from draftline.evaluate.rollout import num_speculative_tokens
    from draftline.speculative import jobs

    train = artifacts.read_manifest(config.stage_dir(cfg, "train"))
    draft = Path(cfg.serve.draft or train["draft"])
    if not (draft / "config.json").is_file():
        raise FileNotFoundError(f"{draft}/config.json missing: no trained draft to serve")
    check_exposure(str(cfg.serve.host), [str(a) for a in cfg.serve.extra_args])
    k = int(cfg.serve.steps or num_speculative_tokens(draft))
    options = engine.engine_options(cfg, cfg.serve)
    command = jobs.serve_command(options, draft.absolute(), k, host=str(cfg.serve.host),
                                    port=int(cfg.serve.port), extra=list(cfg.serve.extra_args))
    # `vllm serve` through this interpreter: the venv's console script may not be on PATH.
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", *command[1:]]
    return command, options.environment(), engine.serving_differences(options)


def write_command(cfg: DictConfig, command: list[str], env: dict[str, str],
                  differences: list[dict]) -> None:
    """serve/command.json and the log lines: what runs and how it differs from the engine
    evaluate measured, without the environment's secrets (the key travels only in this
    process's environment, which the server inherits)."""
    artifacts.write_json(config.stage_dir(cfg, "serve") / "command.json",
                         {"command": command, "environment": env,
                          "differences_from_evaluate": differences})
    for d in differences:
        log.info("serving with %s=%s (evaluate measured %s=%s): %s", d["setting"], d["serve"],
                 d["setting"], d["evaluate"], d["why"])
    log.info("exec: %s", " ".join(command))
