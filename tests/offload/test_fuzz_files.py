"""Fuzzing every file automap reads (issue #23): seeded mutations of safetensors checkpoint
headers, store file headers, store manifests and shard indexes (safetensors and pickle). Each
outcome must be a model whose weights equal what the (mutated) files hold — the source weights
wherever automap rebuilt its own store — or an :class:`~automap.errors.AutomapError`; never a
raw exception, never wrong weights. Deterministic: seed ``i`` always makes the same mutation."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import automap
from automap.errors import AutomapError
from automap.offload import DTYPES, MANIFEST
from conftest import store_dirs

# Values a mutation puts somewhere in a JSON document; the "__...__" ones are spliced in as raw
# text after dumping (json cannot write them).
RAW = {
    '"__DEEP__"': "[" * 100_000 + "]" * 100_000,
    '"__DEEPOBJ__"': '{"a":' * 50_000 + "1" + "}" * 50_000,
    '"__DIGITS__"': "1" + "0" * 5000,
    '"__INF__"': "1e400",
    '"__NAN__"': "NaN",
    '"__NEGINF__"': "-Infinity",
}
POOL: list[Any] = [
    *(k.strip('"') for k in RAW),
    -1,
    0,
    1,
    7,
    2**64,
    2**63 - 1,
    1.5,
    -0.0,
    "F32",
    "I64",
    "BF16",
    ["F32"],
    {"dtype": "F32"},
    [],
    {},
    None,
    True,
    "",
    "../x.safetensors",
    "/etc/passwd",
    "x" * 5000,
    [0, 0],
    [0, 2**62],
    [-8, 8],
    [1, 2, 3],
    [[4]],
    ["4"],
    "model.safetensors",
    "1.safetensors",
]


def dumps(data: Any) -> bytes:
    text = json.dumps(data)
    for sentinel, raw in RAW.items():
        text = text.replace(sentinel, raw)
    return text.encode()


def _paths(node: Any, path: tuple = ()) -> list[tuple]:
    found = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            found += _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += _paths(v, (*path, i))
    return found


def _get(node: Any, path: tuple) -> Any:
    for step in path:
        node = node[step]
    return node


def mutate_json(rng: random.Random, data: Any) -> Any:
    """One structural mutation of a copy of ``data``: replace, delete, rename, wrap or swap."""
    data = json.loads(json.dumps(data))
    paths = _paths(data)
    path = rng.choice(paths)
    op = rng.choice(["replace", "replace", "delete", "rename", "wrap", "swap"])
    if not path:
        return rng.choice(POOL) if op == "replace" else [data]
    parent, last = _get(data, path[:-1]), path[-1]
    if op == "replace":
        parent[last] = rng.choice(POOL)
    elif op == "delete":
        del parent[last]
    elif op == "rename" and isinstance(parent, dict):
        parent[rng.choice([k for k in POOL if isinstance(k, str)]) + str(last)[:3]] = parent.pop(last)
    elif op == "wrap":
        parent[last] = [parent[last]]
    else:
        other = rng.choice(paths)
        if other and not _startswith(other, path) and not _startswith(path, other):
            o_parent, o_last = _get(data, other[:-1]), other[-1]
            parent[last], o_parent[o_last] = o_parent[o_last], parent[last]
    return data


def _startswith(path: tuple, prefix: tuple) -> bool:
    return path[: len(prefix)] == prefix


def mutate_bytes(rng: random.Random, raw: bytes) -> bytes:
    """One byte-level mutation: flip, delete, insert, cut or repeat a slice."""
    raw = bytearray(raw)
    at = rng.randrange(len(raw)) if raw else 0
    op = rng.choice(["flip", "delete", "insert", "cut", "repeat"])
    if op == "flip" and raw:
        raw[at] ^= 1 << rng.randrange(8)
    elif op == "delete":
        del raw[at : at + rng.randint(1, 8)]
    elif op == "insert":
        raw[at:at] = rng.choice([b"{", b"[", b"]", b"}", b'"', b",", b"9" * 40, b"\xff", b"\\u0000", b" "])
    elif op == "cut":
        del raw[at:]
    else:
        raw[at:at] = raw[at : at + rng.randint(1, 64)]
    return bytes(raw)


def mutate_document(rng: random.Random, raw: bytes) -> bytes:
    if rng.random() < 0.6:
        return dumps(mutate_json(rng, json.loads(raw)))
    return mutate_bytes(rng, raw)


def split_safetensors(raw: bytes) -> tuple[bytes, bytes]:
    (length,) = struct.unpack("<Q", raw[:8])
    return raw[8 : 8 + length], raw[8 + length :]


def mutate_safetensors(rng: random.Random, raw: bytes) -> bytes:
    """A file whose header is mutated; sometimes its length field is wrong as well."""
    header, data = split_safetensors(raw)
    header = mutate_document(rng, header)
    length = len(header)
    if rng.random() < 0.15:
        length = rng.choice([0, 1, length - 1, length + 1, len(raw) * 2, 2**64 - 1, 2**40])
    return struct.pack("<Q", length) + header + data


# ------------------------------------------------------------------ the model and the outcome


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


MAP = {"a": "cpu", "b": "disk", "c": "disk"}
SOURCE = {k: v.clone() for k, v in Net().state_dict().items()}


def held_by(path: Path) -> dict[str, torch.Tensor] | None:
    """What a safetensors file holds by its own header, read plainly (None if it cannot be)."""
    try:
        header, data = split_safetensors(path.read_bytes())
        found = {}
        for key, entry in json.loads(header).items():
            if key in SOURCE:
                (begin, end), dtype = entry["data_offsets"], DTYPES[entry["dtype"]]
                flat = (
                    torch.frombuffer(bytearray(data[begin:end]), dtype=dtype)
                    if end > begin
                    else torch.empty(0)
                )
                found[key] = flat.reshape(entry["shape"])
        return found
    except Exception:  # noqa: BLE001 - the plain reader may fail: then automap must refuse the file
        return None


def put(path: Path, raw: bytes) -> None:
    """``raw`` as a new file at ``path`` (a new inode: no mapping of the old one sees it change)."""
    temp = path.with_name(path.name + ".new")
    temp.write_bytes(raw)
    temp.replace(path)


class Outcomes:
    """Counts of each outcome; a raw exception or a wrong weight fails at once."""

    def __init__(self):
        self.loaded = self.refused = 0

    def run(self, label: str, attempt: Callable[[], nn.Module | None], expected: Callable[[], dict]) -> None:
        try:
            model = attempt()
        except AutomapError:
            self.refused += 1
            return
        except Exception as exc:  # noqa: BLE001 - this is what the test is about
            raise AssertionError(f"{label}: a raw {type(exc).__name__}: {str(exc)[:300]}") from exc
        want = expected()
        state = model.state_dict()
        for name, tensor in state.items():
            assert name in want and torch.equal(tensor, want[name].to(tensor.dtype)), (
                f"{label}: {name} holds other values than the file"
            )
        automap.undispatch(model)
        self.loaded += 1


def _skeleton() -> Net:
    with automap.empty_model():
        return Net()


# ------------------------------------------------------------------ the four kinds of file


def fuzz_checkpoints(tmp_path: Path, seeds: range, outcomes: Outcomes) -> None:
    pristine = tmp_path / "source.safetensors"
    save_file(SOURCE, pristine)
    raw = pristine.read_bytes()
    path = tmp_path / "model.safetensors"
    for seed in seeds:
        put(path, mutate_safetensors(random.Random(seed), raw))
        outcomes.run(
            f"checkpoint seed {seed}",
            lambda: automap.load(_skeleton(), path, MAP, quiet=True),
            lambda: held_by(path) or {},
        )


def fuzz_store_headers(tmp_path: Path, seeds: range, outcomes: Outcomes) -> None:
    folder = tmp_path / "off"
    model = Net()
    automap.dispatch(model, MAP, offload_dir=folder)
    automap.undispatch(model)
    (store,) = store_dirs(folder)
    pristine = {p: p.read_bytes() for p in sorted(store.glob("*.safetensors"))}
    for seed in seeds:
        rng = random.Random(seed)
        for p, raw in pristine.items():
            put(p, raw)
        victim = rng.choice(sorted(pristine))
        put(victim, mutate_safetensors(rng, pristine[victim]))
        outcomes.run(
            f"store header seed {seed}",
            lambda: automap.dispatch(Net(), MAP, offload_dir=folder),
            lambda: SOURCE,
        )
    assert store_dirs(folder) == [store], "every damaged store was rebuilt in place"


def fuzz_manifests(tmp_path: Path, seeds: range, outcomes: Outcomes) -> None:
    folder = tmp_path / "off-manifest"
    model = Net()
    automap.dispatch(model, MAP, offload_dir=folder)
    automap.undispatch(model)
    (store,) = store_dirs(folder)
    pristine = (store / MANIFEST).read_bytes()
    for seed in seeds:
        put(store / MANIFEST, mutate_document(random.Random(seed), pristine))
        outcomes.run(
            f"manifest seed {seed}", lambda: automap.dispatch(Net(), MAP, offload_dir=folder), lambda: SOURCE
        )


def fuzz_indexes(tmp_path: Path, seeds: range, outcomes: Outcomes) -> None:
    names = sorted(SOURCE)
    for kind, suffix, save in (("safetensors", ".safetensors", save_file), ("pickle", ".bin", torch.save)):
        folder = tmp_path / f"sharded-{kind}"
        folder.mkdir()
        shards = {name: f"shard-{i % 2}{suffix}" for i, name in enumerate(names)}
        for shard in set(shards.values()):
            save({n: SOURCE[n].clone() for n in names if shards[n] == shard}, folder / shard)
        index = folder / (
            "model.safetensors.index.json" if kind == "safetensors" else "pytorch_model.bin.index.json"
        )
        pristine = json.dumps({"metadata": {"total_size": 4096}, "weight_map": shards}).encode()
        for seed in seeds:
            put(index, mutate_document(random.Random(seed), pristine))
            outcomes.run(
                f"{kind} index seed {seed}",
                lambda: automap.load(_skeleton(), folder, MAP, quiet=True),
                lambda: SOURCE,
            )


def test_fuzzed_files_give_the_right_weights_or_an_automap_error(tmp_path):
    kinds = {
        "checkpoint": Outcomes(),
        "store header": Outcomes(),
        "manifest": Outcomes(),
        "index": Outcomes(),
    }
    fuzz_checkpoints(tmp_path, range(0, 180), kinds["checkpoint"])
    fuzz_store_headers(tmp_path, range(1000, 1160), kinds["store header"])
    fuzz_manifests(tmp_path, range(2000, 2100), kinds["manifest"])
    fuzz_indexes(tmp_path, range(3000, 3040), kinds["index"])
    counts = {kind: vars(o) for kind, o in kinds.items()}
    assert sum(o.loaded + o.refused for o in kinds.values()) == 180 + 160 + 100 + 2 * 40 >= 500
    # automap's own files are never a reason to refuse: a damaged store is rebuilt, every time
    assert kinds["store header"].refused == 0 and kinds["manifest"].refused == 0, counts
    assert kinds["checkpoint"].refused > 100 and kinds["index"].refused > 40, counts


@pytest.mark.parametrize("seed", range(5))
def test_the_mutations_are_deterministic(seed):
    raw = dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})
    assert mutate_document(random.Random(seed), raw) == mutate_document(random.Random(seed), raw)
