"""The ``torch`` backend, a reference GPU engine in PyTorch (see :mod:`.engine`). By folder:
:mod:`.engine` the engine and its leg steps; :mod:`.runner`, :mod:`.batching`, :mod:`.sampling`,
:mod:`.worker` and :mod:`.model` running the model; :mod:`.kv` the KV memory (prefix cache,
handoff arena); :mod:`.handoff` where a context gets exported and received; :mod:`.weights` where
weights are swapped (load, collective and IPC refit, sleep); :mod:`.ipc` CUDA IPC in plain fields."""
