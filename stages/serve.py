"""serve: `vllm serve` of the run's target with its trained EAGLE-3 draft (OpenAI-compatible API).

    make serve EXP=tiny-trained           # or: python -m stages.serve experiment=tiny-trained
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \
         -d '{"model": "<target path>", "prompt": "def ", "max_tokens": 32}'

The patched vLLM (patches/vllm/) serves DeepseekV3 and Kimi-K2.5 targets and runs on the CPU
engine too, where it is slow: for trying the API, not for speed. The command is written to
runs/<EXP>/serve/command.json, then this process becomes the server. It listens on loopback
(serve.host: 127.0.0.1); another address needs an API key in VLLM_API_KEY, which vLLM reads from
the environment and the project never writes (`-H "Authorization: Bearer $VLLM_API_KEY"`).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftline.pipeline.stage import refuse_mistakes
from draftline.serve.run import run


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    refuse_mistakes()
    main()
