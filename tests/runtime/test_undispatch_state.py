"""A dispatched model is what torch's API made of it, and undispatch hands back that model
(issue #23, runtime half): conversions refused at the call or kept, never silently undone;
undispatch reads from the maps automap holds, whatever became of the files' names; copies and
pickles give plain models; a file truncated under a live model is an error naming the tensors,
never a SIGBUS (run in subprocesses); a forward racing undispatch in another thread completes
or raises DispatchError.

The model throughout: six ``Linear(64, 64)``, the last three on disk (a store, or the
checkpoint read in place)."""

from __future__ import annotations

import copy
import io
import os
import pickle
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_model
from torch import nn

import automap
from automap.errors import DispatchError, OffloadError
from automap.offload import HostCopyOps, StagedTransfer, read_header
from automap.runtime import dispatch_plan, state_of
from conftest import file_backing

TESTS = Path(__file__).resolve().parents[1]
DISK = {"0": "cpu", "1": "cpu", "2": "cpu", "3": "disk", "4": "disk", "5": "disk"}


def six(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]).eval()


def x() -> torch.Tensor:
    return torch.randn(4, 64, generator=torch.Generator().manual_seed(1))


def out(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(x())


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def dispatched(tmp_path: Path, swap: bool = False, seed: int = 0) -> nn.Sequential:
    """``six()`` with units 3-5 in a store under ``tmp_path/off``; ``swap``: the accelerator path
    (weights swapped in for each unit), run on the CPU through HostCopyOps."""
    model = six(seed)
    if swap:
        plan = automap.plan(model, DISK)
        return dispatch_plan(
            model,
            plan,
            offload_dir=tmp_path / "off",
            transfer=lambda source, *_: StagedTransfer(source, HostCopyOps()),
        )
    return automap.dispatch(model, DISK, offload_dir=tmp_path / "off")


def loaded(tmp_path: Path, seed: int = 0) -> tuple[nn.Sequential, Path]:
    """``six()`` saved as a checkpoint and loaded with units 3-5 read from it in place."""
    ck = tmp_path / "ck" / "model.safetensors"
    ck.parent.mkdir(parents=True, exist_ok=True)
    save_model(six(seed), str(ck))
    with automap.empty_model():
        skeleton = six()
    model = automap.load(skeleton, ck, DISK, quiet=True)
    assert file_backing(model[4].weight) == ck.resolve()
    return model, ck


def plain(model: nn.Module) -> bool:
    """No automap hook, override or state, and no tensor viewing a file."""
    hooked = [
        m for m in model.modules() if m._forward_pre_hooks or m._forward_hooks or "_apply" in m.__dict__
    ]
    in_files = [n for n, t in model.state_dict().items() if file_backing(t) is not None]
    return not hooked and not in_files and state_of(model) is None


# ------------------------------------------------------------------ 1. torch's API on a dispatched model


@pytest.mark.parametrize(
    "convert",
    [
        lambda m: m.half(),
        lambda m: m.to(torch.float64),
        lambda m: m.double(),
        lambda m: m[4].bfloat16(),
        lambda m: m.type(torch.float16),
    ],
    ids=["half", "to-float64", "double", "unit-bfloat16", "type"],
)
def test_a_dtype_conversion_of_offloaded_weights_is_refused_at_the_call_and_changes_nothing(
    tmp_path, convert
):
    expected, before = out(six()), weights(six())
    model = dispatched(tmp_path)
    with pytest.raises(DispatchError, match=r"offloaded tensor '\d\.weight'.*automap.undispatch"):
        convert(model)
    assert all(t.dtype == torch.float32 for t in model.state_dict().values())  # not even the resident units
    assert torch.equal(out(model), expected)
    automap.undispatch(model)
    assert plain(model) and all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


class CastsItsHead(nn.Module):
    """A forward that converts one of its own modules at each call, as Switch Transformers'
    router does (`self.classifier = self.classifier.to(torch.float32)`)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        self.head = nn.Linear(64, 8)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.head = self.head.to(torch.float64)
        return self.head(self.body(inputs).double())


def test_a_conversion_the_models_own_forward_makes_goes_through_as_in_the_plain_model(tmp_path):
    """Small offloaded tensors the forward itself converts are converted into RAM and kept
    there, as the plain model keeps them; the same call from outside a forward is refused."""
    plain = CastsItsHead().eval()
    expected = out(plain)
    model = automap.dispatch(
        CastsItsHead().eval(), {"body": "cpu", "head": "disk"}, offload_dir=tmp_path / "off"
    )
    with pytest.raises(DispatchError, match="offloaded tensor 'head.weight'"):
        model.head.half()
    assert torch.equal(out(model), expected) and torch.equal(out(model), expected)
    assert model.head.weight.dtype == torch.float64
    automap.undispatch(model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in plain.state_dict().items())


@pytest.mark.parametrize(
    "move",
    [
        lambda m: m.to("meta"),
        lambda m: m.to("cuda"),
        lambda m: m.cuda(),
        lambda m: m[4].to("meta"),
        lambda m: m[1].to_empty(device="meta"),
    ],
    ids=["to-meta", "to-gpu", "gpu", "unit-to-meta", "resident-to-empty"],
)
def test_moving_a_dispatched_model_by_hand_is_refused_at_the_call(tmp_path, move):
    expected = out(six())
    model = dispatched(tmp_path)
    with pytest.raises(DispatchError, match="dispatched Sequential"):
        move(model)
    assert all(t.device.type == "cpu" for t in model.state_dict().values())
    assert torch.equal(out(model), expected)


def test_a_conversion_that_changes_nothing_goes_through(tmp_path):
    model = dispatched(tmp_path)
    assert model.float() is model and model.to("cpu", torch.float32) is model
    assert torch.equal(out(model), out(six()))


def _rebind(model: nn.Module, new: dict[str, torch.Tensor]) -> None:
    model[4].weight.data = new["4.weight"]


def _apply_init(model: nn.Module, new: dict[str, torch.Tensor]) -> None:
    names = {id(m): n for n, m in model.named_modules()}

    def init(
        module: nn.Module,
    ) -> None:  # an init function that rebinds (as many do) rather than fill in place
        if isinstance(module, nn.Linear):
            module.weight.data = new[f"{names[id(module)]}.weight"].clone()

    model.apply(init)


def _assign(model: nn.Module, new: dict[str, torch.Tensor]) -> None:
    model.load_state_dict(new, assign=True)


def _assign_own_views(model: nn.Module, new: dict[str, torch.Tensor]) -> None:
    # The model's own state dict, half of it views of the store, put back as new Parameters.
    own = model.state_dict()
    model.load_state_dict({k: new[k] if k.startswith("4.") else own[k] for k in own}, assign=True)


@pytest.mark.parametrize("swap", [False, True], ids=["cpu", "swapped"])
@pytest.mark.parametrize(
    "change",
    [_rebind, _apply_init, _assign, _assign_own_views],
    ids=["data=", "apply", "load_state_dict-assign", "assign-own-views"],
)
def test_what_torchs_api_put_into_a_dispatched_model_is_used_and_kept_by_undispatch(tmp_path, swap, change):
    new = weights(six(seed=5))
    model = dispatched(tmp_path, swap=swap)
    change(model, new)
    reference = six()
    change(reference, new)
    expected, after = out(reference), weights(reference)
    assert torch.equal(out(model), expected)  # the forward uses what the model holds now
    assert torch.equal(out(model), expected)
    automap.undispatch(model)
    assert plain(model)
    for name, value in after.items():
        assert torch.equal(model.state_dict()[name], value), name
    assert torch.equal(out(model), expected)


# ------------------------------------------------------------------ 2. undispatch reads from the maps automap holds


def test_a_relative_offload_dir_then_chdir(tmp_path, monkeypatch):
    expected, before = out(six()), weights(six())
    monkeypatch.chdir(tmp_path)
    model = automap.dispatch(six(), DISK, offload_dir="off")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.chdir(elsewhere)
    assert torch.equal(out(model), expected)
    automap.undispatch(model)
    assert plain(model) and all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def _delete_store_file(model: nn.Module, tmp_path: Path) -> None:
    os.remove(file_backing(model[4].weight))


def _move_store_folder(model: nn.Module, tmp_path: Path) -> None:
    os.rename(tmp_path / "off", tmp_path / "moved")


def _delete_store_folder(model: nn.Module, tmp_path: Path) -> None:
    import shutil

    shutil.rmtree(tmp_path / "off")


@pytest.mark.parametrize("damage", [_delete_store_file, _move_store_folder, _delete_store_folder])
def test_a_store_file_deleted_or_its_folder_moved_while_dispatched(tmp_path, damage):
    expected, before = out(six()), weights(six())
    model = dispatched(tmp_path)
    damage(model, tmp_path)
    assert torch.equal(out(model), expected)  # the maps still hold every byte
    automap.undispatch(model)
    assert plain(model) and all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def _replace_smaller(ck: Path) -> None:
    tmp = ck.with_suffix(".new")
    save_model(nn.Sequential(nn.Linear(4, 4)), str(tmp))  # another model's save, then renamed over it
    os.replace(tmp, ck)


@pytest.mark.parametrize(
    "damage",
    [
        lambda ck: os.remove(ck),
        _replace_smaller,
        lambda ck: os.rename(ck.parent, ck.parent.with_name("renamed")),
    ],
    ids=["deleted", "replaced-by-a-smaller-file", "folder-moved"],
)
def test_the_checkpoint_deleted_replaced_or_moved_while_loaded(tmp_path, damage):
    expected, before = out(six()), weights(six())
    model, ck = loaded(tmp_path)
    damage(ck)
    assert torch.equal(out(model), expected)
    automap.undispatch(model)
    assert plain(model) and all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_only_a_truly_unreadable_tensor_is_an_error_and_it_names_the_tensor(tmp_path):
    model = dispatched(tmp_path)
    victim = file_backing(model[5].weight)
    good = victim.read_bytes()
    weight = read_header(victim).tensors["5.weight"]  # the larger one: first in the file
    os.truncate(victim, weight.begin + weight.nbytes)  # in place: 5.bias's bytes are gone, 5.weight's intact
    with pytest.raises(OffloadError, match=r"truncated.*tensor '5\.bias' are gone.*restore it"):
        automap.undispatch(model)
    assert state_of(model) is not None  # still dispatched, nothing changed
    victim.write_bytes(good)  # restored in place: readable again
    automap.undispatch(model)
    assert plain(model) and torch.equal(out(model), out(six()))


# ------------------------------------------------------------------ 3. copies and pickles


def _deepcopy(model):
    return copy.deepcopy(model)


def _pickle(model):
    return pickle.loads(pickle.dumps(model))


def _torch_save(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("swap", [False, True], ids=["cpu", "swapped"])
@pytest.mark.parametrize(
    "copier", [_deepcopy, _pickle, _torch_save], ids=["deepcopy", "pickle", "torch.save"]
)
def test_copies_and_pickles_of_a_dispatched_model_are_plain_models_with_the_current_weights(
    tmp_path, copier, swap
):
    model = dispatched(tmp_path, swap=swap)
    with torch.no_grad():
        model[4].bias.add_(1.0)  # a write into an offloaded weight (copy-on-write) is part of what is copied
    reference = six()
    with torch.no_grad():
        reference[4].bias.add_(1.0)
    twin = copier(model)
    assert plain(twin)
    assert all(torch.equal(twin.state_dict()[k], v) for k, v in reference.state_dict().items())
    assert torch.equal(out(twin), out(reference))
    unit = copier(model[4])  # a unit alone too
    assert plain(unit) and torch.equal(unit.bias, reference[4].bias)
    assert state_of(model) is not None and torch.equal(
        out(model), out(reference)
    )  # the original is untouched
    automap.undispatch(model)
    assert torch.equal(out(model), out(reference))


# ------------------------------------------------------------------ 4. a file truncated under a live model: no SIGBUS


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), str(TESTS), str(TESTS.parent)]),
    }
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, env=env
    )


@pytest.mark.parametrize(
    "read",
    [
        "m.state_dict()",
        "torch.save(m.state_dict(), io.BytesIO())",
        "m[4].state_dict()",
        "pickle.dumps(m)",
        "copy.deepcopy(m)",
        "torch.save(m, io.BytesIO())",
        "m(torch.randn(2, 64))",
        "automap.undispatch(m)",
    ],
)
def test_a_checkpoint_truncated_in_place_is_an_error_naming_the_tensors_never_a_sigbus(tmp_path, read):
    result = run_python(f"""
        import copy, io, os, pickle, sys
        from pathlib import Path
        import torch
        import automap
        from automap.errors import OffloadError
        from test_undispatch_state import loaded
        m, ck = loaded(Path({str(tmp_path)!r}))
        os.truncate(ck, 2000)  # in place, under the live model: units 3-5's bytes are gone
        report = automap.placement(m).report()
        assert "truncated" in report and "SIGBUS" in report and "'3.weight'" in report, report
        try:
            {read}
        except OffloadError as exc:
            assert "truncated" in str(exc) and "weight" in str(exc), exc
            print("OK refused:", exc)
        else:
            print("read without an error")
        """)
    assert result.returncode == 0, f"exit {result.returncode} (-7: SIGBUS)\n{result.stderr[-3000:]}"
    assert "OK refused" in result.stdout, result.stdout + result.stderr[-2000:]


# ------------------------------------------------------------------ 5. a forward racing undispatch


@pytest.mark.parametrize("swap", [False, True], ids=["cpu", "swapped"])
def test_a_forward_racing_undispatch_in_another_thread_completes_or_raises_dispatch_error(tmp_path, swap):
    expected = out(six())
    outcomes: dict[str, int] = {}
    for round_ in range(40):
        model = dispatched(tmp_path / str(round_), swap=swap)
        stop, started, errors, wrong = threading.Event(), threading.Event(), [], []

        def forwards() -> None:
            first = True
            while not stop.is_set():
                if not first:  # the round's first forward runs before undispatch may start:
                    started.set()  # each round has one that completes, then the racing ones
                first = False
                try:
                    got = out(model)
                except DispatchError:
                    outcomes["DispatchError"] = outcomes.get("DispatchError", 0) + 1
                    continue
                except BaseException as exc:  # noqa: BLE001 - what the test looks for
                    errors.append(exc)
                    started.set()
                    return
                if not torch.equal(got, expected):
                    wrong.append(round_)
                outcomes["completed"] = outcomes.get("completed", 0) + 1

        worker = threading.Thread(target=forwards)
        worker.start()
        started.wait()
        automap.undispatch(model)
        stop.set()
        worker.join()
        assert not errors, f"round {round_}: {errors[0]!r}"
        assert not wrong, f"round {round_}: a forward gave other outputs"
        assert plain(model) and torch.equal(out(model), expected)
    assert outcomes.get("completed", 0) >= 40


def test_a_dispatched_model_dropped_without_undispatch_is_collected(tmp_path):
    import gc
    import weakref

    model = dispatched(tmp_path)
    out(model)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None  # nothing automap keeps (its state, the guard's overrides) holds it alive
