"""speculators' hidden-state generator on the run's target, started the one way extract and
the rehearsal start it."""

from __future__ import annotations

import os

from omegaconf import DictConfig

from draftline import engine
from draftline.extract import preflight, writer


def make_generator(cfg: DictConfig):
    """The generator with the project's one set of engine options (draftline.engine; their
    environment is set before vLLM is imported) and, under ``extract.writer=rank0``, rank 0's
    shard buffers and writer thread (patches/speculators/0008)."""
    options = engine.engine_options(cfg, cfg.extract)
    os.environ.update(options.environment())
    from speculators.data_generation import VllmHiddenStatesGenerator

    generator = VllmHiddenStatesGenerator(
        str(cfg.model.path), layer_ids=list(cfg.model.aux_layer_ids),
        # Cast (fp8: quantized) in the engine's worker, on its device, so no byte leaves it in
        # the model's dtype (patches/speculators/0006).
        hidden_states_dtype=str(cfg.extract.save_dtype),
        **engine.generator_kwargs(options,
                                  max_num_batched_tokens=int(cfg.extract.max_num_batched_tokens)))
    if cfg.extract.writer == preflight.RANK0:
        try:
            generator.open_shard_writer(preflight.buffer_tokens(cfg), writer.WRITER,
                                        preflight.NUM_BUFFERS, preflight.writer_timeout(cfg))
        except BaseException:
            generator.shutdown()
            raise
    return generator
