"""One splitting rule for every device set: a unit that does not fit CPU RAM's budget (or would
go to disk whole while RAM stays free) is split into its children before anything goes to disk,
with the CPU computing alone as with GPUs. Real models: a transformers encoder with a head, and
a sentence-transformers model built from a folder saved here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import automap
from automap.kinds import kind_of
from conftest import weight_bytes
from tiny_configs import beside_the_run


def bert(layers: int = 4):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return BertModel(
        BertConfig(
            hidden_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=512,
            max_position_embeddings=128,
        )
    ).eval()


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 4)

    def forward(self, out) -> torch.Tensor:
        return self.proj(out.last_hidden_state)


def ram_share(plan: automap.Plan) -> float:
    """Share of the weights the plan keeps in CPU RAM (or on any computing device)."""
    kept = sum(plan.placements.bytes_on.get(d.name, 0) for d in plan.devices if not kind_of(d).stores_only)
    return kept / sum(plan.placements.bytes_on.values())


def test_a_backbone_larger_than_ram_is_split_before_it_goes_to_disk(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(bert(), Head()).eval()
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(1))
    for inputs in ((ids,), None):
        budget = {
            "cpu": beside_the_run(model, int(0.75 * weight_bytes(model)), example_inputs=inputs),
            "disk": "1GB",
        }
        plan = automap.plan(model, max_memory=budget, offload_dir=tmp_path, example_inputs=inputs)
        assert plan.device_map.get("0") != "disk", plan.device_map
        assert ram_share(plan) >= 0.5, plan.device_map
        assert any("split" in c for c in plan.choices), plan.choices
    with torch.no_grad():
        expected = model(ids)
    automap.dispatch(model, plan, offload_dir=tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected)
    automap.undispatch(model)


def test_units_that_fit_ram_whole_are_not_split():
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    plan = automap.plan(
        model, max_memory={"cpu": beside_the_run(model, 10**7), "disk": "1GB"}, offload_dir="unused"
    )
    assert set(plan.device_map.values()) == {"cpu"} and not any("split" in c for c in plan.choices)


@pytest.fixture
def sentence_model(tmp_path):
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertTokenizerFast

    folder = tmp_path / "encoder"
    bert().save_pretrained(folder)
    (folder / "vocab.txt").write_text(
        "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(507)])
    )
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    encoder = models.Transformer(str(folder), max_seq_length=32)
    pooling = models.Pooling(encoder.get_word_embedding_dimension())
    return SentenceTransformer(modules=[encoder, pooling], device="cpu").eval()


def test_a_sentence_transformer_keeps_most_of_its_encoder_in_ram(sentence_model, tmp_path):
    sentences = ["w1 w2 w3", "w4 w5 w6 w7 w8"]
    expected = sentence_model.encode(sentences, convert_to_tensor=True)
    features = sentence_model.tokenize(sentences)
    kept = int(0.75 * weight_bytes(sentence_model))
    budget = {"cpu": beside_the_run(sentence_model, kept, example_inputs=(features,)), "disk": "1GB"}
    plan = automap.plan(sentence_model, max_memory=budget, offload_dir=tmp_path, example_inputs=(features,))
    assert ram_share(plan) >= 0.5, plan.device_map
    automap.dispatch(sentence_model, plan, offload_dir=tmp_path)
    torch.testing.assert_close(sentence_model.encode(sentences, convert_to_tensor=True), expected)
    automap.undispatch(sentence_model)
