"""Import-only placeholder for SGLang's CUDA kernel package, for SGLang on CPU.

Installed by ``tools/setup.sh --sglang`` into ``.venv-sglang`` only. SGLang imports
``sgl_kernel`` unconditionally in a few modules (host memory pool, allocator); PyPI's
``sgl-kernel`` / ``sglang-kernel`` wheels are CUDA builds that fail to import on a CPU
machine. Every attribute and submodule of this package resolves, and calling any of them
raises, so a CPU server that reached a kernel fails loudly instead of computing
something wrong. ``torch.ops.sgl_kernel`` stays empty, so SGLang detects no CPU (AMX)
kernels and takes its plain-torch paths.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

PLACEHOLDER = True


class _Unavailable:
    """Stands for any kernel: resolves every attribute, raises when called."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "_Unavailable":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._name} was called, but sgl_kernel here is moe-rl's CPU placeholder "
            "(tools/sglang_cpu): this SGLang path needs the CUDA kernels"
        )

    def __repr__(self) -> str:
        return f"<sgl_kernel placeholder {self._name}>"


def _module_getattr(module_name: str):
    def __getattr__(attr: str) -> _Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{module_name}.{attr}")

    return __getattr__


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes every ``sgl_kernel.x.y`` importable as another placeholder module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module) -> None:
        return None


__getattr__ = _module_getattr(__name__)
sys.meta_path.append(_SubmoduleFinder())
