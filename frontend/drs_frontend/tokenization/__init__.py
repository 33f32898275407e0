"""Frontend tokenization: render the chat template and tokenize, incrementally per conversation.

:class:`ChatTokenizer` is the only entry point; its ids are bit-identical to
:func:`drs_protocol.chat.render_prompt_ids`, the function the engine uses.
"""

from drs_frontend.tokenization.cache import ChatTokenizer, Path, TurnIds
from drs_frontend.tokenization.probes import probe_windowing

__all__ = ["ChatTokenizer", "Path", "TurnIds", "probe_windowing"]
