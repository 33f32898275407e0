"""`drs engine` as a real process, and the promise that the sim never imports tensorrt_llm or torch."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from drs_engine.config import build_config
from drs_engine.server.runner import start_engine
from drs_protocol.chat import default_tokenizer_dir

DRS = Path(sys.executable).parent / "drs"


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_importing_the_engine_and_building_a_sim_backend_never_imports_tensorrt_llm() -> None:
    result = run_python(
        """
        import sys
        import drs_engine, drs_engine.cli, drs_engine.server.app, drs_engine.backends.trtllm
        from drs_engine.backends import create_backend
        from drs_engine.config import build_config
        backend = create_backend(build_config({"backend": "sim"}), vocab_size=1000, eos_token_id=999)
        assert backend.name == "sim", backend.name
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("tensorrt_llm", "torch"))
        print("tensorrt_llm/torch modules:", loaded)
        sys.exit(1 if loaded else 0)
        """
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_test_can_see_a_tensorrt_llm_import(tmp_path: Path) -> None:
    """Guards the test above: a fake tensorrt_llm on the path is detected once imported."""
    (tmp_path / "tensorrt_llm").mkdir()
    (tmp_path / "tensorrt_llm" / "__init__.py").write_text("")
    result = run_python(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import tensorrt_llm
        sys.exit(1 if any(m.split(".")[0] == "tensorrt_llm" for m in sys.modules) else 0)
        """
    )
    assert result.returncode == 1


def test_the_engine_exits_at_once_naming_a_port_it_cannot_bind() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run(
            [str(DRS), "engine", "--backend", "sim", "--host", "127.0.0.1", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 1
    assert f"127.0.0.1:{port}" in result.stderr
    assert time.monotonic() - started < 60


def test_the_engine_refuses_an_invalid_config_file(tmp_path: Path) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text("backend: sim\ntensorParallelSize: 4\nmoeTensorParallelSize: 3\nmoeExpertParallelSize: 2\n")
    result = subprocess.run([str(DRS), "engine", "--config", str(config)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "moeTensorParallelSize * moeExpertParallelSize" in result.stderr


def test_drs_engine_serves_from_a_config_file_with_flags_overriding_it(tmp_path: Path) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text(
        "backend: sim\nrole: prefill\nmodel: {path: sim-model, maxModelLen: 4096}\nport: 1\nsim: {speed: 0}\n"
    )
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    process = subprocess.Popen(
        [
            str(DRS),
            "engine",
            "--config",
            str(config),
            "--role",
            "decode",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--control-token-file",
            str(token),
            "--log-level",
            "warning",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "DRS_CONTROL_TOKEN": "ignored-because-the-file-wins"},
    )
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert match, line
        url = f"http://127.0.0.1:{match.group(1)}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "engine never became healthy"
            time.sleep(0.2)
        info = httpx.get(url + "/server_info").json()
        assert (info["role"], info["backend"], info["max_model_len"]) == ("decode", "sim", 4096)
        reset = httpx.post(url + "/control/prefix_cache/reset", headers={"authorization": "Bearer s3cret"})
        assert reset.status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:  # pragma: no cover - only if shutdown hangs
            process.kill()
            pytest.fail("the engine did not stop on SIGTERM")


def test_a_trtllm_engine_that_cannot_load_exits_non_zero_saying_why(tmp_path: Path) -> None:
    """No GPU and no tensorrt_llm here: the trtllm backend fails at startup, and the process ends."""
    config = tmp_path / "engine.yaml"
    config.write_text(
        f"backend: trtllm\nmodel: {{path: /models/none, tokenizer: {default_tokenizer_dir()}}}\n"
        "host: 127.0.0.1\nport: 0\n"
    )
    result = subprocess.run([str(DRS), "engine", "--config", str(config)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3
    assert "tensorrt_llm" in result.stderr
    assert "failed to start" in result.stderr


async def test_an_in_process_engine_that_cannot_load_raises_instead_of_exiting_the_process() -> None:
    config = build_config(
        {
            "backend": "trtllm",
            "host": "127.0.0.1",
            "port": 0,
            "model": {"path": "/models/none", "tokenizer": str(default_tokenizer_dir())},
        }
    )
    with pytest.raises(RuntimeError, match="failed to start"):
        async with start_engine(config):
            pass  # pragma: no cover - never reached
