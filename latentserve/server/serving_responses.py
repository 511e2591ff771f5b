"""POST /v1/responses: OpenAI's Responses API (stateless) over the chat path, as /v1/messages serves Anthropic's. A
request is translated into the chat request that serving_chat renders, plans tools for and runs; its output, split by
the same ChatOutput, comes back as the Responses output items, or streamed as the Responses events."""
from __future__ import annotations

import uuid
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from latentserve.engine.chat_reasoning import join_reasoning
from latentserve.engine.outputs import RequestOutput
from latentserve.server.async_engine import RequestStream
from latentserve.server.protocol import ChatCompletionRequest
from latentserve.server.protocol_responses import AssistantMessage, DeltaMessage, now
from latentserve.server.responses_protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    FunctionCallOutput,
    FunctionToolChoice,
    IncompleteDetails,
    InputMessage,
    InputTokensDetails,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningItem,
    ReasoningText,
    ResponseEvent,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
    StreamEvent,
    TextConfig,
    TextDeltaEvent,
    TextDoneEvent,
)
from latentserve.server.serving import EventFormat, OpenAIError, encode
from latentserve.server.serving_chat import PreparedChat, ServingChat


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def chat_messages(req: ResponsesRequest) -> list[dict]:
    """The input as chat messages: the instructions first as a system message; function_call items as the tool
    calls of an assistant message (joined to the assistant's text just before them, as the chat path's assistant
    message holds both), function_call_output items as tool messages; reasoning items as the reasoning_content of the
    assistant message that the item after them makes or joins."""
    messages: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    reasoning: list[str] = []  # reasoning items waiting for their turn
    for item in items:
        if item.type == "reasoning":
            reasoning.append(item.text())
            continue
        if item.type == "message":
            messages.append({"role": item.role, "content": item.chat_content()})
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant":
                last["tool_calls"] = (last.get("tool_calls") or []) + [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        if reasoning:  # the request checked this item is the assistant's: messages[-1] is the turn it made or joined
            turn = messages[-1]
            earlier = [turn["reasoning_content"]] if "reasoning_content" in turn else []
            turn["reasoning_content"] = join_reasoning(earlier + reasoning)
            reasoning = []
    return messages


def _response_format(text: TextConfig | None) -> dict | None:
    """The text format as chat's response_format."""
    if text is None or text.format is None:
        return None
    if text.format.type != "json_schema":
        return {"type": text.format.type}
    schema = text.format
    return {"type": "json_schema", "json_schema": {"name": schema.name, "schema": schema.json_schema,
                                                   "description": schema.description, "strict": schema.strict}}


# The Responses sampling fields and chat's names for them (the rest keep the model's generation defaults).
_SAMPLING = {"max_output_tokens": "max_completion_tokens", "temperature": "temperature", "top_p": "top_p",
             "parallel_tool_calls": "parallel_tool_calls", "metadata": "metadata", "user": "user"}


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that runs `req`; what chat refuses is a 400 as the request's own errors are."""
    fields: dict[str, Any] = {"model": req.model, "messages": chat_messages(req),
                              "response_format": _response_format(req.text)}
    if req.tools is not None:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                           for tool in req.tools]
    if isinstance(req.tool_choice, FunctionToolChoice):
        fields["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        fields["tool_choice"] = req.tool_choice
    fields |= {chat: getattr(req, ours) for ours, chat in _SAMPLING.items() if getattr(req, ours) is not None}
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from e


def output_items(message: AssistantMessage) -> list[OutputItem]:
    """The chat answer as output items: reasoning, the message, then the function calls."""
    items: list[OutputItem] = []
    if message.reasoning_content:
        items.append(ReasoningItem(id=_item_id("rs"), content=[ReasoningText(text=message.reasoning_content)]))
    if message.content:
        items.append(OutputMessage(id=_item_id("msg"), content=[OutputText(text=message.content)]))
    items += [FunctionCallOutput(id=_item_id("fc"), call_id=call.id, name=call.function.name,
                                 arguments=call.function.arguments) for call in message.tool_calls]
    return items


class _Sequence:
    """Writes a stream's events as the Responses API does: numbered in order, each named on an `event:` line."""

    def __init__(self) -> None:
        self.next = 0

    def sse(self, event: StreamEvent) -> str:
        event.sequence_number, self.next = self.next, self.next + 1
        return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"

    def error(self, error: OpenAIError) -> str:
        code = error.info.code if error.info.code is not None else error.info.type
        return self.sse(ErrorEvent(code=str(code), message=error.info.message, param=error.info.param))


class _StreamItems:
    """The output items a stream opens and closes as the output's deltas come: one per run of reasoning or text, one
    per function call; `done` holds the closed ones, as the final response lists them."""

    def __init__(self) -> None:
        self.done: list[OutputItem] = []
        self.open: OutputItem | None = None

    def close(self, status: str = "completed") -> list[StreamEvent]:
        """Close the open item as `status` (incomplete: the output was cut while it was being written)."""
        item, index = self.open, len(self.done)
        if item is None:
            return []
        self.open, item.status = None, status
        self.done.append(item)
        if isinstance(item, FunctionCallOutput):
            events: list[StreamEvent] = [ArgumentsDoneEvent(item_id=item.id, output_index=index, name=item.name,
                                                            arguments=item.arguments)]
        else:
            part = item.content[0]
            done = ReasoningDoneEvent(type="response.reasoning_text.done", item_id=item.id, output_index=index,
                                      text=part.text) if isinstance(item, ReasoningItem) else \
                TextDoneEvent(type="response.output_text.done", item_id=item.id, output_index=index, text=part.text)
            events = [done, ContentPartEvent(type="response.content_part.done", item_id=item.id, output_index=index,
                                             part=part.model_copy())]
        # Copies: an event is written after the chunk's other events, by which time the open item has grown.
        return events + [OutputItemEvent(type="response.output_item.done", output_index=index,
                                         item=item.model_copy(deep=True))]

    def _start(self, item: OutputItem) -> list[StreamEvent]:
        events, index = self.close(), len(self.done)
        item.status, self.open = "in_progress", item
        events.append(OutputItemEvent(type="response.output_item.added", output_index=index,
                                      item=item.model_copy(deep=True)))
        if not isinstance(item, FunctionCallOutput):
            events.append(ContentPartEvent(type="response.content_part.added", item_id=item.id, output_index=index,
                                           part=item.content[0].model_copy()))
        return events

    def _extend(self, kind: type[ReasoningItem] | type[OutputMessage], text: str) -> list[StreamEvent]:
        events = []
        if not isinstance(self.open, kind):
            events = self._start(ReasoningItem(id=_item_id("rs"), content=[ReasoningText(text="")])
                                 if kind is ReasoningItem else OutputMessage(id=_item_id("msg"),
                                                                             content=[OutputText(text="")]))
        item, index = self.open, len(self.done)
        item.content[0].text += text
        if kind is ReasoningItem:
            return events + [ReasoningDeltaEvent(type="response.reasoning_text.delta", item_id=item.id,
                                                 output_index=index, delta=text)]
        return events + [TextDeltaEvent(type="response.output_text.delta", item_id=item.id, output_index=index,
                                        delta=text)]

    def events(self, delta: DeltaMessage) -> list[StreamEvent]:
        events = []
        if delta.reasoning_content:
            events += self._extend(ReasoningItem, delta.reasoning_content)
        if delta.content:
            events += self._extend(OutputMessage, delta.content)
        for call in delta.tool_calls or []:
            if call.id is not None:  # a new call
                events += self._start(FunctionCallOutput(id=_item_id("fc"), call_id=call.id, name=call.function.name,
                                                         arguments=""))
            if call.function.arguments:
                self.open.arguments += call.function.arguments
                events.append(ArgumentsDeltaEvent(item_id=self.open.id, output_index=len(self.done),
                                                  delta=call.function.arguments))
        return events


class ServingResponses:
    """Runs Responses requests on the chat path."""

    def __init__(self, chat: ServingChat) -> None:
        self.chat = chat

    def _usage(self, output: RequestOutput, items: list[OutputItem]) -> ResponseUsage:
        """The usage; reasoning tokens are the reasoning text's as the tokenizer encodes it (the engine counts the
        output's tokens, not where the reasoning ends)."""
        output_tokens = len(output.outputs[0].token_ids)
        reasoning = "".join(item.content[0].text for item in items if isinstance(item, ReasoningItem))
        reasoning_tokens = encode(self.chat.tokenizer, reasoning, add_special_tokens=False)[0] if reasoning else 0
        return ResponseUsage(input_tokens=len(output.prompt_token_ids), output_tokens=output_tokens,
                             total_tokens=len(output.prompt_token_ids) + output_tokens,
                             input_tokens_details=InputTokensDetails(cached_tokens=output.num_cached_tokens),
                             output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens))

    def _response(self, req: ResponsesRequest, prepared: PreparedChat, response_id: str, created_at: int,
                  output: RequestOutput | None, items: list[OutputItem]) -> ResponsesResponse:
        """The response so far (`output` None: not started), echoing the request's settings, the sampling ones
        with the model's defaults filled in."""
        finish_reason = output.outputs[0].finish_reason if output is not None else None
        status = "in_progress" if output is None or not output.finished else \
            "incomplete" if finish_reason == "length" else "completed"
        return ResponsesResponse(
            id=response_id, created_at=created_at, status=status, model=self.chat.model_name, output=items,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            usage=self._usage(output, items) if status != "in_progress" else None, instructions=req.instructions,
            max_output_tokens=req.max_output_tokens, metadata=req.metadata,
            parallel_tool_calls=req.parallel_tool_calls is not False, temperature=prepared.req.temperature,
            top_p=prepared.req.top_p, tool_choice=req.tool_choice or ("auto" if req.tools else "none"),
            tools=req.tools or [], text=req.text or TextConfig(format={"type": "text"}), user=req.user)

    async def create(self, req: ResponsesRequest, raw_request: HTTPRequest) -> ResponsesResponse | Response:
        prepared = await self.chat.prepare(to_chat_request(req))
        response_id, created_at = _item_id("resp"), now()
        stream = self.chat.add_request(prepared.token_ids, prepared.params, response_id)
        if req.stream:
            return self._stream(req, prepared, stream, response_id, created_at)
        done = await self.chat.final_message(prepared, stream, raw_request)
        if done is None:
            return Response(status_code=499)  # nobody is listening
        output, message = done
        items = output_items(message)
        if items and output.outputs[0].finish_reason == "length":
            items[-1].status = "incomplete"  # cut while it was being written, as OpenAI marks it
        return self._response(req, prepared, response_id, created_at, output, items)

    def _stream(self, req: ResponsesRequest, prepared: PreparedChat, stream: RequestStream, response_id: str,
                created_at: int) -> StreamingResponse:
        parser, items, sequence = self.chat.output(prepared), _StreamItems(), _Sequence()
        sent = -1  # characters of the output already turned into events; -1: response.created not sent yet

        def events(_: int, output: RequestOutput) -> list[StreamEvent]:
            nonlocal sent
            completion, result = output.outputs[0], []
            if sent < 0:
                started = self._response(req, prepared, response_id, created_at, None, [])
                result += [ResponseEvent(type="response.created", response=started),
                           ResponseEvent(type="response.in_progress", response=started.model_copy())]
                sent = 0
            delta = parser.delta(completion.text[:sent], completion.text, completion.finished())
            sent = len(completion.text)
            if delta is not None:
                result += items.events(delta)
            if completion.finished():
                result += items.close("incomplete" if completion.finish_reason == "length" else "completed")
                final = self._response(req, prepared, response_id, created_at, output, items.done)
                result.append(ResponseEvent(type=f"response.{final.status}", response=final))
            return result

        return self.chat.stream_response([stream], events, None, EventFormat(event=sequence.sse,
                                                                              error=sequence.error, end=""))
