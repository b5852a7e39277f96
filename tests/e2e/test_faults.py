"""Nothing the user owns is lost or silently wrong: each numbered case of issue #11, reproduced
with real mechanisms — a real ``kill -9`` of a writing process, ``RLIMIT_FSIZE`` as a full disk,
two real processes on one ``offload_dir``, real threads — and every case that could crash the
interpreter (writes into mapped weights) run in a subprocess, so a crash fails its test instead
of killing the suite."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file, save_model

import automap
from automap.errors import CheckpointError, OffloadError
from automap.offload import MANIFEST
from automap.runtime import state_of
from conftest import file_backing, logits_of, store_dirs, tiny_gpt2, tiny_llama

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
_LAYERS_ON_DISK = {
    "model.embed_tokens": "cpu",
    "model.rotary_emb": "cpu",
    "model.layers.0": "disk",
    "model.layers.1": "disk",
    "model.layers.2": "cpu",
    "model.layers.3": "disk",
    "model.norm": "cpu",
    "lm_head": "cpu",
}


def run_python(
    code: str, *args: str, cwd: Path | None = None, timeout: int = 180
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter that imports automap and the test builders."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), str(TESTS), str(ROOT)]),
    }
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )


def ok(result: subprocess.CompletedProcess) -> str:
    detail = (
        f"exit {result.returncode} (a negative code is the signal that killed it)\n{result.stderr[-3000:]}"
    )
    assert result.returncode == 0, detail
    assert "OK" in result.stdout, detail
    return result.stdout


def digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` (relative path -> hash)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _empty(real):
    with automap.empty_model():
        return type(real)(real.config).eval()


# ------------------------------------------------------------------ 1. the checkpoint is never destroyed


def _checkpoint_folder(tmp_path: Path, real) -> Path:
    """A folder holding ``real`` as model.safetensors and a user's file named like a unit's store file."""
    ck = tmp_path / "ck"
    ck.mkdir()
    save_model(real, str(ck / "model.safetensors"))
    (ck / "model_layers_0.safetensors").write_bytes(b"the user's")
    return ck


def test_a_store_written_into_the_checkpoint_folder_replaces_nothing(tmp_path):
    real = tiny_llama(layers=2)
    ck = _checkpoint_folder(tmp_path, real)
    (ck / "lm_head.safetensors").write_bytes(b"a user's file named like a unit")
    before = digest(ck)
    ids = torch.randint(0, 256, (1, 8))
    reference = tiny_llama(layers=2)
    for tensor in reference.state_dict(
        keep_vars=True
    ).values():  # the weights; the rotary inv_freq stays float32
        tensor.data = tensor.data.half()
    expected = logits_of(reference, ids)
    model = automap.load(
        _empty(real),
        ck / "model.safetensors",
        {"model": "disk", "lm_head": "cpu"},
        offload_dir=ck,
        dtype=torch.float16,
        quiet=True,
    )
    assert {k: v for k, v in digest(ck).items() if not k.startswith("automap-store-")} == before
    assert torch.equal(logits_of(model, ids), expected)
    (store,) = store_dirs(ck)
    assert all(str(p).startswith(str(store)) for p in {file_backing(t) for t in model.model.parameters()}), (
        "the converted weights live in automap's own folder"
    )
    automap.undispatch(model)
    assert {k: v for k, v in digest(ck).items() if not k.startswith("automap-store-")} == before


def test_a_failed_write_deletes_nothing_of_the_users(tmp_path):
    ck = _checkpoint_folder(tmp_path, tiny_llama(layers=2))
    before = digest(ck)
    out = ok(
        run_python(
            """
        import resource, signal, sys, torch, automap
        from conftest import tiny_llama
        real = tiny_llama(layers=2)
        with automap.empty_model():
            skeleton = type(real)(real.config).eval()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a full disk: writes fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
        try:
            automap.load(skeleton, sys.argv[1] + "/model.safetensors", {"model": "disk", "lm_head": "cpu"},
                         offload_dir=sys.argv[1], dtype=torch.float16, quiet=True)
        except automap.OffloadError as exc:
            print("OK", exc)
    """,
            str(ck),
        )
    )
    assert "failed (File too large" in out and "ulimit -f" in out
    assert digest(ck) == before, "the user's files are untouched and nothing of automap's is left"


# ------------------------------------------------------------------ 2. a second model never breaks the first


def test_two_models_in_one_offload_dir_each_get_a_store(tmp_path):
    draft, main = tiny_llama(layers=4), tiny_llama(layers=4)
    with torch.no_grad():
        for p in main.model.layers.parameters():
            p.mul_(1.5)  # same architecture, other weights: fine-tuned in memory
    ids = torch.randint(0, 256, (1, 8))
    expected = {"draft": logits_of(draft, ids), "main": logits_of(main, ids)}
    automap.dispatch(main, _LAYERS_ON_DISK, offload_dir=tmp_path)
    automap.dispatch(draft, _LAYERS_ON_DISK, offload_dir=tmp_path)
    assert len(store_dirs(tmp_path)) == 2
    assert torch.equal(logits_of(main, ids), expected["main"])
    assert torch.equal(logits_of(draft, ids), expected["draft"])
    automap.undispatch(draft)
    automap.undispatch(main)
    assert torch.equal(logits_of(main, ids), expected["main"]), "the fine-tuned weights came back"


def test_two_processes_on_one_offload_dir(tmp_path):
    first = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import sys, time, torch, automap
        from pathlib import Path
        from conftest import logits_of, tiny_llama
        from test_faults import _LAYERS_ON_DISK
        folder, ready, done = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
        model = tiny_llama(layers=4)
        with torch.no_grad():
            for p in model.model.layers.parameters():
                p.add_(0.01)  # fine-tuned in memory: the store holds the only copy of these weights
        tuned = {n: t.clone() for n, t in model.state_dict().items()}
        ids = torch.randint(0, 256, (2, 8))
        expected = logits_of(model, ids)
        automap.dispatch(model, _LAYERS_ON_DISK, offload_dir=folder)
        ready.write_text("dispatched")
        deadline = time.time() + 120
        while not done.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert torch.equal(logits_of(model, ids), expected)
        automap.undispatch(model)
        assert all(torch.equal(t, tuned[n]) for n, t in model.state_dict().items())
        print("OK")
    """),
            str(tmp_path / "off"),
            str(tmp_path / "ready"),
            str(tmp_path / "done"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), str(TESTS), str(ROOT)]),
        },
    )
    try:
        deadline = time.time() + 120
        while not (tmp_path / "ready").exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "ready").exists(), first.communicate()[1][-2000:]
        ok(
            run_python(
                """
            import sys, torch, automap
            from conftest import logits_of, tiny_llama
            from test_faults import _LAYERS_ON_DISK
            model = tiny_llama(layers=4)
            ids = torch.randint(0, 256, (2, 8))
            expected = logits_of(model, ids)
            automap.dispatch(model, _LAYERS_ON_DISK, offload_dir=sys.argv[1])
            assert torch.equal(logits_of(model, ids), expected)
            print("OK")  # exits while still dispatched: its lock goes with it
        """,
                str(tmp_path / "off"),
            )
        )
    finally:
        (tmp_path / "done").write_text("")
        stdout, stderr = first.communicate(timeout=180)
    assert first.returncode == 0 and "OK" in stdout, stderr[-3000:]
    assert len(store_dirs(tmp_path / "off")) == 2, "the second process built a store of its own"


# ------------------------------------------------------------------ 3. writes never crash the process


def test_writes_into_offloaded_weights_take_effect_and_never_crash():
    ok(
        run_python("""
        import copy, tempfile, torch, automap
        from torch import nn
        torch.manual_seed(0)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.linear1, self.batchnorm, self.linear2 = nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 5)
            def forward(self, x):
                return self.linear2(self.batchnorm(self.linear1(x)))

        plain = Net()
        placed = copy.deepcopy(plain)
        folder = tempfile.mkdtemp()
        automap.dispatch(placed, {"linear1": "disk", "batchnorm": "disk", "linear2": "disk"}, offload_dir=folder)
        # BatchNorm recalibrating its statistics in train mode, with and without grad
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                x = torch.randn(8, 3)
                assert torch.equal(placed(x), plain(x))
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            assert torch.equal(getattr(placed.batchnorm, name), getattr(plain.batchnorm, name)), name
        # weight.mul_() inside a forward, and a hook doing bias.data.zero_()
        def double(module, args):
            module.weight.data.mul_(2)

        def zero(module, args):
            module.bias.data.zero_()

        for model in (plain, placed):
            model.linear2.register_forward_pre_hook(double)
            model.linear1.register_forward_pre_hook(zero)
        with torch.no_grad():
            x = torch.randn(8, 3)
            assert torch.equal(placed(x), plain(x))
        assert torch.equal(placed.linear2.weight, plain.linear2.weight) and not placed.linear1.bias.any()
        # and outside a forward: a real tensor, never a placeholder
        with torch.no_grad():
            placed.linear1.weight.mul_(3)
            plain.linear1.weight.mul_(3)
        assert torch.equal(placed.linear1.weight, plain.linear1.weight)
        report = automap.placement(placed).report()
        assert "written in memory since dispatch (copy-on-write" in report, report
        automap.undispatch(placed)
        assert all(torch.equal(a, b) for a, b in zip(placed.state_dict().values(), plain.state_dict().values()))
        print("OK")
    """)
    )


# ------------------------------------------------------------------ 4. every reachable weight is real


def test_state_dict_torch_save_and_save_pretrained_see_real_weights(tmp_path):
    from transformers import LlamaForCausalLM

    model = tiny_llama(layers=4)
    plain = {n: t.clone() for n, t in model.state_dict().items()}
    ids = torch.randint(0, 256, (1, 8))
    expected = logits_of(model, ids)
    automap.dispatch(model, _LAYERS_ON_DISK, offload_dir=tmp_path / "off")
    state = model.state_dict()
    assert state.keys() == plain.keys()
    assert all(state[n].shape == t.shape and torch.equal(state[n], t) for n, t in plain.items())
    printed = repr(model.model.layers[0].mlp.up_proj.weight)
    assert model.model.layers[0].mlp.up_proj.weight.shape == (128, 64) and "tensor([]" not in printed
    assert f"{plain['model.layers.0.mlp.up_proj.weight'][0, 0].item():.4f}" in printed
    torch.save(model.state_dict(), tmp_path / "saved.pt")
    again = torch.load(tmp_path / "saved.pt")
    assert all(torch.equal(again[n], t) for n, t in plain.items())
    model.save_pretrained(tmp_path / "hf")
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(logits_of(reloaded, ids), expected)


def test_save_pretrained_over_the_models_own_folder(tmp_path):
    from transformers import LlamaForCausalLM

    real = tiny_llama(layers=4)
    ids = torch.randint(0, 256, (1, 8))
    expected = logits_of(real, ids)
    real.save_pretrained(tmp_path / "hf")
    model = automap.load(_empty(real), tmp_path / "hf", _LAYERS_ON_DISK, quiet=True)
    model.save_pretrained(tmp_path / "hf")  # rewrites the very file its offloaded weights are read from
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert all(
        torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), real.state_dict().values())
    ), "every tensor was saved with its true values"
    assert torch.equal(logits_of(model, ids), expected), "and the model still works"


# ------------------------------------------------------------------ 5. stale copies never shadow the checkpoint


def test_an_old_store_in_the_checkpoint_folder_is_never_read(tmp_path):
    real = tiny_llama(layers=2)
    ids = torch.randint(0, 256, (1, 8))
    expected = logits_of(real, ids)
    ck = tmp_path / "ck"
    ck.mkdir()
    save_model(real, str(ck / "model.safetensors"))
    old = automap.load(
        _empty(real), ck, {"model": "disk", "lm_head": "cpu"}, offload_dir=ck, dtype=torch.float16, quiet=True
    )
    automap.undispatch(old)
    assert store_dirs(ck), "an fp16 store now sits in the checkpoint folder"
    # ... and one of the layout automap wrote before its stores had folders of their own:
    layer = {k: v.half() for k, v in real.state_dict().items() if k.startswith("model.layers.0.")}
    save_file(layer, ck / "model.layers.0.safetensors")
    (ck / "automap-index.json").write_text(
        json.dumps(
            {"version": 1, "tensors": {k: {"file": "model.layers.0.safetensors", "key": k} for k in layer}}
        )
    )
    model = automap.load(_empty(real), ck, max_memory={"cpu": "1GB"}, quiet=True)
    assert all(t.dtype == torch.float32 for t in model.parameters())
    assert torch.equal(logits_of(model, ids), expected)


def test_two_files_holding_one_key_without_an_index_are_refused(tmp_path):
    real = tiny_llama(layers=2)
    save_model(
        real, str(tmp_path / "weights.safetensors")
    )  # no file from_pretrained would pick over the others
    save_file({"lm_head.weight": real.lm_head.weight.detach().half()}, tmp_path / "old-copy.safetensors")
    with pytest.raises(
        CheckpointError,
        match="'lm_head.weight' is in both old-copy.safetensors and weights"
        ".safetensors.*no index.*remove the stale copy",
    ):
        automap.load(_empty(real), tmp_path, quiet=True)


# ------------------------------------------------------------------ 6. threads


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_forwards_from_four_threads_on_one_dispatched_model(tmp_path, grad):
    model = tiny_llama(layers=4)
    inputs = [torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    expected = [logits_of(model, ids) for ids in inputs]
    automap.dispatch(model, _LAYERS_ON_DISK, offload_dir=tmp_path)
    wrong, errors = [], []

    def run(i):
        try:
            for _ in range(13):
                with torch.set_grad_enabled(grad):
                    got = model(inputs[i]).logits.detach()
                if not torch.equal(got, expected[i]):
                    wrong.append(i)
        except Exception as exc:  # noqa: BLE001 - collected and reported
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert not wrong


# ------------------------------------------------------------------ 7. faults while writing, damaged stores


def test_a_full_disk_while_writing_the_store(tmp_path):
    (tmp_path / "off").mkdir()
    (tmp_path / "off" / "keep.txt").write_text("the user's")
    out = ok(
        run_python(
            """
        import resource, signal, sys, torch, automap
        from conftest import logits_of, tiny_llama
        from test_faults import _LAYERS_ON_DISK
        model = tiny_llama(layers=4)
        ids = torch.randint(0, 256, (1, 8))
        expected = logits_of(model, ids)
        before = {n: t for n, t in model.state_dict(keep_vars=True).items()}
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000))
        try:
            automap.dispatch(model, _LAYERS_ON_DISK, offload_dir=sys.argv[1])
        except automap.OffloadError as exc:
            print("OK", exc)
        assert automap.runtime.state_of(model) is None
        assert all(t is before[n] for n, t in model.state_dict(keep_vars=True).items())
        assert torch.equal(logits_of(model, ids), expected), "the model is unchanged"
    """,
            str(tmp_path / "off"),
        )
    )
    assert "writing the offload store in" in out and "nothing it wrote was kept" in out
    assert sorted(os.listdir(tmp_path / "off")) == ["keep.txt"]


def test_a_permission_error_on_the_offload_dir(tmp_path):
    """A real permission error even for root: the folder is made immutable (``chattr +i``)."""
    folder = tmp_path / "off"
    folder.mkdir()
    (folder / "keep.txt").write_text("the user's")
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available on this file system")
    try:
        model = tiny_llama(layers=4)
        ids = torch.randint(0, 256, (1, 8))
        expected = logits_of(model, ids)
        with pytest.raises(OffloadError, match=rf"{folder}.*not writable.*pass a writable directory"):
            automap.dispatch(model, _LAYERS_ON_DISK, offload_dir=folder)
        assert state_of(model) is None and torch.equal(logits_of(model, ids), expected), (
            "the model is unchanged"
        )
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    assert sorted(os.listdir(folder)) == ["keep.txt"]


def _big_model_code() -> str:
    return """
        import torch
        from torch import nn
        def big():
            torch.manual_seed(0)
            return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(32)]).eval()
        DISK = {str(i): ("disk" if i % 2 else "cpu") for i in range(32)}
    """


def test_kill_9_in_the_middle_of_writing_then_the_next_dispatch_rebuilds(tmp_path):
    # The writer pauses (with its third file written, just before renaming it into place) only so
    # that the kill lands mid-write every time: a profile hook in the writer itself, on its calls
    # to os.replace, nothing of automap's replaced. The kill itself is a real SIGKILL.
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(_big_model_code())
            + textwrap.dedent("""
        import os, sys, time, automap
        from pathlib import Path
        folder, seen = Path(sys.argv[1]), set()
        def pause_at_third_file(frame, event, arg):
            if event == "c_call" and arg is os.replace:
                seen.update(p.name for p in folder.glob("*/.*.safetensors.*.tmp"))
                if len(seen) == 3:
                    Path(sys.argv[2]).write_text(str(sorted(seen)))
                    time.sleep(600)
        sys.setprofile(pause_at_third_file)
        automap.dispatch(big(), DISK, offload_dir=sys.argv[1], example_inputs=(torch.randn(1, 1024),))
    """),
            str(tmp_path / "off"),
            str(tmp_path / "paused"),
        ],
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), str(TESTS), str(ROOT)]),
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.time() + 120
        while not (tmp_path / "paused").exists() and writer.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        assert (tmp_path / "paused").exists(), (
            writer.stderr.read().decode()[-2000:] if writer.poll() else "timeout"
        )
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.wait(timeout=30)
    assert writer.returncode == -signal.SIGKILL
    tmp_path = tmp_path / "off"
    (store,) = store_dirs(tmp_path)
    assert json.loads((store / MANIFEST).read_text())["complete"] is False, "killed mid-write: not complete"
    assert [p for p in store.iterdir() if p.name.endswith(".tmp")], "it died with a file half in place"
    namespace: dict = {}
    exec(textwrap.dedent(_big_model_code()), namespace)
    model, x = namespace["big"](), torch.randn(2, 1024)
    with torch.no_grad():
        expected = model(x)
    automap.dispatch(model, namespace["DISK"], offload_dir=tmp_path, example_inputs=(torch.randn(1, 1024),))
    assert store_dirs(tmp_path) == [store], "the interrupted store (its lock died with its writer) is rebuilt"
    assert json.loads((store / MANIFEST).read_text())["complete"] is True
    assert not [p for p in store.iterdir() if p.name.endswith(".tmp")], (
        "the killed writer's temporary file is gone"
    )
    with torch.no_grad():
        assert torch.equal(model(x), expected)


@pytest.mark.parametrize("damage", ["manifest {}", "manifest list", "manifest version", "header list"])
def test_a_damaged_store_is_rebuilt_never_a_raw_exception(tmp_path, damage):
    model = tiny_llama(layers=4)
    ids = torch.randint(0, 256, (1, 8))
    expected = logits_of(model, ids)
    automap.dispatch(model, _LAYERS_ON_DISK, offload_dir=tmp_path)
    automap.undispatch(model)
    (store,) = store_dirs(tmp_path)
    if damage == "header list":
        victim = sorted(store.glob("*.safetensors"))[0]
        text = b"[1, 2, 3]"
        victim.write_bytes(struct.pack("<Q", len(text)) + text)
    else:
        text = {
            "manifest {}": "{}",
            "manifest list": "[]",
            "manifest version": json.dumps(
                {"format": "automap-offload-store", "version": 99, "complete": True, "tensors": {}}
            ),
        }[damage]
        (store / MANIFEST).write_text(text)
    automap.dispatch(model, _LAYERS_ON_DISK, offload_dir=tmp_path)
    assert torch.equal(logits_of(model, ids), expected)


def test_a_damaged_store_file_under_a_live_model_is_refused_with_the_file_and_the_fix(tmp_path):
    model = tiny_llama(layers=4)
    ids = torch.randint(0, 256, (1, 8))
    automap.dispatch(model, _LAYERS_ON_DISK, offload_dir=tmp_path)
    victim = file_backing(model.model.layers[0].mlp.up_proj.weight)
    os.truncate(victim, 100)
    with pytest.raises(OffloadError, match=rf"{victim.name} is truncated.*(restore it|undispatch)"):
        logits_of(model, ids)


# ------------------------------------------------------------------ 8. checkpoint headers


def _raw_safetensors(path: Path, header: object, data: bytes = b"\x00" * 64) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize(
    "header, message",
    [
        (
            {
                "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
            },
            "overlap",
        ),
        (
            {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0.0, 16.0]}},
            "data_offsets .* is not two integers",
        ),
        (
            {"w": {"dtype": "F32", "shape": [4], "data_offsets": ["0", "16"]}},
            "data_offsets .* is not two integers",
        ),
        ([{"dtype": "F32"}], "a JSON list, not an object"),
        (
            {"w": {"dtype": "F32", "shape": [4.5], "data_offsets": [0, 16]}},
            "shape .* is not a list of non-negative",
        ),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1000]}}, "spans bytes 0..1000"),
        ({"w": {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]}}, "is truncated"),
        ({"w": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 16]}}, "dtype 'Q4'.*cannot read"),
        ({"w": [1, 2]}, "its entry is a list"),
    ],
)
def test_bad_headers_are_refused_by_the_one_parser(tmp_path, header, message):
    path = tmp_path / "bad.safetensors"
    _raw_safetensors(path, header)
    with pytest.raises(CheckpointError, match=message) as info:
        automap.load(_empty(tiny_llama(layers=2)), path, quiet=True)
    assert str(path) in str(info.value), "the message names the file"
    assert isinstance(info.value, OffloadError), "the same parser, and error, for store files"


@pytest.mark.parametrize("entry", ["../elsewhere/x.safetensors", "/etc/x.safetensors", "sub/x.safetensors"])
def test_a_shard_index_naming_files_outside_its_folder_is_refused(tmp_path, entry):
    real = tiny_gpt2(layers=2)
    (tmp_path / "elsewhere").mkdir()
    save_model(real, str(tmp_path / "elsewhere" / "x.safetensors"))
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: entry for k in real.state_dict()}})
    )
    with pytest.raises(CheckpointError, match="not a file name inside .*plain file names"):
        automap.load(_empty(real), ck, quiet=True)


# ------------------------------------------------------------------ 9. the CLI does not shadow packages


def test_module_factory_spec_never_lets_the_working_directory_shadow_packages(tmp_path):
    (tmp_path / "matplotlib.py").write_text(
        "import pathlib; pathlib.Path('SHADOWED').write_text('x')\n"
        "raise SystemExit('the stray matplotlib.py was imported')\n"
    )
    (tmp_path / "mymodels.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Sequential("
        "torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))\n"
    )
    cli = Path(sys.executable).parent / "automap"
    result = subprocess.run(
        [str(cli), "plan", "mymodels:build", "--max-memory", "cpu=1GB", "--figure", str(tmp_path / "p.png")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert not (tmp_path / "SHADOWED").exists()
    assert (tmp_path / "p.png").exists() and "automap plan" in result.stdout


def test_the_cli_docs_say_that_a_spec_runs_code():
    text = (ROOT / "docs" / "cli.md").read_text()
    assert "A SPEC runs code" in text and "python -m" in text
