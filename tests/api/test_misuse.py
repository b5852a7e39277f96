"""A user misusing automap on purpose, fifth round: what the earlier adversarial files
(test_adversarial_store.py, test_faults.py, test_store_faults.py, test_interrupts.py,
test_fuzz_files.py, test_api_forms.py, test_argument_types.py) leave out. Real mechanisms
throughout: real threads racing on one model, real processes truncating a checkpoint a model
reads in place, files written byte by byte to lie. Each case ends in the right outputs or an
``AutomapError`` naming the problem and the fix, with the model and the user's files as they
were. What could crash or poison the interpreter (SIGBUS from a mapped file, a global patch
left behind) runs in a fresh one."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import automap
from automap.errors import CheckpointError, DeviceError, DispatchError, FormatError, PlanError
from automap.runtime import state_of
from conftest import store_dirs

ROOT = Path(__file__).resolve().parents[2]
DISK_ODD = {str(i): ("disk" if i % 2 else "cpu") for i in range(6)}


def _model(width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(6)]).eval()


def _skeleton() -> nn.Module:
    with automap.empty_model():
        return _model()


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def _run(code: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _raced(calls: list) -> list[BaseException | None]:
    """Run ``calls`` in threads released together; what each raised (None: returned)."""
    barrier = threading.Barrier(len(calls))
    outcomes: list[BaseException | None] = [None] * len(calls)

    def run(i: int) -> None:
        barrier.wait()
        try:
            calls[i]()
        except BaseException as exc:  # noqa: BLE001 - judged by the test
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


# ------------------------------------------------------------------ races on one model


def test_two_threads_dispatching_one_model_one_wins_and_undispatch_leaves_nothing(tmp_path):
    x = torch.randn(3, 64)
    for _ in range(6):
        model = _model()
        expected = model(x)
        outcomes = _raced([lambda: automap.dispatch(model, DISK_ODD, offload_dir=tmp_path)] * 2)
        lost = [o for o in outcomes if o is not None]
        assert len(lost) == 1 and isinstance(lost[0], DispatchError), (
            outcomes
        )  # "by another thread" or "already"
        assert torch.equal(model(x), expected)
        automap.undispatch(model)
        assert _hooks(model) == 0 and state_of(model) is None, "the losing dispatch left hooks behind"
        assert torch.equal(model(x), expected)
    assert len(store_dirs(tmp_path)) == 1, "the losing dispatches left stores locked"


def test_two_threads_loading_one_skeleton_one_wins(tmp_path):
    real = _model()
    x = torch.randn(3, 64)
    save_file({k: v.contiguous() for k, v in real.state_dict().items()}, tmp_path / "m.safetensors")
    for _ in range(4):
        skeleton = _skeleton()
        outcomes = _raced(
            [
                lambda: automap.load(
                    skeleton, tmp_path / "m.safetensors", DISK_ODD, offload_dir=tmp_path / "off", quiet=True
                )
            ]
            * 2
        )
        lost = [o for o in outcomes if o is not None]
        assert len(lost) == 1 and isinstance(lost[0], DispatchError), outcomes
        assert torch.equal(skeleton(x), real(x))
        automap.undispatch(skeleton)
        assert _hooks(skeleton) == 0 and torch.equal(skeleton(x), real(x))


def test_forwards_racing_undispatch_are_right_or_refused_and_the_model_ends_plain(tmp_path):
    model = _model(128)
    x = torch.randn(4, 128)
    expected = model(x)
    seen: dict[str, int] = {}
    for _ in range(5):
        automap.dispatch(model, DISK_ODD, offload_dir=tmp_path)
        stop = threading.Event()

        def forwards() -> None:
            while not stop.is_set():
                try:
                    key = "right" if torch.equal(model(x), expected) else "WRONG"
                except DispatchError:
                    key = "refused"
                except BaseException as exc:  # noqa: BLE001
                    key = f"raw {type(exc).__name__}: {exc}"
                seen[key] = seen.get(key, 0) + 1

        threads = [threading.Thread(target=forwards) for _ in range(2)]
        for t in threads:
            t.start()
        automap.undispatch(model)
        stop.set()
        for t in threads:
            t.join()
    assert set(seen) <= {"right", "refused"}, seen
    assert _hooks(model) == 0 and torch.equal(model(x), expected)


def test_empty_model_blocks_of_two_threads_ended_in_the_other_order_leave_torch_as_it_was():
    # In a fresh interpreter: a patch left installed would build every later model on meta.
    result = _run("""
        import threading
        from torch import nn
        import automap

        a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
        seen = {}

        def a():
            with automap.empty_model():
                a_in.set(); b_in.wait()
                seen["a"] = nn.Linear(2, 2).weight.device.type
            a_out.set()

        def b():
            a_in.wait()
            with automap.empty_model():
                b_in.set(); a_out.wait()
                seen["b"] = nn.Linear(2, 2).weight.device.type

        inside, done = threading.Event(), threading.Event()

        def c():
            with automap.empty_model():
                inside.set(); done.wait()

        threads = [threading.Thread(target=a), threading.Thread(target=b)]
        [t.start() for t in threads]; [t.join() for t in threads]
        assert seen == {"a": "meta", "b": "meta"}, seen
        assert nn.Linear(2, 2).weight.device.type == "cpu", "the patch was left installed"
        t = threading.Thread(target=c); t.start(); inside.wait()
        assert nn.Linear(2, 2).weight.device.type == "cpu", "another thread's block reached this one"
        done.set(); t.join()
        assert nn.Module.register_parameter.__qualname__ == "Module.register_parameter"
        print("OK")
    """)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


# ------------------------------------------------------------------ a checkpoint read in place, truncated meanwhile


FLAP = """
import os, sys
path, size = sys.argv[1], int(sys.argv[2])
data = open(path, "rb").read()
for _ in range(1500):
    os.truncate(path, size // 3)
    fd = os.open(path, os.O_WRONLY)
    os.pwrite(fd, data, 0)
    os.close(fd)
"""


def test_a_checkpoint_truncated_and_restored_while_forwards_read_it_never_crashes(tmp_path):
    # Another process cuts the checkpoint to a third and writes it back, over and over, while
    # the model reads three layers from it in place: a page touched past the end would be SIGBUS.
    result = _run(
        """
        import os, subprocess, sys, torch
        from torch import nn
        from safetensors.torch import save_file
        import automap
        from automap.errors import OffloadError

        folder, flap = sys.argv[1], sys.argv[2]
        torch.manual_seed(0)
        real = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).eval()
        ck = os.path.join(folder, "model.safetensors")
        save_file({k: v.contiguous() for k, v in real.state_dict().items()}, ck)
        with automap.empty_model():
            model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).eval()
        automap.load(model, ck, {"0": "disk", "1": "disk", "2": "disk", "3": "cpu"}, quiet=True)
        x = torch.randn(4, 256)
        expected = real(x)
        flapper = subprocess.Popen([sys.executable, "-c", flap, ck, str(os.path.getsize(ck))])
        right = refused = 0
        while flapper.poll() is None:
            try:
                assert torch.equal(model(x), expected), "wrong outputs"
                right += 1
            except OffloadError as exc:
                assert "truncated" in str(exc) or "changed" in str(exc), exc
                refused += 1
        assert flapper.returncode == 0
        assert torch.equal(model(x), expected), "the restored file reads right again"
        print("OK", right, refused)
    """,
        str(tmp_path),
        FLAP,
        timeout=120,
    )
    assert result.returncode == 0 and "OK" in result.stdout, (result.returncode, result.stderr[-3000:])


# ------------------------------------------------------------------ offload_dir through a loop of links


@pytest.mark.parametrize("folder", ["a", "a/sub"])
def test_an_offload_dir_through_a_loop_of_links_says_so(tmp_path, monkeypatch, folder):
    monkeypatch.chdir(tmp_path)
    os.symlink("b", "a")
    os.symlink("a", "b")
    model = _model()
    for call in (
        lambda: automap.plan(model, offload_dir=folder),
        lambda: automap.dispatch(model, DISK_ODD, offload_dir=folder),
    ):
        with pytest.raises(
            automap.OffloadError, match=f"offload_dir {folder} leads through a loop of symbolic links"
        ):
            call()
    assert sorted(os.listdir(tmp_path)) == ["a", "b"] and state_of(model) is None


# ------------------------------------------------------------------ checkpoints that lie


def _raw_safetensors(path: Path, header: bytes, data: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_a_safetensors_header_naming_a_tensor_twice_is_refused(tmp_path):
    entry = '{"dtype": "F32", "shape": [2, 2], "data_offsets": [%d, %d]}'
    header = (
        '{"0.weight": %s, "0.weight": %s, "0.bias": %s}'
        % (entry % (0, 16), entry % (16, 32), entry % (32, 40))
    ).encode()
    _raw_safetensors(tmp_path / "m.safetensors", header, bytes(40))
    with automap.empty_model():
        model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(FormatError, match=r"m\.safetensors.*names '0\.weight' twice"):
        automap.load(model, tmp_path / "m.safetensors", quiet=True)
    assert model[0].weight.is_meta and state_of(model) is None


def test_a_shard_index_naming_a_tensor_twice_is_refused(tmp_path):
    real = _model()
    save_file({k: v.contiguous() for k, v in real.state_dict().items()}, tmp_path / "a.safetensors")
    save_file({k: torch.zeros_like(v) for k, v in real.state_dict().items()}, tmp_path / "b.safetensors")
    pairs = ", ".join(f'"{k}": "b.safetensors", "{k}": "a.safetensors"' for k in real.state_dict())
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {%s}}' % pairs)
    before = _hashes(tmp_path)
    with pytest.raises(CheckpointError, match=r"index .*names '0\.weight' twice.*fix or remove the index"):
        automap.load(_skeleton(), tmp_path, DISK_ODD, offload_dir=tmp_path / "off", quiet=True)
    assert _hashes(tmp_path) == before and not (tmp_path / "off").exists()


@pytest.mark.parametrize("kind", ["folder", "pipe"])
def test_a_shard_index_naming_a_folder_or_pipe_says_so(tmp_path, kind):
    real = _model()
    (tmp_path / "shard.safetensors").mkdir() if kind == "folder" else os.mkfifo(
        tmp_path / "shard.safetensors"
    )
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "shard.safetensors" for k in real.state_dict()}})
    )
    with pytest.raises(CheckpointError, match="'shard.safetensors', which is in .* no regular file"):
        automap.load(_skeleton(), tmp_path, DISK_ODD, offload_dir=tmp_path / "off", quiet=True)


def test_complex_numbers_for_a_real_parameter_are_refused_before_any_read(tmp_path):
    real = _model()
    tensors = {k: v.contiguous() for k, v in real.state_dict().items()}
    tensors["2.weight"] = torch.complex(tensors["2.weight"], torch.ones_like(tensors["2.weight"]))
    save_file(tensors, tmp_path / "m.safetensors")
    skeleton = _skeleton()
    with pytest.raises(
        CheckpointError, match=r"'2\.weight': complex64 in the checkpoint, float32 .*imaginary"
    ):
        automap.load(skeleton, tmp_path / "m.safetensors", DISK_ODD, offload_dir=tmp_path / "off", quiet=True)
    assert all(p.is_meta for p in skeleton.parameters()) and not (tmp_path / "off").exists()


@pytest.mark.parametrize("form", ["model and checkpoint", "folder", "accelerate"])
def test_an_empty_checkpoint_path_never_reads_the_working_directory(tmp_path, monkeypatch, form):
    real = _model()
    save_file({k: v.contiguous() for k, v in real.state_dict().items()}, tmp_path / "model.safetensors")
    monkeypatch.chdir(tmp_path)  # a checkpoint here: "" would have loaded it
    from automap.accelerate_compat import load_checkpoint_and_dispatch

    calls = {
        "model and checkpoint": lambda: automap.load(_skeleton(), "", quiet=True),
        "folder": lambda: automap.load(""),
        "accelerate": lambda: load_checkpoint_and_dispatch(_skeleton(), ""),
    }
    with pytest.raises(CheckpointError, match="the path is empty.*'.' for the working directory"):
        calls[form]()


# ------------------------------------------------------------------ plan JSON that lies


def _plan_json(tmp_path) -> dict:
    return json.loads(automap.plan(_model(), DISK_ODD, offload_dir=tmp_path).to_json())


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "is not JSON"),
        ("{", "is not JSON"),
        ("[" * 100_000, "is not JSON"),
        ("null", "holds a NoneType"),
        ("[]", "holds a list"),
        ("1e999", "1e999 is out of range"),
        ('{"version": 1}', "lacks the field 'devices'"),
    ],
)
def test_plan_json_that_is_no_plan_is_a_plan_error(text, message):
    with pytest.raises(PlanError, match=f"{message}.*plan.to_json"):
        automap.Plan.from_json(text)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda d: d["units"][0].update(device="disk:0"),
            "places a unit on 'disk:0', which is not one of its devices",
        ),
        (lambda d: d["units"][0].update(device=None), "places a unit on None"),
        (lambda d: d["units"][0].update(device="cuda:0"), "places a unit on 'cuda:0'"),
        (lambda d: d["units"][0].update(param_bytes="x"), "param_bytes='x', which is not a count"),
        (lambda d: d["units"][0].update(experts=-1), "experts=-1, which is not a count"),
        (lambda d: d["units"][0].update(tensors=[5]), r"tensors=\(5,\), which is not a tuple\[str, ...\]"),
        (lambda d: d["units"][0].update(loose=5), "loose=5"),
        (lambda d: d["units"].__setitem__(0, 5), "unit 0 is a int, not an object"),
        (lambda d: d.update(units=5), "not a plan automap wrote"),
        (
            lambda d: d["devices"][0].update(capacity_bytes="x"),
            r"devices\[0\].capacity_bytes='x' is a str, not a number",
        ),
        (
            lambda d: d.update(execution_device="disk"),
            "execution_device 'disk' is not a device that computes",
        ),
        (lambda d: d.update(devices=d["devices"] + d["devices"][:1]), "lists one device twice"),
    ],
)
def test_a_tampered_plan_is_refused_when_read(tmp_path, change, message):
    data = _plan_json(tmp_path)
    change(data)
    with pytest.raises(PlanError, match=message):
        automap.Plan.from_json(json.dumps(data))


def test_a_plan_computing_on_a_gpu_this_machine_lacks_is_refused_before_anything_moves(tmp_path):
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has cuda:7")
    data = _plan_json(tmp_path)
    data["execution_device"] = "cuda:7"
    plan = automap.Plan.from_json(json.dumps(data))
    model = _model()
    x = torch.randn(2, 64)
    expected = model(x)
    with pytest.raises(DeviceError, match="cuda:7"):
        automap.dispatch(model, plan, offload_dir=tmp_path / "off")
    assert state_of(model) is None and _hooks(model) == 0 and torch.equal(model(x), expected)
    assert not (tmp_path / "off").exists()


def test_an_untampered_plan_still_round_trips(tmp_path):
    plan = automap.plan(_model(), DISK_ODD, offload_dir=tmp_path)
    again = automap.Plan.from_json(plan.to_json())
    assert again.device_map == plan.device_map and again.units == plan.units


# ------------------------------------------------------------------ the command line


@pytest.mark.parametrize("flag", ["--batch", "--seq-len"])
def test_cli_counts_too_large_for_a_tensor_are_one_line_errors(flag, capsys):
    from automap.cli import main

    assert main(["plan", "torchvision:resnet18", flag, str(10**20), "--max-memory", "cpu=1GB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "between 1 and 2,147,483,648" in err[0], err
