"""Incremental detokenization for streaming: emit text only once it is complete.

A token can end in the middle of a multi-byte character; decoding token by token would emit
``"\\ufffd"``. Like vLLM's ``detokenize_incrementally``, we keep a window (``prefix_offset`` to
``read_offset``: the tokens of the last emitted piece) and emit the text the newest tokens add,
holding it back while it still ends in a replacement character. Cost per token: decoding a few ids.
"""

from __future__ import annotations

from typing import Any, Final

REPLACEMENT_CHAR: Final = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip))

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; returns the text that is now complete (possibly ``""``)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta

    def flush(self) -> str:
        """Whatever is still held back (at the end of the stream), replacement characters included."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._read_offset = len(self._ids)
        self._prefix_offset = self._read_offset
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
