"""``runtime.live_params`` and ``runtime.lifetime`` on their own (one process, no ranks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mbridge_refit.runtime.lifetime import ExpiredTensorError, HeldOutputs, guard_buckets, guard_tensors
from mbridge_refit.runtime.live_params import LiveParams, ModelChangedError, registration_count


def _model_and_tasks():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Sequential(torch.nn.Linear(3, 2)))
    tasks = [
        SimpleNamespace(global_param_name=f"g.{name}", param_name=name, vp_stage=None, param_weight=param)
        for name, param in model.named_parameters()
    ]
    return model, tasks


def test_nothing_replaced_costs_no_lookup():
    model, tasks = _model_and_tasks()
    live = LiveParams([model], tasks)
    assert live.refresh() == []
    assert all(live.params[t.global_param_name] is t.param_weight for t in tasks)


def test_a_replaced_parameter_is_swapped_into_the_same_dict():
    model, tasks = _model_and_tasks()
    live = LiveParams([model], tasks)
    params = live.params
    before = registration_count()
    new = torch.nn.Parameter(torch.ones(2, 3))
    model[1][0].weight = new
    assert registration_count() > before
    assert live.refresh() == ["g.1.0.weight"]
    assert live.params is params and params["g.1.0.weight"] is new


def test_load_state_dict_assign_is_followed():
    model, tasks = _model_and_tasks()
    live = LiveParams([model], tasks)
    state = {k: torch.full_like(v, 7.0) for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    assert sorted(live.refresh()) == sorted(t.global_param_name for t in tasks)
    assert all(torch.equal(p, torch.full_like(p, 7.0)) for p in live.params.values())


def test_a_replacement_of_another_shape_is_refused_by_name():
    model, tasks = _model_and_tasks()
    live = LiveParams([model], tasks)
    model[0].weight = torch.nn.Parameter(torch.ones(5, 4))
    with pytest.raises(ModelChangedError, match=r"0\.weight.*\[5, 4\].*\[3, 4\].*forget_model"):
        live.refresh()


def test_a_lost_parameter_is_named():
    model, tasks = _model_and_tasks()
    live = LiveParams([model], tasks)
    model[1] = torch.nn.Identity()
    with pytest.raises(ModelChangedError, match=r"no longer has the parameter 1\.0\.weight"):
        live.refresh()


def test_guarded_tensors_refuse_use_after_their_lifetime():
    stream = guard_tensors((f"t{i}", torch.full((2,), float(i))) for i in range(3))
    name, first = next(stream)
    assert first.sum().item() == 0.0  # valid until the generator advances
    kept = [(name, first), *stream]
    with pytest.raises(ExpiredTensorError, match="t0 was used after the export moved on"):
        kept[0][1].sum()
    with pytest.raises(ExpiredTensorError, match="t2 was used"):  # the generator ended: the last one expired too
        kept[2][1].add(1)
    buckets = list(guard_buckets([[("a", torch.ones(1)), ("b", torch.ones(1))], [("c", torch.ones(1))]]))
    with pytest.raises(ExpiredTensorError, match="b was used after the export moved on to the next bucket"):
        torch.equal(buckets[0][1][1], torch.ones(1))


def test_held_outputs_stay_valid_until_the_next_export_begins():
    held = HeldOutputs()
    buckets = list(held.guard(iter([[("a", torch.ones(1))], [("b", torch.ones(1))]]), in_buckets=True))
    pairs = list(held.guard(iter([("c", torch.ones(1))]), in_buckets=False))  # the same export, one by one
    assert buckets[0][0][1].sum().item() == 1.0 and pairs[0][1].sum().item() == 1.0  # after the export ended
    held.expire()  # the next export begins
    with pytest.raises(ExpiredTensorError, match="a was used after the next export began"):
        buckets[0][0][1].sum()
    with pytest.raises(ExpiredTensorError, match="c was used after the next export began"):
        pairs[0][1].add(1)


def _router_and_tasks():
    """A module holding an exported buffer as Megatron's MoE router holds ``expert_bias``."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    model[0].register_buffer("expert_bias", torch.zeros(3, dtype=torch.float32))
    named = [*model.named_parameters(), *model.named_buffers()]
    tasks = [
        SimpleNamespace(global_param_name=f"g.{name}", param_name=name, vp_stage=None, param_weight=tensor)
        for name, tensor in named
    ]
    return model, tasks


def test_an_exported_buffer_survives_a_registration_elsewhere():
    model, tasks = _router_and_tasks()
    live = LiveParams([model], tasks)
    torch.nn.Linear(2, 2)  # any module built anywhere (a value head, an engine in the process) registers
    assert live.refresh() == []
    model[0].expert_bias.add_(1.0)  # Megatron's in-place update: the same object
    assert live.refresh() == [] and torch.equal(live.params["g.0.expert_bias"], torch.ones(3))


def test_a_replaced_buffer_is_followed():
    model, tasks = _router_and_tasks()
    live = LiveParams([model], tasks)
    new = torch.full((3,), 2.0)
    model[0].expert_bias = new  # setattr of a registered buffer: no parameter registered anywhere
    assert live.refresh() == ["g.0.expert_bias"] and live.params["g.0.expert_bias"] is new
    state = {k: torch.full_like(v, 5.0) for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    assert sorted(live.refresh()) == sorted(t.global_param_name for t in tasks)
    assert torch.equal(live.params["g.0.expert_bias"], torch.full((3,), 5.0))


def test_a_buffer_replaced_where_no_hook_sees_it_is_followed():
    model, tasks = _router_and_tasks()
    live = LiveParams([model], tasks)
    before = registration_count()
    model._apply(lambda t: t.clone())  # what .to() / .cuda() / an offload round trip do: _buffers written directly
    assert registration_count() == before
    assert live.refresh() == ["g.0.expert_bias"] and live.params["g.0.expert_bias"] is model[0].expert_bias
    assert live.refresh() == []


def test_a_buffer_set_to_none_is_named():
    model, tasks = _router_and_tasks()
    live = LiveParams([model], tasks)
    model[0].expert_bias = None
    with pytest.raises(ModelChangedError, match=r"no longer has the parameter 0\.expert_bias"):
        live.refresh()


def test_after_a_registration_an_export_looks_each_parameter_up_once(monkeypatch):
    """check_in_place (before the handshake) and refresh (after it) both need the model's tensors after
    a registration: refresh takes what check_in_place found, unless another registration came between."""
    from mbridge_refit.runtime import live_params

    model, tasks = _model_and_tasks()
    live = LiveParams([model], tasks)
    looked = []
    real_held = live_params._held
    monkeypatch.setattr(
        live_params, "_held", lambda chunk, path, attribute: looked.append(path) or real_held(chunk, path, attribute)
    )
    first = torch.nn.Parameter(torch.ones(2, 3))
    model[1][0].weight = first
    live.check_in_place()
    assert live.refresh() == ["g.1.0.weight"] and live.params["g.1.0.weight"] is first
    assert len(looked) == len(tasks)
    looked.clear()
    second = torch.nn.Parameter(torch.ones(3, 4))
    model[0].weight = second
    live.check_in_place()
    third = torch.nn.Parameter(torch.ones(2))
    model[1][0].bias = third  # registered after check_in_place looked: refresh looks again
    assert sorted(live.refresh()) == ["g.0.weight", "g.1.0.bias"]
    assert live.params["g.0.weight"] is second and live.params["g.1.0.bias"] is third
    assert len(looked) == 2 * len(tasks)
