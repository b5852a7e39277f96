"""What a newcomer meets first on the command line and in ``import automap``: the version, a
public namespace that is the API only, offline presets, the refusal of a hub id (with the
command that downloads), errors that say a path does not exist, and ``--quiet`` that is quiet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import automap
from automap.cli import main
from automap.presets import PRESETS, check_not_hub_id
from automap.spec_plan import plan_spec
from automap.specs import SpecError, build_model
from automap.version import SOURCE_VERSION
from tiny_configs import part_on_disk


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version_is_the_installed_one_on_the_command_line_and_in_python():
    expected = metadata.version("automap")
    assert automap.__version__ == expected
    done = subprocess.run(
        [sys.executable, "-m", "automap", "--version"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout == f"automap {expected}\n" and done.stderr == ""
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert f'version = "{SOURCE_VERSION}"' in pyproject  # the fallback of a never-installed checkout


def test_dir_shows_the_api_only_and_every_name_resolves():
    listed = dir(automap)
    assert listed == sorted({*automap.__all__, "__version__"})
    for helper in ("Any", "TYPE_CHECKING", "importlib", "annotations", "_HOMES"):
        assert helper not in listed
    assert not any(hasattr(automap, name) for name in ("Any", "TYPE_CHECKING", "importlib"))
    for name in automap.__all__:
        assert getattr(automap, name) is not None
    assert {"dispatch", "load", "plan", "placement", "undispatch", "clean"} <= set(automap.__all__)
    assert callable(automap.report.figure) and callable(automap.report.write_json)  # submodules reachable


# Parameter counts of the public models whose shapes the presets carry (their model cards).
PUBLISHED = {
    "llama-3-8b": 8.03e9,
    "llama-3-70b": 70.55e9,
    "mistral-7b": 7.24e9,
    "mixtral-8x7b": 46.70e9,
    "qwen3-30b-a3b": 30.53e9,
    "gpt2": 124.4e6,
}


def test_list_presets_names_every_preset(capsys):
    code, out, _ = _run(capsys, "plan", "--list-presets")
    assert code == 0
    assert set(PRESETS) == set(PUBLISHED)
    for name, fields in PRESETS.items():
        assert any(line.startswith(name + " ") and fields["source"] in line for line in out.splitlines())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_build_on_meta_with_the_published_size(name):
    built = build_model(name)
    assert all(t.device.type == "meta" for t in built.model.state_dict().values())
    assert abs(built.parameters - PUBLISHED[name]) / PUBLISHED[name] < 0.005, built.parameters
    assert name in built.label


def test_a_preset_plans_offline_for_the_headline_case(capsys, tmp_path):
    code, out, err = _run(
        capsys,
        "plan",
        "llama-3-70b",
        "--max-memory",
        "0=24GiB,cpu=64GiB,disk=200GiB",
        "--json",
        str(tmp_path / "p.json"),
    )
    assert code == 0, err
    assert "preset llama-3-70b" in out and "cuda:0" in out
    data = json.loads((tmp_path / "p.json").read_text())
    assert 130 * 2**30 < data["totals"]["weight_bytes"] < 133 * 2**30  # 70.55B parameters in bfloat16
    assert {0, "cpu", "disk"} == set(data["device_map"].values())


def test_a_preset_takes_set_overrides():
    assert build_model("llama-3-8b", {"num_hidden_layers": 2}).model.config.num_hidden_layers == 2


@pytest.mark.parametrize(
    "spec", ["meta-llama/Llama-3-8B", "Qwen/Qwen3-30B-A3B", "hf:meta-llama/Meta-Llama-3-8B"]
)
def test_a_hub_id_says_automap_never_downloads_and_gives_the_command(capsys, spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(capsys, "plan", spec)
    hub_id = spec.removeprefix("hf:")
    assert code == 2 and out == ""
    assert "never downloads" in err and f"hf download {hub_id} --local-dir ./{hub_id.split('/')[1]}" in err
    assert f"automap plan ./{hub_id.split('/')[1]}" in err and len(err.strip().splitlines()) == 1


_NAME = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,20}", fullmatch=True)


@settings(max_examples=200, deadline=None)
@given(org=_NAME, name=_NAME)
def test_every_org_slash_name_that_is_no_path_is_refused_as_a_hub_id(org, name):
    spec = f"{org}/{name}"
    if os.path.lexists(spec) or spec.endswith(".py"):
        return
    with pytest.raises(SpecError, match="never downloads") as caught:
        check_not_hub_id(spec)
    assert f"hf download {spec} --local-dir ./{name}" in str(caught.value)


def test_an_existing_org_slash_name_folder_is_a_folder_not_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "meta-llama" / "Llama-3-8B").mkdir(parents=True)
    check_not_hub_id("meta-llama/Llama-3-8B")  # no error: the folder is there
    with pytest.raises(SpecError, match="has no config.json"):
        build_model("meta-llama/Llama-3-8B")


@pytest.mark.parametrize("spec", ["./missing", "missing/a/b", "/no/such/folder", "../missing-model"])
def test_a_missing_path_says_it_does_not_exist(capsys, spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(capsys, "plan", spec)
    assert code == 2 and "does not exist" in err and "is not a folder" not in err


def test_a_file_given_as_a_folder_says_it_is_a_file(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    code, _, err = _run(capsys, "plan", "./weights.bin")
    assert code == 2 and "is a file, not a model folder" in err
    with pytest.raises(automap.CheckpointError, match="does not exist"):
        automap.load(str(tmp_path / "missing"))


def test_quiet_prints_nothing_and_still_writes(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "automap",
            "plan",
            "torchvision:resnet18",
            "--max-memory",
            "cpu=1GB",
            "--quiet",
            "--json",
            "p.json",
            "--figure",
            "p.svg",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""
    assert json.loads((tmp_path / "p.json").read_text())["device_map"] and (tmp_path / "p.svg").stat().st_size


def test_demo_save_writes_loadable_folders_offline_and_keeps_existing_ones(capsys, tmp_path):
    (tmp_path / "gptj").mkdir()
    (tmp_path / "gptj" / "mine.txt").write_text("mine")
    assert main(["demo", "--save", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'llama'}" in out and f"kept {tmp_path / 'gptj'}" in out
    assert sorted(p.name for p in (tmp_path / "gptj").iterdir()) == ["mine.txt"]
    assert main(["plan", str(tmp_path / "llama"), "--max-memory", "cpu=1GB", "--quiet"]) == 0
    built = plan_spec(str(tmp_path / "llama"), max_memory={"cpu": "1GB"}).built.model
    model = automap.load(
        str(tmp_path / "llama"), max_memory=part_on_disk(built), offload_dir=tmp_path / "offload", quiet=True
    )
    assert type(model).__name__ == "LlamaForCausalLM" and "disk" in automap.placement(model).placement
    automap.undispatch(model)
    assert not (tmp_path / "offload").exists()  # its safetensors are read in place: no store written
