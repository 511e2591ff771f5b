"""Anthropic's Messages API bodies (the subset latentserve serves on POST /v1/messages): requests, responses, stream
events and errors, as pydantic models. Names as vLLM's (`Anthropic...`) and, for content blocks and events, as
Anthropic's own SDK's."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictBool, model_validator
from pydantic_core import PydanticCustomError

from latentserve.server.protocol import EchoedModel, StrictModel, UnicodeModel
from latentserve.server.serving import OpenAIError

# The content blocks each role's messages may hold here: text only (no images or documents), the tool calls an
# assistant made and the results a user sends back, and an assistant's earlier thinking.
BLOCKS_BY_ROLE = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking")}


class CacheControl(StrictModel):
    """Anthropic's prompt-caching breakpoint. Accepted wherever Anthropic takes it: prefix caching (on by default)
    caches every prompt's prefix without breakpoints, so one asks for nothing more."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlockParam(EchoedModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlockParam(EchoedModel):
    """A call an assistant made, sent back in the conversation."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlockParam(EchoedModel):
    """A call's result, in a user message."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlockParam] = ""
    is_error: StrictBool = False
    cache_control: CacheControl | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            _check_block_types(data["content"], ("text",), "a tool_result's content")
        return data

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(block.text for block in self.content)


class ThinkingBlockParam(EchoedModel):
    """An assistant's earlier reasoning, sent back: the turn's reasoning_content. Its signature is not checked (this
    server signs nothing)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


ContentBlockParam = Annotated[TextBlockParam | ToolUseBlockParam | ToolResultBlockParam | ThinkingBlockParam,
                              Field(discriminator="type")]


def _check_block_types(blocks: list, allowed: tuple[str, ...], where: str) -> None:
    """A 400 naming the first block whose type `where` may not hold (an image, a document, ...)."""
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            raise PydanticCustomError(
                "content_block", "{where}: block {index} is of type '{kind}', which this server does not take there "
                "(it takes {allowed} blocks)", {"where": where, "index": i, "kind": kind,
                                                 "allowed": ", ".join(allowed)})


def _check_redacted(blocks: list, where: str) -> None:
    """A 400 for a redacted_thinking block: its reasoning is encrypted by the service that wrote it, and this server
    cannot read it back into the prompt (nor leave it out unseen)."""
    for i, block in enumerate(blocks):
        if isinstance(block, dict) and block.get("type") == "redacted_thinking":
            raise PydanticCustomError(
                "content_block", "{where}: block {index} is redacted_thinking, whose encrypted reasoning this server "
                "cannot decode: send the reasoning as a thinking block, or leave the block out",
                {"where": where, "index": i})


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]

    @model_validator(mode="before")
    @classmethod
    def _check_blocks(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("content"), list) and data.get("role") in BLOCKS_BY_ROLE:
            where = f"a {data['role']} message"
            _check_redacted(data["content"], where)
            _check_block_types(data["content"], BLOCKS_BY_ROLE[data["role"]], where)
        return data


class AnthropicTool(StrictModel):
    """A client tool. Anthropic's server tools (web search, code execution, ...) have other types and are refused."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="a JSON schema of the input (an object)")
    cache_control: CacheControl | None = None


class AnthropicToolChoice(StrictModel):
    """auto, any (some tool), tool (the one named) or none: OpenAI's auto, required, a named function, none."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool = False

    @model_validator(mode="after")
    def _check(self):
        if (self.type == "tool") != (self.name is not None):
            raise PydanticCustomError("tool_choice", "tool_choice: name is required with type 'tool' and only "
                                      "allowed with it", {"field": "tool_choice"})
        if self.disable_parallel_tool_use and self.type in ("auto", "none"):
            # With auto the tool parser returns every call the model writes: one call at most cannot be enforced.
            raise PydanticCustomError("tool_choice", "tool_choice: disable_parallel_tool_use is only supported with "
                                      "type 'any' or 'tool'", {"field": "tool_choice"})
        return self


class ThinkingConfigEnabled(StrictModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024, description="checked as Anthropic checks it; max_tokens bounds the thinking")


class ThinkingConfigDisabled(StrictModel):
    type: Literal["disabled"]


ThinkingConfig = Annotated[ThinkingConfigEnabled | ThinkingConfigDisabled, Field(discriminator="type")]


class AnthropicMetadata(StrictModel):
    user_id: str | None = Field(None, description="accepted and not used")


class AnthropicCountTokensRequest(UnicodeModel):
    """POST /v1/messages/count_tokens: what the prompt of a messages request holds."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    cache_control: CacheControl | None = None


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    max_tokens: int = Field(ge=1)
    metadata: AnthropicMetadata | None = None
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="0: no top-k")

    @model_validator(mode="after")
    def _check_budget(self):
        if isinstance(self.thinking, ThinkingConfigEnabled) and self.thinking.budget_tokens >= self.max_tokens:
            raise PydanticCustomError("thinking", "thinking.budget_tokens: must be less than max_tokens, got "
                                      "{budget} >= {max_tokens}", {"field": "thinking", "max_tokens": self.max_tokens,
                                                                  "budget": self.thinking.budget_tokens})
        return self


# Responses


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = Field("", description="empty: this server does not sign its reasoning")


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicUsage(BaseModel):
    input_tokens: int  # the whole prompt, its cached prefix included
    output_tokens: int


class AnthropicMessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class AnthropicCountTokensResponse(BaseModel):
    input_tokens: int


# Stream events


class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: AnthropicMessagesResponse


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class InputJSONDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | ThinkingDelta | InputJSONDelta


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason
    stop_sequence: str | None = None


class MessageDeltaUsage(BaseModel):
    output_tokens: int


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageDeltaUsage


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


# Errors


class AnthropicError(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicError


# The HTTP statuses the server answers, as Anthropic names their errors. 503 (the engine is busy or gone) is
# Anthropic's overloaded_error, whose own status, 529, its client retries as it retries 503.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}


def anthropic_error(error: OpenAIError) -> AnthropicErrorResponse:
    """The server's error in Anthropic's shape (same status and message)."""
    default = "api_error" if error.status_code >= 500 else "invalid_request_error"
    return AnthropicErrorResponse(error=AnthropicError(type=ERROR_TYPES.get(error.status_code, default),
                                                       message=error.info.message))


AnthropicStreamEvent = (MessageStartEvent | ContentBlockStartEvent | ContentBlockDeltaEvent | ContentBlockStopEvent
                        | MessageDeltaEvent | MessageStopEvent | AnthropicErrorResponse)


def anthropic_sse(event: AnthropicStreamEvent) -> str:
    """One server-sent event as Anthropic writes them: its type on an `event:` line, then its body."""
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"
