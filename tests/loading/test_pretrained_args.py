"""``from_pretrained``'s keyword arguments in ``automap.load(folder, ...)``: each one the pinned
transformers takes is honoured with the same meaning or refused with an ArgumentError naming it;
``trust_remote_code`` is off by default and never asked for on the terminal (run without a
terminal and under a pseudo-terminal)."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_model

import automap
from automap.errors import ArgumentError, CheckpointError
from automap.loading.pretrained_args import ARGUMENTS, HONOURED, NO_OP, REFUSED
from conftest import tiny_llama

TESTS = Path(__file__).resolve().parents[1]


def from_pretrained_arguments() -> set[str]:
    """Every keyword the pinned transformers' ``from_pretrained`` reads: its signature, the
    ``kwargs.pop`` calls of its body and its documented arguments."""
    from transformers import PreTrainedModel

    function = PreTrainedModel.from_pretrained
    named = {
        p.name
        for p in inspect.signature(function).parameters.values()
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }
    source = inspect.getsource(function)
    popped = set(re.findall(r'kwargs\.pop\("(\w+)"', source))
    ignored = re.search(r"for name in \[([^\]]*)\]:\s*\n\s*_ = kwargs\.pop\(name", source)
    dropped = set(re.findall(r'"(\w+)"', ignored.group(1))) if ignored else set()
    documented = set(re.findall(r"\n\s+(\w+) \(`", function.__doc__ or ""))
    return (named | popped | dropped | documented) - {"pretrained_model_name_or_path", "kwargs"}


# automap.load's own parameters (the same meaning as from_pretrained's, see its docstring)
OWN = {"device_map", "max_memory", "offload_folder", "dtype", "torch_dtype"}


def test_every_argument_of_the_pinned_from_pretrained_is_honoured_or_refused():
    missing = from_pretrained_arguments() - OWN - set(ARGUMENTS)
    assert not missing, (
        f"from_pretrained takes {sorted(missing)}: list each in automap.loading.pretrained_args"
    )
    own = set(inspect.signature(automap.load).parameters)
    assert OWN <= own
    assert {a.how for a in ARGUMENTS.values()} == {HONOURED, NO_OP, REFUSED}
    assert all(a.why for a in ARGUMENTS.values())


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    tiny_llama(layers=2).save_pretrained(path)
    return path


IDS = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "given",
    [
        dict(low_cpu_mem_usage=True),
        dict(low_cpu_mem_usage=False),
        dict(attn_implementation="eager"),
        dict(attn_implementation="sdpa"),
        dict(trust_remote_code=False),
        dict(local_files_only=True),
        dict(output_attentions=True),
        dict(use_safetensors=True),
        dict(weights_only=True),
        dict(revision="main"),
        dict(_fast_init=False),
        dict(offload_state_dict=True),
    ],
    ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()),
)
def test_an_honoured_argument_builds_the_model_from_pretrained_builds(folder, given):
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(folder, **given).eval()
    model = automap.load(folder, quiet=True, **given)
    assert type(model) is type(plain)
    assert model.config._attn_implementation == plain.config._attn_implementation
    assert model.config.output_attentions == plain.config.output_attentions
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, plain(IDS).logits)
    automap.undispatch(model)


def test_a_given_config_and_generation_config_are_used(folder):
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(folder)
    config.output_hidden_states = True
    model = automap.load(
        folder, quiet=True, config=config, generation_config=GenerationConfig(max_new_tokens=3)
    )
    assert model.config.output_hidden_states and model.generation_config.max_new_tokens == 3
    with torch.no_grad():
        assert model(IDS).hidden_states is not None
    automap.undispatch(model)


def test_a_subfolder_is_the_model_folder(folder, tmp_path):
    (tmp_path / "sub").symlink_to(folder, target_is_directory=True)
    model = automap.load(tmp_path, subfolder="sub", quiet=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    automap.undispatch(model)


@pytest.mark.parametrize("name", sorted(n for n, a in ARGUMENTS.items() if a.how == REFUSED))
def test_a_refused_argument_names_itself_and_says_why_before_any_work(folder, name):
    value = object()  # never a default
    with pytest.raises(ArgumentError, match=rf"{name}=") as caught:
        automap.load(folder, **{name: value})
    assert ARGUMENTS[name].why in str(caught.value)
    assert isinstance(caught.value, TypeError)  # what Python raises for an unexpected keyword


@pytest.mark.parametrize(
    "given, match",
    [
        (dict(not_an_argument=1), "neither an argument of from_pretrained"),
        (dict(weights_only=False), "weights_only=True only"),
        (dict(use_safetensors=False), "use_safetensors=False"),
        (dict(trust_remote_code="yes"), "True or False"),
        (dict(attn_implementation="no-such-kernel"), "no-such-kernel"),
    ],
)
def test_a_bad_value_is_an_argument_error(folder, given, match):
    with pytest.raises(ArgumentError, match=match):
        automap.load(folder, quiet=True, **given)


def test_the_built_model_form_takes_only_arguments_that_change_nothing(folder):
    with automap.empty_model():
        skeleton = tiny_llama(layers=2)
    with pytest.raises(ArgumentError, match="apply to a folder"):
        automap.load(skeleton, folder, attn_implementation="eager")
    model = automap.load(skeleton, folder, low_cpu_mem_usage=True, quiet=True)
    automap.undispatch(model)


# ------------------------------------------------------------------ remote code

CONFIG_CODE = """
from transformers import PretrainedConfig


class ToyConfig(PretrainedConfig):
    model_type = "toy-remote"

    def __init__(self, width=16, **kwargs):
        self.width = width
        super().__init__(**kwargs)
"""

MODEL_CODE = """
import torch
from torch import nn
from transformers import PreTrainedModel

from .configuration_toy import ToyConfig


class ToyModel(PreTrainedModel):
    config_class = ToyConfig

    def __init__(self, config):
        super().__init__(config)
        self.first = nn.Linear(config.width, config.width)
        self.second = nn.Linear(config.width, 3)
        self.post_init()

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))
"""


@pytest.fixture(scope="module")
def remote_folder(tmp_path_factory) -> Path:
    """A folder whose model is its own code (config.json's auto_map), weights saved beside it."""
    path = tmp_path_factory.mktemp("remote")
    (path / "configuration_toy.py").write_text(CONFIG_CODE)
    (path / "modeling_toy.py").write_text(MODEL_CODE)
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "toy-remote",
                "width": 16,
                "architectures": ["ToyModel"],
                "auto_map": {
                    "AutoConfig": "configuration_toy.ToyConfig",
                    "AutoModel": "modeling_toy.ToyModel",
                },
            }
        )
    )
    torch.manual_seed(0)
    weights = torch.nn.ModuleDict({"first": torch.nn.Linear(16, 16), "second": torch.nn.Linear(16, 3)})
    save_model(weights, str(path / "model.safetensors"))
    return path


def test_remote_code_is_refused_by_default_naming_the_flag(remote_folder):
    for given in ({}, {"trust_remote_code": False}):
        with pytest.raises(CheckpointError, match="trust_remote_code=True"):
            automap.load(remote_folder, quiet=True, **given)


def test_remote_code_runs_when_trusted_with_the_same_outputs_as_from_pretrained(remote_folder):
    from transformers import AutoModel

    plain = AutoModel.from_pretrained(remote_folder, trust_remote_code=True).eval()
    model = automap.load(remote_folder, trust_remote_code=True, quiet=True)
    x = torch.randn(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x))
    automap.undispatch(model)


LOAD = """
import automap
try:
    automap.load({folder!r}, quiet=True)
except automap.AutomapError as exc:
    print("REFUSED:", exc, flush=True)
"""


def test_no_prompt_without_a_terminal(remote_folder):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    result = subprocess.run(
        [sys.executable, "-c", LOAD.format(folder=str(remote_folder))],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        input="y\n",
    )
    assert "REFUSED:" in result.stdout and "trust_remote_code=True" in result.stdout, result.stderr[-2000:]
    assert "[y/N]" not in result.stdout + result.stderr


def test_no_prompt_on_a_pseudo_terminal(remote_folder):
    pty = pytest.importorskip("pty")
    import select

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    main, child = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-c", LOAD.format(folder=str(remote_folder))],
        stdin=child,
        stdout=child,
        stderr=child,
        env=env,
        close_fds=True,
    )
    os.close(child)
    seen = b""
    try:
        while True:
            ready, _, _ = select.select([main], [], [], 120)
            if not ready:
                break
            try:
                chunk = os.read(main, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
            assert b"[y/N]" not in seen, seen.decode(errors="replace")[-2000:]
    finally:
        process.wait(timeout=120)
        os.close(main)
    text = seen.decode(errors="replace")
    assert "REFUSED:" in text and "trust_remote_code=True" in text, text[-2000:]
    assert process.returncode == 0


def test_a_from_pretrained_call_moves_by_changing_one_name(folder):
    model = automap.load(
        folder,
        device_map="auto",
        dtype=torch.float32,
        low_cpu_mem_usage=True,
        attn_implementation="eager",
        trust_remote_code=False,
        quiet=True,
    )
    assert model.config._attn_implementation == "eager"
    automap.undispatch(model)
