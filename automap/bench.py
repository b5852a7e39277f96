"""``automap bench``: automap's plans beside accelerate's, on meta, for hypothetical GPUs.

Each case builds a real architecture on the meta device and plans it twice for the same
``max_memory``: with automap (``device_map="auto"``) and with accelerate the way
``from_pretrained(device_map="auto")`` does it (``get_balanced_memory`` then
``infer_auto_device_map``). Both maps are then scored by the same profile: weight bytes per
GPU, bytes spilled off the GPUs (to CPU or disk), and the busiest GPU's share of the FLOPs
(offloaded units compute on the execution GPU, as they do at run time). Seconds, no GPU needed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

from automap.errors import ReportError
from automap.planning.predict import bottleneck_seconds, forward_seconds
from automap.report.output import replace_whole
from automap.sizes import format_bytes

log = logging.getLogger(__name__)

_LLAMA_7B = dict(
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
)
# Qwen2-1.5B's published shape: a 151,936-token vocabulary, tied embeddings.
_QWEN2_1_5B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
)


@dataclass(frozen=True)
class BenchCase:
    """One model on one hypothetical machine."""

    name: str
    spec: str
    overrides: Mapping[str, Any]
    max_memory: Mapping[int | str, str]
    dtype: torch.dtype | None = None


@dataclass(frozen=True)
class BenchRow:
    """One tool's plan of one case, scored by automap's profile.

    Attributes:
        gpu_bytes: weight bytes on each GPU, in GPU order.
        spill_bytes: weight bytes placed on CPU or disk.
        busiest_gpu_flops_share: the largest share of the model's FLOPs one GPU computes.
        bottleneck_seconds, forward_seconds: automap's predictions for the placement.
    """

    case: str
    tool: str
    gpu_bytes: tuple[int, ...]
    spill_bytes: int
    busiest_gpu_flops_share: float
    bottleneck_seconds: float
    forward_seconds: float


DEFAULT_CASES = (
    BenchCase(
        "Llama-2-7B bf16, 2x6.5GiB",
        "hf:llama",
        _LLAMA_7B,
        {0: "6.5GiB", 1: "6.5GiB", "cpu": "64GiB"},
        torch.bfloat16,
    ),
    BenchCase(
        "Qwen2-1.5B bf16, 2x2GiB",
        "hf:qwen2",
        _QWEN2_1_5B,
        {0: "2GiB", 1: "2GiB", "cpu": "64GiB"},
        torch.bfloat16,
    ),
    BenchCase("ViT-B/16 fp32, 2x200MB", "torchvision:vit_b_16", {}, {0: "200MB", 1: "200MB", "cpu": "1GB"}),
    BenchCase("ResNet-50 fp32, 2x60MB", "torchvision:resnet50", {}, {0: "60MB", 1: "60MB", "cpu": "1GB"}),
)


@contextlib.contextmanager
def _quiet_accelerate() -> Iterator[None]:
    """accelerate logs a warning per hypothetical GPU it cannot see; they are expected here."""
    logger = logging.getLogger("accelerate.utils.modeling")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def accelerate_map(
    model: torch.nn.Module, max_memory: Mapping[int | str, str], dtype: torch.dtype | None
) -> dict[str, int | str]:
    """The device map ``from_pretrained(device_map="auto")`` would use, from accelerate itself."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = getattr(model, "_no_split_modules", None) or []
    with _quiet_accelerate():
        balanced = get_balanced_memory(
            model, max_memory=dict(max_memory), no_split_module_classes=no_split, dtype=dtype
        )
        return dict(
            infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split, dtype=dtype)
        )


def score(case: str, tool: str, plan: Any) -> BenchRow:
    """Score a plan: bytes per GPU, spill, busiest GPU's FLOPs share, predicted times."""
    gpus = [d.name for d in plan.devices if d.is_accelerator]
    total_flops = sum(u.flops for u in plan.units) or 1
    computed = {g: 0 for g in gpus}
    for unit, placement in zip(plan.units, plan.placements):
        if placement.compute in computed:
            computed[placement.compute] += unit.flops
    return BenchRow(
        case=case,
        tool=tool,
        gpu_bytes=tuple(plan.placements.bytes_on[g] for g in gpus),
        spill_bytes=sum(plan.placements.bytes_on[d.name] for d in plan.devices if not d.is_accelerator),
        busiest_gpu_flops_share=max(computed.values(), default=0) / total_flops,
        bottleneck_seconds=bottleneck_seconds(plan),
        forward_seconds=forward_seconds(plan),
    )


def run_case(case: BenchCase) -> list[BenchRow]:
    """Plan ``case`` with automap and with accelerate; score both."""
    from automap.api import plan
    from automap.compose import example_inputs_for
    from automap.spec_plan import plan_spec

    ours = plan_spec(case.spec, case.overrides, max_memory=case.max_memory, dtype=case.dtype)
    theirs_map = accelerate_map(ours.built.model, case.max_memory, case.dtype)
    # A dict map plans without a trace unless given inputs; these score it by the same FLOPs.
    inputs, _ = example_inputs_for(ours.built.model, batch=1, seq_len=128)
    theirs = plan(ours.built.model, theirs_map, case.max_memory, dtype=case.dtype, example_inputs=inputs)
    return [score(case.name, "automap", ours.plan), score(case.name, "accelerate", theirs)]


def runnable_cases(cases: Sequence[BenchCase] | None = None) -> tuple[list[BenchCase], list[BenchCase]]:
    """``cases`` (default: :data:`DEFAULT_CASES`) split into those this install can run and
    those skipped: ``hf:`` cases need transformers (``pip install "automap[hf]"``)."""
    has_hf = importlib.util.find_spec("transformers") is not None
    chosen = list(DEFAULT_CASES if cases is None else cases)
    return (
        [c for c in chosen if has_hf or not c.spec.startswith("hf:")],
        [c for c in chosen if not has_hf and c.spec.startswith("hf:")],
    )


def run_bench(cases: Sequence[BenchCase] | None = None) -> list[BenchRow]:
    """Run every case (default: :data:`DEFAULT_CASES`); two rows per case (automap, accelerate)."""
    rows: list[BenchRow] = []
    for case in DEFAULT_CASES if cases is None else cases:
        log.info("bench: %s", case.name)
        rows += run_case(case)
    return rows


def format_table(rows: Sequence[BenchRow]) -> str:
    """The rows as an 80-column table: weights per GPU, spill, busiest GPU's FLOPs share."""
    lines = [
        f"{'case':<25} {'tool':<10} {'weights per GPU':>23} {'spilled':>10} {'busiest':>7}",
        f"{'':<25} {'':<10} {'':>23} {'to CPU':>10} {'GPU':>7}",
    ]
    for row in rows:
        per_gpu = " / ".join(format_bytes(b) for b in row.gpu_bytes) or "-"
        lines.append(
            f"{row.case if row.tool == 'automap' else '':<25} {row.tool:<10} {per_gpu:>23} "
            f"{format_bytes(row.spill_bytes):>10} {100 * row.busiest_gpu_flops_share:>6.1f}%"
        )
    lines += [
        "",
        "busiest GPU: its share of the model's FLOPs (offloaded units count on the GPU that",
        "runs them); lower is better balanced. accelerate: get_balanced_memory, then",
        'infer_auto_device_map, as from_pretrained(device_map="auto") does.',
    ]
    return "\n".join(lines)


def write_rows(rows: Sequence[BenchRow], path: str | Path) -> Path:
    """Write the rows as a JSON list of objects (keys as in :class:`BenchRow`)."""
    target = Path(path)
    text = (json.dumps([asdict(r) for r in rows], indent=2) + "\n").encode()
    try:
        replace_whole(target, lambda file: file.write(text))
    except OSError as exc:
        raise ReportError(
            f"cannot write the bench rows to {str(target)!r}: {exc.strerror or exc}; choose a writable path"
        ) from exc
    return target
