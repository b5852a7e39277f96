"""accelerate's tied-weights calls of ``infer_auto_device_map`` in toy budgets (its
``test_infer_auto_device_map_with_tied_weights``): blocks whose guessed forward cannot run, so
they are planned from their weights, with three weights tied in one group or in two tie groups.
The GPUs hold every weight: none goes to disk or CPU RAM, and tied weights share a device."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import automap
from automap.accelerate_compat import infer_auto_device_map
from automap.profiling.units import longest_prefix


class _Block(nn.Module):
    """accelerate's ``ModelForTest``: 3 features in, 5 out, so a chain of them cannot run."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.batchnorm(self.linear1(x)))


def _tied(groups: int) -> nn.Sequential:
    """Three blocks, their ``linear2`` weights tied (548 B in all); with ``groups=2`` the
    first two ``linear1`` weights tied too (500 B)."""
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict((f"layer{i}", _Block()) for i in (1, 2, 3)))
    model.layer2.linear2.weight = model.layer3.linear2.weight = model.layer1.linear2.weight
    if groups == 2:
        model.layer2.linear1.weight = model.layer1.linear1.weight
    return model


def _tie_groups(model: nn.Module) -> list[list[str]]:
    names: dict[int, list[str]] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(tensor), []).append(name)
    return [group for group in names.values() if len(group) > 1]


@pytest.mark.parametrize("budgets", [{0: 400, 1: 500}, {0: 500, 1: 400}])
@pytest.mark.parametrize("groups", [1, 2])
def test_tied_weights_in_toy_budgets_stay_on_the_gpus_together(groups, budgets):
    model = _tied(groups)
    ties = _tie_groups(model)
    assert sorted(len(g) for g in ties) == ([3] if groups == 1 else [2, 3])
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert weights <= sum(budgets.values())

    device_map = infer_auto_device_map(model, max_memory=budgets)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    where = {name: longest_prefix(device_map, name) for name in names}
    assert set(where.values()) <= set(budgets), device_map  # no weight on "disk" or "cpu"
    for group in ties:
        assert len({where[name] for name in group}) == 1, (group, device_map)

    plan = automap.plan(model, "auto", budgets)  # the plan behind it, dispatched as is
    assert any(unit.untraced for unit in plan.units)  # planned from bytes
    assert all(plan.device(d).is_accelerator for d in plan.placement), plan.device_map
    assert not [w for w in plan.warnings if "tied weights split" in w], plan.warnings
