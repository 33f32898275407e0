"""This project's TensorRT-LLM worker extension (runs inside TensorRT-LLM's Ray GPU workers).

``extension.DrsWorkerExtension`` is the default ``ray_worker_extension_cls``; its pure arithmetic
(NeMo RL's packed-broadcast layout, ranks, dtypes, checkpoint files) is
:mod:`drs_protocol.nemo_rl_refit`, tested without torch or a GPU.
"""
