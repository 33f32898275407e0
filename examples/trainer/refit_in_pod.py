"""The trainer's refit step, run in a pod beside its refit sidecar (`make demo`, after the Gym turns).

What a trainer does after a policy update, in-cluster: write the new weights into the checkpoint
volume the engines also mount, ask the sidecar on localhost (``drs sidecar``, a native sidecar
container of this pod with its ServiceAccount and the fleet's control token) to refit every engine
to them, then read back, from the DisaggReplicaSet's status, the version each engine reports, and
send one fixed request before and after (the sim engine's tokens depend on the weights it loaded).

The pod gets only this file; it imports httpx, the kubernetes client and ``drs_protocol`` (all in
the project's image).

    python refit_in_pod.py --name pod-sim --namespace default --sidecar http://127.0.0.1:8400 \\
        --checkpoints /checkpoints --engine-mount /models
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from drs_protocol.routes import HEALTHZ, Endpoint, TrainerRoute
from drs_protocol.weights_digest import digest_files
from kubernetes import client, config

SIDECAR_START_TIMEOUT_S = 60.0
REFIT_TIMEOUT_S = 120.0
STATUS_TIMEOUT_S = 60.0
POLL_S = 0.5


def say(msg: str) -> None:
    print(f"[trainer] {msg}", flush=True)


def read_status(name: str, namespace: str) -> dict[str, Any]:
    body = client.CustomObjectsApi().get_namespaced_custom_object(
        "disagg.dev", "v1alpha1", namespace, "disaggreplicasets", name
    )
    status: dict[str, Any] = (body.get("status") if isinstance(body, dict) else None) or {}
    return status


def engine_versions(status: dict[str, Any]) -> dict[str, str | None]:
    return {e["name"]: e.get("weightsVersion") for r in status.get("replicaStatuses", []) for e in r["engines"]}


def one_completion(http: httpx.Client, url: str) -> list[int]:
    """The token ids a fixed request generates through a frontend."""
    body = {"model": "sim-qwen3", "prompt": "The policy after this update says", "max_tokens": 6, "ignore_eos": True}
    resp = http.post(url + Endpoint.COMPLETIONS, json=body)
    resp.raise_for_status()
    return list(resp.json()["choices"][0]["token_ids"])


def wait_sidecar(http: httpx.Client, sidecar: str) -> None:
    deadline = time.monotonic() + SIDECAR_START_TIMEOUT_S
    while True:
        try:
            if http.get(sidecar + HEALTHZ, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"the sidecar at {sidecar} did not answer {HEALTHZ} in {SIDECAR_START_TIMEOUT_S:.0f}s")
        time.sleep(POLL_S)


def write_checkpoint(checkpoints: Path, version: str) -> Path:
    """New "weights" (random bytes: the sim hashes what it loads) in the shared volume."""
    directory = checkpoints / version
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.safetensors").write_bytes(os.urandom(64))
    return directory


def wait_versions(name: str, namespace: str, version: str) -> dict[str, Any]:
    deadline = time.monotonic() + STATUS_TIMEOUT_S
    while True:
        status = read_status(name, namespace)
        versions = engine_versions(status)
        shown = (status.get("weights") or {}).get("version")
        if shown == version and versions and all(v == version for v in versions.values()):
            return status
        if time.monotonic() > deadline:
            raise SystemExit(f"status still shows weights {shown} and engines {versions} after {STATUS_TIMEOUT_S:.0f}s")
        time.sleep(POLL_S)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--sidecar", required=True, help="the sidecar's URL on localhost")
    parser.add_argument("--checkpoints", type=Path, required=True, help="the checkpoint volume, here")
    parser.add_argument("--engine-mount", required=True, help="where the engines mount the same volume")
    args = parser.parse_args()
    config.load_incluster_config()
    status = read_status(args.name, args.namespace)
    url = status["urls"][0]
    version = time.strftime("step-%H%M%S")  # a new policy version on every run
    with httpx.Client(timeout=60) as http:
        wait_sidecar(http, args.sidecar)
        before = one_completion(http, url)
        served = sorted({v or "the weights they started with" for v in engine_versions(status).values()})
        say(f"before the refit the engines serve {', '.join(served)}")
        digest = digest_files(write_checkpoint(args.checkpoints, version))  # over what it wrote
        path = f"{args.engine_mount.rstrip('/')}/{version}"
        resp = http.post(
            args.sidecar + TrainerRoute.REFIT,
            json={"path": path, "version": version, "digest": digest},
            timeout=REFIT_TIMEOUT_S,
        )
        report = resp.json()
        say(
            f"POST {TrainerRoute.REFIT} {{path: {path}, version: {version}}} to the sidecar: "
            f"complete={report['complete']} engines={report['engines']} ok={report['ok']} in {report['elapsed_s']}s"
            f" (digest {digest[:20]}…, over what it wrote)"
        )
        if not report["complete"]:
            say(f"refit incomplete: failed {report['failed']}, pending {report['pending']}")
            return 1
        status = wait_versions(args.name, args.namespace, version)
        say(f"status.weights.version = {(status.get('weights') or {}).get('version')}")
        for engine, shown in sorted(engine_versions(status).items()):
            say(f"  {engine}: weightsVersion {shown}")
        after = one_completion(http, url)
    say(f"the same request via {url}: token ids {before} before, {after} after the refit")
    return 0 if before != after else 1


if __name__ == "__main__":
    sys.exit(main())
