"""Changed fallback pools without a restart: the frontend re-reads its mounted config file.

The operator mounts the replica's frontend ConfigMap under
:data:`drs_protocol.lifecycle.FRONTEND_CONFIG_DIR` and names the file in ``configWatch``; the
kubelet rewrites it when the ConfigMap changes (another replica placed, moved or scaled away).
Every ``healthInterval`` the frontend looks at the file's modification time and size; when they
changed it parses the file as a :class:`~drs_protocol.frontend_config.FrontendConfig` and applies
its ``fallbackPrefill`` / ``fallbackDecode`` to the pools (engines added are probed from the next
round on; engines dropped stop being candidates at once). Everything else in the file is left
alone: a change there changes the pod template's config hash and rolls the pod anyway. A file
that is missing, unreadable or invalid is logged (naming the file and the problem) and the pools
stay as they are.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from drs_protocol.config import parse_config_json
from drs_protocol.frontend_config import FrontendConfig
from pydantic import ValidationError

from drs_frontend.engines import EnginePool

log = logging.getLogger(__name__)


def read_fallbacks(path: Path) -> tuple[list[str], list[str]] | None:
    """The fallback prefill and decode URLs the file names, or None (logged) when it cannot be read."""
    try:
        data = parse_config_json(path.read_text(), source=str(path))
        if data is None:
            raise ValueError("the file is empty")
        config = FrontendConfig.model_validate(data)
    except (OSError, ValueError, ValidationError) as exc:
        log.warning("config %s: not applied: %s", path, exc)
        return None
    return config.fallback_prefill, config.fallback_decode


def apply_fallbacks(prefill: EnginePool, decode: EnginePool, urls: tuple[list[str], list[str]]) -> bool:
    """Set both pools' fallback engines; True when anything changed."""
    changed = False
    for pool, wanted in ((prefill, urls[0]), (decode, urls[1])):
        added, removed = pool.set_fallback(wanted)
        if added or removed:
            changed = True
            log.info("%s fallback engines: added %s, removed %s", pool.role, added or "none", removed or "none")
    return changed


async def watch_config(path: Path, prefill: EnginePool, decode: EnginePool, *, interval: float) -> None:
    """Apply the file's fallback pools whenever it changes (until cancelled)."""
    seen: tuple[int, int] | None = None
    while True:
        try:
            st = os.stat(path)
            stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp is not None and stamp != seen:
            urls = read_fallbacks(path)
            if urls is not None:
                apply_fallbacks(prefill, decode, urls)
            seen = stamp
        await asyncio.sleep(interval)
