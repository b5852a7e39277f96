import pytest

from automap import SizeError, format_bytes, parse_size
from automap.devices import parse_max_memory, parse_max_memory_text
from automap.errors import AutomapError, DeviceError


@pytest.mark.parametrize(
    "text, expected",
    [
        ("10GiB", 10 * 2**30),
        ("500MB", 500 * 10**6),
        ("1.5GB", 1_500_000_000),
        ("2048", 2048),
        (4096, 4096),
        ("3 KiB", 3072),
        ("1tb", 10**12),
        ("0", 0),
        ("2G", 2 * 2**30),
    ],
)
def test_sizes_parse(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["-1GB", -5, "ten GB", "10 XB", "", "1.2.3GB", None, True, float("nan")])
def test_bad_sizes_are_refused_with_a_fix(bad):
    with pytest.raises(SizeError) as info:
        parse_size(bad)
    assert isinstance(info.value, AutomapError)
    assert "GiB" in str(info.value) or "negative" in str(info.value) or "finite" in str(info.value)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**30) == "3.00 GiB"


def test_max_memory_accepts_the_accelerate_forms():
    parsed = parse_max_memory({0: "10GiB", "cuda:1": 100, "mps": "1GB", "cpu": "2GiB", "disk": "1TB"})
    assert parsed == {"cuda:0": 10 * 2**30, "cuda:1": 100, "mps": 10**9, "cpu": 2 * 2**30, "disk": 10**12}


@pytest.mark.parametrize("bad", [{"gpu0": "1GB"}, {-1: "1GB"}, ["cpu"]])
def test_bad_max_memory_keys(bad):
    with pytest.raises(DeviceError):
        parse_max_memory(bad)


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({0: "1GB", "cuda:0": "2GB"}, "'cuda:0' two budgets"),
        ({"cpu": 0.5}, "not a whole number of bytes"),
        ({"cpu": "0.5"}, "not a whole number of bytes"),
    ],
)
def test_fractional_or_duplicate_budgets_are_size_errors(bad, needle):
    with pytest.raises(SizeError, match=needle):
        parse_max_memory(bad)


def test_max_memory_text_refuses_a_device_named_twice():
    with pytest.raises(SizeError, match="'cpu' two budgets"):
        parse_max_memory_text("cpu=2GB,cpu=3GB")
    with pytest.raises(SizeError, match="'cuda:0' two budgets"):
        parse_max_memory_text("0=2GB,cuda:0=3GB")
    assert parse_max_memory_text(" 0=20GiB, cpu=1.5GB") == {0: "20GiB", "cpu": "1.5GB"}


def test_units_still_take_fractions():
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size(1e9) == 10**9 and parse_size("1.3KiB") == 1331


@pytest.mark.parametrize(
    "reserve, needle",
    [
        ({"cpu": 10**400}, "reserve['cpu']"),
        ({"cpu": float("inf")}, "reserve['cpu']"),
        ({"cpu": "-1GB"}, "reserve['cpu']"),
        ({0: "1GB", "cuda:0": "2GB"}, "reserve gives 'cuda:0' two budgets"),
        ([("cpu", 1)], "reserve=[('cpu', 1)] is a list"),
    ],
)
def test_a_bad_reserve_is_named_reserve_not_max_memory(reserve, needle):
    from automap.devices import DeviceSpec, parse_reserve

    with pytest.raises(AutomapError) as info:
        parse_reserve(reserve, [DeviceSpec("cpu", "cpu", 10**9, 1e11, 2.5e10)])
    assert needle in str(info.value) and "max_memory" not in str(info.value)
