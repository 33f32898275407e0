"""CONTRACT TEST DOUBLE of ``tensorrt_llm`` (see ../README.md); never shipped."""

from tensorrt_llm._torch.async_llm import AsyncLLM
from tensorrt_llm.llmapi import SamplingParams

TEST_DOUBLE = True
__all__ = ["TEST_DOUBLE", "AsyncLLM", "SamplingParams"]
