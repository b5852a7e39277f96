"""Reports: the text names every device and unit range in 80 columns, the JSON round-trips and
matches docs/plan-schema.md, figures are valid files whose bars carry the plan's numbers, and
automap.placement sees where a dispatched model's tensors really are."""

from __future__ import annotations

import dataclasses
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

import automap
from automap.planning.predict import compute_seconds, cuts, forward_seconds, summary
from automap.report import (
    ReportError,
    draw,
    figure,
    placement,
    plan_dict,
    read_json,
    render_text,
    to_json,
    unit_ranges,
    write_json,
)
from automap.sizes import format_flops, format_number, format_rate, format_seconds
from conftest import tiny_llama, weight_bytes
from tiny_configs import beside_the_run

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(scope="module")
def spread_plan():
    """A tiny Llama over two hypothetical GPUs, CPU and disk: cuts and offloaded units."""
    model = tiny_llama(layers=8)
    size = weight_bytes(model)
    budget = {0: int(size * 0.3), 1: int(size * 0.3), "cpu": int(size * 0.25), "disk": "1TB"}
    return automap.plan(model, max_memory=budget, example_inputs=(torch.randint(0, 256, (1, 16)),))


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_unit_ranges_collapse_runs_only():
    names = [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
        "model.norm",
        "model.layers.3",
        "model.layers.5",
        "lm_head",
    ]
    assert (
        unit_ranges(names) == "model.embed_tokens, model.layers.0-2, model.norm, model.layers.3, "
        "model.layers.5, lm_head"
    )
    assert (
        unit_ranges(["layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer2.2"]) == "layer1.0-1, layer2.0-2"
    )


def test_text_names_every_device_and_unit_range_in_80_columns(spread_plan):
    text = render_text(spread_plan)
    assert text == spread_plan.report()
    assert max(len(line) for line in text.splitlines()) <= 80
    rows = summary(spread_plan)
    assert {r.device.name for r in rows} == {"cuda:0", "cuda:1", "cpu", "disk"}
    for row in rows:
        assert re.search(rf"^{re.escape(row.device.name)}\s", text, re.M), row.device.name
        if row.units:
            assert _flat(unit_ranges(list(row.units))) in _flat(text)
    placed = [n for r in rows for n in r.units]
    assert sorted(placed) == sorted(u.name for u in spread_plan.units)
    assert "model.layers." in text and re.search(r"model\.layers\.\d+-\d+", text), "runs must collapse"


def test_text_shows_cuts_totals_and_warnings(spread_plan):
    text = _flat(render_text(spread_plan))
    found = cuts(spread_plan)
    assert found and f"cuts ({len(found)})" in text
    for cut in found:
        assert f"{cut.before} | {cut.after}" in text
    assert "bottleneck" in text and "predicted forward" in text
    assert "offloaded" in text  # the planner's warning and the per-device note
    assert "headroom" in text and "flops%" in text


def test_bytes_only_plan_says_so(spread_plan):
    # what a model without example inputs gets
    bare = dataclasses.replace(spread_plan, inputs=dataclasses.replace(spread_plan.inputs, example=""))
    assert "balanced by bytes only" in _flat(render_text(bare))
    assert "balanced by FLOPs at the given example inputs" in _flat(render_text(spread_plan))


def test_tied_weights_split_by_a_user_map_are_warned_once():
    model = tiny_llama(layers=2, tie=True)
    device_map = {
        "model.embed_tokens": 0,
        "model.rotary_emb": 0,
        "model.layers.0": 0,
        "model.layers.1": 1,
        "model.norm": 1,
        "lm_head": 1,
    }
    plan = automap.plan(model, device_map=device_map, max_memory={0: "1GB", 1: "1GB", "cpu": "1GB"})
    assert _flat(render_text(plan)).count("tied weights split") == 1
    splits = plan_dict(plan)["totals"]["tied_splits"]
    assert len(splits) == 1 and "lm_head.weight on cuda:1" in splits[0]


def test_json_round_trips_and_keeps_device_map(spread_plan, tmp_path):
    text = to_json(spread_plan)
    again = automap.Plan.from_json(text)
    assert again == spread_plan
    assert to_json(again) == text
    data = json.loads(text)
    assert data["device_map"] == {k: v for k, v in spread_plan.device_map.items()}
    assert read_json(write_json(spread_plan, tmp_path / "plan.json")) == spread_plan
    by_name = {d["name"]: d for d in data["devices"]}
    for row in summary(spread_plan):
        entry = by_name[row.device.name]
        assert entry["units"] == list(row.units)
        assert entry["headroom_bytes"] == row.device.capacity_bytes - row.used_bytes
        assert entry["weight_bytes"] == row.weight_bytes
    assert data["totals"]["spill_bytes"] == by_name["cpu"]["weight_bytes"] + by_name["disk"]["weight_bytes"]
    assert data["totals"]["offloaded_units"] == list(spread_plan.offloaded_units)


def _documented_keys(section: str) -> set[str]:
    """Keys in the first column of the table under ``## section`` in docs/plan-schema.md."""
    doc = (DOCS / "plan-schema.md").read_text()
    body = doc.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z_]+)`", body, re.M))


def test_json_has_every_documented_key(spread_plan):
    data = plan_dict(spread_plan)
    for section, obj in (
        ("Top level", data),
        ("devices[]", data["devices"][0]),
        ("totals", data["totals"]),
        ("cuts[]", data["cuts"][0]),
        ("units[]", data["units"][0]),
    ):
        keys = _documented_keys(section)
        assert keys, f"docs/plan-schema.md has no table for {section}"
        assert keys <= set(obj), f"{section}: documented but missing {sorted(keys - set(obj))}"
    # What the report adds is documented exactly (the plan and profile may add keys of their own).
    assert set(data["totals"]) == _documented_keys("totals")


def test_png_and_svg_are_valid_files(spread_plan, tmp_path):
    png = figure(spread_plan, tmp_path / "plan.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(png).shape
    assert width > 800 and height > 400
    svg = figure(spread_plan, tmp_path / "plan.svg")
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    text = " ".join(root.itertext())  # labels are SVG text elements, not paths
    for name in ("cuda:0", "cuda:1", "cpu", "disk", "which units sit where"):
        assert name in text


def test_figure_rejects_unknown_format(spread_plan, tmp_path):
    with pytest.raises(ReportError, match=r"plan\.jpg.*\.png"):
        figure(spread_plan, tmp_path / "plan.jpg")
    with pytest.raises(ReportError, match="cannot write"):
        figure(spread_plan, tmp_path / "missing-dir" / "plan.png")


def _bar_widths(ax, colour: str) -> dict[int, float]:
    """Width of each horizontal bar of ``colour`` in ``ax``, keyed by its row."""
    from matplotlib.colors import to_rgba

    widths: dict[int, float] = {}
    for patch in ax.patches:
        if patch.get_facecolor() == to_rgba(colour) and patch.get_width() > 0:
            row = round(patch.get_y() + patch.get_height() / 2)
            widths[row] = widths.get(row, 0.0) + patch.get_width()
    return widths


def test_figure_bars_carry_the_plans_numbers(spread_plan):
    from automap.report.figure import MEMORY_COLOURS, device_colours

    fig = draw(spread_plan)
    memory, flops = fig.axes[0], fig.axes[1]
    weights = _bar_widths(memory, MEMORY_COLOURS["weights"])
    colours = device_colours(spread_plan)
    for row_index, row in enumerate(summary(spread_plan)):
        expected = 100 * row.weight_bytes / row.device.capacity_bytes
        assert weights.get(row_index, 0.0) == pytest.approx(expected, abs=1e-6), row.device.name
        # FLOPs count on the device that computes them: a tier that only stores draws none.
        computes = row.device.name == spread_plan.placements.by_home[row.device.name].compute
        computed = sum(
            u.flops
            for u, d in zip(spread_plan.units, spread_plan.placement)
            if spread_plan.placements.by_home[d].compute == row.device.name
        )
        share = _bar_widths(flops, colours[row.device.name]).get(row_index, 0.0)
        assert share == pytest.approx(100 * computed / sum(u.flops for u in spread_plan.units), abs=1e-6)
        assert computes or share == 0.0, row.device.name
    labels = [t.get_text() for t in memory.texts]
    for row in summary(spread_plan):
        assert any(automap.format_bytes(row.used_bytes) in label for label in labels)


def test_placement_of_dispatched_model_matches_its_plan(tmp_path):
    model = tiny_llama(layers=4)
    chosen = automap.plan(
        model,
        max_memory={"cpu": int(weight_bytes(model) * 0.5)},
        offload_dir=tmp_path,
        example_inputs=(torch.randint(0, 256, (1, 8)),),
    )
    automap.dispatch(model, chosen, offload_dir=tmp_path)
    try:
        actual = automap.placement(model)
        assert actual.origin == "actual"
        assert actual.placement == chosen.placement and "disk" in actual.placement
        assert not [w for w in actual.warnings if "plan put it" in w or "split" in w]
        assert "actual placement" in actual.report()
        # Someone loads fresh weights into an offloaded unit by hand: placement notices.
        unit = next(u for u, d in zip(chosen.units, chosen.placement) if d == "disk" and len(u.tensors) > 1)
        owner, _, leaf = unit.tensors[0].rpartition(".")
        setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(torch.zeros(4)))
        found = automap.placement(model)
        assert any(unit.name in w and "split over cpu, disk" in w for w in found.warnings), found.warnings
        for name in unit.tensors:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(torch.zeros(4)))
        moved = automap.placement(model)
        assert moved.device_of(unit.name) == "cpu"
        assert any(f"{unit.name!r} is on cpu but the plan put it on disk" in w for w in moved.warnings)
    finally:
        automap.undispatch(model)


def test_placement_follows_hf_device_map_for_meta_tensors():
    with torch.device("meta"):
        model = tiny_llama(layers=2)
    model.hf_device_map = {"": "cpu", "model.layers.1": "disk"}
    actual = placement(model)
    assert actual.device_of("model.layers.1") == "disk"
    assert actual.device_of("model.layers.0") == "cpu"
    del model.hf_device_map
    with pytest.raises(ReportError, match="meta"):
        placement(model)


# ----------------------------------------------------------------- numbers a person can read


EXPONENT = re.compile(r"\d[eE][+-]?\d")


@pytest.mark.parametrize(
    "seconds, text",
    [
        (3.316, "3.32 s"),
        (0.0878, "87.8 ms"),
        (4.92e-05, "49.2 µs"),
        (2.4e-07, "240 ns"),
        (754.0, "12.6 min"),
        (1e-13, "<1 ns"),
        (0, "0 s"),
    ],
)
def test_times_read_in_the_unit_that_fits(seconds, text):
    assert format_seconds(seconds) == text


def test_rates_flops_and_plain_numbers_have_no_exponent():
    assert format_rate(1130.4, "tokens") == "1,130 tokens/s"
    assert format_rate(0.1184, "tokens") == "0.118 tokens/s"
    assert format_rate(0.000123, "tokens") == "0.000123 tokens/s"
    assert format_flops(1.25e12) == "1.25 TFLOP" and format_flops(3e14, per_second=True) == "300 TFLOP/s"
    for value in (1e-9, 0.5, 999.6, 12345678.0, 3.2e21):
        assert not EXPONENT.search(format_number(value)), value


def _strings(value) -> list[str]:
    """Every string in a JSON value."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


@pytest.fixture(scope="module")
def extreme_plans(spread_plan):
    """The spread plan on very slow and very fast devices (times of minutes and of
    nanoseconds, decode rates below 1 and above 1,000 tokens/s), planned for a generation."""
    model = tiny_llama(layers=8)
    size = weight_bytes(model)
    budget = {0: int(size * 0.3), 1: int(size * 0.3), "cpu": int(size * 0.25), "disk": "1TB"}
    inputs = (torch.randint(0, 256, (1, 16)),)
    slow = {"cuda:0": 1e3, "cuda:1": 1e3, "cpu": 1e2}
    return [
        spread_plan,
        automap.plan(model, max_memory=budget, example_inputs=inputs, speeds=slow, batch=1, max_length=64),
        automap.plan(
            model, max_memory={0: "1GB", "cpu": "1GB"}, example_inputs=inputs, batch=1, max_length=64
        ),
    ]


def test_report_and_json_text_carry_no_exponents(extreme_plans):
    seen = set()
    for plan in extreme_plans:
        text = plan.report()
        assert not EXPONENT.search(text), [line for line in text.splitlines() if EXPONENT.search(line)]
        for string in _strings(plan_dict(plan)):
            assert not EXPONENT.search(string), string
        seen |= set(re.findall(r"\d (µs|ns|ms|s|min|h)\b", text))
        assert not re.search(r"\d us\b", text)
    assert {"µs", "min"} <= seen, "the slow plan takes minutes, the fast one microseconds"
    fast = extreme_plans[2].report()
    rate = re.search(r"~([\d,.]+) tokens/s", fast).group(1)
    assert float(rate.replace(",", "")) >= 1000 and "," in rate, "thousands are separated"


def test_the_root_unit_is_named():
    """A model that is one unit (no child module is a unit of its own) is named as such, in
    the report, the JSON and the error for an offload without a folder."""
    model = torch.nn.Linear(64, 64)
    plan = automap.plan(model, max_memory={"cpu": 1000, "disk": "1GB"}, example_inputs=(torch.randn(1, 64),))
    assert [u.name for u in plan.units] == [""] and plan.offloaded_units == ("",)
    text = plan.report()
    assert "units: the whole model" in text and "1 unit," in text and "1 units" not in text
    disk = next(d for d in plan_dict(plan)["devices"] if d["name"] == "disk")
    assert disk["unit_ranges"] == "the whole model"
    with pytest.raises(
        automap.AutomapError, match=r"offloads 1 unit \(the whole model\) to disk but no offload_dir"
    ):
        automap.dispatch(model, plan)


def test_flops_count_on_the_device_that_computes_them(spread_plan):
    """cpu and disk only store units streamed to cuda:0: the table shows no FLOPs share or
    stage for them, and cuda:0's share and stage include the units it runs from them."""
    data = plan_dict(spread_plan)
    by_name = {d["name"]: d for d in data["devices"]}
    total = sum(u.flops for u in spread_plan.units)
    assert by_name["disk"]["flops"] > 0, "disk stores units with FLOPs"
    for tier in ("cpu", "disk"):
        assert by_name[tier]["computed_flops"] == 0 and by_name[tier]["compute_seconds"] == 0.0
        assert re.search(rf"^{tier}\s.*\s-\s+-$", spread_plan.report(), re.M), f"{tier}: no FLOPs%, no stage"
    executor = by_name[spread_plan.execution_device]
    streamed = sum(by_name[t]["flops"] for t in ("cpu", "disk"))
    assert executor["computed_flops"] == executor["flops"] + streamed
    assert sum(d["computed_flops"] for d in data["devices"]) == total
    per_device = compute_seconds(spread_plan)
    assert executor["compute_seconds"] == pytest.approx(per_device[spread_plan.execution_device])
    share = f"{100 * executor['computed_flops_share']:.1f}%"
    assert re.search(rf"^cuda:0\s.*\s{re.escape(share)}\s", spread_plan.report(), re.M)


def test_print_plan_is_a_short_line(spread_plan):
    text = repr(spread_plan)
    assert str(spread_plan) == text and "\n" not in text and len(text) < 400
    assert text.startswith("<Plan auto: 12 units, ")
    for device in spread_plan.used_devices:
        assert device in text
    assert "streamed to cuda:0" in text
    assert f"predicted forward {format_seconds(forward_seconds(spread_plan))}" in text


def test_a_slower_choice_says_why():
    """The chosen plan streams to a GPU; a plan in which the CPU computes some units is
    predicted faster. The choices say which rule put it first. (A Llama of 290 MiB, planned on
    meta: for spread_plan's, the CPU's budget cannot hold its run beside enough weights for
    the CPU to be faster.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
    )
    with automap.empty_model():
        model = LlamaForCausalLM(config).eval()
    size, ids = weight_bytes(model), (torch.randint(0, 256, (1, 16)),)
    cpu = beside_the_run(model, int(size * 0.25), example_inputs=ids)
    plan = automap.plan(
        model,
        max_memory={0: int(size * 0.3), 1: int(size * 0.3), "cpu": cpu, "disk": "1TB"},
        example_inputs=ids,
    )
    choices = " ".join(plan.choices)
    faster = re.search(r"alternatives: the CPU computes .*?\(([\d.]+) ms\)", choices)
    assert faster and float(faster.group(1)) < forward_seconds(plan) * 1e3, choices
    line = next(c for c in plan.choices if c.startswith("chosen over a faster alternative"))
    assert (
        "because the accelerators compute every unit in it, while in the faster one the CPU computes some"
        in line
    )
    assert "then the fastest" in line and "chosen over a faster alternative" in _flat(plan.report())


def test_the_fastest_choice_needs_no_excuse():
    model = tiny_llama(layers=2)
    plan = automap.plan(
        model, max_memory={0: "1GB", 1: "1GB"}, example_inputs=(torch.randint(0, 256, (1, 16)),)
    )
    assert not any("chosen over" in c for c in plan.choices)


@pytest.fixture
def full_disk(tmp_path):
    """A real 64 KiB file system (tmpfs) holding the user's previous plan and figure, then
    filled to the last block; unmounted after."""
    import subprocess

    point = tmp_path / "disk"
    point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(point)], capture_output=True, text=True
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); needs root")
    try:
        (point / "plan.json").write_text('{"the user\'s": "previous plan"}\n')
        (point / "plan.svg").write_text("<svg>the user's figure</svg>\n")
        with open(point / "filler", "wb", buffering=0) as filler:
            try:
                while True:
                    filler.write(b"\0" * 4096)
            except OSError:
                pass
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=False)


def test_a_report_that_cannot_be_written_leaves_the_users_file_as_it_was(spread_plan, full_disk):
    before = {p.name: p.read_bytes() for p in full_disk.iterdir() if p.name != "filler"}
    with pytest.raises(ReportError, match="No space left on device"):
        write_json(spread_plan, full_disk / "plan.json")
    with pytest.raises(ReportError, match="No space left on device"):
        figure(spread_plan, full_disk / "plan.svg")
    assert {p.name: p.read_bytes() for p in full_disk.iterdir() if p.name != "filler"} == before, (
        "the old files are whole and no temporary is left"
    )


def test_a_report_written_over_a_file_keeps_its_permissions_and_writes_through_a_link(spread_plan, tmp_path):
    old = tmp_path / "plan.json"
    old.write_text("{}")
    old.chmod(0o640)
    link = tmp_path / "latest.json"
    link.symlink_to(old)
    write_json(spread_plan, link)
    assert link.is_symlink() and json.loads(old.read_text())["device_map"]
    assert old.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.json", "plan.json"]
