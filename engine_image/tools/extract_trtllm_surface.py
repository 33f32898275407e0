"""Re-extract the recorded TensorRT-LLM surface from a checkout and compare it with the record.

    python engine_image/tools/extract_trtllm_surface.py /path/to/TensorRT-LLM [--json]

Reads (with ``ast``, importing nothing) the files the surface names, at the checkout's commit:
dataclass/pydantic fields of the recorded classes, parameters of the recorded methods, the
``ExecutorMemoryType`` values, and the fields of the OpenAI response models. Prints, per recorded
name, whether the checkout has it; exits 1 when a required name is missing (feature names only
warn). ``--json`` prints what was extracted, with the checkout's commit, to refresh the record.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SURFACE = Path(__file__).resolve().parents[1] / "drs_engine" / "backends" / "trtllm" / "surface.json"

#: recorded symbol -> (file in the checkout, class name)
CLASS_FILES = {
    "tensorrt_llm.llmapi.SamplingParams": ("tensorrt_llm/sampling_params.py", "SamplingParams"),
    "tensorrt_llm.llmapi.DisaggregatedParams": ("tensorrt_llm/disaggregated_params.py", "DisaggregatedParams"),
    "tensorrt_llm.llmapi.ConversationParams": ("tensorrt_llm/conversation_params.py", "ConversationParams"),
    "tensorrt_llm.executor.result.CompletionOutput": ("tensorrt_llm/executor/result.py", "CompletionOutput"),
    "tensorrt_llm.executor.result.Logprob": ("tensorrt_llm/executor/result.py", "Logprob"),
}
METHOD_FILES = {
    "generate_async": ("tensorrt_llm/llmapi/llm.py", "BaseLLM", "LLM"),
    "release": ("tensorrt_llm/_torch/async_llm.py", "AsyncLLM"),
    "resume": ("tensorrt_llm/_torch/async_llm.py", "AsyncLLM"),
    "collective_rpc": ("tensorrt_llm/_torch/async_llm.py", "AsyncLLM"),
    "setup_async": ("tensorrt_llm/_torch/async_llm.py", "AsyncLLM"),
}
MEMORY_FILES = ("tensorrt_llm/llmapi/llm_args.py", "tensorrt_llm/_torch/virtual_memory.py")
OPENAI_FILE = "tensorrt_llm/serve/openai_protocol.py"


def classes(path: Path) -> dict[str, ast.ClassDef]:
    if not path.is_file():
        return {}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name: node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def class_fields(node: ast.ClassDef) -> list[str]:
    names = []
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and not stmt.target.id.startswith("_"):
            names.append(stmt.target.id)
    return names


def class_values(node: ast.ClassDef) -> list[str]:
    return [
        stmt.value.value
        for stmt in node.body
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)
    ]


def method_params(node: ast.ClassDef, name: str) -> list[str] | None:
    for stmt in node.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name == name:
            args = stmt.args
            return [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs] if a.arg != "self"]
    return None


def extract(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"commit": _commit(root), "classes": {}, "methods": {}, "openai_models": {}}
    for symbol, (file, cls) in CLASS_FILES.items():
        node = classes(root / file).get(cls)
        out["classes"][symbol] = class_fields(node) if node else None
    for method, (file, *owners) in METHOD_FILES.items():
        found = classes(root / file)
        params = next(
            (method_params(found[o], method) for o in owners if o in found and method_params(found[o], method)), None
        )
        out["methods"][method] = params
    for file in MEMORY_FILES:
        node = classes(root / file).get("ExecutorMemoryType")
        if node is not None:
            out["memory_tags"] = {"file": file, "values": class_values(node)}
            break
    found = classes(root / OPENAI_FILE)
    for model in _surface()["openai_models"]["models"]:
        out["openai_models"][model] = class_fields(found[model]) if model in found else None
    return out


def compare(extracted: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(missing required names, missing feature names)."""
    surface = _surface()
    missing: list[str] = []
    features: list[str] = []
    for symbol, fields in extracted["classes"].items():
        entry = surface["classes"][symbol]
        have = set(fields or ())
        missing += [f"{symbol}.{f}" for f in entry.get("fields", []) if f not in have and "feature" not in entry]
        features += [f"{symbol}.{f}" for f in entry.get("feature_fields", {}) if f not in have]
        if fields is None and "feature" in entry:
            features.append(symbol)
    for method, params in extracted["methods"].items():
        want = surface["llm"]["methods"][method]["params"]
        missing += [f"{method}({p})" for p in want if p not in (params or ())]
    if "conversation_params" not in (extracted["methods"].get("generate_async") or ()):
        features.append("generate_async(conversation_params)")
    for model, fields in extracted["openai_models"].items():
        missing += [f"openai {model}.{f}" for f in surface["openai_models"]["models"][model] if f not in (fields or ())]
    return missing, features


def _surface() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(SURFACE.read_text(encoding="utf-8"))
    return data


def _commit(root: Path) -> str | None:
    try:
        return subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 2
    extracted = extract(Path(argv[0]))
    if "--json" in argv:
        print(json.dumps(extracted, indent=2))
    missing, features = compare(extracted)
    print(f"checkout commit: {extracted['commit']}", file=sys.stderr)
    for name in features:
        print(f"feature missing (degrades): {name}", file=sys.stderr)
    for name in missing:
        print(f"REQUIRED name missing: {name}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
