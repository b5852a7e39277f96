"""Every number a user gives goes through one reader (``automap.sizes.parse_number``, and
``parse_size`` for sizes): property tests of that reader, then of every public entry that takes
a number (``automap.plan``, ``dispatch``, ``load``, the accelerate drop-ins, ``Plan.from_json``,
the ``automap`` command) fed hostile values — non-finite, negative, absurd, non-numeric. Only
``AutomapError`` subclasses escape, and nothing is left in ``offload_dir``."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

import automap
from automap import accelerate_compat
from automap.cli import main
from automap.errors import AutomapError, DeviceError, PlanError, SizeError
from automap.sizes import MAX_BYTES, MAX_COUNT, MAX_RATE, parse_number, parse_size

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))

UNITS = st.sampled_from(["", "B", "GB", "GiB", "TB", "kib", "x", " MB "])
NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.sampled_from([10**400, -(10**400), 2**60 + 1, MAX_COUNT + 1, 1e300, -0.0, 0, 1, 2**31, 1e18 + 1]),
)
# What a user may pass where a number belongs: numbers of every size and sign, texts that look
# like sizes ("1e300GB"), and things that are no number at all.
HOSTILE = st.one_of(
    NUMBERS,
    st.builds(lambda n, unit: f"{n}{unit}", NUMBERS, UNITS),
    st.text(max_size=20),
    st.binary(max_size=8),
    st.booleans(),
    st.none(),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)
HASHABLE = st.one_of(
    NUMBERS,
    st.text(max_size=12),
    st.binary(max_size=4),
    st.booleans(),
    st.sampled_from(["cpu", "cuda", "cuda:0", "disk", "cuda:99999999999999999999999", "0" * 50]),
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()


@SETTINGS
@given(value=HOSTILE, integral=st.booleans(), maximum=st.sampled_from([MAX_COUNT, MAX_RATE, MAX_BYTES]))
def test_parse_number_returns_a_bounded_finite_number_or_names_the_field(value, integral, maximum):
    try:
        number = parse_number(value, "the_field", integral=integral, maximum=maximum, error=PlanError)
    except PlanError as exc:
        assert "the_field" in str(exc) and len(str(exc)) < 400
        return
    assert math.isfinite(number) and 0 <= number <= maximum
    assert not integral or isinstance(number, int)


@SETTINGS
@given(value=HOSTILE)
def test_parse_size_returns_bytes_within_the_bound_or_a_size_error(value):
    try:
        size = parse_size(value, "max_memory['cpu']")
    except SizeError as exc:
        assert "max_memory['cpu']" in str(exc)
        return
    assert isinstance(size, int) and 0 <= size <= MAX_BYTES


def _numbers_of_plan(argument: str, value: object) -> dict:
    """Keyword arguments of automap.plan with ``value`` where ``argument`` names."""
    budget: dict = {"cpu": "1GB"}
    made = {
        "max_memory": lambda: {"max_memory": {"cpu": value}},
        "max_memory_key": lambda: {"max_memory": {value: "1GB", "cpu": "1GB"}},
        "reserve": lambda: {"max_memory": budget, "reserve": value},
        "reserve_map": lambda: {"max_memory": budget, "reserve": {"cpu": value}},
        "speeds": lambda: {"max_memory": budget, "speeds": {"cpu": value}},
        "links": lambda: {"max_memory": budget, "links": {"cpu": value}},
        "bandwidths": lambda: {"max_memory": budget, "bandwidths": {"cpu": value}},
        "speeds_whole": lambda: {"max_memory": budget, "speeds": value},
        "bandwidths_key": lambda: {"max_memory": budget, "bandwidths": {value: 1e9}},
        "batch": lambda: {"max_memory": budget, "batch": value},
        "max_length": lambda: {"max_memory": budget, "max_length": value},
    }
    return made[argument]()


PLAN_ARGUMENTS = [
    "max_memory",
    "max_memory_key",
    "reserve",
    "reserve_map",
    "speeds",
    "links",
    "bandwidths",
    "speeds_whole",
    "bandwidths_key",
    "batch",
    "max_length",
]


@SETTINGS
@given(argument=st.sampled_from(PLAN_ARGUMENTS), value=HOSTILE, key=HASHABLE)
def test_plan_takes_a_number_or_raises_an_automap_error(argument, value, key):
    value = key if argument.endswith("_key") else value
    try:
        automap.plan(_model(), **_numbers_of_plan(argument, value))
    except AutomapError:
        pass


@SETTINGS
@given(argument=st.sampled_from(["max_memory", "batch", "max_length", "offload_dir"]), value=HOSTILE)
def test_dispatch_load_and_the_drop_ins_take_a_number_or_raise_an_automap_error(
    argument, value, tmp_path_factory
):
    folder = tmp_path_factory.mktemp("off")
    with contextlib.chdir(folder):  # a text offload_dir is a folder here
        dispatch_and_load(argument, value, folder)


def dispatch_and_load(argument: str, value: object, folder) -> None:
    checkpoint = folder.parent / f"{folder.name}.safetensors"
    model = _model()
    save_file(model.state_dict(), checkpoint)
    offload = {"offload_dir": value} if argument == "offload_dir" else {"offload_dir": folder}
    kwargs = {} if argument == "offload_dir" else _numbers_of_plan(argument, value)
    kwargs.setdefault("max_memory", {"cpu": "1GB"})
    with automap.empty_model():
        skeleton = _model()
    calls = [
        lambda: automap.dispatch(_model(), **kwargs, **offload),
        lambda: automap.load(skeleton, checkpoint, **kwargs, **offload),
    ]
    if argument == "max_memory":
        calls.append(lambda: accelerate_compat.infer_auto_device_map(_model(), max_memory={"cpu": value}))
    if argument == "offload_dir":
        calls.append(
            lambda: accelerate_compat.dispatch_model(
                _model(), {"0": "cpu", "1": "cpu", "2": "disk"}, offload_dir=value
            )
        )
        calls.append(
            lambda: accelerate_compat.load_checkpoint_and_dispatch(
                skeleton, checkpoint, device_map={"0": "cpu", "1": "cpu", "2": "disk"}, offload_folder=value
            )
        )
    for call in calls:
        before = sorted(folder.rglob("automap-store-*"))
        try:
            result = call()
        except AutomapError:
            assert sorted(folder.rglob("automap-store-*")) == before  # a refused call leaves no store
            continue
        if isinstance(result, nn.Module):  # a store it made stays, for the next dispatch to reuse
            automap.undispatch(result)


PLAN_FIELDS = [
    ("devices", 0, "capacity_bytes"),
    ("devices", 0, "flops_per_second"),
    ("devices", 0, "link_bytes_per_second"),
    ("devices", 0, "memory_bytes_per_second"),
    ("units", 0, "weight_bytes"),
    ("units", 0, "flops"),
    ("reserves", None, "cpu"),
    ("cut_bytes", None, None),
]


@pytest.fixture(scope="module")
def plan_json() -> str:
    return automap.plan(_model(), max_memory={"cpu": "1GB"}, reserve={"cpu": "1MB"}).to_json()


@SETTINGS
@given(field=st.sampled_from(PLAN_FIELDS), value=HOSTILE)
def test_plan_from_json_reads_each_number_or_raises_a_plan_error(plan_json, field, value):
    data = json.loads(plan_json)
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    where, index, key = field
    if key is None:
        data[where] = [value]
    elif index is None:
        data[where] = {key: value}
    else:
        data[where][index][key] = value
    text = json.dumps(data)  # allow_nan: Infinity and NaN as Python writes them
    try:
        plan = automap.Plan.from_json(text)
    except PlanError:
        return
    device = plan.devices[0]
    assert 0 <= device.capacity_bytes <= MAX_BYTES and math.isfinite(device.flops_per_second)


@pytest.fixture(scope="module")
def factory(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("factory")
    (folder / "tinynet.py").write_text(
        "from torch import nn\n\ndef build():\n"
        "    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))\n"
    )
    return f"{folder / 'tinynet.py'}:build"


@SETTINGS
@given(
    flag=st.sampled_from(["--max-memory", "--batch", "--seq-len", "--max-length"]),
    value=st.one_of(
        NUMBERS.map(str), st.builds(lambda n, u: f"{n}{u}", NUMBERS, UNITS), st.text(max_size=12)
    ),
)
def test_the_command_reads_each_number_flag_or_exits_2_with_one_line(capsys, factory, flag, value):
    text = f"cpu={value}" if flag == "--max-memory" else value
    if text.startswith("-"):
        text = " " + text  # a value, not a flag: argparse reads "-1" after the flag as another option
    code = main(
        [
            "plan",
            factory,
            flag,
            text,
            *([] if flag == "--max-memory" else ["--max-memory", "cpu=1GB"]),
            "--quiet",
        ]
    )
    err = capsys.readouterr().err
    assert code in (0, 1, 2), err  # 1: the model does not fit, or generates nothing past the prompt
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 1, err
    assert "internal error" not in err, err


def test_the_reported_cases_name_their_field():
    model = _model()
    cases = [
        (SizeError, "max_memory", lambda: automap.plan(model, max_memory={"cpu": "1e300GB"})),
        (SizeError, "max_memory", lambda: automap.plan(model, max_memory={"cpu": 10**400})),
        (SizeError, "reserve", lambda: automap.plan(model, max_memory={"cpu": "1GB"}, reserve=10**400)),
        (
            DeviceError,
            "speeds",
            lambda: automap.plan(model, max_memory={"cpu": "1GB"}, speeds={"cpu": "fast"}),
        ),
        (PlanError, "bandwidths", lambda: automap.plan(model, max_memory={"cpu": "1GB"}, bandwidths=[1e9])),
        (
            AutomapError,
            "offload_dir",
            lambda: accelerate_compat.dispatch_model(model, {"": "cpu"}, offload_dir=b"off"),
        ),
        (PlanError, "Infinity", lambda: automap.Plan.from_json(_with_infinity(model))),
    ]
    for error, needle, call in cases:
        with pytest.raises(error) as caught:
            call()
        assert needle in str(caught.value), str(caught.value)


def _with_infinity(model: nn.Module) -> str:
    data = json.loads(automap.plan(model, max_memory={"cpu": "1GB"}).to_json())
    data["devices"][0]["flops_per_second"] = float("inf")
    return json.dumps(data)
