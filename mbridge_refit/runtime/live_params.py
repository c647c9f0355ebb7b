"""The parameters an export reads, and noticing when the model replaces them.

An export plan is built once per model, but the model keeps changing under it: a checkpoint
reload or an offload framework replaces parameter objects (``load_state_dict(assign=True)``,
``module.weight = Parameter(...)``), and an optimizer swaps storages (``param.data = ...``).
Reading a parameter object kept from the first export would then return stale values.

* ``LiveParams`` holds the model's parameters by global name (the exporters read this one dict)
  and where each lives in the model (chunk, local name). ``refresh`` looks them up again only
  when some module somewhere registered a parameter, a buffer or a submodule since the last look
  (``registration_count``, a global counter bumped by torch's registration hooks: every
  ``setattr`` of a ``Parameter``, a registered buffer or a ``Module`` and every ``register_parameter``
  / ``register_buffer`` / ``register_module`` goes through them, ``load_state_dict(assign=True)``
  too), so the steady state costs one integer comparison per export. Replaced parameters are
  swapped into the same dict, in place.
* Some exported weights are buffers, not parameters: MoE routers' ``expert_bias`` (DeepSeek-V3's
  ``e_score_correction_bias``, GLM-4.5's, Kimi-K2's), kept in float32 and updated in place by
  Megatron's ``_update_router_expert_bias``. They are looked up where the module holds them, as
  parameters are, and on every refresh whatever the counter says: ``Module._apply`` (``.to()``,
  ``.cuda()``, ``.cpu()``, an offload's round trip) replaces buffers by writing the module's
  ``_buffers`` dict, which no hook sees (it swaps parameters' ``.data`` instead). A model holds few.
  ``.data`` swaps need nothing: the export reads each parameter's current storage every time.
* It refers to the model chunks weakly: holding these parameters keeps no module alive (the
  bridge drops them with the model, ``RefitBridge``'s per-model state).

A parameter replaced by one of another shape or dtype no longer fits the plan: ``refresh`` raises
``ModelChangedError`` naming it (build the plan anew: ``RefitBridge.forget_model()``). Writing into
a module's ``_parameters`` dict directly bypasses torch's hook and is not noticed.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch

from mbridge_refit.errors import InputError

__all__ = ["LiveParams", "ModelChangedError", "registration_count"]


class ModelChangedError(InputError):
    """A parameter the export plan describes was replaced by one the plan cannot read."""


_count = 0
_hook_handle: Any = None


def _on_registration(module: torch.nn.Module, name: str, value: Any) -> None:
    global _count
    _count += 1


def registration_count() -> int:
    """How many parameters, buffers and submodules any module has registered since the hooks were
    installed (by the first call): a changed count means some exported tensor object may have been
    replaced."""
    global _hook_handle
    if _hook_handle is None:
        from torch.nn.modules import module

        _hook_handle = (
            module.register_module_parameter_registration_hook(_on_registration),
            module.register_module_buffer_registration_hook(_on_registration),
            module.register_module_module_registration_hook(_on_registration),
        )
    return _count


class LiveParams:
    """This rank's parameters of one model, by global Megatron name, kept current (module docstring).

    ``params`` is one dict, shared with every exporter of the model; ``refresh`` updates it in
    place. Built from the bridge's conversion tasks (``param_name`` local to the unwrapped chunk
    ``vp_stage``); holds the chunks weakly.
    """

    def __init__(self, unwrapped: list[torch.nn.Module], tasks: Iterable[Any]) -> None:
        self._unwrapped = tuple(weakref.ref(chunk) for chunk in unwrapped)
        self._where: dict[str, tuple[int, tuple[str, ...], str]] = {}  # global name -> (chunk, module path, attribute)
        self.params: dict[str, torch.Tensor] = {}
        for task in tasks:
            if task is not None and task.param_weight is not None:
                *path, attribute = task.param_name.split(".")
                self._where[task.global_param_name] = (task.vp_stage or 0, tuple(path), attribute)
                self.params[task.global_param_name] = task.param_weight
        self._buffer_names = [
            name for name, tensor in self.params.items() if not isinstance(tensor, torch.nn.Parameter)
        ]
        self._seen = registration_count()

    def refresh(self) -> list[str]:
        """Swap in the parameters the model holds now, where it replaced them; returns their names.

        Looks up only the exported buffers unless something was registered anywhere since the last
        call. Raises ``ModelChangedError`` for a replacement of another shape, dtype or class."""
        count = registration_count()
        names: Iterable[str] = self._where if count != self._seen else self._buffer_names
        if not names:
            return []
        chunks = [ref() for ref in self._unwrapped]
        if any(chunk is None for chunk in chunks):
            raise ModelChangedError("the model these parameters belong to no longer exists: export a live model")
        replaced = []
        for name in names:
            stage, path, attribute = self._where[name]
            current = _held(chunks[stage], path, attribute)
            old = self.params[name]
            if current is not old:
                _check_fits(name, old, current)
                self.params[name] = current
                replaced.append(name)
        self._seen = count
        return replaced


def _held(chunk: torch.nn.Module, path: tuple[str, ...], attribute: str) -> Any:
    """The parameter (or buffer) the module at ``path`` holds as ``attribute`` now (the submodule dicts
    walked directly: ``get_parameter`` costs ~30x more per call); raises naming a path the model lost."""
    module = chunk
    try:
        for part in path:
            module = module._modules[part]
        held = module._parameters.get(attribute)
        held = held if held is not None else module._buffers[attribute]
        if held is None:  # a buffer set to None
            raise KeyError(attribute)
        return held
    except KeyError:
        raise ModelChangedError(
            f"the model no longer has the parameter {'.'.join((*path, attribute))}: build the plan anew for the changed "
            "model (bridge.forget_model() on every rank, then export)"
        ) from None


def _check_fits(name: str, old: torch.Tensor, new: torch.Tensor) -> None:
    if (tuple(new.shape), new.dtype, type(new)) != (tuple(old.shape), old.dtype, type(old)):
        raise ModelChangedError(
            f"parameter {name} was replaced by a {type(new).__name__} {list(new.shape)} {new.dtype}, where the export "
            f"plan describes a {type(old).__name__} {list(old.shape)} {old.dtype}: build the plan anew for the changed "
            "model (bridge.forget_model() on every rank, then export)"
        )
