"""The ``torch`` backend's weights: :mod:`.manager` (the served weights and every way they are
swapped), :mod:`.packed` (one buffer in the refit layout), :mod:`.refit` (collective broadcast
and colocated CUDA IPC)."""
