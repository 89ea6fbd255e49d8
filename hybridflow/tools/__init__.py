"""Tools for agentic RL: `BaseTool` (create / execute / calc_reward / release), the `TOOLS` registry,
OpenAI function schemas, loading tools from verl's tools YAML, and the built-ins `calculator`,
`code_interpreter` (the sandbox), `search` (local BM25), `gsm8k_answer` and `sandbox_fusion` (a SandboxFusion
server), which import lazily through `TOOLS`.
"""

from hybridflow.tools.base import TOOLS, BaseTool, ToolError, ToolInstance, build_tool_config
from hybridflow.tools.loader import build_tool, load_tools
from hybridflow.tools.schemas import (
    FunctionCall, OpenAIFunctionParametersSchema, OpenAIFunctionPropertySchema, OpenAIFunctionSchema,
    OpenAIFunctionToolSchema, ToolResponse, validate_arguments)

__all__ = [
    "TOOLS",
    "BaseTool",
    "FunctionCall",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionPropertySchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolSchema",
    "ToolError",
    "ToolInstance",
    "ToolResponse",
    "build_tool",
    "build_tool_config",
    "load_tools",
    "validate_arguments",
]
