"""The seed's failure, injected on purpose (tests/test_rehearse.py): with this directory on
PYTHONPATH every Python process (vLLM's spawned workers too) imports this file at start-up, and
once speculators' capture worker is imported, its aux-capture hook receives the decoder layer's
arguments swapped (hidden_states where positions belong, and back), as the seed's custom
worker called the layer. Nothing installed is edited: the module is patched as it loads.
"""

import importlib.abc
import importlib.util
import sys

CAPTURE_MODULE = "speculators.data_generation.custom_worker"


def break_capture(module) -> None:
    hook = module._LayerInputHook
    capture = hook.__call__

    def broken_capture_call(self, layer, args, kwargs):
        positions, hidden_states, *rest = args
        return capture(self, layer, (hidden_states, positions, *rest), kwargs)  # arguments swapped

    hook.__call__ = broken_capture_call


class BreakOnImport(importlib.abc.MetaPathFinder):
    """Finds the capture module the normal way, then patches it right after it executes."""

    def find_spec(self, name, path, target=None):
        if name != CAPTURE_MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        execute = spec.loader.exec_module

        def execute_and_break(module):
            execute(module)
            break_capture(module)

        spec.loader.exec_module = execute_and_break
        return spec


sys.meta_path.insert(0, BreakOnImport())
