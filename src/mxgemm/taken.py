"""Modules mxgemm takes in place (gated MLPs, attention modules, MoE blocks): the module's class becomes a subclass of
its own, of the same name and module, holding mxgemm's forward; parameters, buffers and state dict stay as they were.
Such a subclass is made at run time and found by no name, so its instances pickle and copy as instances of the class
they were made from, taken again when loaded. And the forward hooks that make mxgemm's forward step aside."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["global_hooks", "hooked", "hooked_inside", "same_name_subclass"]


def same_name_subclass(cls: type, make: Callable[..., type], args: tuple, namespace: dict) -> type:
    """A subclass of ``cls`` of its name, module and docstring with ``namespace``; ``make(*args)`` makes it again
    (a function of a module, cached: each call the same class) where a pickle or copy is loaded."""

    def __reduce_ex__(self, protocol):
        _, _, *rest = cls.__reduce_ex__(self, protocol)
        return (_remade, (make, args), *rest)

    attrs = {"__module__": cls.__module__, "__doc__": cls.__doc__, "__reduce_ex__": __reduce_ex__, **namespace}
    return type(cls.__name__, (cls,), attrs)


def _remade(make: Callable[..., type], args: tuple) -> nn.Module:
    made = make(*args)
    return made.__new__(made)


def global_hooks() -> bool:
    """Forward hooks registered for every module (``nn.modules.module.register_module_forward_hook``)."""
    state = nn.modules.module
    return bool(getattr(state, "_global_forward_hooks", None) or getattr(state, "_global_forward_pre_hooks", None))


def hooked(module: nn.Module) -> bool:
    """Forward hooks on ``module`` itself."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def hooked_inside(module: nn.Module) -> bool:
    """Forward hooks that a forward of mxgemm's could skip or run out of turn: on a module inside ``module``, or on
    every module."""
    return global_hooks() or any(hooked(m) for m in module.modules() if m is not module)
