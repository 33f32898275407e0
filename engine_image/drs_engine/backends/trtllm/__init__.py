"""The ``trtllm`` backend: :mod:`.engine` (TensorRT-LLM's async LLM API applied), :mod:`.translate`
(everything checkable without a GPU: kwargs, params, results, control RPCs), :mod:`.features`
(what the installed release offers) and :mod:`.surface` (the recorded API names, ``surface.json``).
TensorRT-LLM's own KV cache transceiver hands contexts over; weights are swapped by its workers'
RPCs (:meth:`.engine.TrtllmBackend.load_weights` and the collective ops)."""
