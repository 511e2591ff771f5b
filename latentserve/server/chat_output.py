"""An assistant's output text as OpenAI's message and streamed deltas: reasoning split off by the reasoning parser,
tool calls found by the request's tool plan."""
from __future__ import annotations

from latentserve.engine.reasoning import ReasoningParser
from latentserve.server.protocol_responses import AssistantMessage, DeltaMessage
from latentserve.server.tool_parsers import ToolParser
from latentserve.server.tool_protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall, \
    random_tool_call_id
from latentserve.server.tools import ToolPlan


def _grown(old: str | None, new: str | None) -> str | None:
    old, new = old or "", new or ""
    if not new.startswith(old):
        raise ValueError("chat output: the parsed text did not grow by appending")
    return new[len(old):] or None


class ChatOutput:
    """One choice's output; streaming keeps what was sent (the calls and their ids)."""

    def __init__(self, reasoning_parser: ReasoningParser | None, plan: ToolPlan, tool_parser: ToolParser | None) -> None:
        self.reasoning_parser = reasoning_parser
        self.plan = plan
        self.tool_parser = tool_parser
        self.call_ids: list[str] = []
        self.sent_arguments = 0  # a named call's argument characters streamed

    def _parse(self, text: str, partial: bool) -> tuple[str | None, str | None, list[FunctionCall]]:
        """(reasoning, content, calls)."""
        reasoning, answer = None, text
        if self.reasoning_parser is not None:
            reasoning, answer = self.reasoning_parser.extract_reasoning(text, partial)
        content, calls = self.plan.parse(answer, self.tool_parser, partial)
        return reasoning, content, calls

    def finish_reason(self, reason: str | None, calls: list) -> str | None:
        """OpenAI's: "tool_calls" when auto or required calls ended the output, "stop" for a named function."""
        return "tool_calls" if reason == "stop" and calls and self.plan.mode in ("auto", "required") else reason

    def message(self, text: str, reason: str | None) -> tuple[AssistantMessage, str | None]:
        reasoning, content, calls = self._parse(text, partial=False)
        message = AssistantMessage(content=content, reasoning_content=reasoning, reasoning=reasoning,
                                   tool_calls=[ToolCall(function=c) for c in calls])
        return message, self.finish_reason(reason, calls)

    def delta(self, previous_text: str, text: str, finished: bool) -> DeltaMessage | None:
        """What `text` adds to `previous_text` (the output so far); None if nothing yet."""
        old_reasoning, old_content, _ = self._parse(previous_text, partial=True)
        reasoning, content, calls = self._parse(text, partial=not finished)
        reasoning_delta = _grown(old_reasoning, reasoning)
        content_delta = _grown(old_content, content) if self.plan.mode != "named" else None
        tool_deltas = self._tool_deltas(calls)
        if reasoning_delta is None and content_delta is None and not tool_deltas:
            return None
        return DeltaMessage(content=content_delta, reasoning_content=reasoning_delta, reasoning=reasoning_delta,
                            tool_calls=tool_deltas or None)

    def _tool_deltas(self, calls: list[FunctionCall]) -> list[DeltaToolCall]:
        deltas = []
        if self.plan.mode == "named":  # one call whose arguments grow
            arguments = calls[0].arguments
            new = arguments[self.sent_arguments:]
            if not self.call_ids:
                self.call_ids.append(random_tool_call_id())
                deltas.append(DeltaToolCall(index=0, id=self.call_ids[0], type="function",
                                            function=DeltaFunctionCall(name=calls[0].name, arguments=new)))
            elif new:
                deltas.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=new)))
            self.sent_arguments = len(arguments)
            return deltas
        for index in range(len(self.call_ids), len(calls)):  # whole calls, as each one closes
            self.call_ids.append(random_tool_call_id())
            deltas.append(DeltaToolCall(index=index, id=self.call_ids[index], type="function",
                                        function=DeltaFunctionCall(name=calls[index].name,
                                                                   arguments=calls[index].arguments)))
        return deltas
