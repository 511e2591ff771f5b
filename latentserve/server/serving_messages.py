"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path. A request is
translated into the chat request that serving_chat renders, plans tools for and runs; its output, split by the same
ChatOutput, comes back as Anthropic's content blocks, or streamed as Anthropic's events."""
from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from latentserve.engine.chat_reasoning import join_reasoning
from latentserve.engine.chat_template import chat_variables
from latentserve.engine.outputs import RequestOutput
from latentserve.server.async_engine import RequestStream
from latentserve.server.anthropic_protocol import (
    AnthropicCountTokensRequest,
    AnthropicCountTokensResponse,
    AnthropicMessage,
    AnthropicMessagesRequest,
    AnthropicMessagesResponse,
    AnthropicStreamEvent,
    AnthropicToolChoice,
    AnthropicUsage,
    ContentBlock,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    InputJSONDelta,
    MessageDelta,
    MessageDeltaEvent,
    MessageDeltaUsage,
    MessageStartEvent,
    MessageStopEvent,
    StopReason,
    TextBlock,
    TextBlockParam,
    TextDelta,
    ThinkingBlock,
    ThinkingConfig,
    ThinkingDelta,
    ToolUseBlock,
    anthropic_error,
    anthropic_sse,
)
from latentserve.server.protocol import ChatCompletionRequest
from latentserve.server.protocol_responses import AssistantMessage, DeltaMessage
from latentserve.server.serving import EventFormat, OpenAIError
from latentserve.server.serving_chat import PreparedChat, ServingChat

# The chat-template variables that turn a model's thinking on and off: DeepSeek-V3.1's and GLM's.
THINKING_SWITCHES = ("thinking", "enable_thinking")
# Anthropic's streams end with message_stop, not OpenAI's [DONE].
ANTHROPIC_EVENTS = EventFormat(event=anthropic_sse, error=lambda error: anthropic_sse(anthropic_error(error)), end="")
# A tool result the client marks as an error reaches the model as its text after this (the chat path's tool messages
# have no error flag).
TOOL_ERROR_PREFIX = "Error: "


def _texts(blocks: list[TextBlockParam]) -> list[dict]:
    return [{"type": "text", "text": block.text} for block in blocks]


def _user_messages(message: AnthropicMessage) -> list[dict]:
    """A user turn as chat messages: each tool_result a tool message, the text between them user messages, in the
    order the blocks come."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    result, texts = [], []
    for block in message.content:
        if block.type == "text":
            texts.append(block)
            continue
        if texts:
            result.append({"role": "user", "content": _texts(texts)})
            texts = []
        prefix = TOOL_ERROR_PREFIX if block.is_error else ""
        result.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": prefix + block.text()})
    if texts or not result:
        result.append({"role": "user", "content": _texts(texts)})
    return result


def _assistant_message(message: AnthropicMessage) -> dict:
    """An assistant turn as a chat message: its text, its tool calls and its thinking as the reasoning_content the
    chat template reads (several thinking blocks, as interleaved thinking writes them, joined by a blank line)."""
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts = [block for block in message.content if block.type == "text"]
    thinking = [block.thinking for block in message.content if block.type == "thinking"]
    # Compact JSON, as the model writes a call's arguments: the prompt repeats its own text.
    calls = [{"id": block.id, "type": "function",
              "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False,
                                                                       separators=(",", ":"))}}
             for block in message.content if block.type == "tool_use"]
    return {"role": "assistant", "content": _texts(texts) or None, "tool_calls": calls or None,
            "reasoning_content": join_reasoning(thinking)}


def chat_messages(req: AnthropicCountTokensRequest) -> list[dict]:
    """The conversation as chat messages: the system prompt first."""
    messages = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _texts(req.system)
        messages.append({"role": "system", "content": system})
    for message in req.messages:
        messages.extend(_user_messages(message) if message.role == "user" else [_assistant_message(message)])
    return messages


def _tool_choice(choice: AnthropicToolChoice) -> str | dict:
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


# Anthropic's sampling fields and chat's names for them (the rest keep the model's generation defaults).
_SAMPLING = {"max_tokens": "max_tokens", "stop_sequences": "stop", "temperature": "temperature", "top_p": "top_p",
             "top_k": "top_k"}


def to_chat_request(req: AnthropicCountTokensRequest, chat_template_kwargs: dict[str, bool] | None
                    ) -> ChatCompletionRequest:
    """The chat request that runs `req`; what chat refuses is a 400 as the request's own errors are."""
    fields: dict[str, Any] = {"model": req.model, "messages": chat_messages(req)}
    if req.tools is not None:
        fields["tools"] = [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                              "parameters": tool.input_schema}} for tool in req.tools]
    if req.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(req.tool_choice)
        if req.tool_choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if chat_template_kwargs:
        fields["chat_template_kwargs"] = chat_template_kwargs
    if isinstance(req, AnthropicMessagesRequest):
        fields |= {chat: getattr(req, ours) for ours, chat in _SAMPLING.items()
                   if ours in req.model_fields_set and getattr(req, ours) is not None}
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from e


def _tool_input(arguments: str) -> dict | None:
    """A call's arguments as tool_use's input; None if they are not a JSON object (cut short by max_tokens)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def content_blocks(message: AssistantMessage) -> list[ContentBlock]:
    """The chat answer as Anthropic's blocks: thinking, text, then the tool calls (a call whose arguments were cut
    short goes out as text, as the chat path returns an unfinished `required` array)."""
    blocks: list[ContentBlock] = []
    if message.reasoning_content:
        blocks.append(ThinkingBlock(thinking=message.reasoning_content))
    if message.content:
        blocks.append(TextBlock(text=message.content))
    for call in message.tool_calls:
        tool_input = _tool_input(call.function.arguments)
        blocks.append(TextBlock(text=call.function.arguments) if tool_input is None else
                      ToolUseBlock(id=call.id, name=call.function.name, input=tool_input))
    return blocks


def stop_reason(finish_reason: str | None, stop: int | str | None, called: bool) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence) of an output that ended for the engine's `finish_reason` and `stop`."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


class _StreamBlocks:
    """The content blocks a stream opens and closes as the output's deltas come: one block per run of thinking or
    text, one per tool call."""

    def __init__(self) -> None:
        self.index = -1
        self.open_type: str | None = None

    def close(self) -> list[AnthropicStreamEvent]:
        if self.open_type is None:
            return []
        self.open_type = None
        return [ContentBlockStopEvent(index=self.index)]

    def _start(self, block: ContentBlock) -> list[AnthropicStreamEvent]:
        events = self.close()
        self.index += 1
        self.open_type = block.type
        return events + [ContentBlockStartEvent(index=self.index, content_block=block)]

    def _extend(self, block: ContentBlock, delta: TextDelta | ThinkingDelta) -> list[AnthropicStreamEvent]:
        events = self._start(block) if self.open_type != block.type else []
        return events + [ContentBlockDeltaEvent(index=self.index, delta=delta)]

    def events(self, delta: DeltaMessage) -> list[AnthropicStreamEvent]:
        events = []
        if delta.reasoning_content:
            events += self._extend(ThinkingBlock(thinking=""), ThinkingDelta(thinking=delta.reasoning_content))
        if delta.content:
            events += self._extend(TextBlock(text=""), TextDelta(text=delta.content))
        for call in delta.tool_calls or []:
            if call.id is not None:  # a new call
                events += self._start(ToolUseBlock(id=call.id, name=call.function.name, input={}))
            if call.function.arguments:
                events.append(ContentBlockDeltaEvent(index=self.index,
                                                     delta=InputJSONDelta(partial_json=call.function.arguments)))
        return events


class AnthropicServingMessages:
    """Runs Anthropic's requests on the chat path."""

    def __init__(self, chat: ServingChat) -> None:
        self.chat = chat

    def _thinking_kwargs(self, thinking: ThinkingConfig | None) -> dict[str, bool] | None:
        """The chat-template variables that turn thinking on or off as asked; a 400 where that cannot be done."""
        if thinking is None:
            return None
        variables = chat_variables(self.chat.tokenizer) if self.chat.tokenizer is not None else frozenset()
        switches = [name for name in THINKING_SWITCHES if name in variables]
        enabled = thinking.type == "enabled"
        if not switches:
            raise OpenAIError(400, f"thinking: this model's chat template has no thinking switch (it reads neither "
                                   f"'thinking' nor 'enable_thinking'), so thinking cannot be turned "
                                   f"{'on' if enabled else 'off'}; leave thinking out", param="thinking")
        if enabled and self.chat.reasoning_parser is None:
            raise OpenAIError(400, "thinking: enabled needs the server started with --reasoning-parser, which "
                                   "returns the thinking apart from the answer", param="thinking")
        return {name: enabled for name in switches}

    async def _prepare(self, req: AnthropicCountTokensRequest) -> PreparedChat:
        return await self.chat.prepare(to_chat_request(req, self._thinking_kwargs(req.thinking)))

    async def count_tokens(self, req: AnthropicCountTokensRequest) -> AnthropicCountTokensResponse:
        return AnthropicCountTokensResponse(input_tokens=len((await self._prepare(req)).token_ids))

    async def create_messages(self, req: AnthropicMessagesRequest, raw_request: HTTPRequest
                              ) -> AnthropicMessagesResponse | Response:
        prepared = await self._prepare(req)
        message_id = f"msg_{uuid.uuid4().hex}"
        stream = self.chat.add_request(prepared.token_ids, prepared.params, message_id)
        if req.stream:
            return self._stream(prepared, stream, message_id)
        done = await self.chat.final_message(prepared, stream, raw_request)
        if done is None:
            return Response(status_code=499)  # nobody is listening
        output, message = done
        completion = output.outputs[0]
        blocks = content_blocks(message)
        reason, sequence = stop_reason(completion.finish_reason, completion.stop_reason,
                                       any(isinstance(block, ToolUseBlock) for block in blocks))
        return AnthropicMessagesResponse(id=message_id, model=self.chat.model_name, content=blocks,
                                         stop_reason=reason, stop_sequence=sequence,
                                         usage=AnthropicUsage(input_tokens=len(output.prompt_token_ids),
                                                              output_tokens=len(completion.token_ids)))

    def _stream(self, prepared: PreparedChat, stream: RequestStream, message_id: str) -> StreamingResponse:
        parser, blocks = self.chat.output(prepared), _StreamBlocks()
        sent = -1  # characters of the output already turned into events; -1: message_start not sent yet

        def events(_: int, output: RequestOutput) -> list[AnthropicStreamEvent]:
            nonlocal sent
            completion, result = output.outputs[0], []
            if sent < 0:
                usage = AnthropicUsage(input_tokens=len(output.prompt_token_ids), output_tokens=0)
                result.append(MessageStartEvent(message=AnthropicMessagesResponse(
                    id=message_id, model=self.chat.model_name, content=[], stop_reason=None, usage=usage)))
                sent = 0
            delta = parser.delta(completion.text[:sent], completion.text, completion.finished())
            sent = len(completion.text)
            if delta is not None:
                result += blocks.events(delta)
            if completion.finished():
                reason, sequence = stop_reason(completion.finish_reason, completion.stop_reason,
                                               bool(parser.call_ids))
                result += blocks.close() + [
                    MessageDeltaEvent(delta=MessageDelta(stop_reason=reason, stop_sequence=sequence),
                                      usage=MessageDeltaUsage(output_tokens=len(completion.token_ids))),
                    MessageStopEvent()]
            return result

        return self.chat.stream_response([stream], events, None, ANTHROPIC_EVENTS)
