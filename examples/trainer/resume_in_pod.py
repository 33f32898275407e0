"""A trainer pod started again after its refit was cut short (the pod deleted mid-refit): it asks nothing.

The refit it was running had stored its desired weights on the DisaggReplicaSet before any engine
was called; this pod's ``drs sidecar`` (a native sidecar container, as in ``refit_in_pod.py``)
reads them back at its start and its reconcile passes load them on every engine still behind.
The trainer only waits until the status shows ``--version`` on every engine, and says so.

    python resume_in_pod.py --name pod-sim --namespace default --sidecar http://127.0.0.1:8400 \\
        --checkpoints /checkpoints --engine-mount /models --version step-123456

Exits 1 when the fleet does not reach ``--version`` within ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import sys

from drs_client import Fleet

SIDECAR_START_TIMEOUT_S = 60.0


def say(msg: str) -> None:
    print(f"[trainer] {msg}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--sidecar", required=True, help="the sidecar's URL on localhost")
    parser.add_argument("--checkpoints", help="the checkpoint volume, here (unused: nothing is written)")
    parser.add_argument("--engine-mount", help="where the engines mount it (unused)")
    parser.add_argument("--version", required=True, help="the weights version the cut-short refit brought")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for every engine")
    args = parser.parse_args()
    with Fleet.connect(args.name, args.namespace, sidecar_url=args.sidecar) as fleet:
        fleet.wait_sidecar(timeout_s=SIDECAR_START_TIMEOUT_S)
        say(f"the sidecar is up; engines now: {fleet.engine_weights()}")
        try:
            view = fleet.wait_weights(args.version, timeout_s=args.timeout)
        except TimeoutError as exc:
            say(f"the fleet did not reach {args.version}: {exc}; engines: {fleet.engine_weights()}")
            return 1
    say(f"every engine at {args.version}: {view.engine_weights()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
