"""POST /v1/chat/completions."""
from __future__ import annotations

from dataclasses import dataclass, replace

from fastapi import Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse

from latentserve.engine.outputs import Logprob, LogprobsOnePosition, RequestOutput
from latentserve.engine.reasoning import ReasoningParser, parser_for_prompt
from latentserve.engine.structured.backend import build_grammar
from latentserve.sampling_params import SamplingParams
from latentserve.server.async_engine import AsyncLLMEngine, RequestStream
from latentserve.server.chat_output import ChatOutput
from latentserve.server.protocol import ChatCompletionRequest, answer_id, random_id
from latentserve.server.protocol_responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
)
from latentserve.server.serving import OpenAIError, Serving, sampling_params, top_entries, usage
from latentserve.server.tool_parsers import ToolParser
from latentserve.server.tools import ToolPlan, plan_tools


@dataclass(frozen=True)
class PreparedChat:
    """A chat request ready for the engine."""

    req: ChatCompletionRequest  # with the model's generation defaults filled in
    params: SamplingParams
    plan: ToolPlan
    token_ids: list[int]  # the rendered prompt's
    reasoning_parser: ReasoningParser | None  # None also where the prompt already closed the reasoning

    @property
    def top_k(self) -> int | None:
        return _top_k(self.req)


def _top_k(req: ChatCompletionRequest) -> int | None:
    """How many top logprobs each token lists; None: no logprobs."""
    return (req.top_logprobs or 0) if req.logprobs else None


class ServingChat(Serving):
    def __init__(self, engine: AsyncLLMEngine, model_name: str, tool_parser: ToolParser | None = None,
                 chat_template: str | None = None, default_chat_template_kwargs: dict | None = None) -> None:
        super().__init__(engine, model_name, chat_template, default_chat_template_kwargs)
        self.tool_parser = tool_parser

    @property
    def reasoning_parser(self) -> ReasoningParser | None:
        return getattr(self.engine.engine, "reasoning_parser", None)

    async def prepare(self, req: ChatCompletionRequest) -> PreparedChat:
        """Everything before the engine runs the request: its sampling params and tool plan, the rendered prompt's
        token ids and the reasoning parser for them (also what /v1/messages runs, translated into a chat request)."""
        self.check_model(req.model)
        req = self.with_defaults(req)
        params = sampling_params(req, req.max_new_tokens, _top_k(req))
        plan = self._plan_tools(req)
        if plan.structured_outputs is not None:
            params = replace(params, structured_outputs=plan.structured_outputs)
        prompt = await self.render(req.messages, req, plan.tools)
        token_ids = (await self.prompt_ids([prompt], params, req.max_new_tokens, "messages",
                                           req.add_special_tokens))[0]
        return PreparedChat(req, params, plan, token_ids, parser_for_prompt(self.reasoning_parser, token_ids))

    def output(self, prepared: PreparedChat) -> ChatOutput:
        """A new parser of one choice's output text."""
        return ChatOutput(prepared.reasoning_parser, prepared.plan, self.tool_parser)

    async def final_message(self, prepared: PreparedChat, stream: RequestStream,
                            raw_request: HTTPRequest) -> tuple[RequestOutput, AssistantMessage] | None:
        """A one-choice request run to its end, and its choice parsed (the other APIs' answers); None when the client
        went away."""
        outputs = await self.run_to_end([stream], raw_request)
        if outputs is None:
            return None
        completion = outputs[0].outputs[0]
        return outputs[0], self.output(prepared).message(completion.text, completion.finish_reason)[0]

    async def create(self, req: ChatCompletionRequest, raw_request: HTTPRequest) -> ChatCompletionResponse | Response:
        prepared = await self.prepare(req)
        req, top_k = prepared.req, prepared.top_k
        request_id = random_id("chatcmpl")
        response_id = answer_id(request_id, "chatcmpl", req)
        stream = self.add_request(prepared.token_ids, prepared.params, request_id)
        if req.stream:
            return self._stream(prepared, stream, response_id)
        outputs = await self.run_to_end([stream], raw_request)
        if outputs is None:
            return Response(status_code=499)  # nobody is listening
        output, ids = outputs[0], req.return_token_ids
        choices = []
        for c in output.outputs:
            message, finish_reason = self.output(prepared).message(c.text, c.finish_reason)
            listed = self.num_listed_tokens(c, req.skip_special_tokens)
            choices.append(ChatChoice(index=c.index, message=message, finish_reason=finish_reason,
                                      stop_reason=c.stop_reason,
                                      logprobs=self._logprobs(c.token_ids, c.logprobs, top_k, listed,
                                                              req.return_tokens_as_token_ids),
                                      token_ids=c.token_ids if ids else None))
        return ChatCompletionResponse(id=response_id, model=self.model_name, choices=choices, usage=usage(outputs),
                                      prompt_logprobs=self.prompt_logprobs(output, req.prompt_logprobs),
                                      prompt_token_ids=output.prompt_token_ids if ids else None)

    def _plan_tools(self, req: ChatCompletionRequest) -> ToolPlan:
        try:
            plan = plan_tools(req, self.tool_parser)
            if plan.structured_outputs is not None:
                build_grammar(plan.structured_outputs)
        except ValueError as e:
            param = "tools" if "structured_outputs.json" in str(e) or req.tool_choice is None else "tool_choice"
            raise OpenAIError(400, str(e).replace("structured_outputs.json", "tools parameters"), param=param) from e
        return plan

    def _stream(self, prepared: PreparedChat, stream: RequestStream, response_id: str) -> StreamingResponse:
        req, top_k = prepared.req, prepared.top_k
        sent: dict[int, tuple[int, int]] = {}  # choice index -> (chars, tokens) sent
        parsers: dict[int, ChatOutput] = {}
        ids = req.return_token_ids

        def chunk(index: int, delta: DeltaMessage, logprobs: ChatLogprobs | None = None,
                  finish_reason: str | None = None, token_ids: list[int] | None = None,
                  prompt_token_ids: list[int] | None = None) -> ChatCompletionChunk:
            choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                                     token_ids=token_ids)
            return ChatCompletionChunk(id=response_id, model=self.model_name, choices=[choice],
                                       prompt_token_ids=prompt_token_ids)

        def chunks(_: int, output: RequestOutput) -> list[ChatCompletionChunk]:
            out = []
            for completion in output.outputs:
                if completion.index not in sent:
                    sent[completion.index] = (0, 0)
                    parsers[completion.index] = self.output(prepared)
                    out.append(chunk(completion.index, DeltaMessage(role="assistant", content=""),
                                     token_ids=[] if ids else None,
                                     prompt_token_ids=output.prompt_token_ids if ids else None))
                parser = parsers[completion.index]
                chars, tokens = sent[completion.index]
                delta = parser.delta(completion.text[:chars], completion.text, completion.finished())
                if delta is not None or completion.finished():
                    token_ids = completion.token_ids[tokens:]
                    entries = completion.logprobs[tokens:] if completion.logprobs is not None else None
                    listed = self.num_listed_tokens(completion, req.skip_special_tokens) - tokens
                    sent[completion.index] = (len(completion.text), len(completion.token_ids))
                    out.append(chunk(completion.index, delta or DeltaMessage(content=""),
                                     self._logprobs(token_ids, entries, top_k, listed, req.return_tokens_as_token_ids),
                                     parser.finish_reason(completion.finish_reason, parser.call_ids),
                                     token_ids if ids else None))
            return out

        def usage_chunk(info: UsageInfo) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=response_id, model=self.model_name, choices=[], usage=info)

        options = req.stream_options
        include_usage = options is not None and options.include_usage
        return self.stream_response([stream], chunks, usage_chunk if include_usage else None,
                                    continuous_usage=options is not None and options.continuous_usage_stats)

    def _top(self, token_id: int, logprob: Logprob, as_id: bool) -> TopLogprob:
        text = self.logprob_text(token_id, logprob)
        return TopLogprob(token=self.token_label(token_id, text, as_id), logprob=logprob.logprob,
                          bytes=list(text.encode()))

    def _logprobs(self, token_ids: list[int], entries: list[LogprobsOnePosition] | None, k: int | None,
                  listed: int, as_ids: bool) -> ChatLogprobs | None:
        """The first `listed` tokens' logprobs in chat's shape (tokens named by id: `as_ids`)."""
        if entries is None or k is None:
            return None
        content = []
        for token_id, entry in zip(token_ids[:max(listed, 0)], entries):
            chosen = self._top(token_id, entry[token_id], as_ids)
            top = [self._top(t, lp, as_ids) for t, lp in top_entries(entry, k)]
            content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)
