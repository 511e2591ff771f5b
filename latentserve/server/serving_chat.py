"""POST /v1/chat/completions."""
from __future__ import annotations

from fastapi import Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse

from latentserve.engine.outputs import RequestOutput
from latentserve.engine.request import Logprobs
from latentserve.server.async_engine import RequestStream
from latentserve.engine.chat_template import chat_prompt_ids
from latentserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
    random_id,
)
from latentserve.server.serving import OpenAIError, Serving, sampling_params, top_entries, usage


class ServingChat(Serving):
    async def create(self, req: ChatCompletionRequest, raw_request: HTTPRequest) -> ChatCompletionResponse | Response:
        self.check_model(req.model)
        if self.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer: chat needs one (use /v1/completions with token ids)")
        top_k = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, req.max_new_tokens, top_k)
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in req.messages]
        try:
            prompt_ids = chat_prompt_ids(self.tokenizer, messages)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="messages") from e
        token_ids = self.tokenize(prompt_ids, req.max_new_tokens)
        request_id = random_id("chatcmpl")
        stream = self.add_request(token_ids, params, request_id)
        if req.stream:
            return self._stream(req, stream, request_id, top_k)
        output = await self.run_to_end(stream, raw_request)
        if output is None:
            return Response(status_code=499)  # nobody is listening
        completion = output.outputs[0]
        choice = ChatChoice(message=AssistantMessage(content=completion.text), finish_reason=completion.finish_reason,
                            logprobs=self._logprobs(completion.token_ids, completion.logprobs, top_k))
        return ChatCompletionResponse(id=request_id, model=self.model_name, choices=[choice], usage=usage(output))

    def _stream(self, req: ChatCompletionRequest, stream: RequestStream, request_id: str,
                top_k: int | None) -> StreamingResponse:
        sent = {"chars": 0, "tokens": 0, "role": False}

        def chunk(delta: DeltaMessage, logprobs: ChatLogprobs | None = None, finish_reason: str | None = None):
            choice = ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish_reason)
            return ChatCompletionChunk(id=request_id, model=self.model_name, choices=[choice])

        def chunks(output: RequestOutput):
            out = []
            if not sent["role"]:
                sent["role"] = True
                out.append(chunk(DeltaMessage(role="assistant", content="")))
            completion = output.outputs[0]
            delta = completion.text[sent["chars"] :]
            if delta or output.finished:
                token_ids = completion.token_ids[sent["tokens"] :]
                entries = completion.logprobs[sent["tokens"] :] if completion.logprobs is not None else None
                sent["chars"], sent["tokens"] = len(completion.text), len(completion.token_ids)
                out.append(chunk(DeltaMessage(content=delta), self._logprobs(token_ids, entries, top_k),
                                 completion.finish_reason))
            return out

        def usage_chunk(info: UsageInfo) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, model=self.model_name, choices=[], usage=info)

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return self.stream_response(stream, chunks, usage_chunk if include_usage else None)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
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
