"""What several processes must agree on so that no turn is lost: draining, refit safety, fallbacks.

* An engine that is stopping *drains*: ``GET /health`` answers 503 with the error type
  :data:`DRAINING_ERROR_TYPE` at once (probes and frontends stop choosing it), new legs get the
  same 503 (a frontend moves the leg to another engine), legs in flight and context states not yet
  fetched by a decode engine get up to ``drainSeconds`` (:data:`DEFAULT_DRAIN_SECONDS`), then the
  process exits. The operator sets the pod's ``terminationGracePeriodSeconds`` to the drain time
  plus :data:`TERMINATION_MARGIN_SECONDS`.
* Every serving response names the weights version that produced its tokens: the body field
  :data:`FIELD_WEIGHTS_VERSION` and the header ``drs_protocol.fields.HEADER_WEIGHTS_VERSION``.
  A leg that decoded across a weights load re-prefilled its prompt plus the tokens generated so far
  under the new weights and resumed; :data:`FIELD_WEIGHTS_BOUNDARY` is the number of completion
  tokens produced before the last switch (absent when there was none).
* A refit *announces* its target weights to every engine before any load
  (``POST /control/weights/target``, :class:`drs_protocol.control.WeightsTarget`). An engine that
  holds other weights than the target refuses new legs with 503 :data:`WEIGHTS_PENDING_ERROR_TYPE`
  (and ``Retry-After``) until it holds them or the target's lease ends; legs already running keep
  the rule above. A frontend that gets it tries another engine after ``weightsPendingRetrySeconds``
  and holds the leg up to ``weightsPendingHoldSeconds`` for one that holds the target.
* A frontend's config may name *fallback* engines of other replicas
  (:data:`FALLBACK_PREFILL_KEY`, :data:`FALLBACK_DECODE_KEY`); it uses them only while no engine of
  its own replica of that role is up. The operator renders them; they are left out of the config
  hash, so a change elsewhere in the fleet never restarts a frontend. It also mounts the rendered
  config under :data:`FRONTEND_CONFIG_DIR` and names the file with ``configWatch``: the frontend
  re-reads it and applies changed fallback pools without a restart.
"""

from __future__ import annotations

from typing import Final

#: ``error.type`` of the 503 a draining engine answers (health and new legs).
DRAINING_ERROR_TYPE: Final = "draining"
#: ``error.type`` of the 503 an engine answers a new leg while it does not hold the announced target weights,
#: and health and turns while it does not hold the desired weights it started under (a catch-up).
WEIGHTS_PENDING_ERROR_TYPE: Final = "weights_pending"
#: Seconds an engine waits for its in-flight legs and unfetched context states when stopping.
DEFAULT_DRAIN_SECONDS: Final = 30
#: terminationGracePeriodSeconds = drain seconds + this margin (uvicorn shutdown, backend close).
TERMINATION_MARGIN_SECONDS: Final = 10

#: Response body field: the weights version that produced the response's tokens.
FIELD_WEIGHTS_VERSION: Final = "weights_version"
#: Response body field: completion tokens produced before the last weights switch of this leg.
FIELD_WEIGHTS_BOUNDARY: Final = "weights_boundary"

#: Frontend config keys: other replicas' engines, used only while this replica has none of a role up.
FALLBACK_PREFILL_KEY: Final = "fallback_prefill"
FALLBACK_DECODE_KEY: Final = "fallback_decode"
#: Where a frontend pod has its replica's rendered config mounted (the kubelet updates the file
#: in place when the ConfigMap changes); the file is the ConfigMap's key under it.
FRONTEND_CONFIG_DIR: Final = "/etc/drs/frontend"
