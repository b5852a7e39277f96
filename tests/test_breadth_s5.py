"""Breadth beyond the registry sweeps: what a folder carries besides its weights, and families
and forms the other sweeps do not reach, each against what transformers (``from_pretrained``)
or the plain model computes. Small random models, saved under ``tmp_path``."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

import automap
from tiny_configs import part_on_disk, run_dispatched, tiny

transformers = pytest.importorskip("transformers")

IDS = torch.randint(3, 60, (1, 6), generator=torch.Generator().manual_seed(0))


def _reference(folder, auto: str) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, auto).from_pretrained(folder).eval()


def _generation_json(folder) -> None:
    """A ``generation_config.json`` whose settings change the greedy tokens."""
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 5, "repetition_penalty": 3.0,
         "no_repeat_ngram_size": 1}))


def _generation_in_config(folder) -> None:
    """An older folder: no ``generation_config.json``, generation settings in ``config.json``."""
    (folder / "generation_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    config.update(num_beams=3, no_repeat_ngram_size=2, max_length=9)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("family,auto,edit", [("llama", "AutoModelForCausalLM", _generation_json),
                                               ("bart", "AutoModelForSeq2SeqLM", _generation_in_config)],
                         ids=["generation_config.json", "settings-in-config.json"])
def test_a_folder_generates_with_its_generation_settings(family, auto, edit, tmp_path):
    """from_pretrained reads the folder's generation settings; automap.load(folder) kept the
    ones the model derives from its config at init, so generate() ran past the folder's
    max_new_tokens, without its repetition penalty or beams, and gave other tokens."""
    model = tiny(family, auto)
    model.save_pretrained(tmp_path / "m")
    edit(tmp_path / "m")
    reference = _reference(tmp_path / "m", auto)
    with torch.no_grad():
        expected = reference.generate(IDS)
    loaded = automap.load(tmp_path / "m", max_memory=part_on_disk(model), offload_dir=tmp_path / "off", quiet=True)
    assert loaded.generation_config == reference.generation_config
    assert torch.equal(run_dispatched(loaded, lambda m: m.generate(IDS)), expected)
