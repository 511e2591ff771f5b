"""Tool-call parsers by name (`--tool-call-parser`): find the calls in a model's output, in its own format."""
from latentserve.server.tool_parsers.base import ToolParser, get_tool_parser, register_tool_parser, tool_parser_names
from latentserve.server.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from latentserve.server.tool_parsers.deepseek_v31 import DeepSeekV31ToolParser
from latentserve.server.tool_parsers.deepseek_v32 import DeepSeekV32ToolParser
from latentserve.server.tool_parsers.glm45 import GLM45ToolParser
from latentserve.server.tool_parsers.kimi_k2 import KimiK2ToolParser

__all__ = ["DeepSeekV31ToolParser", "DeepSeekV32ToolParser", "DeepSeekV3ToolParser", "GLM45ToolParser", "KimiK2ToolParser", "ToolParser", "get_tool_parser",
           "register_tool_parser", "tool_parser_names"]
