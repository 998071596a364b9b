"""A fault injected into one TP rank, for tests: never on the path of a real run.

Put this directory on PYTHONPATH and every Python process started with it (the stage, vLLM's
engine core, its spawned workers) imports it at start-up. With DRAFTLINE_FAULT set to
``module:Class.method`` the method, once its module is imported, raises in the process whose
``self.rank`` is DRAFTLINE_FAULT_RANK, on its DRAFTLINE_FAULT_AFTER-th call (0: the first), and
writes the time it raised to DRAFTLINE_FAULT_STAMP; with DRAFTLINE_FAULT_MODE=hang it sleeps
there instead, for ever (a rank that hangs without raising). Installed files are never edited
(uv hard-links the venv to its cache).
"""

import importlib.abc
import importlib.util
import os
import sys
import time

FAULT = os.environ.get("DRAFTLINE_FAULT")


class InjectedFault(RuntimeError):
    """The failure a test asked for."""


def _wrap(owner, name: str) -> None:
    original = getattr(owner, name)
    rank = int(os.environ.get("DRAFTLINE_FAULT_RANK", "1"))
    after = int(os.environ.get("DRAFTLINE_FAULT_AFTER", "0"))
    calls = [0]

    def faulty(self, *args, **kwargs):
        if getattr(self, "rank", None) == rank:
            calls[0] += 1
            if calls[0] > after:
                stamp = os.environ.get("DRAFTLINE_FAULT_STAMP")
                if stamp:
                    with open(stamp, "w") as f:
                        f.write(repr(time.time()))
                if os.environ.get("DRAFTLINE_FAULT_MODE") == "hang":
                    print(f"injected hang in {FAULT} on TP rank {rank} (call {calls[0]})",
                          file=sys.stderr, flush=True)
                    while True:
                        time.sleep(3600)
                raise InjectedFault(f"injected fault in {FAULT} on TP rank {rank} (call {calls[0]})")
        return original(self, *args, **kwargs)

    setattr(owner, name, faulty)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the method right after its module has been executed."""

    def __init__(self, module: str, path: str):
        self.module, self.path = module, path

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader, path_ = spec.loader, self.path

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                owner_name, _, method = path_.rpartition(".")
                _wrap(getattr(module, owner_name), method)

        spec.loader = Loader()
        return spec


if FAULT:
    _module, _, _path = FAULT.partition(":")
    sys.meta_path.insert(0, _Finder(_module, _path))
