"""The ``automap`` command: every SPEC kind plans, the 70B acceptance command places nothing on
CPU, bad arguments exit 2 with one line, and the demo still shows identical outputs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from automap import bench
from automap.cli import main
from automap.errors import SizeError
from automap.specs import SpecError, build_model, parse_max_memory_arg, parse_overrides

LLAMA_70B = (
    "hidden_size=8192,intermediate_size=28672,num_hidden_layers=80,num_attention_heads=64,"
    "num_key_value_heads=8"
)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_demo_runs_and_reports_identical_outputs():
    result = subprocess.run(
        [sys.executable, "-m", "automap", "demo"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("IDENTICAL") == 2
    assert "hypothetical 2 GPU" in result.stdout and "disk" in result.stdout


def test_70b_on_two_80gib_gpus_places_nothing_on_cpu(capsys, tmp_path):
    code, out, err = _run(
        capsys,
        "plan",
        "hf:llama",
        "--set",
        LLAMA_70B,
        "--max-memory",
        "0=80GiB,1=80GiB,cpu=200GiB",
        "--dtype",
        "bf16",
        "--json",
        str(tmp_path / "p.json"),
        "--figure",
        str(tmp_path / "p.png"),
    )
    assert code == 0, err
    assert "LlamaForCausalLM" in out and "cuda:0" in out and "cuda:1" in out
    data = json.loads((tmp_path / "p.json").read_text())
    assert set(data["device_map"].values()) == {0, 1}
    assert data["totals"]["spill_bytes"] == 0
    cpu = next(d for d in data["devices"] if d["name"] == "cpu")
    assert cpu["units"] == [] and cpu["weight_bytes"] == 0
    assert 128 * 2**30 < data["totals"]["weight_bytes"] < 130 * 2**30  # ~69B parameters at 2 bytes
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_spec_models_are_built_on_meta():
    built = build_model(
        "hf:llama", parse_overrides(["num_hidden_layers=2,hidden_size=256,intermediate_size=512"])
    )
    assert built.model.config.num_hidden_layers == 2
    assert all(t.device.type == "meta" for t in built.model.state_dict().values())
    vision = build_model("torchvision:resnet18", {"num_classes": 10})
    assert vision.model.fc.out_features == 10
    assert all(p.device.type == "meta" for p in vision.model.parameters())


@pytest.mark.parametrize(
    "spec, extra, expect",
    [
        ("torchvision:resnet18", [], "layer4"),
        ("hf:gpt2", ["--set", "n_layer=2,n_embd=128,n_head=4"], "transformer.h.0-1"),
        (
            "hf:t5",
            [
                "--set",
                "num_layers=2,d_model=64,d_ff=128,num_heads=4,d_kv=16",
                "--batch",
                "2",
                "--seq-len",
                "16",
            ],
            "encoder.block",
        ),
    ],
)
def test_every_builtin_spec_kind_plans(capsys, spec, extra, expect):
    code, out, err = _run(capsys, "plan", spec, *extra, "--max-memory", "0=2GB,1=2GB,cpu=8GB")
    assert code == 0, err
    assert expect in out and "cuda:0" in out


def test_config_file_and_factory_specs(capsys, tmp_path, monkeypatch):
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, err = _run(capsys, "plan", f"hf:{tmp_path / 'config.json'}", "--max-memory", "cpu=1GB")
    assert code == 0, err
    assert "model.layers.0-2" in out and "bfloat16" in out  # the config's dtype is used
    (tmp_path / "mymodels.py").write_text(
        textwrap.dedent("""
        import torch
        def build(width=8, depth=3):
            return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    """)
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    code, out, err = _run(
        capsys,
        "plan",
        "mymodels:build",
        "--set",
        "width=16,depth=4",
        "--max-memory",
        "0=600B,1=600B,cpu=1GB",
        "--json",
        "plan.json",
    )
    assert code == 0, err
    data = json.loads((tmp_path / "plan.json").read_text())
    assert len(data["units"]) == 4 and data["units"][0]["param_bytes"] == (16 * 16 + 16) * 4
    assert set(data["device_map"].values()) <= {0, 1, "cpu"}


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["plan", "hf:lama"], "did you mean llama"),
        (["plan", "resnet50"], "kind:name"),
        (["plan", "torchvision:resnet5"], "resnet50"),
        (["plan", "hf:llama", "--set", "num_hidden_layer=2"], "num_hidden_layers"),
        (["plan", "hf:llama", "--set", "num_hidden_layers"], "key=value"),
        (["plan", "hf:llama", "--set", "to_dict=1"], "does not have"),  # a method of the config, no field
        (["plan", "torchvision:resnet18", "--max-memory", "0=20XB"], "unknown size unit 'XB'"),
        (["plan", "torchvision:resnet18", "--max-memory", "gpu=20GiB"], "unknown device 'gpu'"),
        (["plan", "torchvision:resnet18", "--dtype", "bf15"], "invalid choice: 'bf15'"),
        (["plan", "torchvision:resnet18", "--figure", "plan.jpg"], ".png"),
        (["plan", "torchvision:resnet18", "--json", "no/such/folder/p.json"], "does not exist"),
        (["plan", "nosuchmodule_xyz:build"], "cannot import 'nosuchmodule_xyz'"),
        (["plan", "torchvision:resnet18", "--strategy", "fast"], "invalid choice: 'fast'"),
        (["plan", "torchvision:resnet18", "--batch", "0"], "--batch"),
        (["plan"], "SPEC"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, argv, needle):
    code, out, err = _run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("automap") and needle in lines[0]
    assert "Traceback" not in err


def test_model_that_does_not_fit_exits_1(capsys):
    code, out, err = _run(capsys, "plan", "torchvision:resnet18", "--max-memory", "0=1MB,cpu=1MB,disk=1MB")
    assert code == 1
    assert len(err.strip().splitlines()) == 1 and "error" in err


def test_bad_arguments_in_a_real_process_exit_2_without_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "automap", "plan", "hf:llama", "--max-memory", "0=lots"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert "'lots'" in result.stderr


def test_help_teaches(capsys):
    code, out, _ = _run(capsys, "plan", "--help")
    assert code == 0
    for needle in (
        "torchvision:resnet50",
        "hf:llama",
        "hf:/path/config.json",
        "module.path:factory",
        "--max-memory",
        "0=80GiB",
        "--json",
        "--figure",
        "examples:",
    ):
        assert needle in out
    code, out, _ = _run(capsys, "--help")
    assert code == 0 and "plan" in out and "demo" in out and "bench" in out


def test_parsers_read_the_documented_forms():
    assert parse_max_memory_arg("0=20GiB, 1=20GiB,cpu=64GiB,disk=500GiB") == {
        0: "20GiB",
        1: "20GiB",
        "cpu": "64GiB",
        "disk": "500GiB",
    }
    assert parse_overrides(["a=1,b=2.5", "c=true,d=silu,e=none"]) == {
        "a": 1,
        "b": 2.5,
        "c": True,
        "d": "silu",
        "e": None,
    }
    with pytest.raises(SizeError, match="device=size"):
        parse_max_memory_arg("0:20GiB")


def test_bench_compares_with_accelerate(capsys, tmp_path, monkeypatch):
    case = bench.BenchCase(
        "ResNet-18 fp32, 2 x 30MB", "torchvision:resnet18", {}, {0: "30MB", 1: "30MB", "cpu": "1GB"}
    )
    monkeypatch.setattr(bench, "DEFAULT_CASES", (case,))
    code, out, err = _run(capsys, "bench", "--json", str(tmp_path / "bench.json"))
    assert code == 0, err
    assert "automap" in out and "accelerate" in out and case.name in out
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert [r["tool"] for r in rows] == ["automap", "accelerate"]
    for row in rows:
        assert len(row["gpu_bytes"]) == 2
        assert 0.5 <= row["busiest_gpu_flops_share"] <= 1.0
        assert sum(row["gpu_bytes"]) + row["spill_bytes"] == pytest.approx(
            sum(rows[0]["gpu_bytes"]) + rows[0]["spill_bytes"]
        )
    assert rows[0]["spill_bytes"] == 0  # 45 MB of weights fit on 2 x 30 MB without CPU


def test_70b_planned_for_generation_reserves_its_cache_and_predicts_decode(capsys, tmp_path):
    code, out, err = _run(
        capsys,
        "plan",
        "hf:llama",
        "--set",
        LLAMA_70B,
        "--max-memory",
        "0=80GiB,1=80GiB,cpu=200GiB",
        "--dtype",
        "bf16",
        "--batch",
        "16",
        "--max-length",
        "8192",
        "--json",
        str(tmp_path / "p.json"),
    )
    assert code == 0, err
    flat = " ".join(out.split())
    assert "generation: 16 x 8,192 tokens (prompt 128)" in flat and "decode limited by" in flat
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["generation"]["kv_bytes"] == data["totals"]["kv_bytes"] > 0
    for device in data["devices"]:
        assert device["used_bytes"] <= device["capacity_bytes"]


def test_max_length_shorter_than_the_prompt_exits_1_with_one_line(capsys):
    code, out, err = _run(
        capsys,
        "plan",
        "hf:gpt2",
        "--set",
        "n_layer=2",
        "--max-memory",
        "cpu=2GiB",
        "--seq-len",
        "64",
        "--max-length",
        "32",
    )
    assert code == 1 and err.count("\n") == 1
    assert (
        "max_length=32 is not longer than the prompt (64 tokens)" in err
        and "max_length is --max-length" in err
    )


def test_set_resolves_config_aliases_and_nested_keys():
    gpt2 = build_model(
        "hf:gpt2", parse_overrides(["num_hidden_layers=2,hidden_size=64,num_attention_heads=2"])
    )
    config = gpt2.model.config
    assert config.n_layer == 2 and config.n_embd == 64 and len(gpt2.model.transformer.h) == 2
    llava = build_model(
        "hf:llava",
        parse_overrides(
            [
                "text_config.num_hidden_layers=1,text_config.hidden_size=64",
                "text_config.intermediate_size=128",
                "vision_config.num_hidden_layers=1",
            ]
        ),
    )
    config = llava.model.config
    assert config.text_config.num_hidden_layers == 1 and config.text_config.hidden_size == 64
    assert config.vision_config.num_hidden_layers == 1
    with pytest.raises(SpecError, match="not a nested config"):
        build_model("hf:gpt2", {"n_layer.x": 1})
    with pytest.raises(SpecError, match="'num_hidden_layerz'.*text_config config"):
        build_model("hf:llava", parse_overrides(["text_config.num_hidden_layerz=1"]))


def test_a_capped_seq_len_is_said_with_the_value_used(capsys):
    code, out, _ = _run(
        capsys,
        "plan",
        "hf:gpt2",
        "--set",
        "n_layer=1,n_embd=32,n_head=2,n_positions=64",
        "--seq-len",
        "4096",
        "--max-memory",
        "cpu=1GB",
    )
    assert code == 0
    assert "--seq-len 4096 capped at 64" in out and "input_ids 1x64" in out


def test_plans_print_no_third_party_deprecation_and_no_tied_unit_that_never_ran():
    # a fresh process: transformers warns once per process
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "automap",
            "plan",
            "hf:t5",
            "--set",
            "num_layers=1,num_decoder_layers=1,d_model=32,d_ff=64,num_heads=2,d_kv=16",
            "--max-memory",
            "cpu=1GB",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "deprecated" not in result.stderr + result.stdout
    assert "never" not in result.stderr + result.stdout, "T5's shared embedding is tied to one that ran"


def test_the_names_offered_before_torch_are_the_registries():
    from automap import cli
    from automap.planning import STRATEGIES
    from automap.report.figure import FORMATS
    from automap.specs import DTYPES

    assert set(cli.STRATEGY_NAMES) == set(STRATEGIES)
    assert set(cli.DTYPE_NAMES) == set(DTYPES)
    assert tuple(cli.FIGURE_FORMATS) == tuple(FORMATS)


@pytest.mark.parametrize(
    "argv",
    [
        ["-v", "plan", "torchvision:resnet18"],
        ["plan", "-v", "torchvision:resnet18"],
        ["plan", "torchvision:resnet18", "-v"],
    ],
)
def test_verbose_is_accepted_anywhere(capsys, argv):
    code, out, err = _run(capsys, *argv, "--max-memory", "cpu=1GB", "--quiet")
    assert code == 0, err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["plan", "x", "--max-memory", "cpu=2GB,cpu=3GB"], "'cpu' two budgets"),
        (["plan", "x", "--max-memory", "0=1GB,cuda:0=2GB"], "'cuda:0' two budgets"),
        (["plan", "x", "--max-memory", "cpu=0.5"], "not a whole number of bytes"),
        (["plan", "x", "--input-shape", "1x0x3"], "--input-shape"),
        (["plan", "x", "--input-shape", "1x3", "--example-inputs", "m:f"], "not allowed with"),
    ],
)
def test_strict_arguments(capsys, argv, needle):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_detection_models_plan_without_downloading_a_backbone(capsys, monkeypatch):
    import torch.hub

    monkeypatch.setattr(
        torch.hub, "load_state_dict_from_url", lambda *a, **k: pytest.fail("a download started")
    )
    code, out, err = _run(
        capsys, "plan", "torchvision:fasterrcnn_resnet50_fpn", "--max-memory", "cpu=2GB", "--quiet"
    )
    assert code == 0, err


def test_a_video_model_plans_with_its_input_shape_and_a_failed_guess_names_the_options(
    capsys, tmp_path, monkeypatch
):
    # the guessed image input fails: the plan falls back to the weights (issue 22) and says how to trace it
    code, out, err = _run(capsys, "plan", "torchvision:r3d_18", "--max-memory", "cpu=1GB")
    assert code == 0, err
    assert "without a trace" in out and "--input-shape" in out and "--example-inputs" in out
    assert "example_inputs=" in out
    code, out, err = _run(
        capsys, "plan", "torchvision:r3d_18", "--input-shape", "1x3x8x56x56", "--max-memory", "cpu=1GB"
    )
    assert code == 0, err
    assert "layer4" in out
    (tmp_path / "clips.py").write_text(
        "import torch\ndef clip():\n    return (torch.zeros(1, 3, 8, 56, 56),)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    code, out, err = _run(
        capsys,
        "plan",
        "torchvision:r3d_18",
        "--example-inputs",
        "clips:clip",
        "--max-memory",
        "cpu=1GB",
        "--json",
        "p.json",
    )
    assert code == 0, err
    assert json.loads((tmp_path / "p.json").read_text())["units"]


def test_without_transformers_hf_specs_and_the_demo_name_the_extra():
    """A real missing module (None in sys.modules makes every import of it fail)."""
    block = "import sys; sys.modules['transformers'] = None; from automap.cli import main; "
    done = subprocess.run(
        [sys.executable, "-c", block + "sys.exit(main(['plan', 'hf:llama']))"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and 'pip install "automap[hf]"' in done.stderr
    assert "folder" not in done.stderr.split(";")[0]  # says what needed it: planning hf:llama


def test_help_mentions_the_input_options(capsys):
    code, out, _ = _run(capsys, "plan", "--help")
    assert code == 0 and "--input-shape" in out and "--example-inputs" in out and "r3d_18" in out


def test_a_factory_module_that_fails_to_import_is_one_line_and_a_file_path_works(
    capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nets").mkdir()
    (tmp_path / "nets" / "small.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(8, 8))\n"
    )
    (tmp_path / "broken.py").write_text("def build(:\n")
    (tmp_path / "raising.py").write_text("raise RuntimeError('boom at import')\n")
    for spec in ("./nets/small.py:build", "nets/small:build"):
        assert main(["plan", spec, "--max-memory", "cpu=1GB", "--quiet"]) == 0, spec
    capsys.readouterr()
    for spec, needle in [
        ("broken:build", "SyntaxError"),
        ("raising:build", "RuntimeError: boom at import"),
        ("./absent.py:build", "no file 'absent.py'"),
    ]:
        assert main(["plan", spec]) == 2, spec
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert main(["plan", "./nets/small.py:build", "--example-inputs", "raising:x"]) == 2
    assert "cannot import 'raising' (RuntimeError: boom at import)" in capsys.readouterr().err


def test_output_paths_that_cannot_be_files_are_refused_before_any_work(capsys, tmp_path):
    assert main(["plan", "torchvision:resnet18", "--json", str(tmp_path)]) == 2
    err = capsys.readouterr()
    assert "it is a folder; name a file in it" in err.err and err.out == ""  # nothing planned, no report
    assert main(["bench", "--json", str(tmp_path / "absent" / "rows.json")]) == 2
    err = capsys.readouterr()
    assert "folder" in err.err and "does not exist" in err.err and err.out == ""


def test_errors_keep_the_librarys_words_and_name_the_flags_of_its_arguments(capsys):
    """The library's errors say ``raise max_memory`` and ``dtype=torch.float16``; printed by the
    command, the message is the library's, followed by the flag of each argument it names."""
    code, out, err = _run(
        capsys,
        "plan",
        "hf:llama",
        "--set",
        "num_hidden_layers=2",
        "--max-memory",
        "cpu=2GB,disk=10MB",
        "--max-length",
        "4096",
    )
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "raise max_memory" in err and "dtype=torch.float16" in err, err
    assert err.rstrip().endswith(")") and "(on the command line: " in err, err
    glossary = err[err.rindex("(on the command line: ") :]
    assert "max_memory is --max-memory" in glossary and "dtype is --dtype" in glossary, glossary
    # a CPU budget that cannot hold the run (max_memory['cpu'] in the library's words)
    code, out, err = _run(
        capsys,
        "plan",
        "hf:llama",
        "--set",
        "num_hidden_layers=2",
        "--max-memory",
        "cpu=10MB,disk=10MB",
        "--max-length",
        "4096",
    )
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "while it runs" in err and "raise max_memory['cpu'] to at least" in err, err
    assert "max_memory is --max-memory" in err and "KV cache" not in err, err


def test_the_flags_are_read_from_the_parser_and_only_whole_names_are_matched():
    from automap.cli import _parser, flags_of, with_flags

    flags = flags_of(_parser())
    assert {
        "max_memory": "--max-memory",
        "dtype": "--dtype",
        "max_length": "--max-length",
        "example_inputs": "--example-inputs",
    }.items() <= flags.items()
    message = "unit 'model.max_memory' and my_max_length, max_memory={'cpu': '16GiB', ...}"
    assert with_flags(message, flags) == message + " (on the command line: max_memory is --max-memory)"
    assert with_flags("no argument named", flags) == "no argument named"


@pytest.mark.parametrize(
    "spec",
    [
        [
            "hf:mamba",
            "--set",
            "num_hidden_layers=1,hidden_size=32,vocab_size=128",
        ],  # transformers' log: a fallback kernel
        ["torchvision:inception_v3"],  # torchvision's FutureWarning about its default initialisation
    ],
)
def test_the_libraries_warnings_about_the_model_show_only_with_verbose(spec):
    # fresh processes: both warn once per process
    argv = [sys.executable, "-m", "automap", "plan", *spec, "--max-memory", "cpu=2GB", "--quiet"]
    quiet = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and "[transformers]" not in quiet.stderr and "Warning" not in quiet.stderr, (
        quiet.stderr
    )
    loud = subprocess.run([*argv, "-v"], capture_output=True, text=True, timeout=300)
    assert loud.returncode == 0 and ("falling back" in loud.stderr or "FutureWarning" in loud.stderr), (
        loud.stderr
    )


def test_a_folder_without_architectures_plans_its_head_and_a_quantized_one_is_refused(tmp_path, capsys):
    """As automap.load builds them: the head whose tensors the checkpoint holds (a classifier,
    not the family's causal LM); a declared quantization is one line naming it."""
    import json

    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
    )
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({k: v for k, v in fields.items() if k != "architectures"})
    )
    code, out, err = _run(capsys, "plan", str(tmp_path), "--max-memory", "cpu=1GB")
    assert code == 0 and out.startswith("BertForSequenceClassification"), err
    (tmp_path / "config.json").write_text(
        json.dumps({**fields, "quantization_config": {"quant_method": "gptq", "bits": 4}})
    )
    code, out, err = _run(capsys, "plan", str(tmp_path), "--max-memory", "cpu=1GB")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "gptq" in err, err
