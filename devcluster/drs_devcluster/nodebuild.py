"""Build what a real node runs, from Go modules, into the control plane's binary directory.

* ``kubelet`` and ``kube-proxy`` from the same k8s.io/kubernetes wrapper the control plane uses
  (one ``go build``; most packages are already in Go's build cache);
* ``drs-device-plugin`` (``devcluster/deviceplugin``): the fake GPU device plugin, against the
  kubelet's device-plugin API module ``k8s.io/kubelet``;
* ``drs-coredns`` (``devcluster/coredns``): CoreDNS from ``github.com/coredns/coredns`` with only
  the plugins cluster DNS needs;
* ``kube-router`` from ``github.com/cloudnativelabs/kube-router/v2``, run with its firewall only
  (the NetworkPolicy controller: iptables + ipset), built from a copy of the module with one local
  change (``devcluster/kuberouter``): a pod is filtered when its node's address is an address of
  the network namespace kube-router runs in, not only when it is kube-router's own node's, since
  the real nodes of a cluster share one network namespace (``KUBE_ROUTER_PATCH``).

Only missing binaries are built: the directory is keyed by versions and shared, and the control
plane's binaries in it are never rebuilt here. A file lock keeps two builds from racing.
"""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from . import build, profiles

COREDNS_VERSION = "v1.14.7"
KUBE_ROUTER_MODULE = "github.com/cloudnativelabs/kube-router/v2"
KUBE_ROUTER_VERSION = "v2.1.0"
#: The one line of kube-router's ``pkg/controllers/netpol/pod.go`` the build changes, and its
#: replacement (``devcluster/kuberouter/drs_local_pods.go`` defines the function it calls).
KUBE_ROUTER_PATCH = (
    "if strings.Compare(pod.Status.HostIP, nodeIP) != 0 || !isNetPolActionable(pod) {",
    "if !drsHostIPIsLocal(pod.Status.HostIP, nodeIP) || !isNetPolActionable(pod) {",
)
KUBE_ROUTER_PATCHED_FILE = "pkg/controllers/netpol/pod.go"
NODE_COMMANDS = ("kubelet", "kube-proxy")
LOCAL_SOURCES = Path(__file__).resolve().parents[1]
#: binary -> (source directory in this repository, the module it is built against, its version)
LOCAL_TARGETS = {
    "drs-device-plugin": ("deviceplugin", "k8s.io/kubelet", "v0." + build.KUBERNETES_VERSION.removeprefix("v1.")),
    "drs-coredns": ("coredns", "github.com/coredns/coredns", COREDNS_VERSION),
}
KUBE_ROUTER = "kube-router"
NODE_BINARIES = (*NODE_COMMANDS, *LOCAL_TARGETS, KUBE_ROUTER)


def node_target() -> build.GoTarget:
    return build.GoTarget(
        "kubernetes-node",
        "k8s.io/kubernetes",
        build.KUBERNETES_VERSION,
        tuple(f"k8s.io/kubernetes/cmd/{c}" for c in NODE_COMMANDS),
        NODE_COMMANDS,
    )


def node_binaries() -> tuple[str, ...]:
    """The real nodes' binaries: kube-router only where NetworkPolicies are enforced
    (:func:`drs_devcluster.profiles.network_policies`)."""
    return NODE_BINARIES if profiles.network_policies() else tuple(b for b in NODE_BINARIES if b != KUBE_ROUTER)


def is_built(bins: Path) -> bool:
    return all((bins / b).is_file() for b in node_binaries())


@contextlib.contextmanager
def _lock(bins: Path) -> Iterator[None]:
    bins.mkdir(parents=True, exist_ok=True)
    with (bins.parent / ".node-build.lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _build_local(name: str, bins: Path, go: str) -> None:
    """Build one of this repository's Go programs in a wrapper module that requires its module."""
    subdir, module, version = LOCAL_TARGETS[name]
    wrapper = bins.parent / "wrappers" / name
    shutil.rmtree(wrapper, ignore_errors=True)
    wrapper.mkdir(parents=True)
    go_line = ".".join(go.removeprefix("go").split(".")[:2])
    (wrapper / "go.mod").write_text(f"module drs.local/{name}\n\ngo {go_line}\n\nrequire {module} {version}\n")
    for src in (LOCAL_SOURCES / subdir).glob("*.go"):
        shutil.copyfile(src, wrapper / src.name)
    build._log(f"{name}: resolving {module}@{version}")
    build._run_go(["mod", "tidy"], wrapper, f"resolve {name}", build.GO_DOWNLOAD_TIMEOUT_S)
    _go_build(name, bins, wrapper, ".", "compiling")


def _build_kube_router(bins: Path, go: str) -> None:
    """kube-router from a writable copy of its module with ``KUBE_ROUTER_PATCH`` applied, built
    against the module's own go.mod and go.sum."""
    src = bins.parent / "wrappers" / KUBE_ROUTER
    shutil.rmtree(src, ignore_errors=True)
    build._log(f"{KUBE_ROUTER}: downloading {KUBE_ROUTER_MODULE}@{KUBE_ROUTER_VERSION}")
    module_dir = build._module_dir(KUBE_ROUTER_MODULE, KUBE_ROUTER_VERSION, bins.parent)
    # The module cache is read-only: copy the files, not their modes.
    shutil.copytree(module_dir, src, copy_function=shutil.copyfile)
    for d in [src, *(p for p in src.rglob("*") if p.is_dir())]:
        d.chmod(0o755)
    patched = src / KUBE_ROUTER_PATCHED_FILE
    patched.chmod(0o644)
    text = patched.read_text()
    old, new = KUBE_ROUTER_PATCH
    if text.count(old) != 1:
        raise build.BuildError(
            f"{KUBE_ROUTER}: {KUBE_ROUTER_PATCHED_FILE} of {KUBE_ROUTER_VERSION} does not contain the line "
            f"KUBE_ROUTER_PATCH changes exactly once: {old!r}"
        )
    patched.write_text(text.replace(old, new))
    shutil.copyfile(LOCAL_SOURCES / "kuberouter" / "drs_local_pods.go", patched.parent / "drs_local_pods.go")
    _go_build(KUBE_ROUTER, bins, src, "./cmd/kube-router", "compiling (a cold Go build cache takes minutes)")


def _go_build(name: str, bins: Path, module_dir: Path, package: str, what: str) -> None:
    """``go build`` one program of ``module_dir`` into ``bins/name`` (stripped, reproducible paths), logged
    with its duration."""
    started = time.monotonic()
    build._log(f"{name}: {what}")
    build._run_go(
        ["build", "-trimpath", "-ldflags=-s -w", "-o", str(bins / name), package],
        module_dir,
        f"build {name}",
        build.GO_BUILD_TIMEOUT_S,
    )
    build._log(f"{name}: done in {time.monotonic() - started:.0f}s")


def ensure_node_built(bins: Path | None = None) -> Path:
    """Build every missing real-node binary into the control plane's directory; return it."""
    go = build.go_version()
    bins = bins or build.bin_dir(go)
    if is_built(bins):
        return bins
    with _lock(bins):
        target = node_target()
        if not all((bins / o).is_file() for o in target.outputs):
            build._build_target(target, bins, go)
        for name in LOCAL_TARGETS:
            if not (bins / name).is_file():
                _build_local(name, bins, go)
        if KUBE_ROUTER in node_binaries() and not (bins / KUBE_ROUTER).is_file():
            _build_kube_router(bins, go)
        shutil.rmtree(bins.parent / "build-tmp" / target.name, ignore_errors=True)
    return bins
