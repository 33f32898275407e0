"""Which component a large fleet waits for: figures read off the cluster after ``bench/operator_scale.py``
applied it (imported by it; not run alone).

From the pods of the fleet (their own timestamps, one-second resolution as the API writes them),
each relative to the moment the DisaggReplicaSet was applied:

* ``created``: the last pod object written (engine pods by the operator, frontend pods by the
  ReplicaSet controller);
* ``scheduled``: the last ``PodScheduled`` (kube-scheduler's bind), and the bind rate over the run;
* ``ready``: the last ``Ready`` (kwok's pod-ready stage: bind → Running and Ready);
* per pod, create → bind and bind → ready latencies (p50, p99).

From the apiserver's own metrics (``/metrics``, before and after): mean latency and count per
verb and resource of what the fleet's writers sent (pod creates, scheduler binds, kwok's pod
status patches, lease renewals). And the node lifecycle: how many nodes turned NotReady during the
run (the node controller's ``NodeNotReady`` Events), which is what made kwok's pods lose Ready;
and from the dev apiserver's audit log, who deleted the fleet's pods.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Json = dict[str, Any]
#: (verb, resource, subresource) of the apiserver requests reported.
WATCHED: tuple[tuple[str, str, str], ...] = (
    ("POST", "pods", ""),
    ("POST", "pods", "binding"),
    ("PATCH", "pods", "status"),
    ("PUT", "pods", "status"),
    ("POST", "deployments", ""),
    ("PUT", "leases", ""),
    ("PATCH", "disaggreplicasets", "status"),
)
_SAMPLE = re.compile(r"^(apiserver_request_duration_seconds_(?:sum|count))\{([^}]*)\} (\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def _time(value: Any) -> datetime.datetime | None:
    if not isinstance(value, str) or not value:
        return None
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))


def _condition(pod: Mapping[str, Any], type_: str) -> datetime.datetime | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return _time(c.get("lastTransitionTime"))
    return None


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def pod_timeline(pods: Sequence[Mapping[str, Any]], applied: datetime.datetime) -> Json:
    """Last create, bind and Ready of ``pods``, seconds after ``applied``; rates and latencies."""
    created, bound, ready, to_bind, to_ready = [], [], [], [], []
    engines: list[float] = []
    for pod in pods:
        c = _time((pod.get("metadata") or {}).get("creationTimestamp"))
        owners = (pod.get("metadata") or {}).get("ownerReferences") or []
        if c is not None and all(o.get("kind") != "ReplicaSet" for o in owners):  # the operator's pods
            engines.append((c - applied).total_seconds())
        b, r = _condition(pod, "PodScheduled"), _condition(pod, "Ready")
        if c is not None:
            created.append((c - applied).total_seconds())
        if b is not None:
            bound.append((b - applied).total_seconds())
            if c is not None:
                to_bind.append((b - c).total_seconds())
        if r is not None:
            ready.append((r - applied).total_seconds())
            if b is not None:
                to_ready.append((r - b).total_seconds())
    span = (max(bound) - min(bound)) if bound else 0.0

    def last(values: Sequence[float]) -> float | None:
        return round(max(values), 2) if values else None

    return {
        "pods": len(pods),
        "last_created_s": last(created),
        "last_engine_pod_created_s": last(engines),
        "last_scheduled_s": last(bound),
        "last_ready_s": last(ready),
        "not_ready": len(pods) - len(ready),
        "binds_per_s_first_to_last": round(len(bound) / span, 1) if span > 0 else None,
        "create_to_bind_s": {"p50": _pct(to_bind, 0.5), "p99": _pct(to_bind, 0.99)},
        "bind_to_ready_s": {"p50": _pct(to_ready, 0.5), "p99": _pct(to_ready, 0.99)},
    }


def request_totals(metrics_text: str) -> dict[tuple[str, str, str], tuple[float, float]]:
    """(sum of seconds, count) per (verb, resource, subresource) of the apiserver's requests."""
    out: dict[tuple[str, str, str], tuple[float, float]] = {}
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = dict(_LABEL.findall(m.group(2)))
        key = (labels.get("verb", ""), labels.get("resource", ""), labels.get("subresource", ""))
        total, count = out.get(key, (0.0, 0.0))
        if m.group(1).endswith("_sum"):
            total += float(m.group(3))
        else:
            count += float(m.group(3))
        out[key] = (total, count)
    return out


def apiserver_latency(
    before: Mapping[tuple[str, str, str], tuple[float, float]],
    after: Mapping[tuple[str, str, str], tuple[float, float]],
) -> Json:
    """Requests and mean milliseconds per watched (verb, resource/subresource) between two scrapes."""
    out: Json = {}
    for key in WATCHED:
        s0, c0 = before.get(key, (0.0, 0.0))
        s1, c1 = after.get(key, (0.0, 0.0))
        if c1 > c0:
            name = f"{key[0]} {key[1]}" + (f"/{key[2]}" if key[2] else "")
            out[name] = {"requests": int(c1 - c0), "mean_ms": round(1000 * (s1 - s0) / (c1 - c0), 1)}
    return out


def nodes_not_ready(events: Sequence[Mapping[str, Any]], since: datetime.datetime) -> int:
    """Distinct nodes the node controller reported NotReady after ``since``."""
    names = set()
    for e in events:
        when = _time(e.get("lastTimestamp") or e.get("eventTime"))
        obj = e.get("involvedObject") or {}
        if e.get("reason") == "NodeNotReady" and obj.get("kind") == "Node" and when is not None and when >= since:
            names.add(obj.get("name"))
    return len(names)


def bound_by(timeline: Mapping[str, Any], ready_s: float | None) -> Json:
    """apply → Ready cut at the last pod's steps (each from the one before, seconds): pods
    written (engine pods by the operator, frontend pods by the ReplicaSet controller), bound
    (kube-scheduler), Ready (kwok), and the operator publishing Ready; and the longest."""
    marks = [
        ("pods created (operator, ReplicaSet controller)", timeline.get("last_created_s")),
        ("pods bound (kube-scheduler)", timeline.get("last_scheduled_s")),
        ("pods Ready (kwok)", timeline.get("last_ready_s")),
        ("status Ready (operator)", ready_s),
    ]
    steps: Json = {}
    before = 0.0
    for what, at in marks:
        if isinstance(at, int | float):
            steps[what] = round(max(0.0, float(at) - before), 2)
            before = max(before, float(at))
    longest = max(steps.items(), key=lambda kv: kv[1], default=("", 0.0))
    return {"steps_s": steps, "longest": longest[0]}


def pod_deletes_by(audit_lines: Iterable[str], namespace: str) -> dict[str, int]:
    """Who deleted the pods of ``namespace`` (the dev apiserver's audit log, ``logs/audit.log``):
    successful deletes per client (its user agent: the operator is the Python client, a
    controller-manager controller is named by its own name) and per kind of pod."""
    out: dict[str, int] = {}
    for line in audit_lines:
        e = json.loads(line)
        ref = e.get("objectRef") or {}
        if e.get("verb") != "delete" or ref.get("namespace") != namespace or ref.get("resource") != "pods":
            continue
        if e.get("stage") != "ResponseComplete" or (e.get("responseStatus") or {}).get("code") != 200:
            continue
        agent = str(e.get("userAgent", ""))
        who = agent.rsplit("/", 1)[-1] if "controller-manager" in agent else agent.split("/", 1)[0]
        kind = "engine" if re.search(r"-(prefill|decode)-\d", str(ref.get("name", ""))) else "frontend"
        out[f"{who} ({kind})"] = out.get(f"{who} ({kind})", 0) + 1
    return out
