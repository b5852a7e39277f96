import subprocess
import sys


def test_demo_runs_and_reports_identical_outputs():
    result = subprocess.run([sys.executable, "-m", "automap", "demo"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("IDENTICAL") == 2
    assert "hypothetical 2 GPU" in result.stdout and "disk" in result.stdout
