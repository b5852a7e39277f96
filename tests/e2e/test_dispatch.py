"""Dispatch transparency on real architectures with 30-70% of their weights on disk, generate(),
training through the map, the meta-skeleton path the loader uses, and bad input."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import automap
from automap.runtime import dispatch_plan, state_of
from automap.errors import DispatchError, OffloadError
from automap.offload import CheckpointSource
from conftest import ToyModel, file_backing, ids_and_logits, logits_of, tiny_gpt2, tiny_llama, tiny_t5


def _disk_plan(model: nn.Module, disk_share: float = 0.5) -> automap.Plan:
    """A plan with about ``disk_share`` of the weights on disk, taken from the middle of the
    model (so the forward crosses RAM -> disk -> RAM), checked to be within 30-70%."""
    base = automap.plan(model, max_memory={"cpu": "64GB"})
    total = sum(u.weight_bytes for u in base.units)
    start, on_disk, device_map = 0, 0, {}
    for unit in base.units:
        fits = on_disk + unit.weight_bytes <= 0.7 * total and on_disk < disk_share * total
        where = "disk" if start >= 0.15 * total and fits else "cpu"
        on_disk += unit.weight_bytes if where == "disk" else 0
        start += unit.weight_bytes
        device_map.update({unit.name: where, **{t: where for t in unit.loose}})
    plan = automap.plan(model, device_map)
    share = plan.placements.bytes_on.get("disk", 0) / total
    assert 0.3 <= share <= 0.7, f"{share:.2f} of the weights on disk"
    return plan


def _released(model: nn.Module) -> bool:
    """Every offloaded tensor holds its home again — the real weights, a view of the store —
    and nothing of it stays elsewhere (no copy held after its unit ran)."""
    state = state_of(model)
    return all(
        item.tensor.data_ptr() == item.home.data_ptr()
        and item.tensor.shape == item.home.shape
        and file_backing(item.tensor) is not None
        for item in state.streamed.values()
    )


def _vision(name: str) -> tuple[nn.Module, tuple]:
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)().eval()
    return model, (torch.randn(1, 3, 224, 224) if name == "vit_b_16" else torch.randn(2, 3, 96, 96),)


def _text(name: str) -> tuple[nn.Module, dict]:
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    if name == "t5":
        return tiny_t5(), {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
    return (tiny_gpt2() if name == "gpt2" else tiny_llama()), {"input_ids": ids}


def _logits(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


@pytest.mark.parametrize("name", ["resnet50", "vit_b_16", "swin_t", "gpt2", "llama", "t5"])
def test_outputs_identical_with_part_on_disk(name, tmp_path):
    model, inputs = _vision(name) if name in ("resnet50", "vit_b_16", "swin_t") else _text(name)
    call = (lambda m: m(*inputs)) if isinstance(inputs, tuple) else (lambda m: m(**inputs))
    with torch.no_grad():
        expected = _logits(call(model))
    automap.dispatch(model, _disk_plan(model), offload_dir=tmp_path)
    with torch.no_grad():
        got = _logits(call(model))
    assert torch.equal(got, expected)
    assert _released(model)
    automap.undispatch(model)
    with torch.no_grad():
        assert torch.equal(_logits(call(model)), expected)


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_generate_gives_the_same_tokens(build, tmp_path):
    model = build(layers=4)
    ids = torch.randint(1, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    options = dict(
        max_new_tokens=20,
        min_new_tokens=20,
        do_sample=False,
        pad_token_id=0,
        attention_mask=torch.ones_like(ids),
    )
    expected = model.generate(ids, **options)
    automap.dispatch(model, _disk_plan(model, 0.4), offload_dir=tmp_path)
    assert torch.equal(model.generate(ids, **options), expected)
    assert expected.shape[1] == ids.shape[1] + 20


def test_tied_weights_stay_one_parameter(tmp_path):
    model = tiny_gpt2(layers=2)
    ids, expected = ids_and_logits(model)
    device_map = {
        "transformer.wte": "disk",
        "transformer.wpe": "cpu",
        "transformer.drop": "cpu",
        "transformer.h": "cpu",
        "transformer.ln_f": "cpu",
        "lm_head": "disk",
    }
    automap.dispatch(model, device_map, offload_dir=tmp_path)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(logits_of(model, ids), expected)
    assert _released(model)
    automap.undispatch(model)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_tie_split_between_disk_and_ram_stays_one_parameter(tmp_path):
    model = tiny_gpt2(layers=2)
    ids, expected = ids_and_logits(model)
    device_map = {
        "transformer.wte": "disk",
        "transformer.wpe": "cpu",
        "transformer.drop": "cpu",
        "transformer.h": "disk",
        "transformer.ln_f": "cpu",
        "lm_head": "cpu",
    }
    # A ModuleList placed whole (as accelerate's infer_auto_device_map maps one) is never called:
    # its blocks are the units, each streamed in when it runs.
    automap.dispatch(model, device_map, offload_dir=tmp_path)
    assert {"transformer.h.0", "transformer.h.1"} <= set(automap.placement(model).device_map)
    assert torch.equal(logits_of(model, ids), expected)
    automap.undispatch(model)
    device_map.update({"transformer.h": "cpu", "transformer.h.0": "disk"})
    automap.dispatch(model, device_map, offload_dir=tmp_path)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(logits_of(model, ids), expected)
    assert _released(model)


def test_inference_mode_leaves_parameters_usable(tmp_path):
    model = tiny_llama(layers=2)
    ids, expected = ids_and_logits(model)
    automap.dispatch(model, _disk_plan(model), offload_dir=tmp_path)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, expected)
    assert torch.equal(model(ids).logits.detach(), expected)  # grad mode after inference mode
    automap.undispatch(model)
    assert not any(p.is_inference() for p in model.parameters())


def test_next_offloaded_unit_is_prefetched(tmp_path):
    model = tiny_llama(layers=4)
    plan = _disk_plan(model)
    automap.dispatch(model, plan, offload_dir=tmp_path)
    transfer, calls = state_of(model).transfer, []
    real = transfer.prefetch
    transfer.prefetch = lambda key, names: (calls.append(key), real(key, names))
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 8)))
    offloaded = list(plan.offloaded_units)
    assert calls == offloaded[1:] + offloaded[:1]


def test_interrupted_forward_releases_weights_at_once(tmp_path):
    model = tiny_llama(layers=2)
    ids, expected = ids_and_logits(model)
    device_map = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.layers.0": "disk",
        "model.layers.1": "disk",
        "model.norm": "cpu",
        "lm_head": "cpu",
    }
    automap.dispatch(model, device_map, offload_dir=tmp_path)
    with torch.no_grad(), pytest.raises(RuntimeError):
        model(inputs_embeds=torch.randn(1, 8, 63))  # fails inside model.layers.0
    assert _released(model)
    assert torch.equal(logits_of(model, ids), expected)
    assert _released(model)


# ------------------------------------------------------------------ training


def _train_step(model: nn.Module, loss_of) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    loss = loss_of(model)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    return loss.detach(), grads


def _assert_same_training(plain: nn.Module, placed: nn.Module, loss_of) -> None:
    loss, grads = _train_step(plain, loss_of)
    loss2, grads2 = _train_step(placed, loss_of)
    assert torch.equal(loss, loss2)
    assert grads.keys() == grads2.keys() and grads
    for name in grads:
        assert torch.equal(grads[name], grads2[name]), name
    with torch.no_grad():
        assert torch.equal(loss_of(plain), loss_of(placed)), "the optimizer step must update the same weights"


def test_toy_model_training_step_matches(tmp_path):
    torch.manual_seed(0)
    plain = ToyModel()
    placed = copy.deepcopy(plain)
    plan = automap.plan(placed, {"net1": "cpu", "relu": "cpu", "net2": "cpu"})
    dispatch_plan(placed, plan, always_hook=True)
    x, y = torch.randn(20, 10), torch.randn(20, 5)
    _assert_same_training(plain, placed, lambda m: nn.functional.mse_loss(m(x), y))


def _lm_loss(ids: torch.Tensor):
    return lambda m: m(ids, labels=ids).loss


def test_llama_training_step_matches_resident():
    plain = tiny_llama(layers=2).train()
    placed = copy.deepcopy(plain)
    dispatch_plan(placed, automap.plan(placed, max_memory={"cpu": "1GB"}), always_hook=True)
    _assert_same_training(plain, placed, _lm_loss(torch.randint(0, 256, (2, 10))))


def test_llama_training_with_frozen_offloaded_units_matches(tmp_path):
    plain = tiny_llama(layers=4).train()
    placed = copy.deepcopy(plain)
    plan = _disk_plan(placed)
    for model in (plain, placed):
        for unit in plan.offloaded_units:
            model.get_submodule(unit).requires_grad_(False)
    automap.dispatch(placed, plan, offload_dir=tmp_path)
    _assert_same_training(plain, placed, _lm_loss(torch.randint(0, 256, (2, 10))))


def test_training_offloaded_trainable_units_is_refused_at_backward_and_model_stays_usable(tmp_path):
    model = tiny_llama(layers=4)
    ids, expected = ids_and_logits(model)
    plan = _disk_plan(model)
    automap.dispatch(model, plan, offload_dir=tmp_path)
    model.train()
    loss = model(ids, labels=ids).loss  # a forward in train mode runs
    offloaded = tuple(u + "." for u in plan.offloaded_units)
    with pytest.raises(
        DispatchError, match=r"gradient reached offloaded parameter '([^']+)'.*requires_grad_"
    ) as info:
        loss.backward()
    assert info.match(r"'(" + "|".join(u.replace(".", r"\.") for u in offloaded) + ")")
    model.eval()
    assert torch.equal(logits_of(model, ids), expected)
    assert _released(model)


# ------------------------------------------------------------------ the loader's path: a meta skeleton + a store


def _named(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(
        list(model.named_parameters(remove_duplicate=False))
        + list(model.named_buffers(remove_duplicate=False))
    )


def _skeleton_with_store(
    tmp_path, model: nn.Module, plan: automap.Plan
) -> tuple[nn.Module, CheckpointSource]:
    """What automap.load hands dispatch_plan: resident tensors real, offloaded ones on meta and
    referenced in place in a safetensors checkpoint."""
    streamed = {
        n for u, d in zip(plan.units, plan.placement) if d == "disk" for n in u.tensors if n not in u.loose
    }
    state = {n: t for n, t in model.state_dict().items() if n in streamed}
    save_file(
        {n: t.contiguous() for n, t in state.items() if n != "lm_head.weight" or n in streamed},
        str(tmp_path / "ckpt.safetensors"),
    )
    store = CheckpointSource({n: (tmp_path / "ckpt.safetensors", n) for n in state})
    with torch.device("meta"):
        skeleton = type(model)(model.config).eval()
    real = {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    meta = _named(skeleton)
    streamed_ids = {id(meta[n]) for n in streamed}
    for name, tensor in meta.items():
        if id(tensor) not in streamed_ids:
            owner, _, key = name.rpartition(".")
            table = (
                skeleton.get_submodule(owner)._parameters
                if isinstance(tensor, nn.Parameter)
                else skeleton.get_submodule(owner)._buffers
            )
            table[key] = (
                nn.Parameter(real[name].detach().clone())
                if isinstance(tensor, nn.Parameter)
                else real[name].clone()
            )
    return skeleton, store


def test_meta_skeleton_with_store_matches_without_allocating(tmp_path):
    model = tiny_llama(layers=4)
    ids, expected = ids_and_logits(model, (2, 9))
    plan = _disk_plan(model)
    skeleton, store = _skeleton_with_store(tmp_path, model, plan)
    dispatch_plan(skeleton, plan, source=store)
    assert not any(t.is_meta for t in skeleton.parameters())
    offloaded = [
        p for n, p in skeleton.named_parameters() if any(n.startswith(u + ".") for u in plan.offloaded_units)
    ]
    assert offloaded and all(
        file_backing(p) == (tmp_path / "ckpt.safetensors").resolve() for p in offloaded
    ), "offloaded tensors must stay unallocated: views of the checkpoint"
    assert not (tmp_path / "off").exists(), "the checkpoint is referenced, not copied"
    assert torch.equal(logits_of(skeleton, ids), expected)
    automap.undispatch(skeleton)
    for name, tensor in model.state_dict().items():
        assert skeleton.state_dict()[name].device.type == "cpu"
        assert torch.equal(skeleton.state_dict()[name], tensor), name


def test_meta_skeleton_keeps_ties(tmp_path):
    model = tiny_llama(layers=2, tie=True)
    ids, expected = ids_and_logits(model, (1, 7))
    device_map = {
        "model.embed_tokens": "disk",
        "model.rotary_emb": "cpu",
        "model.layers": "cpu",
        "model.norm": "cpu",
        "lm_head": "disk",
    }
    plan = automap.plan(model, device_map)
    skeleton, store = _skeleton_with_store(tmp_path, model, plan)
    dispatch_plan(skeleton, plan, source=store)
    assert skeleton.lm_head.weight is skeleton.model.embed_tokens.weight
    assert torch.equal(logits_of(skeleton, ids), expected)


def test_meta_tensor_kept_resident_is_refused_and_skeleton_untouched(tmp_path):
    model = tiny_llama(layers=2)
    plan = _disk_plan(model)
    skeleton, store = _skeleton_with_store(tmp_path, model, plan)
    resident = next(n for n, t in skeleton.named_parameters() if not t.is_meta)
    owner, _, key = resident.rpartition(".")
    skeleton.get_submodule(owner)._parameters[key] = nn.Parameter(torch.empty(1, device="meta"))
    before = {n: t for n, t in skeleton.named_parameters()}
    with pytest.raises(DispatchError, match=rf"'{resident}' is on meta.*keeps it resident.*automap.load"):
        dispatch_plan(skeleton, plan, source=store)
    assert {n: t for n, t in skeleton.named_parameters()}.keys() == before.keys()
    assert all(t is before[n] for n, t in skeleton.named_parameters())
    assert state_of(skeleton) is None


# ------------------------------------------------------------------ bad input


def test_missing_gpu_is_refused_and_model_untouched(tmp_path):
    model = tiny_llama(layers=2)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    params = {n: (p, p.device) for n, p in model.named_parameters()}
    with pytest.raises(automap.DeviceError, match=rf"'cuda:{count}' but this machine has {count} cuda"):
        automap.dispatch(model, {"model": count, "lm_head": "cpu"}, offload_dir=tmp_path)
    assert all(p is params[n][0] and p.device == params[n][1] for n, p in model.named_parameters())
    assert state_of(model) is None


def test_offload_file_changed_after_writing_is_refused_until_restored(tmp_path):
    model = tiny_llama(layers=4)
    ids, expected = ids_and_logits(model)
    plan = _disk_plan(model)
    automap.dispatch(model, plan, offload_dir=tmp_path)
    path = file_backing(model.get_submodule(plan.offloaded_units[0]).input_layernorm.weight)
    assert path.parent.parent == tmp_path
    good = path.read_bytes()
    os.truncate(path, len(good) // 2)
    with torch.no_grad(), pytest.raises(OffloadError, match=rf"{path.name} is truncated.*restore it"):
        model(ids)
    path.write_bytes(good[:-8] + bytes(8))
    with torch.no_grad(), pytest.raises(OffloadError, match="does not match its checksum"):
        model(ids)
    path.write_bytes(good)
    assert torch.equal(logits_of(model, ids), expected)
    automap.undispatch(model)
    assert torch.equal(logits_of(model, ids), expected)


# ------------------------------------------------------------------ moving nested inputs


def test_send_moves_every_nested_tensor_and_keeps_what_does_not_move():
    import dataclasses
    from collections import namedtuple

    from transformers.cache_utils import DynamicCache
    from transformers.modeling_outputs import BaseModelOutput

    from automap.runtime import send

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        extra: dict

    Pair = namedtuple("Pair", "a b")
    cache = DynamicCache()
    value = (
        Pair(torch.ones(2), [torch.zeros(1)]),
        {"batch": Batch(torch.ones(3), {"m": torch.ones(1)})},
        BaseModelOutput(last_hidden_state=torch.ones(2, 2)),
        cache,
        7,
    )
    moved = send(value, torch.device("meta"))
    assert moved[0].a.is_meta and moved[0].b[0].is_meta and isinstance(moved[0], Pair)
    assert moved[1]["batch"].x.is_meta and moved[1]["batch"].extra["m"].is_meta
    assert isinstance(moved[2], BaseModelOutput) and moved[2].last_hidden_state.is_meta
    assert moved[3] is cache and moved[4] == 7, "caches follow their layers; other objects pass through"
    assert send(value, torch.device("cpu")) is value, "nothing to move: the same object, no rebuilding"


# ------------------------------------------------------------------ a weight source of one's own


class _HalfSource:
    """A new kind of weight source, written only against the WeightSource protocol: it keeps
    weights as fp16 bytes and widens each to fp32 once, when first asked (a toy compressed
    store). Nothing in automap/runtime knows about it."""

    def __init__(self, tensors):
        self.packed = {n: t.detach().half() for n, t in tensors.items()}
        self.widened, self.prefetched, self.closed = {}, [], False

    def names(self):
        return self.packed.keys()

    def get(self, name):
        if name not in self.widened:
            self.widened[name] = self.packed[name].float()
        return self.widened[name]

    def prefetch(self, names, populate=True):
        self.prefetched.append(tuple(names))

    def check_unchanged(self, names):
        return None

    def stats(self):
        from automap.offload import SourceStats

        return SourceStats(ram_bytes=sum(t.numel() * 2 for t in self.packed.values()))

    def close(self, discard=False):
        self.closed = True


def test_a_new_weight_source_plugs_in_without_runtime_changes(tmp_path):
    from automap.offload import WeightSource

    model = tiny_llama(layers=4)
    plan = _disk_plan(model)
    streamed = {
        n for u, d in zip(plan.units, plan.placement) if d == "disk" for n in u.tensors if n not in u.loose
    }
    source = _HalfSource({n: t for n, t in model.state_dict().items() if n in streamed})
    assert isinstance(source, WeightSource)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name in streamed:
                tensor.copy_(tensor.half().float())  # the precision the source keeps
    ids, expected = ids_and_logits(model)
    dispatch_plan(model, plan, source=source)
    assert torch.equal(logits_of(model, ids), expected)
    assert source.prefetched, "the runtime asked the source to prefetch the next unit"
    assert "offloaded tensors:" in automap.placement(model).report()
    automap.undispatch(model)
    assert source.closed and torch.equal(logits_of(model, ids), expected)


# ------------------------------------------------------------------ a model as users hand it over (issue 17)


class _NormNet(nn.Module):
    """Linear(3, 4) -> BatchNorm1d(4) -> Linear(4, 5), in its default train mode."""

    def __init__(self):
        super().__init__()
        self.linear1, self.batchnorm, self.linear2 = nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 5)

    def forward(self, x):
        return self.linear2(self.batchnorm(self.linear1(x)))


_ALL_ON_DISK = {"linear1": "disk", "batchnorm": "disk", "linear2": "disk"}


def test_train_mode_model_all_on_disk_runs_like_the_plain_one(tmp_path):
    torch.manual_seed(0)
    plain = _NormNet()
    placed = copy.deepcopy(plain)
    assert placed.training
    automap.dispatch(placed, _ALL_ON_DISK, offload_dir=tmp_path)  # no example_inputs, train mode
    for _ in range(3):
        x = torch.randn(6, 3)
        assert torch.equal(placed(x), plain(x))  # grad on, train mode: BatchNorm uses batch statistics
    for name in ("running_mean", "running_var"):
        assert (getattr(placed.batchnorm, name) - getattr(plain.batchnorm, name)).abs().max() <= 1e-6, name
    assert placed.batchnorm.num_batches_tracked.item() == 3


def test_backward_through_a_trainable_offloaded_unit_names_the_parameter(tmp_path):
    torch.manual_seed(0)
    model = _NormNet()
    automap.dispatch(model, _ALL_ON_DISK, offload_dir=tmp_path)
    loss = model(torch.randn(6, 3)).sum()
    with pytest.raises(
        DispatchError,
        match=r"gradient reached offloaded parameter 'linear2\.(weight|bias)'.*"
        r"requires_grad_\(False\).*keep its unit resident",
    ):
        loss.backward()


def test_an_offloaded_parameter_unfrozen_after_dispatch_is_refused_as_one_trainable_at_dispatch(tmp_path):
    torch.manual_seed(0)
    model = _NormNet()
    model.linear2.requires_grad_(False)
    automap.dispatch(model, {"linear1": "cpu", "batchnorm": "cpu", "linear2": "disk"}, offload_dir=tmp_path)
    model(torch.randn(6, 3)).sum().backward()  # frozen: the resident part trains
    model.linear2.weight.requires_grad_(True)
    loss = model(torch.randn(6, 3)).sum()
    with pytest.raises(DispatchError, match=r"gradient reached offloaded parameter 'linear2\.weight'"):
        loss.backward()
    automap.undispatch(model)


def test_frozen_offloaded_units_train_the_resident_part_like_the_plain_model(tmp_path):
    torch.manual_seed(0)
    plain = _NormNet()
    placed = copy.deepcopy(plain)
    for model in (plain, placed):
        model.batchnorm.requires_grad_(False)
        model.linear2.requires_grad_(False)
    automap.dispatch(placed, {"linear1": "cpu", "batchnorm": "disk", "linear2": "disk"}, offload_dir=tmp_path)
    x, y = torch.randn(6, 3), torch.randn(6, 5)
    losses = [nn.functional.mse_loss(m(x), y) for m in (plain, placed)]
    for loss in losses:
        loss.backward()
    assert torch.equal(losses[0], losses[1])
    assert torch.equal(plain.linear1.weight.grad, placed.linear1.weight.grad)
    assert torch.equal(plain.linear1.bias.grad, placed.linear1.bias.grad)


@pytest.mark.parametrize("max_memory", [{"disk": "1GB"}, {0: "1GB"}])
def test_a_map_on_disk_with_no_cpu_budget_still_computes_on_the_cpu(max_memory, tmp_path):
    """accelerate reads a missing "cpu" key as a CPU with no room: it still computes what
    streams from disk (this raised a bare KeyError before)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    automap.dispatch(model, device_map={"": "disk"}, max_memory=max_memory, offload_dir=tmp_path)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
