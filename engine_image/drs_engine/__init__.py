"""The engine server of DisaggReplicaSet: one per prefill or decode engine.

``drs engine --backend trtllm|sim --role prefill|decode --port P`` serves TensorRT-LLM's
OpenAI-compatible API with disaggregated (context-only / generation-only) legs, a control API for
refit, sleep/wake and profiling, and Prometheus metrics. The ``trtllm`` backend runs TensorRT-LLM
on GPUs; the ``sim`` backend is a CPU test double with a real prefix cache, a real KV handoff and a
latency model. Importing this package never imports ``tensorrt_llm``.
"""

__version__ = "0.1.0"
