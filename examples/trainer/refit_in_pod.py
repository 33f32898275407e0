"""The trainer's refit step, run in a pod beside its refit sidecar (`make demo`, after the Gym turns).

What a trainer does after a policy update, in-cluster: write the new weights into the checkpoint
volume the engines also mount, ask the sidecar on localhost (``drs sidecar``, a native sidecar
container of this pod with its ServiceAccount and the fleet's control token) to refit every engine
to them, then read back, from the DisaggReplicaSet's status, the version each engine reports, and
send one fixed request before and after (the sim engine's tokens depend on the weights it loaded).

The fleet's status, the sidecar and the refit go through the trainer's library (``drs_client``,
in the project's image, with in-cluster credentials); the one request is plain httpx.

    python refit_in_pod.py --name pod-sim --namespace default --sidecar http://127.0.0.1:8400 \\
        --checkpoints /checkpoints --engine-mount /models
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import httpx
from drs_client import Fleet, RefitIncomplete
from drs_protocol.routes import Endpoint, TrainerRoute
from drs_protocol.weights_digest import digest_files

SIDECAR_START_TIMEOUT_S = 60.0
STATUS_TIMEOUT_S = 60.0


def say(msg: str) -> None:
    print(f"[trainer] {msg}", flush=True)


def one_completion(http: httpx.Client, url: str) -> list[int]:
    """The token ids a fixed request generates through a frontend."""
    body = {"model": "sim-qwen3", "prompt": "The policy after this update says", "max_tokens": 6, "ignore_eos": True}
    resp = http.post(url + Endpoint.COMPLETIONS, json=body)
    resp.raise_for_status()
    return list(resp.json()["choices"][0]["token_ids"])


def write_checkpoint(checkpoints: Path, version: str) -> Path:
    """New "weights" (random bytes: the sim hashes what it loads) in the shared volume."""
    directory = checkpoints / version
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.safetensors").write_bytes(os.urandom(64))
    return directory


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--sidecar", required=True, help="the sidecar's URL on localhost")
    parser.add_argument("--checkpoints", type=Path, required=True, help="the checkpoint volume, here")
    parser.add_argument("--engine-mount", required=True, help="where the engines mount the same volume")
    args = parser.parse_args()
    version = time.strftime("step-%H%M%S")  # a new policy version on every run
    with Fleet.connect(args.name, args.namespace, sidecar_url=args.sidecar) as fleet, httpx.Client(timeout=60) as http:
        view = fleet.get()
        url = view.urls[0]
        fleet.wait_sidecar(timeout_s=SIDECAR_START_TIMEOUT_S)
        before = one_completion(http, url)
        served = sorted({v or "the weights they started with" for v in view.engine_weights().values()})
        say(f"before the refit the engines serve {', '.join(served)}")
        digest = digest_files(write_checkpoint(args.checkpoints, version))  # over what it wrote
        path = f"{args.engine_mount.rstrip('/')}/{version}"
        try:
            report = fleet.refit(path, version, digest=digest)
        except RefitIncomplete as exc:
            say(f"refit incomplete: {exc}")
            return 1
        say(
            f"POST {TrainerRoute.REFIT} {{path: {path}, version: {version}}} to the sidecar: "
            f"complete={report.complete} engines={report.engines} ok={report.ok} in {report.elapsed_s}s"
            f" (digest {digest[:20]}…, over what it wrote)"
        )
        view = fleet.wait_weights(version, timeout_s=STATUS_TIMEOUT_S)
        say(f"status.weights.version = {view.weights_version}")
        for engine, shown in sorted(view.engine_weights().items()):
            say(f"  {engine}: weightsVersion {shown}")
        after = one_completion(http, url)
    say(f"the same request via {url}: token ids {before} before, {after} after the refit")
    return 0 if before != after else 1


if __name__ == "__main__":
    sys.exit(main())
