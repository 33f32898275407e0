"""``drs dev images``: build the project's image (the top-level Dockerfile) with no registry.

No container registry is reachable from the machines this project is developed on, so nothing
can be pulled, not even a base image. The build therefore:

1. starts a private ``dockerd`` (Debian's docker.io) on its own socket and data root, with no
   bridge and no iptables rules (builds use the host network), and stops it by pid afterwards;
2. makes the base image from Debian packages: ``mmdebstrap --variant=minbase`` with Python 3.11,
   then ``docker import`` (``drs-base:bookworm``);
3. builds the Dockerfile with BuildKit, passing ``BASE_IMAGE=drs-base:bookworm`` and the host's CA
   bundle as a build *secret* (the machines reach PyPI through a TLS-inspecting proxy; the bundle
   is mounted for the ``pip install`` step only and never stored in a layer), progress shown;
4. builds the sandbox image ``drs-pause`` from ``devcluster/pause/pause.go``;
5. saves both into one ``docker save`` archive in the cache, keyed by the image's inputs, which
   ``drs dev up --real-nodes`` imports into each node's containerd;
6. unless told not to (``drs dev images --no-gym``; ``drs dev up`` does not build it), builds the
   Dockerfile's ``gym`` target, ``drs-gym:<version>`` (NeMo-Gym 0.7.0 in ``/opt/gym``, the real
   client of `make demo`'s rollout pod), into an archive of its own keyed by its own inputs (the
   Dockerfile and tests/realgym's pins: a source change rebuilds nothing of it), which
   ``realnodes.import_archive`` imports into running nodes when a Gym pod is about to run.

A second call with unchanged sources finds the archives and builds nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from . import build, packages, processes

ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGE = "drs-base:bookworm"
#: Debian packages of the base image: the interpreter the Dockerfile's venv is made with.
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")
PAUSE_SOURCE = ROOT / "devcluster" / "pause" / "pause.go"
DOCKERD_START_TIMEOUT_S = 60.0
MMDEBSTRAP_TIMEOUT_S = 900.0
BUILD_TIMEOUT_S = 1800.0
#: BuildKit's layer cache is pruned, least recently used first, down to this (pip's cache mount
#: is never pruned: it is what makes a dependency change download only what changed).
BUILD_CACHE_KEEP = "4gb"


class ImageError(RuntimeError):
    """The image could not be built; the message names the cause."""


def _say(msg: str) -> None:
    print(f"[drs images] {msg}", file=sys.stderr, flush=True)


def version() -> str:
    return metadata.version("disagg-replicaset")


def image_ref() -> str:
    """The project's image as pods name it: ``drs:<version>``."""
    return f"drs:{version()}"


def pause_ref() -> str:
    return f"drs-pause:{version()}"


def gym_ref() -> str:
    """The NeMo-Gym image (the Dockerfile's ``gym`` target): ``drs-gym:<version>``."""
    return f"drs-gym:{version()}"


def images_dir() -> Path:
    return build.cache_root() / "images"


def ca_bundle() -> Path | None:
    """The host's trusted CA bundle, passed into builds (None when the host has none)."""
    for candidate in (os.environ.get("SSL_CERT_FILE"), "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


#: What the ``gym`` target COPYs (besides the Dockerfile): NeMo-Gym's pins.
GYM_INPUTS = ("tests/realgym/requirements.txt", "tests/realgym/constraints.txt")
GYM_TARGET = "gym"


def context_files() -> list[str]:
    """The tracked files the build reads (Dockerfile, .dockerignore and what it COPYs), sorted."""
    return _tracked("Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "cli", "operator", "frontend",
                    "engine_image/drs_engine", "protocol", "devcluster", "sidecar", "client")  # fmt: skip


def gym_context_files() -> list[str]:
    """The tracked files the ``gym`` target's build reads, sorted."""
    return _tracked("Dockerfile", ".dockerignore", *GYM_INPUTS)


def _tracked(*paths: str) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z", "--", *paths], cwd=ROOT, capture_output=True, check=False, timeout=60
    )
    if out.returncode != 0:
        raise ImageError(f"`git ls-files` failed in {ROOT}: {out.stderr.decode().strip()}")
    return sorted(filter(None, out.stdout.decode().split("\0")))


def inputs_digest(files: list[str]) -> str:
    """A digest of the build's inputs: every context file's path and content, the base packages."""
    h = hashlib.sha256("\n".join(BASE_PACKAGES).encode())
    for rel in files:
        h.update(rel.encode() + b"\0")
        path = ROOT / rel
        h.update(path.read_bytes() if path.is_file() else b"(missing)")
    return h.hexdigest()[:16]


def archive_path() -> Path:
    """The ``docker save`` archive of this source tree's images."""
    return images_dir() / f"drs-{version()}-{inputs_digest(context_files())}.tar"


def gym_archive_path() -> Path:
    """The ``docker save`` archive of ``drs-gym:<version>`` for this tree's Gym inputs."""
    return images_dir() / f"drs-gym-{version()}-{inputs_digest(gym_context_files())}.tar"


# ---------------------------------------------------------------------------------------- dockerd


@dataclasses.dataclass(frozen=True)
class Docker:
    """A private dockerd: its socket and the CLI that talks to it (Debian's, BuildKit built in)."""

    root: Path

    @property
    def socket(self) -> Path:
        return self.root / "run" / "docker.sock"

    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": f"unix://{self.socket}", "DOCKER_BUILDKIT": "1"}

    def cli(self) -> str:
        # Debian's docker.io ships a 20.10 CLI with BuildKit built in; a newer CLI elsewhere on
        # PATH needs the buildx plugin, which is not installed.
        return "/usr/bin/docker" if Path("/usr/bin/docker").is_file() else "docker"

    def run(self, *args: str, timeout: float = 600.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [self.cli(), *args], env=self.env(), capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and out.returncode != 0:
            raise ImageError(f"`docker {' '.join(args)}` failed: {out.stderr.strip()[-2000:]}")
        return out

    def has_image(self, ref: str) -> bool:
        return self.run("image", "inspect", ref, check=False).returncode == 0


def _dockerd_argv(root: Path) -> list[str]:
    return [
        shutil.which("dockerd") or "/usr/sbin/dockerd",
        f"--data-root={root / 'data'}",
        f"--exec-root={root / 'run' / 'exec'}",
        f"--pidfile={root / 'run' / 'dockerd.pid'}",
        f"--host=unix://{root / 'run' / 'docker.sock'}",
        "--storage-driver=overlay2",
        # No docker0 bridge, no iptables or forwarding changes: builds use the host network.
        "--bridge=none",
        "--iptables=false",
        "--ip-forward=false",
        "--ip-masq=false",
    ]


@contextlib.contextmanager
def private_dockerd() -> Iterator[Docker]:
    """Start a dockerd of our own for the duration of the block; stop it (by pid) afterwards."""
    root = images_dir() / "docker"
    (root / "run").mkdir(parents=True, exist_ok=True)
    docker = Docker(root)
    docker.socket.unlink(missing_ok=True)
    log = images_dir() / "dockerd.log"
    tracked = processes.start("dockerd", _dockerd_argv(root), log)
    try:
        deadline = time.monotonic() + DOCKERD_START_TIMEOUT_S
        while docker.run("version", "--format", "{{.Server.Version}}", check=False, timeout=10).returncode != 0:
            if not processes.is_running(tracked) or time.monotonic() > deadline:
                raise ImageError(f"dockerd did not start; last lines of {log}:\n{processes.log_tail(log)}")
            time.sleep(0.5)
        yield docker
    finally:
        processes.stop([tracked], grace_s=30.0)


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    images_dir().mkdir(parents=True, exist_ok=True)
    with (images_dir() / ".lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


# ---------------------------------------------------------------------------------------- steps


def _stream(argv: list[str], env: dict[str, str], what: str, timeout: float) -> None:
    """Run ``argv`` with its output shown line by line (prefixed), raising with the tail on failure."""
    started = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            line = line.rstrip()
            tail = [*tail, line][-30:]
            _say(f"{what}: {line}")
        rc = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - started)))
    finally:
        if proc.poll() is None:
            proc.kill()
    if rc != 0:
        raise ImageError(f"{what} failed (exit {rc}):\n" + "\n".join(tail))


def _build_base(docker: Docker) -> None:
    if docker.has_image(BASE_IMAGE):
        _say(f"{BASE_IMAGE}: present")
        return
    with tempfile.TemporaryDirectory(prefix="drs-base-", dir=images_dir()) as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        argv = ["mmdebstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", "bookworm", str(rootfs)]
        _say(f"{BASE_IMAGE}: {' '.join(argv)} (about a minute)")
        _stream(argv, dict(os.environ), "mmdebstrap", MMDEBSTRAP_TIMEOUT_S)
        docker.run("import", "--change", 'CMD ["/bin/bash"]', str(rootfs), BASE_IMAGE, timeout=600)


def _build_pause(docker: Docker) -> None:
    with tempfile.TemporaryDirectory(prefix="drs-pause-", dir=images_dir()) as tmp:
        binary = Path(tmp) / "pause"
        env = {**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local", "GOFLAGS": ""}
        out = subprocess.run(
            ["go", "build", "-trimpath", "-ldflags=-s -w", "-o", str(binary), str(PAUSE_SOURCE)],
            cwd=tmp, env=env, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        if out.returncode != 0:
            raise ImageError(f"building {PAUSE_SOURCE.name} failed: {out.stderr.strip()}")
        tar = Path(tmp) / "pause.tar"
        subprocess.run(["tar", "-C", tmp, "-cf", str(tar), "pause"], check=True, timeout=60)
        docker.run("import", "--change", 'ENTRYPOINT ["/pause"]', str(tar), pause_ref(), timeout=120)


def build_argv(docker: Docker, ca: Path | None, target: str | None = None) -> list[str]:
    """The ``docker build`` command line: BuildKit, the local base, the CA bundle as a secret;
    the default target (``drs:<version>``) or ``gym`` (``drs-gym:<version>``)."""
    argv = [docker.cli(), "build", "--progress=plain", "--network=host", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}"]
    if ca is not None:
        argv += ["--secret", f"id=ca-bundle,src={ca}"]
    if target is not None:
        argv += ["--target", target]
    return [*argv, "-t", gym_ref() if target == GYM_TARGET else image_ref(), str(ROOT)]


def _ensure_packages() -> None:
    try:
        packages.ensure_packages()
    except packages.PackageError as exc:
        raise ImageError(str(exc)) from exc


def _prune(docker: Docker) -> None:
    """Drop what the new build superseded: the untagged images of earlier builds, and BuildKit's
    layer cache beyond ``BUILD_CACHE_KEEP``."""
    images = docker.run("image", "prune", "--force", timeout=600, check=False).stdout.strip().splitlines()
    cache = docker.run(
        "builder", "prune", "--force", "--filter", "type=regular", "--keep-storage", BUILD_CACHE_KEEP,
        timeout=600, check=False,
    )  # fmt: skip
    freed = [line for line in [*images, *cache.stdout.strip().splitlines()] if "reclaimed" in line.lower()]
    _say(f"pruned superseded images and build cache ({'; '.join(freed) or 'nothing to reclaim'})")


def ensure_images(force: bool = False) -> Path:
    """Build ``drs:<version>`` and ``drs-pause:<version>`` unless this tree's archive exists."""
    return _ensure(force, gym=False)[0]


def ensure_gym_image(force: bool = False) -> Path:
    """Build ``drs-gym:<version>`` unless the archive of this tree's Gym inputs exists."""
    return _ensure(force, gym=True, main=False)[-1]


def ensure_all(force: bool = False, gym: bool = True) -> list[Path]:
    """``drs dev images``: the project's archive, and the Gym archive unless ``gym`` is False."""
    return _ensure(force, gym=gym)


def _ensure(force: bool, gym: bool, main: bool = True) -> list[Path]:
    with _lock():
        archive, gym_archive = archive_path(), gym_archive_path()
        wanted = [a for a, on in ((archive, main), (gym_archive, gym)) if on]
        todo = [a for a in wanted if force or not a.is_file()]
        if not todo:
            return wanted
        _ensure_packages()
        with private_dockerd() as docker:
            _build_base(docker)
            if archive in todo:
                _build_main(docker, archive)
            if gym_archive in todo:
                _build_gym(docker, gym_archive)
            _prune(docker)
        return wanted


def _save(docker: Docker, archive: Path, stale: str, *refs: str) -> None:
    for old in images_dir().glob(stale):
        old.unlink()
    tmp = archive.with_suffix(".partial")
    docker.run("save", "-o", str(tmp), *refs, timeout=600)
    tmp.replace(archive)


def _build_main(docker: Docker, archive: Path) -> None:
    t0 = time.monotonic()
    _say(f"{image_ref()}: docker build (BuildKit, base {BASE_IMAGE}, host CA bundle as a build secret)")
    _stream(build_argv(docker, ca_bundle()), docker.env(), "build", BUILD_TIMEOUT_S)
    _build_pause(docker)
    _save(docker, archive, f"drs-{version()}-*.tar", image_ref(), pause_ref())
    _say(f"{image_ref()} and {pause_ref()} built in {time.monotonic() - t0:.0f}s: {archive}")


def _build_gym(docker: Docker, archive: Path) -> None:
    t0 = time.monotonic()
    _say(f"{gym_ref()}: docker build --target {GYM_TARGET} (NeMo-Gym 0.7.0 in /opt/gym; a few minutes the first time)")
    _stream(build_argv(docker, ca_bundle(), GYM_TARGET), docker.env(), "build gym", BUILD_TIMEOUT_S)
    _save(docker, archive, f"drs-gym-{version()}-*.tar", gym_ref())
    size = docker.run("image", "inspect", "--format", "{{.Size}}", gym_ref()).stdout.strip()
    _say(f"{gym_ref()} built in {time.monotonic() - t0:.0f}s ({int(size) / 2**20:.0f} MiB): {archive}")
