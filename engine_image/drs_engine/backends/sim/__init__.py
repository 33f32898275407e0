"""The ``sim`` backend, a CPU test double: :mod:`.engine` (the engine and its leg steps),
:mod:`.model` (the token function), :mod:`.handoff` (the context store and its HTTP fetch),
:mod:`.weights` (a version and a content hash)."""
