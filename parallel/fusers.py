"""megatron-core's ``jit_fuser`` on a CPU-only build of torch: its own no-op decorator.

megatron binds ``torch.compile`` as ``jit_fuser`` when ``megatron.core.jit`` is imported,
and some 50 helpers are decorated with it as their modules import, which imports
torch's compiler stack (dynamo, inductor: ~40 MiB of a process's memory, RSS measured on
the bench's run). On a machine without CUDA those helpers run eagerly anyway (the CPU
bridge sets ``torch.compiler.set_stance("force_eager")``), so with a torch built without
CUDA or ROCm megatron's ``disable_jit_fuser()`` runs right after its ``jit`` module
executes, before any helper is decorated. Builds with a GPU backend are left as they are.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

_JIT = "megatron.core.jit"


def run_megatron_fusers_eagerly_on_cpu_builds() -> None:
    """Install the import hook (idempotent; it acts at most once, at the first import of
    ``megatron.core.jit``; does nothing if megatron is already imported)."""
    if _JIT not in sys.modules and not any(isinstance(f, _DisableJitFuser) for f in sys.meta_path):
        sys.meta_path.insert(0, _DisableJitFuser())


def _cpu_only_build() -> bool:
    import torch

    return torch.version.cuda is None and torch.version.hip is None


class _DisableJitFuser(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` with the other finders and wraps its loader's
    ``exec_module`` to call the module's ``disable_jit_fuser()`` after it."""

    def find_spec(self, name: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if name != _JIT:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not _cpu_only_build():
            return spec
        spec.loader = _ThenDisable(spec.loader)
        return spec


class _ThenDisable(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        disable = getattr(module, "disable_jit_fuser", None)  # (a megatron without it: compiled as before)
        if disable is not None:
            disable()
