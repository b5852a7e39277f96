"""Shared builders of real models with small configs (random weights, nothing downloaded)."""
from __future__ import annotations

import pytest
import torch
from torch import nn


def tiny_llama(layers: int = 4, tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
                         tie_word_embeddings=tie)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def tiny_gpt2(layers: int = 4):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=64, n_layer=layers, n_head=4, vocab_size=256, n_positions=128,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).eval()


def tiny_t5(layers: int = 2):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(d_model=64, d_ff=128, d_kv=16, num_layers=layers, num_heads=4, vocab_size=256,
                      decoder_start_token_id=0)
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
