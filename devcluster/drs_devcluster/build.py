"""Build the local control plane from Go modules at pinned versions.

There is no Docker engine and no kind on the machines this project is developed and tested on,
and nothing can be downloaded but packages from registries. So the control plane is compiled
from Go modules with the machine's Go toolchain:

* ``k8s.io/kubernetes`` (kube-apiserver, kube-scheduler, kube-controller-manager, kubectl) via a
  wrapper module: the kubernetes module requires its staging modules at ``v0.0.0`` and publishes
  no ``replace`` lines, so the wrapper adds one ``replace k8s.io/X => k8s.io/X v0.<minor>.<patch>``
  per staging module, read from the kubernetes go.mod itself;
* ``go.etcd.io/etcd/server/v3`` in its own wrapper (its go.mod has relative replaces);
* ``sigs.k8s.io/kwok`` and ``helm.sh/helm/v3`` in their own wrappers.

Binaries land in a cache directory outside the work tree, keyed by every pinned version and the
Go version, so a second build is a no-op. A cold build prints progress (packages compiled out of
the total) because it takes many minutes on two cores.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

KUBERNETES_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.16"
KWOK_VERSION = "v0.8.0"
HELM_VERSION = "v3.22.0"

#: Kubernetes binaries built from the kubernetes wrapper module, all in one ``go build``.
KUBERNETES_COMMANDS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl")
#: Every binary the dev cluster needs, for ``ensure_built`` and status reports.
ALL_BINARIES = (*KUBERNETES_COMMANDS, "etcd", "kwok", "helm")

#: kwok stage files copied out of the kwok module (kwok >= 0.8 ships no built-in stages).
KWOK_STAGE_FILES = (
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/node/chaos/node-not-ready.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-complete.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
    "kustomize/stage/pod/chaos/pod-container-running-failed.yaml",
)

PROGRESS_INTERVAL_S = 15.0
GO_DOWNLOAD_TIMEOUT_S = 1800.0
GO_BUILD_TIMEOUT_S = 5400.0


class BuildError(RuntimeError):
    """The control plane could not be built; the message names the cause."""


@dataclasses.dataclass(frozen=True)
class GoTarget:
    """One wrapper module and the packages built from it."""

    name: str
    module: str
    version: str
    packages: tuple[str, ...]
    outputs: tuple[str, ...]


def _targets() -> tuple[GoTarget, ...]:
    return (
        GoTarget("etcd", "go.etcd.io/etcd/server/v3", ETCD_VERSION, ("go.etcd.io/etcd/server/v3",), ("etcd",)),
        GoTarget("kwok", "sigs.k8s.io/kwok", KWOK_VERSION, ("sigs.k8s.io/kwok/cmd/kwok",), ("kwok",)),
        GoTarget("helm", "helm.sh/helm/v3", HELM_VERSION, ("helm.sh/helm/v3/cmd/helm",), ("helm",)),
        GoTarget(
            "kubernetes",
            "k8s.io/kubernetes",
            KUBERNETES_VERSION,
            tuple(f"k8s.io/kubernetes/cmd/{c}" for c in KUBERNETES_COMMANDS),
            KUBERNETES_COMMANDS,
        ),
    )


def go_version() -> str:
    """The machine's Go version (``go1.26.8``), or a BuildError naming the missing toolchain."""
    go = shutil.which("go")
    if go is None:
        raise BuildError(
            "no Go toolchain: `go` is not on PATH. The dev control plane is compiled from Go "
            "modules; install Go >= 1.26 (the version k8s.io/kubernetes "
            f"{KUBERNETES_VERSION} requires) and retry."
        )
    out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, timeout=60, check=False)
    version = out.stdout.strip()
    if out.returncode != 0 or not version.startswith("go"):
        raise BuildError(f"`go env GOVERSION` failed: {out.stderr.strip() or out.stdout.strip()}")
    return version


def cache_root() -> Path:
    """Where built binaries are cached (``$DRS_CACHE_DIR`` or ``~/.cache/drs``)."""
    return Path(os.environ.get("DRS_CACHE_DIR", Path.home() / ".cache" / "drs")).expanduser()


def bin_dir(go: str | None = None) -> Path:
    """The versioned binary directory: a change of any pinned version is a new directory."""
    go = go or go_version()
    minor_go = ".".join(go.removeprefix("go").split(".")[:2])
    key = f"k8s-{KUBERNETES_VERSION}_etcd-{ETCD_VERSION}_kwok-{KWOK_VERSION}_helm-{HELM_VERSION}_go{minor_go}"
    return cache_root() / "controlplane" / key / "bin"


def stages_dir(bins: Path) -> Path:
    return bins.parent / "kwok-stages"


def is_built(bins: Path) -> bool:
    return all((bins / b).is_file() for b in ALL_BINARIES) and all(
        (stages_dir(bins) / Path(f).name).is_file() for f in KWOK_STAGE_FILES
    )


def _log(msg: str) -> None:
    print(f"[drs build] {msg}", file=sys.stderr, flush=True)


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    env["CGO_ENABLED"] = "0"
    env.setdefault("GOFLAGS", "-mod=mod")
    env["GOTOOLCHAIN"] = "local"
    return env


def _run_go(args: Sequence[str], cwd: Path, what: str, timeout: float) -> str:
    try:
        out = subprocess.run(
            ["go", *args], cwd=cwd, env=_go_env(), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise BuildError(f"{what}: `go {' '.join(args)}` did not finish in {timeout:.0f}s") from exc
    if out.returncode != 0:
        tail = "\n".join((out.stderr or out.stdout).strip().splitlines()[-15:])
        raise BuildError(f"{what}: `go {' '.join(args)}` failed (exit {out.returncode}):\n{tail}")
    return out.stdout


def _module_gomod(module: str, version: str, workdir: Path) -> str:
    out = _run_go(
        ["mod", "download", "-json", f"{module}@{version}"], workdir, f"download {module}", GO_DOWNLOAD_TIMEOUT_S
    )
    info = json.loads(out)
    return Path(info["GoMod"]).read_text()


def _module_dir(module: str, version: str, workdir: Path) -> Path:
    out = _run_go(
        ["mod", "download", "-json", f"{module}@{version}"], workdir, f"download {module}", GO_DOWNLOAD_TIMEOUT_S
    )
    return Path(json.loads(out)["Dir"])


def _kubernetes_replaces(gomod: str) -> list[str]:
    """Staging modules that k8s.io/kubernetes requires at v0.0.0, mapped to v0.<minor>.<patch>."""
    staging = sorted(set(re.findall(r"^\s*(k8s\.io/[\w.\-/]+)\s+v0\.0\.0\s*$", gomod, flags=re.M)))
    if not staging:
        raise BuildError("k8s.io/kubernetes go.mod lists no staging modules at v0.0.0: unexpected layout")
    staging_version = "v0." + KUBERNETES_VERSION.removeprefix("v1.")
    return [f"replace {m} => {m} {staging_version}" for m in staging]


def _write_wrapper(target: GoTarget, root: Path, go: str) -> Path:
    wrapper = root / "wrappers" / target.name
    wrapper.mkdir(parents=True, exist_ok=True)
    go_line = ".".join(go.removeprefix("go").split(".")[:2])
    lines = [
        f"module drs.local/controlplane/{target.name}",
        "",
        f"go {go_line}",
        "",
        f"require {target.module} {target.version}",
        "",
    ]
    if target.module == "k8s.io/kubernetes":
        lines += [*_kubernetes_replaces(_module_gomod(target.module, target.version, wrapper)), ""]
    (wrapper / "go.mod").write_text("\n".join(lines))
    imports = "\n".join(f'\t_ "{p}"' for p in target.packages)
    (wrapper / "tools.go").write_text(f"//go:build tools\n\npackage tools\n\nimport (\n{imports}\n)\n")
    return wrapper


def _ldflags(target: GoTarget) -> str:
    if target.module != "k8s.io/kubernetes":
        return "-s -w"
    major, minor = KUBERNETES_VERSION.removeprefix("v").split(".")[:2]
    pkg = "k8s.io/component-base/version"
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return " ".join(
        [
            "-s -w",
            f"-X {pkg}.gitVersion={KUBERNETES_VERSION}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
            f"-X {pkg}.buildDate={date}",
        ]
    )


def _build_target(target: GoTarget, bins: Path, go: str) -> None:
    root = bins.parent
    wrapper = _write_wrapper(target, root, go)
    _log(f"{target.name}: resolving {target.module}@{target.version} (go mod tidy; downloads modules on a cold cache)")
    _run_go(["mod", "tidy"], wrapper, f"resolve {target.name}", GO_DOWNLOAD_TIMEOUT_S)
    deps = _run_go(["list", "-deps", *target.packages], wrapper, f"list {target.name}", GO_DOWNLOAD_TIMEOUT_S)
    total = len(deps.split())
    tmp_out = root / "build-tmp" / target.name
    shutil.rmtree(tmp_out, ignore_errors=True)
    tmp_out.mkdir(parents=True)
    cmd = ["go", "build", "-v", "-trimpath", "-ldflags", _ldflags(target), "-o", str(tmp_out) + "/", *target.packages]
    _log(f"{target.name}: compiling {len(target.packages)} command(s), {total} packages in the graph")
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=wrapper, env=_go_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    compiled = 0
    tail: list[str] = []
    stop = threading.Event()

    def report() -> None:
        while not stop.wait(PROGRESS_INTERVAL_S):
            _log(f"{target.name}: {compiled}/{total} packages compiled, {time.monotonic() - started:.0f}s elapsed")

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            line = line.rstrip()
            if re.fullmatch(r"[\w.\-/~]+", line):
                compiled += 1
            else:
                tail = [*tail, line][-20:]
        rc = proc.wait(timeout=GO_BUILD_TIMEOUT_S)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
    if rc != 0:
        raise BuildError(f"{target.name}: go build failed (exit {rc}):\n" + "\n".join(tail))
    for out in target.outputs:
        built = tmp_out / (out if out != "etcd" else "v3")
        if not built.is_file():
            candidates = list(tmp_out.iterdir())
            if out == "etcd" and len(candidates) == 1:
                built = candidates[0]
            else:
                raise BuildError(f"{target.name}: expected binary {out} not produced (found {candidates})")
        shutil.move(str(built), bins / out)
    _log(f"{target.name}: done in {time.monotonic() - started:.0f}s")


def _copy_kwok_stages(bins: Path) -> None:
    src = _module_dir("sigs.k8s.io/kwok", KWOK_VERSION, bins.parent)
    dest = stages_dir(bins)
    dest.mkdir(parents=True, exist_ok=True)
    for rel in KWOK_STAGE_FILES:
        shutil.copyfile(src / rel, dest / Path(rel).name)


def ensure_built(force: bool = False) -> Path:
    """Build every control-plane binary that is missing; return the binary directory."""
    go = go_version()
    bins = bin_dir(go)
    if is_built(bins) and not force:
        return bins
    bins.mkdir(parents=True, exist_ok=True)
    # One build at a time per binary directory: two test sessions (worktrees) starting together
    # would otherwise share `build-tmp` and remove each other's half-built outputs. The second
    # waits, then finds the binaries built.
    with (bins.parent / ".controlplane-build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(bins) and not force:
            return bins
        _build_missing(bins, go, force)
    return bins


def _build_missing(bins: Path, go: str, force: bool) -> None:
    _log(f"building the control plane into {bins} with {go} (cold builds take tens of minutes on 2 cores)")
    started = time.monotonic()
    for target in _targets():
        if all((bins / o).is_file() for o in target.outputs) and not force:
            _log(f"{target.name}: cached")
            continue
        _build_target(target, bins, go)
    _copy_kwok_stages(bins)
    shutil.rmtree(bins.parent / "build-tmp", ignore_errors=True)
    _log(f"control plane ready in {time.monotonic() - started:.0f}s: {bins}")


if __name__ == "__main__":
    try:
        print(ensure_built(force="--force" in sys.argv))
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
