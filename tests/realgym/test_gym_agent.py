"""examples/gym_agent.py, the demo's Gym pod, run here by ``.venv-gym``'s interpreter (the drs-gym
image's venv at the same pins) against a local fleet (two replicas, real frontends and sim
engines, as test_real_gym.py's), with the config ``drs gym-config`` writes for it
(``drs_client.gym``): it starts Gym's own ``vllm_model`` server and its checks pass; and they fail
when turns do not land where the agent expects them."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from drs_client.fleet import FleetView
from drs_client.gym import gym_config, render
from drs_protocol.engine_config import SIM_DEFAULT_TOKENS_PER_BLOCK

from .test_real_gym import GYM_PYTHON, MODEL, fleet, free_port

AGENT = Path(__file__).resolve().parents[2] / "examples" / "gym_agent.py"


def view(urls: list[str]) -> FleetView:
    return FleetView(
        namespace="default", name="pod-sim", generation=1, observed_generation=1, phase="Ready",
        replicas=len(urls), ready_replicas=len(urls), updated_replicas=len(urls), urls=tuple(urls),
        engines=(), weights_version=None, message="", model=MODEL,
    )  # fmt: skip


async def run_agent(config: Path, workdir: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    if not GYM_PYTHON.exists():
        raise AssertionError(f"{GYM_PYTHON} is missing: `make gym-install` builds NeMo-Gym's venv (`make test` does)")
    argv = [str(AGENT), "--config", str(config), "--block-tokens", str(SIM_DEFAULT_TOKENS_PER_BLOCK)]
    argv += ["--port", str(free_port()), "--workdir", str(workdir), *extra]
    proc = await asyncio.create_subprocess_exec(
        str(GYM_PYTHON), *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out = (await asyncio.wait_for(proc.communicate(), timeout=300))[0].decode()
    sys.stdout.write(out)
    return int(proc.returncode or 0), json.loads(out.strip().splitlines()[-1]), out


async def test_the_demos_gym_agent_passes_its_checks_through_gyms_own_server(tmp_path: Path) -> None:
    async with fleet(1, True) as urls:
        config = tmp_path / "policy.yaml"
        config.write_text(render(gym_config(view(urls)), view(urls)))
        rc, result, out = await run_agent(config, tmp_path / "agent")
    assert rc == 0, out
    assert result["ok"] is True and result["turns"] == "12/12" and result["ids_equal"] == "12/12", result
    assert result["continuity"] == "8/8" and result["prefill_affinity"] == "8/8", result
    assert result["url_affinity"]["ok"] and sum(result["url_affinity"]["per_frontend"]) == 12, result
    assert result["base_urls"] == [u + "/v1" for u in urls]
    assert out.count(" turn ") == 12 and "prefix-cache hit" in out


async def test_the_agent_fails_when_turns_do_not_land_where_it_expects(tmp_path: Path) -> None:
    """A ``base_url`` list that names the first frontend twice: Gym spreads sessions over three
    entries, two of them one frontend, whose counter the agent reads for both: the URL affinity
    check fails (unless no session of eight picks either copy: (1/3)^8)."""
    async with fleet(1, True) as urls:
        config = tmp_path / "policy.yaml"
        text = render(gym_config(view(urls)), view(urls))
        assert f"- {urls[0]}/v1\n" in text
        config.write_text(text.replace(f"- {urls[0]}/v1\n", f"- {urls[0]}/v1\n- {urls[0]}/v1\n"))
        rc, result, out = await run_agent(config, tmp_path / "agent", "--conversations", "8")
    assert rc == 1, out
    assert result["ok"] is False and result["url_affinity"]["ok"] is False, result
    assert result["turns"] == "24/24" and result["continuity"] == "16/16", result  # only affinity failed
