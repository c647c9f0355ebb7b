"""The parameters an export reads, and noticing when the model replaces them.

An export plan is built once per model, but the model keeps changing under it: a checkpoint
reload or an offload framework replaces parameter objects (``load_state_dict(assign=True)``,
``module.weight = Parameter(...)``, ``module._parameters[k] = ...``), torch's own conversions
replace them too (``model.float()`` under ``torch.__future__.set_overwrite_module_params_on_conversion(True)``),
a module may be deleted, and an optimizer swaps storages (``param.data = ...``). Reading a
parameter object kept from the first export would then return stale values.

* ``LiveParams`` holds the model's parameters by global name (the exporters read this one dict)
  and where each lives in the model (chunk, local name). ``refresh`` looks them up again only
  when something was registered or written since the last look (``registration_count``, a global
  counter): torch's registration hooks bump it (every ``setattr`` of a ``Parameter``, a registered
  buffer or a ``Module``, every ``register_parameter`` / ``register_buffer`` / ``register_module``,
  ``load_state_dict(assign=True)`` too), and so does every write into the ``_parameters`` and
  ``_modules`` dicts of the modules on the way to an exported parameter, which ``LiveParams``
  replaces with dicts that count their writes (``_CountingDict``: item assignment, deletion,
  ``pop``, ``update``, ...; reads stay the plain dict's, in C; pickled and copied as a plain dict,
  so a saved model does not need this package to load). The steady state costs one integer
  comparison per export. Replaced parameters are swapped into the same dict, in place; a
  parameter or module deleted raises ``ModelChangedError`` naming it. A module dict reassigned
  whole (``module._modules = {...}``) is not seen until the next look, which counts it anew.
* Some exported weights are buffers, not parameters: MoE routers' ``expert_bias`` (DeepSeek-V3's
  ``e_score_correction_bias``, GLM-4.5's, Kimi-K2's), kept in float32 and updated in place by
  Megatron's ``_update_router_expert_bias``. They are looked up where the module holds them, as
  parameters are, and on every refresh whatever the counter says: ``Module._apply`` (``.to()``,
  ``.cuda()``, ``.cpu()``, an offload's round trip) replaces buffers by writing the module's
  ``_buffers`` dict, which no hook sees (it swaps parameters' ``.data`` instead). A model holds few.
* ``.data`` swaps keep the parameter object: the export reads each parameter's current storage
  (the exporter checks where its kept views point, ``runtime.exporter``). A swap that changes the
  dtype (``model.half()``, which swaps ``.data``; ``torch.utils.swap_tensors``) no longer fits the
  plan (pipeline receive buffers, FP8 plans and ``weight_dtype`` all take the plan's dtype), and
  a storage emptied in place (an offload's ``untyped_storage().resize_(0)``) cannot be read:
  ``check_in_place`` (C-level passes over the parameters' dtypes and data addresses, every export,
  before any collective) raises ``ModelChangedError`` naming the parameter.
* It refers to the model chunks weakly: holding these parameters keeps no module alive (the
  bridge drops them with the model, ``RefitBridge``'s per-model state).

A parameter replaced by one of another shape or dtype no longer fits the plan: ``refresh`` raises
``ModelChangedError`` naming it (build the plan anew: ``RefitBridge.forget_model()``).
"""

from __future__ import annotations

import collections
import operator
import weakref
from itertools import repeat
from typing import Any, Iterable, Mapping

import torch

from mbridge_refit.errors import InputError

__all__ = ["LiveParams", "ModelChangedError", "check_readable", "params_device", "registration_count"]

_FIX = "build the plan anew for the changed model (bridge.forget_model() on every rank, then export)"


class ModelChangedError(InputError):
    """A parameter the export plan describes was replaced, changed or removed so that the plan cannot read it."""


_count = 0
_hook_handle: Any = None


def _on_registration(module: torch.nn.Module, name: str, value: Any) -> None:
    global _count
    _count += 1


def _bump() -> None:
    global _count
    _count += 1


def registration_count() -> int:
    """How many parameters, buffers and submodules any module has registered since the hooks were
    installed (by the first call), plus the writes into the module dicts ``LiveParams`` counts: a
    changed count means some exported tensor object may have been replaced or removed."""
    global _hook_handle
    if _hook_handle is None:
        from torch.nn.modules import module

        _hook_handle = (
            module.register_module_parameter_registration_hook(_on_registration),
            module.register_module_buffer_registration_hook(_on_registration),
            module.register_module_module_registration_hook(_on_registration),
        )
    return _count


class _Counting:
    """Mixin: every write bumps ``registration_count``; reads are the base dict's own (C) methods."""

    __slots__ = ()

    def __setitem__(self, key, value):
        _bump()
        super().__setitem__(key, value)

    def __delitem__(self, key):
        _bump()
        super().__delitem__(key)

    def pop(self, *args):
        _bump()
        return super().pop(*args)

    def popitem(self, *args):
        _bump()
        return super().popitem(*args)

    def clear(self):
        _bump()
        super().clear()

    def update(self, *args, **kwargs):
        _bump()
        super().update(*args, **kwargs)

    def setdefault(self, key, default=None):
        _bump()
        return super().setdefault(key, default)

    def __ior__(self, other):
        _bump()
        return super().__ior__(other)

    def __reduce__(self):
        """Pickled, copied and deep-copied as the plain dict it stands for (no reference to this package)."""
        return (self._plain, (list(self.items()),))


class _CountingDict(_Counting, dict):
    __slots__ = ()
    _plain = dict


class _CountingOrderedDict(_Counting, collections.OrderedDict):
    __slots__ = ()
    _plain = collections.OrderedDict

    def move_to_end(self, *args, **kwargs):
        _bump()
        super().move_to_end(*args, **kwargs)


_COUNTING = {dict: _CountingDict, collections.OrderedDict: _CountingOrderedDict}
_WATCHED = ("_parameters", "_modules")


def _count_writes(module: torch.nn.Module) -> None:
    """Make ``module``'s ``_parameters`` and ``_modules`` dicts count their writes (in place of the
    plain ones, same contents); a dict of another type (a user's own) is left as it is."""
    state = module.__dict__
    for key in _WATCHED:
        current = state.get(key)
        counting = _COUNTING.get(type(current))
        if counting is not None:
            state[key] = counting(current)


_dtype = operator.attrgetter("dtype")
_data_ptr = torch.Tensor.data_ptr
_PLAIN = (torch.Tensor, torch.nn.Parameter)


class LiveParams:
    """This rank's parameters of one model, by global Megatron name, kept current (module docstring).

    ``params`` is one dict, shared with every exporter of the model; ``refresh`` updates it in
    place. Built from the bridge's conversion tasks (``param_name`` local to the unwrapped chunk
    ``vp_stage``); holds the chunks weakly, and makes the module dicts on the way to each exported
    tensor count their writes.
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
        self._dtypes = list(map(_dtype, self.params.values()))  # as planned, in ``params`` order
        self._moves = 0  # bumped by ``check_in_place`` where an address was not the last call's (``moves``)
        self._looked: tuple[int, list[Any]] | None = None  # (registration_count, tensors) of ``_check_held``'s look
        self._readable_from_now_on()
        self._paths = _path_tree(self._where.values())
        self._watch(unwrapped)
        self._seen = registration_count()

    def refresh(self) -> list[str]:
        """Swap in the parameters the model holds now, where it replaced them; returns their names.

        Looks up only the exported buffers unless something was registered or written anywhere
        since the last call; then every tensor, or takes what ``check_in_place`` just found where
        nothing was registered since it looked (one lookup per export, not two). Raises ``ModelChangedError`` for a replacement of another shape,
        dtype or class, and for a parameter the model no longer has."""
        count = registration_count()
        names: Iterable[str] = self._where if count != self._seen else self._buffer_names
        if not names:
            return []
        chunks = [ref() for ref in self._unwrapped]
        if any(chunk is None for chunk in chunks):
            raise ModelChangedError("the model these parameters belong to no longer exists: export a live model")
        looked, self._looked = self._looked, None
        if count != self._seen:
            self._watch(chunks)  # a dict reassigned whole (ModuleList.__delitem__ does) counts again
            held = looked[1] if looked is not None and looked[0] == count else self._held_now(chunks)
        else:
            held = [_held(chunks[stage], path, attribute) for stage, path, attribute in map(self._where.get, names)]
        replaced = []
        for name, current in zip(names, held):
            old = self.params[name]
            if current is not old:
                _check_fits(name, old, current)
                self.params[name] = current
                replaced.append(name)
        if replaced:
            self._readable_from_now_on()
        self._seen = registration_count()
        return replaced

    def check_in_place(self) -> None:
        """Raise ``ModelChangedError`` naming a parameter changed in place so that the plan cannot read
        it: its dtype is no longer the plan's (a ``.data`` swap: ``model.half()``,
        ``p.data = p.data.view(torch.float16)``, ``swap_tensors``), or its storage no longer holds its
        data (offloaded in place, ``untyped_storage().resize_(0)``); and, where something was
        registered or written since the last ``refresh``, what that ``refresh`` will raise (a
        parameter deleted, or replaced by one the plan cannot read), so that a change made on one
        rank only is refused on every rank. Two C-level passes over the parameters (dtypes, data
        addresses; a moved address is looked at once, in Python) and one integer comparison; call it
        once per export, before any collective."""
        if registration_count() != self._seen:
            self._check_held()
        if list(map(_dtype, self.params.values())) != self._dtypes:
            for (name, tensor), planned in zip(self.params.items(), self._dtypes):
                if tensor.dtype != planned:
                    raise ModelChangedError(
                        f"parameter {name} is {tensor.dtype} now, where the export plan reads it as {planned} (its "
                        "data was swapped in place, e.g. model.half() or param.data = ...): the plan's dtypes no "
                        f"longer fit; {_FIX}"
                    )
        if list(map(_data_ptr, self._plain)) != self._addresses:
            for name, tensor, address in zip(self._plain_names, self._plain, self._addresses or repeat(None)):
                if tensor.data_ptr() != address:
                    check_readable(name, tensor)
            self._addresses = list(map(_data_ptr, self._plain))
            self._moves += 1

    def _check_held(self) -> None:
        """Look every exported tensor up where the model holds it now, as ``refresh`` does, swapping
        nothing: raises the ``ModelChangedError`` that ``refresh`` would. What it found is kept for
        that ``refresh`` (``_looked``), which uses it while no registration came in between: one
        lookup per export after a registration, not two."""
        chunks = [ref() for ref in self._unwrapped]
        if any(chunk is None for chunk in chunks):
            return  # ``refresh`` names it
        held = self._held_now(chunks)
        for (name, old), current in zip(self.params.items(), held):
            if current is not old:
                _check_fits(name, old, current)
        self._looked = (registration_count(), held)

    def _held_now(self, chunks: list[torch.nn.Module]) -> list[Any]:
        """Every exported tensor as the model holds it now, in ``params`` order (raises naming one it lost)."""
        return [_held(chunks[stage], path, attribute) for stage, path, attribute in self._where.values()]

    def moves(self) -> int:
        """A count ``check_in_place`` bumps whenever it finds a data address of ``params`` other than at
        its last call: an exporter whose kept views saw the same count needs not read addresses again."""
        return self._moves

    def _readable_from_now_on(self) -> None:
        """Note the plain tensors (not subclasses: TE's FP8 parameters, on no meta device) whose storage
        ``check_in_place`` looks at; their storages are looked at on its next call."""
        plain = [(n, t) for n, t in self.params.items() if type(t) in _PLAIN and not t.is_meta]
        self._plain_names = [n for n, _ in plain]
        self._plain = [t for _, t in plain]
        self._addresses: list[int] | None = None

    def _watch(self, chunks: list[torch.nn.Module]) -> None:
        """Make the module dicts on the way to every exported tensor count their writes (``_count_writes``),
        each module once: the tree of the tensors' module paths (``_paths``) walked from each chunk."""
        for stage, tree in self._paths.items():
            _count_writes_along(chunks[stage], tree)


def _path_tree(where: Iterable[tuple[int, tuple[str, ...], str]]) -> dict[int, dict]:
    """Per chunk, the module paths of ``where`` as a tree of submodule names (``{name: {name: ...}}``)."""
    trees: dict[int, dict] = {}
    for stage, path, _ in where:
        node = trees.setdefault(stage, {})
        for part in path:
            node = node.setdefault(part, {})
    return trees


def _count_writes_along(module: torch.nn.Module, tree: dict) -> None:
    """``_count_writes`` on ``module`` and on its submodules along ``tree`` (a lost one is skipped: ``refresh`` names it)."""
    _count_writes(module)
    modules = module._modules
    for part, subtree in tree.items():
        child = modules.get(part)
        if child is not None:
            _count_writes_along(child, subtree)


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
            f"the model no longer has the parameter {'.'.join((*path, attribute))} (deleted, or its module "
            f"removed): {_FIX}"
        ) from None


def params_device(params: Mapping[str, torch.Tensor]) -> torch.device:
    """The device a rank's exported tensors are on (the first one's: a rank holds its model on one); CPU for none."""
    return next(iter(params.values())).device if params else torch.device("cpu")


def check_readable(name: str, tensor: torch.Tensor) -> None:
    """Raise ``ModelChangedError`` for a tensor whose storage does not hold its data (emptied in place
    by an offload, ``untyped_storage().resize_(0)``): reading it would read freed memory."""
    if not tensor.numel():
        return
    extent = tensor.storage_offset() + sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride())) + 1
    held, needed = tensor.untyped_storage().nbytes(), extent * tensor.element_size()
    if held < needed:
        raise ModelChangedError(
            f"parameter {name} cannot be read: its storage holds {held} of the {needed} bytes its data needs "
            "(offloaded in place, untyped_storage().resize_(0)?): load it back before exporting"
        )


def _check_fits(name: str, old: torch.Tensor, new: torch.Tensor) -> None:
    if (tuple(new.shape), new.dtype, type(new)) != (tuple(old.shape), old.dtype, type(old)):
        raise ModelChangedError(
            f"parameter {name} was replaced by a {type(new).__name__} {list(new.shape)} {new.dtype}, where the export "
            f"plan describes a {type(old).__name__} {list(old.shape)} {old.dtype}: {_FIX}"
        )
