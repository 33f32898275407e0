"""``drs crd`` and ``drs plan``: the API and the layout, without a cluster.

``drs plan -f FILE`` validates a DisaggReplicaSet manifest (every problem at once, each naming its
field path and rule; exit code 2), plans it and, given nodes (``--nodes`` Node manifests or a
simulated ``--profile``), places it, then prints the layout as a table or as JSON::

    {"name", "namespace", "replicaWidth", "replicaCount", "gpus",
     "replicas": [{"index", "placed", "segment", "split", "reason", "nodes": [..],
                   "engines": [{"name", "role", "ordinal", "width", "port", "nodes": [..]}],
                   "frontends": [{"index", "port", "nodeId", "node"}]}],
     "urls": [..], "unplaced": [..], "split": [..], "excludedNodes": [{"node", "reason"}]}

Exit codes: 0 the layout is complete; 1 some replica could not be placed on the given nodes;
2 the input is invalid.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import click
import yaml

from drs_operator.api import names
from drs_operator.api.constants import KIND
from drs_operator.crd import render_crd
from drs_operator.layout import frontend_urls
from drs_operator.nodepool import nodes_from_manifests
from drs_operator.placement import NodeInfo, Placement, place
from drs_operator.plan import EngineSlot, Plan
from drs_operator.plan import plan as make_plan
from drs_operator.profiles import PROFILES, ProfileError, build_nodes
from drs_operator.validation import validate_manifest

EXIT_UNPLACED = 1
EXIT_INVALID = 2


@click.command(name="crd", help="Print the CustomResourceDefinition generated from the API models.")
@click.option(
    "--api-reference", is_flag=True, help="Print the API reference (Markdown, docs/api-reference.md) instead."
)
def crd(api_reference: bool) -> None:
    if api_reference:
        from drs_operator.api_reference import render_api_reference

        click.echo(render_api_reference(), nl=False)
        return
    click.echo(render_crd(), nl=False)


PLAN_HELP = """Show the engine and frontend layout of a DisaggReplicaSet before applying it.

Validates the manifest (every problem at once, each with its field path), plans it and, given
nodes (--nodes or --profile), places it.

Exit codes: 0 complete layout; 1 some replica could not be placed; 2 invalid input.
"""


@click.command(name="plan", help=PLAN_HELP)
@click.option(
    "-f",
    "--file",
    "path",
    required=True,
    type=click.Path(dir_okay=False, allow_dash=True),
    help="A DisaggReplicaSet manifest ('-' for stdin).",
)
@click.option(
    "--nodes",
    "nodes_path",
    type=click.Path(dir_okay=False),
    help="Node manifests: a List or multi-document YAML (kubectl get nodes -o yaml).",
)
@click.option("--profile", type=click.Choice(PROFILES), help="Plan on simulated nodes of this profile instead.")
@click.option("--node-count", type=int, help="Number of simulated nodes (with --profile).")
@click.option("-n", "--namespace", help="Namespace for URLs (default: the manifest's, else 'default').")
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
def plan(
    path: str, nodes_path: str | None, profile: str | None, node_count: int | None, namespace: str | None, output: str
) -> None:
    if nodes_path and profile:
        _invalid(["--nodes and --profile are exclusive: give one"])
    if node_count is not None and not profile:
        _invalid(["--node-count needs --profile"])
    manifest = _load_manifest(path)
    resource, problems = validate_manifest(manifest)
    if resource is None:
        _invalid([str(p) for p in problems], header=f"{path}: {len(problems)} problem(s)")
    ns = namespace or resource.metadata.namespace or "default"
    layout = make_plan(resource.spec, resource.metadata.name)
    nodes: list[NodeInfo] | None = None
    if nodes_path:
        nodes = nodes_from_manifests(_load_nodes(nodes_path), topology=resource.spec.topology)
    elif profile:
        try:
            manifests = build_nodes(profile, node_count)
        except ProfileError as exc:
            _invalid([str(exc)])
        nodes = nodes_from_manifests(manifests, topology=resource.spec.topology)
    placement = place(layout, nodes) if nodes is not None else None
    report = describe(layout, placement, nodes, ns)
    if output == "json":
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(render_table(report))
    if placement is not None and not placement.complete:
        sys.exit(EXIT_UNPLACED)


def describe(layout: Plan, placement: Placement | None, nodes: list[NodeInfo] | None, namespace: str) -> dict[str, Any]:
    """The JSON report of ``drs plan`` (see the module docstring)."""
    addresses = {n.name: n.address for n in nodes or [] if n.address}
    replicas = []
    for rep in layout.replicas:
        rp = placement.replica(rep.index) if placement is not None else None
        engine_nodes = {e.name: list(e.nodes) for e in rp.engines} if rp else {}
        frontend_nodes = {f.index: f.node for f in rp.frontends} if rp else {}
        replicas.append(
            {
                "index": rep.index,
                "placed": bool(rp and rp.placed),
                "segment": rp.segment if rp else None,
                "split": bool(rp and rp.split),
                "reason": rp.reason if rp else None,
                "nodes": list(rp.nodes) if rp else [],
                "engines": [
                    {
                        "name": e.name,
                        "role": str(e.role),
                        "ordinal": e.ordinal,
                        "width": e.width,
                        "port": e.port,
                        "nodes": engine_nodes.get(e.name, []),
                        **_rank_pods(layout.name, e, engine_nodes.get(e.name, [])),
                    }
                    for e in rep.engines
                ],
                "frontends": [
                    {"index": f.index, "port": f.port, "nodeId": f.node_id, "node": frontend_nodes.get(f.index)}
                    for f in rep.frontends
                ],
            }
        )
    report: dict[str, Any] = {
        "name": layout.name,
        "namespace": namespace,
        "replicaWidth": layout.replica_width,
        "replicaCount": len(layout.replicas),
        "gpus": layout.gpus,
        "hostNetwork": layout.host_network,
        "replicas": replicas,
        "urls": frontend_urls(layout, placement, namespace, addresses),
    }
    if placement is not None:
        report["unplaced"] = [r.reason for r in placement.unplaced]
        report["split"] = [r.reason for r in placement.split]
        report["excludedNodes"] = [{"node": n, "reason": why} for n, why in placement.excluded]
    return report


def _rank_pods(drs: str, engine: EngineSlot, nodes: list[str]) -> dict[str, Any]:
    """``{"pods": [...]}`` for an engine placed on several nodes (a gang: one pod per node), else ``{}``."""
    if len(nodes) < 2:
        return {}
    pods = [
        {"rank": k, "name": names.engine_pod_name(drs, engine.replica, engine.role, engine.ordinal, k), "node": node}
        for k, node in enumerate(nodes)
    ]
    return {"pods": pods, "gpusPerPod": engine.width // len(nodes)}


def render_table(report: Mapping[str, Any]) -> str:
    """The report for a person: one line per engine and per frontend, then the URLs."""
    lines = [
        f"{KIND} {report['name']} (namespace {report['namespace']}): {report['replicaCount']} replica(s) x "
        f"{report['replicaWidth']} GPUs = {report['gpus']} GPUs",
        "",
    ]
    rows = [("REPLICA", "SEGMENT", "KIND", "NAME", "ROLE", "WIDTH", "PORT", "NODES")]
    for r in report["replicas"]:
        segment = r["segment"] or ("(split)" if r["split"] else "-")
        for e in r["engines"]:
            nodes = ",".join(e["nodes"]) or "-"
            rows.append(
                (str(r["index"]), segment, "engine", e["name"], e["role"], str(e["width"]), str(e["port"]), nodes)
            )
            for p in e.get("pods", []):
                kind = "- leader" if p["rank"] == 0 else f"- rank {p['rank']}"
                rows.append(
                    (
                        str(r["index"]),
                        segment,
                        kind,
                        p["name"],
                        e["role"],
                        str(e["gpusPerPod"]),
                        str(e["port"]),
                        p["node"],
                    )
                )
        for f in r["frontends"]:
            rows.append(
                (
                    str(r["index"]),
                    segment,
                    "frontend",
                    f"f{f['index']} (node id {f['nodeId']})",
                    "frontend",
                    "-",
                    str(f["port"]),
                    f["node"] or "-",
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines.extend("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)
    lines += ["", "URLs (replica-major):"]
    lines += [f"  {url or '(not placed)'}" for url in report["urls"]]
    for key, title in (("split", "Split replicas"), ("unplaced", "Not placed")):
        if report.get(key):
            lines += ["", f"{title}:"] + [f"  {why}" for why in report[key]]
    if report.get("excludedNodes"):
        lines += ["", "Nodes not used:"] + [f"  {x['node']}: {x['reason']}" for x in report["excludedNodes"]]
    return "\n".join(lines)


# --- input ----------------------------------------------------------------------------------
def _invalid(messages: list[str], header: str | None = None) -> NoReturn:
    if header:
        click.echo(f"error: {header}", err=True)
    for message in messages:
        click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_INVALID)


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text()
    except OSError as exc:
        _invalid([f"{path}: {exc.strerror or exc}"])


def _documents(path: str) -> list[Any]:
    try:
        return [d for d in yaml.safe_load_all(_read(path)) if d is not None]
    except yaml.YAMLError as exc:
        _invalid([f"{path}: not valid YAML: {exc}"])


def _load_manifest(path: str) -> Any:
    docs = _documents(path)
    ours = [d for d in docs if isinstance(d, Mapping) and d.get("kind") == KIND]
    if len(ours) == 1:
        return ours[0]
    if len(docs) == 1 and not ours:
        return docs[0]  # validation names what is wrong with it
    _invalid([f"{path}: expected one {KIND} document, found {len(ours)} among {len(docs)}"])


def _load_nodes(path: str) -> list[Mapping[str, Any]]:
    nodes = [n for n in _flatten(_documents(path)) if n.get("kind", "Node") == "Node"]
    if not nodes:
        _invalid([f"{path}: no Node manifests found (expected kind: Node, or a List of them)"])
    bad = [i for i, n in enumerate(nodes) if not isinstance((n.get("metadata") or {}).get("name"), str)]
    if bad:
        _invalid([f"{path}: node #{i} has no metadata.name" for i in bad])
    return nodes


def _flatten(docs: list[Any]) -> Iterator[Mapping[str, Any]]:
    for doc in docs:
        if isinstance(doc, Mapping) and isinstance(doc.get("items"), list):
            yield from _flatten(doc["items"])
        elif isinstance(doc, Mapping):
            yield doc
