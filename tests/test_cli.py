"""The `asyncrl` command, run as a user runs it (a subprocess)."""

import json
import subprocess
import sys


def asyncrl(*args, cwd):
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_generate_on_tiny_model(tmp_path):
    out = asyncrl("generate", "-n", "2", "model=tiny", "task=tiny", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "### 0:" in out.stdout and "tokens/s" in out.stdout


def test_bench_messages_quick_writes_json(tmp_path):
    out = asyncrl("bench", "messages", "--quick", "--run-dir", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "bench_messages.json").read_text())
    assert result["4096_tokens"]["msgspec_roundtrip_us"] > 0 and "machine" in result


def test_bad_override_fails_with_the_field_name(tmp_path):
    out = asyncrl("generate", "model=tiny", "engine.windw=3", cwd=tmp_path)
    assert out.returncode != 0 and "windw" in out.stderr
    out = asyncrl("bench", "nonsense", "--quick", cwd=tmp_path)
    assert out.returncode != 0 and "unknown benchmark" in out.stderr
