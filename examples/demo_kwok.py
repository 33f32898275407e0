"""`make demo-kwok`: the main job on the local control plane with simulated nodes and the pod runner.

1. bring up the dev control plane with simulated HGX GPU nodes (reused when already up);
2. install the CRD, start the operator and the local pod runner (which runs our pods' commands as
   processes bound to their nodes' loopback addresses);
3. apply examples/local-sim.yaml (sim engines: the CPU test double of a GPU engine) and wait,
   showing progress, until the DisaggReplicaSet is Ready;
4. read `status.urls` and drive multi-turn conversations through them with the official `openai`
   client, exactly as NeMo-Gym does (sha256(session) % len(urls)), printing which prefill and
   decode engines served each turn and how many prompt tokens the prefill engine's cache held;
5. start the trainer's refit sidecar (`drs sidecar`), refit every engine to new weights through
   it as a trainer does after a policy update, and show `status.weights.version` and that the
   same request now generates other tokens.

Everything keeps running afterwards; `make demo-down` (`drs dev down`) stops all of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from drs_devcluster import build, processes, runner_daemon
from drs_devcluster.cluster import DevCluster
from drs_protocol import routes

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "local-sim.yaml"
NAME = "local-sim"
READY_TIMEOUT_S = 180.0
TURNS = 3
CONVERSATIONS = 4
#: Long enough to fill several 32-token cache blocks, as a real agent's system prompt does.
SYSTEM_PROMPT = (
    "You are a careful assistant inside a reinforcement-learning rollout. Answer briefly, keep the "
    "conversation's earlier turns in mind, never invent tool results, and when a question is "
    "ambiguous say what you assumed. Prefer short sentences. Use plain text without markdown. "
    "If the user asks for code, give the smallest example that runs."
)


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def kubectl(cluster: DevCluster, *args: str, input: str | None = None) -> str:
    out = subprocess.run(
        [str(cluster.layout.bin_dir / "kubectl"), *args],
        input=input,
        capture_output=True,
        text=True,
        env={**os.environ, "KUBECONFIG": str(cluster.layout.kubeconfig)},
        timeout=120,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"kubectl {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


def ensure_cluster() -> DevCluster:
    cluster = DevCluster.at()
    status = cluster.status()
    if status["components"] and all(c["running"] for c in status["components"].values()):
        say(f"reusing the running dev cluster ({status.get('nodes')})")
        return DevCluster.at(bin_dir=build.bin_dir())
    cluster.down()
    cluster = DevCluster.at()
    cluster.up("hgx", 4)
    return cluster


def ensure_operator(cluster: DevCluster) -> None:
    pids = cluster.layout.state_dir / "operator-pids.json"
    if any(processes.is_running(t) for t in processes.load(pids)):
        say("operator already running")
        return
    log = cluster.layout.log("operator")
    drs = str(Path(sys.executable).parent / "drs")
    env = {**os.environ, "KUBECONFIG": str(cluster.layout.kubeconfig)}
    # argv[0] is the interpreter, so the pid file names the executable /proc shows for it and
    # `drs dev down` recognises (and stops) the process.
    argv = [sys.executable, drs, "operator", "--metrics-port", "19090", "--health-port", "18080"]
    argv += ["--lease-namespace", "default"]
    tracked = processes.start("operator", argv, log, env=env)
    processes.save(pids, [tracked])
    say(f"operator started (pid {tracked.pid}, log {log}, metrics http://127.0.0.1:19090/metrics)")


def wait_ready(cluster: DevCluster) -> dict[str, Any]:
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        body = json.loads(kubectl(cluster, "get", "drs", NAME, "-o", "json"))
        st = body.get("status") or {}
        progress = next((c["message"] for c in st.get("conditions", []) if c["type"] == "Progressing"), "")
        line = f"phase={st.get('phase')} ready={st.get('readyReplicas', 0)}/{st.get('replicas', '?')} {progress}"
        if line != last:
            say(line)
            last = line
        if st.get("phase") == "Ready" and st.get("observedGeneration") == body["metadata"]["generation"]:
            return st
        time.sleep(1)
    raise SystemExit(f"{NAME} not Ready after {READY_TIMEOUT_S:.0f}s; see `kubectl describe drs {NAME}` and the logs")


def wait_serving(urls: list[str]) -> None:
    """Until every frontend answers /ready (kwok reports a pod Ready the instant it starts it; the
    pod runner corrects that from the real probe within milliseconds, so check the real thing)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    pending = list(urls)
    while pending and time.monotonic() < deadline:
        for url in list(pending):
            try:
                with urllib.request.urlopen(url + routes.READY, timeout=2) as resp:
                    if resp.status == 200:
                        pending.remove(url)
            except OSError:
                pass
        time.sleep(0.5)
    if pending:
        raise SystemExit(f"frontends not serving after {READY_TIMEOUT_S:.0f}s: {pending}")


def prefix_cache_hits(engine_urls: list[str]) -> tuple[float, float]:
    query = hit = 0.0
    for url in engine_urls:
        with urllib.request.urlopen(url + routes.METRICS, timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("drs_engine_prefix_cache_query_tokens_total"):
                    query += float(line.split()[-1])
                elif line.startswith("drs_engine_prefix_cache_hit_tokens_total"):
                    hit += float(line.split()[-1])
    return query, hit


def drive(status: dict[str, Any]) -> None:
    import openai

    urls: list[str] = status["urls"]
    prefills = [e["url"] for r in status["replicaStatuses"] for e in r["engines"] if e["role"] == "prefill"]
    say(f"status.urls ({len(urls)} frontends, replica-major): {urls}")
    for c in range(CONVERSATIONS):
        session = f"demo-session-{c}"
        url = urls[int.from_bytes(hashlib.sha256(session.encode()).digest()[:8], "big") % len(urls)]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2, timeout=60)
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"Turn {turn} of conversation {c}: say something."})
            q0, h0 = prefix_cache_hits(prefills)
            raw = client.chat.completions.with_raw_response.create(
                model="sim-qwen3",
                messages=messages,  # type: ignore[arg-type]
                max_tokens=12,
                extra_body={"conversation_params": {"conversation_id": session}},
            )
            reply = raw.parse()
            q1, h1 = prefix_cache_hits(prefills)
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            say(
                f"{session} turn {turn} via {url}: prefill={raw.headers.get('x-drs-prefill')} "
                f"decode={raw.headers.get('x-drs-decode')} prompt={reply.usage.prompt_tokens if reply.usage else '?'} "
                f"tokens, prefix-cache hits {h1 - h0:.0f}/{q1 - q0:.0f}"
            )


SIDECAR_PORT = 18400


def one_completion(url: str) -> list[int]:
    """The token ids a fixed request generates through a frontend (the sim's depend on the weights)."""
    body = {"model": "sim-qwen3", "prompt": "The policy after this update says", "max_tokens": 6, "ignore_eos": True}
    request = urllib.request.Request(
        url + routes.Endpoint.COMPLETIONS, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        return list(json.loads(resp.read())["choices"][0]["token_ids"])


def refit(cluster: DevCluster, status: dict[str, Any]) -> None:
    pids = cluster.layout.state_dir / "sidecar-pids.json"
    processes.stop(processes.load(pids))  # a sidecar left by an earlier `make demo`
    drs = str(Path(sys.executable).parent / "drs")
    env = {**os.environ, "KUBECONFIG": str(cluster.layout.kubeconfig)}
    argv = [sys.executable, drs, "sidecar", "--name", NAME, "--namespace", "default", "--port", str(SIDECAR_PORT)]
    tracked = processes.start("sidecar", argv, cluster.layout.log("sidecar"), env=env)
    processes.save(pids, [tracked])
    sidecar = f"http://127.0.0.1:{SIDECAR_PORT}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(sidecar + routes.HEALTHZ, timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"the sidecar did not start; see {cluster.layout.log('sidecar')}") from None
            time.sleep(0.2)
    say(f"trainer sidecar started (pid {tracked.pid}, http://127.0.0.1:{SIDECAR_PORT}, reads {NAME}'s status)")
    version = time.strftime("step-%H%M%S")  # a new policy version on every run of the demo
    checkpoint = cluster.layout.state_dir / "checkpoints" / version
    checkpoint.mkdir(parents=True, exist_ok=True)
    (checkpoint / "model.safetensors").write_bytes(os.urandom(64))  # the sim hashes what it loads
    url = status["urls"][0]
    before = one_completion(url)
    request = urllib.request.Request(
        sidecar + routes.TrainerRoute.REFIT,
        data=json.dumps({"path": str(checkpoint), "version": version}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        report = json.loads(resp.read())
    say(
        f"POST /v1/refit {version}: complete={report['complete']} engines={report['engines']} ok={report['ok']} "
        f"in {report['elapsed_s']}s"
    )
    deadline = time.monotonic() + 30
    shown = None
    while time.monotonic() < deadline and shown != version:
        body = json.loads(kubectl(cluster, "get", "drs", NAME, "-o", "json"))
        shown = ((body.get("status") or {}).get("weights") or {}).get("version")
        time.sleep(0.5)
    say(f"status.weights.version = {shown}")
    after = one_completion(url)
    say(f"the same request via {url}: token ids {before} before, {after} after the refit")


def main() -> None:
    cluster = ensure_cluster()
    kubectl(cluster, "apply", "-f", str(ROOT / "crds"))
    kubectl(cluster, "wait", "--for=condition=Established", "crd/disaggreplicasets.disagg.dev", "--timeout=60s")
    ensure_operator(cluster)
    if runner_daemon.running_runner(cluster) is None:
        runner_daemon.start_runner(cluster)
    say("pod runner started (runs pods whose command is `drs` as local processes on their node's address)")
    kubectl(cluster, "apply", "-f", str(EXAMPLE))
    say(f"applied {EXAMPLE.relative_to(ROOT)}; waiting for Ready")
    status = wait_ready(cluster)
    print(kubectl(cluster, "get", "drs", "-o", "wide"), flush=True)
    wait_serving(status["urls"])
    drive(status)
    refit(cluster, status)
    say(
        f"done. The fleet keeps running: export KUBECONFIG={cluster.layout.kubeconfig}; `make demo-down` stops everything."
    )


if __name__ == "__main__":
    main()
