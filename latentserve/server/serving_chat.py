"""POST /v1/chat/completions."""
from __future__ import annotations

import asyncio

from fastapi import Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse

from latentserve.engine.chat_template import render_chat
from latentserve.engine.outputs import RequestOutput
from latentserve.engine.request import Logprobs
from latentserve.engine.reasoning import ReasoningParser
from latentserve.server.async_engine import RequestStream
from latentserve.server.chat_output import assistant_message, delta_message
from latentserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
    random_id,
)
from latentserve.server.serving import OpenAIError, Serving, sampling_params, top_entries, usage


class ServingChat(Serving):
    @property
    def reasoning_parser(self) -> ReasoningParser | None:
        return getattr(self.engine.engine, "reasoning_parser", None)

    async def create(self, req: ChatCompletionRequest, raw_request: HTTPRequest) -> ChatCompletionResponse | Response:
        self.check_model(req.model)
        top_k = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, req.max_new_tokens, top_k)
        prompt = await self.render(req.messages)
        token_ids = (await self.prompt_ids([prompt], params, req.max_new_tokens, "messages", False))[0]
        request_id = random_id("chatcmpl")
        stream = self.add_request(token_ids, params, request_id)
        if req.stream:
            return self._stream(req, stream, request_id, top_k)
        outputs = await self.run_to_end([stream], raw_request)
        if outputs is None:
            return Response(status_code=499)  # nobody is listening
        output = outputs[0]
        choices = [ChatChoice(index=c.index, message=assistant_message(c.text, self.reasoning_parser),
                              finish_reason=c.finish_reason,
                              stop_reason=c.stop_reason, logprobs=self._logprobs(c.token_ids, c.logprobs, top_k))
                   for c in output.outputs]
        return ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage(outputs),
                                      prompt_logprobs=self.prompt_logprobs(output, req.prompt_logprobs))

    async def render(self, messages: list[ChatMessage]) -> str:
        """The conversation's prompt text, rendered with the chat template on a worker thread."""
        if self.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer: chat needs one (use /v1/completions with token ids)")
        rendered = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages]
        try:
            return await asyncio.to_thread(render_chat, self.tokenizer, rendered)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="messages") from e

    def _stream(self, req: ChatCompletionRequest, stream: RequestStream, request_id: str,
                top_k: int | None) -> StreamingResponse:
        sent: dict[int, tuple[int, int]] = {}  # choice index -> (chars, tokens) sent

        def chunk(index: int, delta: DeltaMessage, logprobs: ChatLogprobs | None = None,
                  finish_reason: str | None = None) -> ChatCompletionChunk:
            choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
            return ChatCompletionChunk(id=request_id, model=self.model_name, choices=[choice])

        def chunks(_: int, output: RequestOutput) -> list[ChatCompletionChunk]:
            out = []
            for completion in output.outputs:
                if completion.index not in sent:
                    sent[completion.index] = (0, 0)
                    out.append(chunk(completion.index, DeltaMessage(role="assistant", content="")))
                chars, tokens = sent[completion.index]
                delta = delta_message(completion.text[:chars], completion.text, completion.finished(),
                                      self.reasoning_parser)
                if delta is not None or completion.finished():
                    token_ids = completion.token_ids[tokens:]
                    entries = completion.logprobs[tokens:] if completion.logprobs is not None else None
                    sent[completion.index] = (len(completion.text), len(completion.token_ids))
                    out.append(chunk(completion.index, delta or DeltaMessage(content=""),
                                     self._logprobs(token_ids, entries, top_k), completion.finish_reason))
            return out

        def usage_chunk(info: UsageInfo) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, model=self.model_name, choices=[], usage=info)

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return self.stream_response([stream], chunks, usage_chunk if include_usage else None)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    def _logprobs(self, token_ids: list[int], entries: list[Logprobs] | None, k: int | None) -> ChatLogprobs | None:
        if entries is None or k is None:
            return None
        content = []
        for token_id, entry in zip(token_ids, entries):
            chosen = self._top(token_id, entry[token_id])
            top = [self._top(t, lp) for t, lp in top_entries(entry, k)]
            content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)
