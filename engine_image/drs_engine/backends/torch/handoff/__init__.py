"""The ``torch`` backend's KV handoff: :mod:`.contexts` (the component: contexts left, exported and
received), :mod:`.frame` (the wire frame, the opaque state, the transport choice) and
:mod:`.transfer` (moving the bytes: HTTP through pinned memory, CUDA IPC, the arena copy)."""
