"""Shared builders of real models with small configs (random weights, nothing downloaded)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

# Plans in tests read the kinds' default speeds, never this machine's measured ones (which
# differ from machine to machine), and no test writes the user's cache: the tests of
# measuring point AUTOMAP_CALIBRATION at a file under tmp_path. Subprocesses inherit it.
os.environ["AUTOMAP_CALIBRATION"] = "off"


def tiny_llama(layers: int = 4, tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def tiny_moe(kind: str, *, layers: int, hidden: int, experts: int, shared: int):
    """A small mixture-of-experts causal LM from transformers, 2 experts per token, vocab 128:
    ``kind`` "mixtral" (``experts`` routed experts) or "qwen2_moe" (also a shared expert of
    ``shared`` features)."""
    import transformers

    common = dict(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_experts_per_tok=2,
    )
    if kind == "mixtral":
        config = transformers.MixtralConfig(**common, num_local_experts=experts)
        build = transformers.MixtralForCausalLM
    else:
        config = transformers.Qwen2MoeConfig(
            **common, num_experts=experts, moe_intermediate_size=32, shared_expert_intermediate_size=shared
        )
        build = transformers.Qwen2MoeForCausalLM
    torch.manual_seed(0)
    return build(config).eval()


def tiny_gpt2(layers: int = 4):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_embd=64, n_layer=layers, n_head=4, vocab_size=256, n_positions=128, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).eval()


def tiny_t5(layers: int = 2):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        d_model=64,
        d_ff=128,
        d_kv=16,
        num_layers=layers,
        num_heads=4,
        vocab_size=256,
        decoder_start_token_id=0,
    )
    torch.manual_seed(0)
    return T5ForConditionalGeneration(config).eval()


class ToyModel(nn.Module):
    """The model of PyTorch's distributed tutorials."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def logits_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The language model's logits for ``ids``, computed without a graph."""
    with torch.no_grad():
        return model(ids).logits


def ids_and_logits(model: nn.Module, shape: tuple[int, ...] = (1, 8)) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids drawn from the global generator and the plain model's logits for them, taken
    before dispatch changes the model."""
    ids = torch.randint(0, 256, shape)
    return ids, logits_of(model, ids)


@pytest.fixture
def resnet50():
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet50().eval()


@pytest.fixture
def exact_cuda_math():
    """Full float32 on CUDA (no TF32 in convolutions and matmuls, which cuDNN uses by default):
    a test comparing units computed on a GPU with the same units computed on the CPU then
    checks the placement, not TF32's 10-bit mantissa."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def has_cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "cuda" in item.keywords and count < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none on this machine"))
        if "multi_gpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2+ CUDA GPUs; this machine has {count}"))


def file_backing(tensor: torch.Tensor):
    """The file a tensor's bytes are mapped from (None: anonymous memory): how a test tells an
    offloaded weight (a view of a store or checkpoint file) from one held in RAM."""
    from automap.offload import backing_file

    return backing_file(tensor)


def streamed_files(model: nn.Module) -> dict[str, object]:
    """Every offloaded tensor of a dispatched model (by name) and the file it is a view of."""
    from automap.runtime import state_of

    ids = state_of(model).streamed_ids()
    named = dict(
        list(model.named_parameters(remove_duplicate=False))
        + list(model.named_buffers(remove_duplicate=False))
    )
    return {n: file_backing(t) for n, t in named.items() if id(t) in ids}


def assert_offloaded_in_files(model: nn.Module, under=None) -> dict[str, object]:
    """Part of the model is offloaded, and every offloaded tensor is a real tensor (non-empty
    where the model's is) viewing a file (under ``under`` when given), not RAM."""
    found = streamed_files(model)
    assert found, "part of the model must be offloaded"
    for name, path in found.items():
        assert path is not None, f"{name} is offloaded but its bytes are not a file mapping"
        if under is not None:
            assert str(path).startswith(str(under)), f"{name} views {path}, not a file under {under}"
    return found


def store_dirs(root) -> list:
    """The automap store directories under ``root``."""
    from pathlib import Path

    return sorted(p for p in Path(root).glob("automap-store-*") if p.is_dir())


@pytest.fixture(autouse=True, scope="session")
def nothing_written_into_the_checkout():
    """No test leaves an offload store in the folder the suite runs from (a relative
    offload_dir belongs in the test's own tmp_path)."""
    import os
    from pathlib import Path

    root = Path(os.getcwd())

    def stores() -> set[str]:  # in the folder and one level down (offload_dir="x")
        return {
            str(p.relative_to(root))
            for pattern in ("automap-store-*", "*/automap-store-*")
            for p in root.glob(pattern)
        }

    before = stores()
    yield
    assert not stores() - before, f"tests left offload stores in {root}: {sorted(stores() - before)[:5]}"


def pin_machine(
    path,
    monkeypatch,
    folder=None,
    *,
    cpu_flops: float = 40e9,
    cpu_memory: float = 12e9,
    disk_read: float = 1.5e9,
):
    """Point AUTOMAP_CALIBRATION at ``path`` holding this machine's record with the figures
    given (nothing measured): plans read them as measured here. The disk's are recorded for the
    file system of ``folder`` (the working directory when None)."""
    from automap import machine

    monkeypatch.setenv("AUTOMAP_CALIBRATION", str(path))
    rates = {"float32": cpu_flops, "bfloat16": cpu_flops / 2, "float16": cpu_flops / 50}
    record = {
        "fingerprint": machine.fingerprint(),
        "capacities": {},
        "devices": {
            "cpu": {"flops_per_second": rates, "memory_bytes_per_second": cpu_memory},
            machine.disk_key(folder): {"read_bytes_per_second": disk_read},
        },
    }
    machine.write_record(record)
    return record
