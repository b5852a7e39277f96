"""Resource limits met with real rlimits in a subprocess: shards read into RAM release their
handles as they go (hundreds of shards under a low ``RLIMIT_NOFILE``); an ``undispatch`` that
cannot allocate the weights it brings back (low ``RLIMIT_AS``) leaves the model dispatched and
working, with an AutomapError that says so, and succeeds once memory is there."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def test_hundreds_of_shards_read_into_ram_under_a_low_open_files_limit(tmp_path):
    result = run(
        """
        import resource, sys, torch, automap
        from pathlib import Path
        from safetensors.torch import save_file
        from torch import nn
        folder = Path(sys.argv[1])
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(150)]).eval()
        state = model.state_dict()
        for i in range(150):  # one shard per layer, no index: every shard of the folder is read
            save_file({k: v for k, v in state.items() if k.split(".")[0] == str(i)}, folder / f"s{i:03}.safetensors")
        x = torch.randn(2, 8)
        with torch.no_grad():
            want = model(x)
        with automap.empty_model():
            empty = nn.Sequential(*[nn.Linear(8, 8) for _ in range(150)]).eval()
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        loaded = automap.load(empty, folder, {"": "cpu"}, quiet=True)
        with torch.no_grad():
            assert torch.equal(loaded(x), want)
        print("OK")
    """,
        str(tmp_path),
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


def test_undispatch_that_cannot_allocate_leaves_the_model_dispatched(tmp_path):
    result = run(
        """
        import resource, sys, torch, automap
        from automap.errors import AutomapError
        from torch import nn
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).eval()  # 4 MiB a layer
        x = torch.randn(2, 1024)
        with torch.no_grad():
            want = model(x)
        device_map = {str(i): "disk" if i % 2 else "cpu" for i in range(8)}
        automap.dispatch(model, device_map, offload_dir=sys.argv[1])
        with torch.no_grad():
            assert torch.equal(model(x), want)
        def vm() -> int:
            for line in open("/proc/self/status"):
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (vm() + (4 << 20), hard))  # 16 MiB come back: no room
        try:
            automap.undispatch(model)
        except AutomapError as exc:
            assert "still dispatched" in str(exc), exc
        else:
            raise SystemExit("undispatch succeeded under the limit: the test did not test")
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        assert automap.placement(model) is not None  # still dispatched
        with torch.no_grad():
            assert torch.equal(model(x), want)
        automap.undispatch(model)
        assert not any(p.device.type == "meta" for p in model.parameters())
        with torch.no_grad():
            assert torch.equal(model(x), want)
        print("OK")
    """,
        str(tmp_path / "off"),
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout[-1000:] + result.stderr[-3000:]
