"""OpenAI's Responses API bodies (the stateless subset latentserve serves on POST /v1/responses): the request, its
input items, the response, its output items and stream events, as pydantic models named as the openai client's
types."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, Tag, model_validator
from pydantic_core import PydanticCustomError

from latentserve.engine.chat_reasoning import REASONING_JOIN
from latentserve.server.protocol import EchoedModel, StrictModel, UnicodeModel, refuse_unsupported
from latentserve.server.protocol_responses import now

# Fields of OpenAI's request that need state or features this server does not keep: refused by name, never ignored.
UNSUPPORTED = {name: "not supported: " + why for name, why in {
    "previous_response_id": "this server stores no responses: send the whole conversation as input",
    "conversation": "this server stores no conversations: send the whole conversation as input",
    "include": "no extra output data (encrypted reasoning, logprobs, sources) is available",
    "background": "responses run in the foreground only: nothing is stored to poll",
    "reasoning": "reasoning is set by the server's chat template and --reasoning-parser, not per request",
    "prompt": "stored prompt templates are not supported",
    "max_tool_calls": "max_tool_calls is not supported: use parallel_tool_calls=false for one call at most",
    "top_logprobs": "logprobs are not supported on this route: use /v1/chat/completions",
}.items()}


class InputText(EchoedModel):
    """A text part of an input message; output_text (an assistant's reply sent back) may carry its annotations."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = Field(None, description="accepted and not used")


# The input items and message content parts this server takes: text only (no images or files), function calls and
# their outputs, and reasoning sent back.
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
PART_TYPES = ("input_text", "output_text")


def _check_types(values: list, allowed: tuple[str, ...], where: str, default: str | None = None) -> None:
    """A 400 naming the first item or part whose type `where` may not hold."""
    for i, value in enumerate(values):
        kind = value.get("type", default) if isinstance(value, dict) else None
        if kind not in allowed:
            raise PydanticCustomError(
                "input", "{field}: {where} {index} is of type '{kind}', which this server does not take (it takes "
                "{allowed})", {"field": "input", "where": where, "index": i, "kind": kind,
                                "allowed": ", ".join(allowed)})


class InputMessage(EchoedModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None  # an output message sent back
    status: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            _check_types(data["content"], PART_TYPES, "a message's content part")
        return data

    def chat_content(self) -> str | list[dict]:
        if isinstance(self.content, str):
            return self.content
        return [{"type": "text", "text": part.text} for part in self.content]


class FunctionCallItem(EchoedModel):
    """A call the model made, sent back."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(EchoedModel):
    """A call's result."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningPartParam(EchoedModel):
    type: Literal["summary_text", "reasoning_text"]  # a part of the summary, or of the content
    text: str


class ReasoningItemParam(EchoedModel):
    """A reasoning item sent back: the reasoning_content of the assistant turn that follows it."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPartParam]
    content: list[ReasoningPartParam] | None = None
    encrypted_content: None = None
    status: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _readable(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("encrypted_content") is not None:
            raise PydanticCustomError("input", "{field}: a reasoning item's encrypted_content cannot be decoded by "
                                      "this server: send the reasoning as its content or summary", {"field": "input"})
        return data

    def text(self) -> str:
        """The reasoning: its own text (content) where the item has it, else its summary."""
        return REASONING_JOIN.join(part.text for part in self.content or self.summary)


def _item_type(item: Any) -> str | None:
    # A message item may leave its type out (OpenAI's EasyInputMessage).
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)


InputItem = Annotated[Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItemParam, Tag("reasoning")], Discriminator(_item_type)]


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = Field(None, description="arguments always match: true and false are the same")


class FunctionToolChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormatText(StrictModel):
    type: Literal["text"]


class TextFormatJSONObject(StrictModel):
    type: Literal["json_object"]


class TextFormatJSONSchema(StrictModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    type: Literal["json_schema"]
    name: str = Field(max_length=64)
    json_schema: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: StrictBool | None = None


class TextConfig(StrictModel):
    format: Annotated[TextFormatText | TextFormatJSONObject | TextFormatJSONSchema,
                      Field(discriminator="type")] | None = None


class ResponsesRequest(UnicodeModel):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: StrictBool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = Field(None, description="accepted and echoed")
    user: str | None = Field(None, description="accepted and not used")
    store: StrictBool | None = Field(None, description="only false: nothing is stored")
    truncation: Literal["disabled", "auto"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = refuse_unsupported(data, UNSUPPORTED)
        if isinstance(data.get("input"), list):
            _check_types(data["input"], ITEM_TYPES, "item", default="message")
        for i, tool in enumerate(data.get("tools") or []):
            if isinstance(tool, dict) and tool.get("type") != "function":
                raise PydanticCustomError(
                    "tools", "{field}: tools[{index}] is of type '{kind}'; this server runs function tools only",
                    {"field": "tools", "index": i, "kind": tool.get("type")})
        return data

    @model_validator(mode="after")
    def _stateless(self):
        if self.store:
            raise PydanticCustomError("store", "{field}: true is not supported: this server stores no responses; "
                                      "send store=false or leave it out", {"field": "store"})
        if self.truncation == "auto":
            raise PydanticCustomError("truncation", "{field}: 'auto' is not supported: a prompt longer than the "
                                      "context is refused, never truncated", {"field": "truncation"})
        if self.input in ("", []):
            raise PydanticCustomError("input", "{field}: the input is empty", {"field": "input"})
        if isinstance(self.input, list):
            _check_reasoning_followed(self.input)
        return self


def _check_reasoning_followed(items: list) -> None:
    """A 400 naming a reasoning item that no assistant message or function call follows (after any more reasoning):
    it would belong to no turn of the prompt."""
    assistant_next = False  # whether the next item that is not reasoning is the assistant's
    for i in reversed(range(len(items))):
        if items[i].type != "reasoning":
            assistant_next = items[i].type == "function_call" or getattr(items[i], "role", None) == "assistant"
        elif not assistant_next:
            raise PydanticCustomError("input", "{field}: item {index} is a reasoning item without the assistant "
                                      "message or function call it reasoned toward after it",
                                      {"field": "input", "index": i})


# Responses


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText]


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = []
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class FunctionCallOutput(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = ReasoningItem | OutputMessage | FunctionCallOutput


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int  # the whole prompt, its cached prefix included
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponsesResponse(BaseModel):
    """The response, with the request's settings echoed as OpenAI echoes them."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now)
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoice
    tools: list[FunctionTool]
    text: TextConfig
    truncation: Literal["disabled"] = "disabled"
    user: str | None = None
    store: Literal[False] = False
    previous_response_id: None = None
    reasoning: None = None


# Stream events: each one's sequence_number is set as it is written.


class StreamEvent(BaseModel):
    type: str
    sequence_number: int = 0


class ResponseEvent(StreamEvent):
    """response.created, .in_progress, .completed, .incomplete."""

    response: ResponsesResponse


class OutputItemEvent(StreamEvent):
    """response.output_item.added and .done."""

    output_index: int
    item: OutputItem


class ContentPartEvent(StreamEvent):
    """response.content_part.added and .done."""

    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText | ReasoningText


class ReasoningDeltaEvent(StreamEvent):
    """response.reasoning_text.delta."""

    item_id: str
    output_index: int
    content_index: int = 0
    delta: str


class TextDeltaEvent(ReasoningDeltaEvent):
    """response.output_text.delta: with its logprobs (none here)."""

    logprobs: list[Any] = []


class ReasoningDoneEvent(StreamEvent):
    """response.reasoning_text.done."""

    item_id: str
    output_index: int
    content_index: int = 0
    text: str


class TextDoneEvent(ReasoningDoneEvent):
    """response.output_text.done."""

    logprobs: list[Any] = []


class ArgumentsDeltaEvent(StreamEvent):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(StreamEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(StreamEvent):
    type: Literal["error"] = "error"
    code: str | None = None
    message: str
    param: str | None = None
