"""The frontend: an OpenAI-compatible relay in front of one replica's prefill and decode engines.

Request path (PROTOCOL.md section 2), one module per step: :mod:`.httpserver` terminates HTTP,
:mod:`.app` maps routes,
:mod:`.relay` runs a turn (strip Gym-only fields, tokenize, context leg, generation leg),
:mod:`.shaping` builds the engine bodies and the client answer (pure), :mod:`.routing` picks the
engines (pure), :mod:`.tokenization` renders and tokenizes with a per-conversation cache (pure),
:mod:`.upstream` is the HTTP client to the engines, :mod:`.engines` holds the pools' live state.
"""
