"""The aux hidden states a served target hands its draft, read inside vLLM's worker.

``LLM.apply_model(install)`` hooks the target model's forward in each worker: every forward
that returns (hidden states, aux hidden states), as a target with an EAGLE-3 draft does, keeps
a CPU copy of the aux list; ``LLM.apply_model(take)`` removes the hook and returns them, one
list per forward (and per rank). Outputs are unchanged. For tests and benchmarks only
(``apply_model`` pickles these functions: vLLM needs VLLM_ALLOW_INSECURE_SERIALIZATION=1).
"""


def install(model) -> int:
    captured = []

    def hook(_module, _args, output):
        if isinstance(output, tuple):
            # copied to the CPU: the engine's answer crosses to the caller's process (and a
            # CUDA graph's output buffer is reused by its next replay)
            captured.append([h.detach().to("cpu", copy=True) for h in output[1]])

    model._draftline_capture = captured
    model._draftline_capture_hook = model.register_forward_hook(hook)
    return len(captured)


def take(model) -> list:
    model._draftline_capture_hook.remove()
    return model._draftline_capture
