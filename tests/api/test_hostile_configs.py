"""A hostile ``config.json`` or ``generation_config.json`` (wrong types, negative, huge, nested
values in any field) is refused with an ``AutomapError`` before anything is built, and never
makes automap allocate: the fuzz runs in a fresh process whose address space is limited to what
it holds after its imports plus 1 GiB (``RLIMIT_AS``), checks its peak RSS too, and finds nothing
left in ``offload_dir`` after a refused load. Both ways a config reaches automap are fuzzed:
``automap.load(folder)`` and ``automap plan hf:./config.json`` (``build_model``)."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30

FIELDS = [
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "head_dim",
    "rope_scaling",
    "rope_parameters",
    "architectures",
    "model_type",
    "rms_norm_eps",
    "rope_theta",
    "hidden_act",
    "tie_word_embeddings",
    "pad_token_id",
    "dtype",
    "attention_bias",
    "layer_types",
    "initializer_range",
    "quantization_config",
    "auto_map",
]
GENERATION_FIELDS = [
    "max_length",
    "max_new_tokens",
    "num_beams",
    "temperature",
    "top_k",
    "top_p",
    "do_sample",
    "eos_token_id",
    "pad_token_id",
    "repetition_penalty",
    "num_return_sequences",
    "min_length",
    "bad_words_ids",
    "forced_decoder_ids",
    "suppress_tokens",
    "_from_model_config",
]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([10**12, 10**9, 2**31, 2**31 + 1, -1, 0, 1, 3, 7]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(["linear", "dynamic", "yarn", "bogus", "LlamaForCausalLM", "llama", "silu", "float16"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(["rope_type", "type", "factor", "hidden_size", "x", "quant_method"]),
            inner,
            max_size=3,
        ),
    ),
    max_leaves=8,
)
EDITS = st.lists(st.tuples(st.sampled_from(FIELDS), VALUES), min_size=1, max_size=3)
GENERATION_EDITS = st.lists(st.tuples(st.sampled_from(GENERATION_FIELDS), VALUES), min_size=1, max_size=3)
EXAMPLES = int(os.environ.get("AUTOMAP_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
# What torch says when an allocation fails: a config made automap allocate what it should not.
ALLOCATION_FAILED = ("allocate", "out of memory", "MemoryError", "Cannot allocate")


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _address_space() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize in /proc/self/status")


def _outcome(call) -> str:
    """``"ok"`` or the AutomapError's message; anything else is raised."""
    import automap

    try:
        result = call()
    except automap.AutomapError as exc:
        message = str(exc)
        assert not any(word in message for word in ALLOCATION_FAILED), message
        return message
    if result is not None and hasattr(result, "parameters"):
        try:
            automap.undispatch(result)
        except automap.AutomapError:
            pass  # built, not dispatched (build_model's result)
    return "ok"


class Folder:
    """A saved tiny Llama (config, generation config, weights), rewritten per example."""

    def __init__(self, root: Path) -> None:
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import tiny_llama

        self.root = root
        self.path = root / "model"
        tiny_llama(1).save_pretrained(self.path)
        self.config = json.loads((self.path / "config.json").read_text())
        self.generation = json.loads((self.path / "generation_config.json").read_text())
        self.offload = root / "offload"
        self.offload.mkdir()

    def write(self, name: str, data: dict, edits: list) -> None:
        changed = copy.deepcopy(data)
        for field, value in edits:
            changed[field] = value
        (self.path / name).write_text(json.dumps(changed))

    def check(self) -> list[str]:
        import automap
        from automap.specs import build_model

        outcomes = [
            _outcome(
                lambda: automap.load(
                    self.path, max_memory={"cpu": "1GB", "disk": "1GB"}, offload_dir=self.offload
                )
            ),
            _outcome(lambda: build_model(f"hf:{self.path / 'config.json'}").model),
        ]
        stores = [p.name for p in self.offload.iterdir()]
        assert not stores or "ok" in outcomes[:1], (outcomes, stores)
        return outcomes


def fuzz_in_this_process() -> None:
    """The fuzz, run in a fresh process by the test: the address space is limited first."""
    import warnings

    warnings.filterwarnings("ignore")
    import automap  # noqa: F401 - imported before the limit: its imports are not the configs' doing
    import transformers  # noqa: F401

    folder = Folder(Path(tempfile.mkdtemp()))
    assert folder.check() == ["ok", "ok"]  # the unedited folder loads: imports and caches warmed
    base = _peak_rss()
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + GIB, resource.RLIM_INFINITY))
    try:
        import torch

        torch.empty(2 * GIB, dtype=torch.uint8)
        raise AssertionError("RLIMIT_AS did not bind: 2 GiB were allocated")
    except RuntimeError:
        pass  # the limit holds: a config that made automap allocate would fail the same way
    config, generation = folder.config, folder.generation

    @FUZZ
    @given(edits=EDITS)
    @example(edits=[("vocab_size", 10**9), ("hidden_size", 2)])  # 8 GB in one tensor: refused, not allocated
    @example(edits=[("vocab_size", 10**12)])
    @example(edits=[("hidden_size", -64)])
    def config_fields(edits):
        folder.write("generation_config.json", generation, [])
        folder.write("config.json", config, edits)
        folder.check()

    @FUZZ
    @given(edits=GENERATION_EDITS)
    def generation_fields(edits):
        folder.write("config.json", config, [])
        folder.write("generation_config.json", generation, edits)
        folder.check()

    config_fields()
    generation_fields()
    _fuzz_numbers(folder.root)
    grown = _peak_rss() - base
    assert grown < GIB, f"peak RSS grew by {grown / GIB:.2f} GiB while fuzzing configs"
    print(
        f"fuzzed {EXAMPLES} configs, {EXAMPLES} generation configs and the number arguments; "
        f"peak RSS grew {grown / 2**20:.0f} MiB"
    )


def _fuzz_numbers(root: Path) -> None:
    """The number arguments' fuzz (test_number_inputs.py), under the same address-space limit."""
    import test_number_inputs as numbers

    numbers.test_plan_takes_a_number_or_raises_an_automap_error()

    @FUZZ
    @given(
        argument=st.sampled_from(["max_memory", "batch", "max_length", "offload_dir"]), value=numbers.HOSTILE
    )
    def dispatch_numbers(argument, value):
        with contextlib.chdir(root):
            numbers.dispatch_and_load(argument, value, root)

    dispatch_numbers()


def test_hostile_config_fields_only_raise_automap_errors_and_allocate_nothing():
    pytest.importorskip("transformers")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "api"), str(ROOT / "tests"), str(ROOT)]),
    }
    done = subprocess.run(
        [sys.executable, "-c", "import test_hostile_configs as t; t.fuzz_in_this_process()"],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-6000:])
    assert "fuzzed" in done.stdout


def test_the_reported_configs_are_refused_by_name(tmp_path):
    pytest.importorskip("transformers")
    import automap

    folder = Folder(tmp_path)
    cases = [
        ([("hidden_size", -64)], "hidden_size"),
        ([("architectures", [5])], "architectures"),
        ([("rope_scaling", {"rope_type": "bogus", "factor": 2.0})], "bogus"),
        ([("vocab_size", 10**12)], "vocab_size"),
    ]
    for edits, needle in cases:
        folder.write("config.json", folder.config, edits)
        with pytest.raises(automap.CheckpointError, match=needle):
            automap.load(folder.path, max_memory={"cpu": "1GB"})
