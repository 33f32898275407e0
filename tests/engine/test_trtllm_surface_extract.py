"""``engine_image/tools/extract_trtllm_surface.py`` re-extracts the recorded names from a checkout.

The checkout here is synthesized from the record itself (class bodies with the recorded fields),
then one required name is removed: the script must pass the first and fail the second naming it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from drs_engine.backends.trtllm.surface import surface

SCRIPT = Path(__file__).resolve().parents[2] / "engine_image" / "tools" / "extract_trtllm_surface.py"
FILES = {
    "tensorrt_llm.llmapi.SamplingParams": "tensorrt_llm/sampling_params.py",
    "tensorrt_llm.llmapi.DisaggregatedParams": "tensorrt_llm/disaggregated_params.py",
    "tensorrt_llm.llmapi.ConversationParams": "tensorrt_llm/conversation_params.py",
    "tensorrt_llm.executor.result.CompletionOutput": "tensorrt_llm/executor/result.py",
    "tensorrt_llm.executor.result.Logprob": "tensorrt_llm/executor/result.py",
}


def _class(name: str, fields: list[str]) -> str:
    return f"class {name}:\n" + "".join(f"    {f}: int = 0\n" for f in fields) + "\n"


def synthesize(root: Path, *, drop: str | None = None) -> None:
    s = surface()
    texts: dict[str, str] = {}
    for symbol, file in FILES.items():
        entry = s["classes"][symbol]
        fields = [*entry.get("fields", []), *entry.get("feature_fields", {}), *entry.get("attributes", [])]
        texts[file] = texts.get(file, "") + _class(symbol.rsplit(".", 1)[1], [f for f in fields if f != drop])
    methods = s["llm"]["methods"]
    llm = "class LLM:\n" + "".join(
        f"    def {m}(self, {', '.join([*methods[m]['params'], 'conversation_params=None'] if m == 'generate_async' else methods[m]['params'])}): ...\n"
        for m in ("generate_async", "shutdown")
    )
    texts["tensorrt_llm/llmapi/llm.py"] = llm
    texts["tensorrt_llm/_torch/async_llm.py"] = "class AsyncLLM:\n" + "".join(
        f"    async def {m}(self, {', '.join(methods[m]['params'])}): ...\n"
        for m in ("setup_async", "release", "resume", "collective_rpc")
    )
    models = s["openai_models"]["models"]
    texts["tensorrt_llm/serve/openai_protocol.py"] = "".join(_class(m, f) for m, f in models.items())
    for file, text in texts.items():
        (root / file).parent.mkdir(parents=True, exist_ok=True)
        (root / file).write_text(text)


def run(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=60)


def test_a_checkout_with_every_recorded_name_passes(tmp_path: Path) -> None:
    synthesize(tmp_path)
    result = run(tmp_path)
    assert result.returncode == 0, result.stderr
    assert "REQUIRED" not in result.stderr


def test_a_checkout_missing_a_required_name_fails_naming_it(tmp_path: Path) -> None:
    synthesize(tmp_path, drop="opaque_state")
    result = run(tmp_path)
    assert result.returncode == 1
    assert "REQUIRED name missing: tensorrt_llm.llmapi.DisaggregatedParams.opaque_state" in result.stderr


def _source_refs(node: object) -> list[str]:
    """Every ``source`` / ``class_source`` value anywhere in the record."""
    if isinstance(node, dict):
        own = [v for k, v in node.items() if k in ("source", "class_source") and isinstance(v, str)]
        return own + [ref for v in node.values() for ref in _source_refs(v)]
    if isinstance(node, list):
        return [ref for v in node for ref in _source_refs(v)]
    return []


def test_every_recorded_name_points_at_a_source_with_repo_path_and_full_commit() -> None:
    s = surface()
    sources = s["sources"]
    refs = _source_refs({k: v for k, v in s.items() if k != "sources"})
    assert refs, "the record names no sources at all"
    assert not sorted(set(refs) - set(sources)), "a name points at a source that is not recorded"
    for key, src in sources.items():
        assert src["repo"].count("/") == 1 and src["path"], key
        assert isinstance(src["commit"], str) and len(src["commit"]) == 40, f"{key}: commit {src['commit']!r}"
        int(src["commit"], 16)
