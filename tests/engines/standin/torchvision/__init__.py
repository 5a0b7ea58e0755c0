"""A stand-in for torchvision in vllm_serve.py's vision-language runs, put on PYTHONPATH only where torchvision
is not importable (the registry's wheel is a CUDA build that fails next to CPU torch; CI's vLLM venv drops it).

vLLM's Qwen2-VL / Qwen3-VL modules import transformers' image processors, which import torchvision at module
level; vLLM inspects each model class in a subprocess, so a stand-in in ``sys.modules`` would not reach it.
Every ``torchvision.*`` module is a placeholder and every name in it a placeholder class (callable,
subclassable, its attributes placeholders too). Text-only serving calls none of them; a call that reached one
would get an empty object, not torchvision's result.
"""
import importlib.abc
import importlib.machinery
import sys
import types


class _Placeholder(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any ``torchvision.<sub>`` import: a placeholder package."""

    def find_spec(self, name, path, target=None):
        if name.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _Module
__version__ = "0.0.0+stand-in"
