"""Models nobody here wrote: planning never depends on guessing a forward right.

A sweep over custom models that defeat a guessed forward (a head declared before the body that
runs first, a mask argument, a dict input, a keyword-only input, containers with no forward of
their own, a unit that reads a number, weights tied across layers) and library models from
small configs (torchvision, transformers). For each, accelerate's two entry points, with only
the import changed:

- ``infer_auto_device_map`` with hypothetical GPUs, CPU and disk budgets returns a map that
  covers every tensor and fits every budget (bytes per device summed over the map, a tied
  tensor counted once per device);
- ``load_checkpoint_and_dispatch(..., device_map="auto")`` from a safetensors checkpoint, with a
  CPU budget that sends part of the model to disk, gives the plain model's outputs (a container
  without a forward: every weight placed, its state_dict the checkpoint's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
import torchvision
from safetensors.torch import save_model
from torch import nn

import automap
from automap.accelerate_compat import infer_auto_device_map, init_empty_weights, load_checkpoint_and_dispatch
from automap.profiling.units import longest_prefix
from conftest import tiny_gpt2, tiny_llama, tiny_t5
from test_fallback import item_model, tiny_moe
from tiny_configs import beside_the_run

# ---------------------------------------------------------------------------- custom models


class HeadFirst(nn.Module):
    """Declaration order is not execution order: a guess shaped for ``head`` fails in ``body``."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(64, 10)
        self.body = nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


class Masked(nn.Module):
    """A required second positional argument the forward uses."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 64)
        self.mid = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.body(x) * mask)))


class DictInput(nn.Module):
    """A forward that takes one dict of tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Conv2d(3, 8, 3)
        self.text = nn.Embedding(50, 8)
        self.head = nn.Linear(16, 4)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        pooled = self.image(batch["image"]).mean(dim=(2, 3))
        return self.head(torch.cat([pooled, self.text(batch["ids"]).mean(dim=1)], dim=-1))


class KeywordOnly(nn.Module):
    """Inputs by keyword only: no positional guess can call it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(24, 24) for _ in range(4))

    def forward(self, *, features: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        for layer in self.layers:
            features = torch.tanh(layer(features)) * scale
        return features


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TiedAcrossLayers(nn.Module):
    """An autoencoder whose decoder reuses every encoder matrix, and one block used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(nn.Linear(32, 32, bias=False) for _ in range(3))
        self.middle = Block(32)
        self.decoder = nn.ModuleList(nn.Linear(32, 32, bias=False) for _ in range(3))
        for enc, dec in zip(self.encoder, reversed(self.decoder)):
            dec.weight = enc.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.encoder:
            x = torch.tanh(layer(x))
        x = self.middle(self.middle(x))
        for layer in self.decoder:
            x = layer(x)
        return x


class LooseAndBuffers(nn.Module):
    """Tensors held by the root itself (a learned position table, a buffer) between blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.position = nn.Parameter(torch.randn(12, 16))
        self.register_buffer("scale", torch.tensor(0.5))
        self.blocks = nn.Sequential(*(Block(16) for _ in range(3)))
        self.out = nn.Linear(16, 40)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.position[: ids.shape[1]]
        return self.out(self.blocks(x) * self.scale)


class Attention(nn.Module):
    """``nn.MultiheadAttention`` (reads its own ``out_proj.weight``) and an LSTM, in train mode."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(12, 16)
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        x = self.attention(x, x, x, need_weights=False)[0]
        x = self.lstm(x)[0][:, -1]
        return self.head(self.norm(x))


class ReturnsDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.stages = nn.Sequential(
            nn.Conv2d(8, 16, 3, stride=2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3),
            nn.BatchNorm2d(16),
        )
        self.classifier = nn.Linear(16, 5)

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.stages(torch.relu(self.stem(images)))
        return {"features": features, "logits": self.classifier(features.mean(dim=(2, 3)))}


def module_dict_root() -> nn.Module:
    return nn.ModuleDict(
        {
            "encoder": nn.Sequential(Block(16), Block(16)),
            "proj": nn.Linear(16, 8),
            "heads": nn.ModuleDict({"a": Block(8), "b": nn.Linear(8, 2)}),
        }
    )


def module_list_root() -> nn.Module:
    return nn.ModuleList([Block(24), nn.Linear(24, 24), Block(24), nn.LayerNorm(24)])


# ---------------------------------------------------------------------------- library models


def tiny_bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    return BertModel(
        BertConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=120,
            max_position_embeddings=32,
        )
    ).eval()


def tiny_qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        )
    ).eval()


def tiny_vit() -> nn.Module:
    return torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
    )


# ---------------------------------------------------------------------------- the sweep


@dataclass(frozen=True)
class Case:
    """A model to sweep: how to build it, real inputs for its forward, its output as a tensor."""

    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[tuple, dict]] | None  # None: the model has no forward of its own
    output: Callable[[Any], torch.Tensor] = field(default=lambda out: out)
    on_meta: bool = True  # load into a skeleton from init_empty_weights (else into a real model)


def _ids(vocab: int, shape: tuple[int, int] = (2, 8)) -> Callable[[], tuple[tuple, dict]]:
    return lambda: ((torch.randint(0, vocab, shape),), {})


def _x(*shape: int) -> Callable[[], tuple[tuple, dict]]:
    return lambda: ((torch.randn(*shape),), {})


CASES = {
    "head-declared-first": Case(HeadFirst, _x(3, 32)),
    "mask-argument": Case(Masked, lambda: ((torch.randn(3, 32), torch.rand(3, 64) > 0.5), {}), on_meta=False),
    "dict-input": Case(
        DictInput, lambda: (({"image": torch.randn(2, 3, 12, 12), "ids": torch.randint(0, 50, (2, 5))},), {})
    ),
    "keyword-only": Case(KeywordOnly, lambda: ((), {"features": torch.randn(2, 24), "scale": 0.5})),
    "module-dict-root": Case(module_dict_root, None),
    "module-list-root": Case(module_list_root, None, on_meta=False),
    "item-unit": Case(item_model, _x(3, 16)),
    "tied-across-layers": Case(TiedAcrossLayers, _x(2, 32)),
    "loose-tensors": Case(LooseAndBuffers, _ids(40, (2, 12)), on_meta=False),
    "attention-lstm-train-mode": Case(lambda: Attention().train(), _x(3, 5, 12), on_meta=False),
    "returns-dict": Case(ReturnsDict, _x(2, 3, 16, 16), output=lambda out: out["logits"]),
    "sequential-mlp": Case(
        lambda: nn.Sequential(nn.Linear(20, 40), nn.GELU(), nn.Linear(40, 40), nn.Linear(40, 6)), _x(4, 20)
    ),
    "resnet18": Case(lambda: torchvision.models.resnet18(num_classes=10), _x(2, 3, 64, 64)),
    "mobilenet_v2": Case(
        lambda: torchvision.models.mobilenet_v2(width_mult=0.25, num_classes=10), _x(2, 3, 64, 64)
    ),
    "vit": Case(tiny_vit, _x(2, 3, 32, 32), on_meta=False),
    "gpt2-tied": Case(lambda: tiny_gpt2(layers=2), _ids(256), output=lambda out: out.logits),
    "llama": Case(lambda: tiny_llama(layers=2), _ids(256), output=lambda out: out.logits, on_meta=False),
    "qwen2-tied": Case(tiny_qwen2, _ids(128), output=lambda out: out.logits),
    "t5": Case(
        lambda: tiny_t5(layers=2),
        lambda: (
            (),
            {"input_ids": torch.randint(0, 256, (2, 8)), "decoder_input_ids": torch.randint(0, 256, (2, 4))},
        ),
        output=lambda out: out.logits,
    ),
    "bert": Case(tiny_bert, _ids(120), output=lambda out: out.last_hidden_state),
    "mixtral": Case(lambda: tiny_moe("mixtral"), _ids(128), output=lambda out: out.logits),
}


def build(case: Case, meta: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if not meta:
        return case.build().eval()
    with init_empty_weights():
        return case.build().eval()


def distinct_tensors(model: nn.Module) -> dict[int, tuple[list[str], int]]:
    """Each distinct parameter or buffer: its names and bytes."""
    found: dict[int, tuple[list[str], int]] = {}
    named = list(model.named_parameters(remove_duplicate=False)) + [
        (n, b) for n, b in model.named_buffers(remove_duplicate=False) if b is not None
    ]
    for name, tensor in named:
        found.setdefault(id(tensor), ([], tensor.numel() * tensor.element_size()))[0].append(name)
    return found


def bytes_per_device(model: nn.Module, device_map: dict) -> dict[Any, int]:
    """Bytes each device of ``device_map`` holds; a tied tensor counts once on each device it is on."""
    used: dict[Any, int] = {}
    for names, nbytes in distinct_tensors(model).values():
        homes = {longest_prefix(device_map, name) for name in names}
        assert None not in homes, f"{names} have no device in {device_map}"
        for home in homes:
            used[home] = used.get(home, 0) + nbytes
    return used


def weight_total(model: nn.Module) -> int:
    return sum(nbytes for _, nbytes in distinct_tensors(model).values())


@pytest.mark.parametrize("name", CASES)
def test_infer_auto_device_map_fits_hypothetical_budgets(name):
    model = build(CASES[name], meta=True)
    total = weight_total(model)
    budgets = {0: total // 5, 1: total // 4, "cpu": total // 4, "disk": 2 * total}
    device_map = infer_auto_device_map(model, max_memory=budgets)
    used = bytes_per_device(model, dict(device_map))
    assert set(used) <= set(budgets), device_map
    for device, nbytes in used.items():
        assert nbytes <= budgets[device], (device, nbytes, budgets, device_map)
    assert sum(used.values()) >= total  # everything placed (ties split over devices count twice)
    assert used.get("disk", 0) > 0  # the budgets force part of the model to disk


@pytest.mark.parametrize("name", CASES)
def test_load_checkpoint_and_dispatch_on_cpu_and_disk_matches_the_plain_model(name, tmp_path):
    case = CASES[name]
    plain = build(case)
    checkpoint = tmp_path / "model.safetensors"
    save_model(plain, str(checkpoint))
    model = build(case, meta=case.on_meta)
    budget = beside_the_run(plain, int(0.4 * weight_total(plain)))
    loaded = load_checkpoint_and_dispatch(
        model, checkpoint, device_map="auto", max_memory={"cpu": budget}, offload_folder=tmp_path / "offload"
    )
    placed = bytes_per_device(plain, loaded.hf_device_map)  # every tensor has a device
    assert placed.get("disk", 0) > 0 and set(placed) <= {"cpu", "disk"}, loaded.hf_device_map
    if case.inputs is None:
        expected = plain.state_dict()
        got = loaded.state_dict()
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    else:
        torch.manual_seed(1)
        args, kwargs = case.inputs()
        with torch.no_grad():
            want = case.output(plain(*args, **kwargs))
            got = case.output(loaded(*args, **kwargs))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    automap.undispatch(loaded)


def test_the_sweep_has_the_models_the_issue_names():
    assert len(CASES) >= 20
    assert {
        "head-declared-first",
        "mask-argument",
        "dict-input",
        "module-dict-root",
        "item-unit",
        "tied-across-layers",
    } <= set(CASES)
