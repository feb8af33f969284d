"""Test-only stand-in for SGLang's CUDA kernel package `sgl_kernel` (no CPU wheel exists).

SGLang imports names from it at module level; on a CPU without AMX it then takes its
pure-torch fallbacks, so nothing here runs on the tested paths. Every attribute, of this
package and of the submodules SGLang 0.5.23 imports unguarded (SUBMODULES), is a function
that raises naming itself, so a path that does reach a kernel fails loudly instead of
computing something else. Other submodules (`scalar_type`, `quantization`: SGLang guards
those imports and has fallbacks) stay missing.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+lockstep-cpu-shim"
SUBMODULES = ("allreduce", "elementwise", "flash_attn", "kvcacheio", "mamba", "speculative",
              "utils")


def _kernel(qualname: str):
    def missing(*args, **kwargs):
        raise RuntimeError(f"{qualname}: a CUDA kernel; the lockstep CPU test shim of "
                           f"sgl_kernel has none (this path needs a GPU build of SGLang)")
    missing.__qualname__ = qualname
    return missing


class _ShimModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _kernel(f"{self.__name__}.{name}")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `sgl_kernel.<sub>` (a SUBMODULES entry) as a _ShimModule."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + ".") and fullname.split(".")[1] in SUBMODULES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _ShimModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _SubmoduleFinder())
sys.modules[__name__].__class__ = _ShimModule
