"""POST /v1/completions."""
from __future__ import annotations

from fastapi import Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse

from latentserve.engine.outputs import RequestOutput
from latentserve.engine.request import Logprobs
from latentserve.server.async_engine import RequestStream
from latentserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from latentserve.server.serving import Serving, sampling_params, top_entries, usage


class ServingCompletion(Serving):
    async def create(self, req: CompletionRequest, raw_request: HTTPRequest) -> CompletionResponse | Response:
        self.check_model(req.model)
        params = sampling_params(req, req.max_tokens, req.logprobs)
        token_ids = self.tokenize(req.prompt, req.max_tokens)
        request_id = random_id("cmpl")
        stream = self.add_request(token_ids, params, request_id)
        if req.stream:
            return self._stream(req, stream, request_id)
        output = await self.run_to_end(stream, raw_request)
        if output is None:
            return Response(status_code=499)  # nobody is listening
        completion = output.outputs[0]
        choice = CompletionChoice(text=completion.text, finish_reason=completion.finish_reason,
                                  logprobs=self._logprobs(completion.token_ids, completion.logprobs, req.logprobs, 0))
        return CompletionResponse(id=request_id, model=self.model_name, choices=[choice], usage=usage(output))

    def _stream(self, req: CompletionRequest, stream: RequestStream, request_id: str) -> StreamingResponse:
        sent = {"chars": 0, "tokens": 0}

        def chunks(output: RequestOutput):
            completion = output.outputs[0]
            delta = completion.text[sent["chars"] :]
            if not delta and not output.finished:
                return []
            token_ids = completion.token_ids[sent["tokens"] :]
            entries = completion.logprobs[sent["tokens"] :] if completion.logprobs is not None else None
            logprobs = self._logprobs(token_ids, entries, req.logprobs, sent["chars"])
            sent["chars"], sent["tokens"] = len(completion.text), len(completion.token_ids)
            choice = CompletionChoice(text=delta, logprobs=logprobs, finish_reason=completion.finish_reason)
            return [CompletionResponse(id=request_id, model=self.model_name, choices=[choice])]

        def usage_chunk(info: UsageInfo) -> CompletionResponse:
            return CompletionResponse(id=request_id, model=self.model_name, choices=[], usage=info)

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return self.stream_response(stream, chunks, usage_chunk if include_usage else None)

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, token_ids: list[int], entries: list[Logprobs] | None, k: int | None,
                  offset: int) -> CompletionLogprobs | None:
        """OpenAI's legacy logprobs: each token's text, logprob, top-k alternatives and text offset."""
        if entries is None or k is None:
            return None
        result = CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries):
            text = self._token_text(token_id)
            result.tokens.append(text)
            result.token_logprobs.append(entry[token_id])
            result.top_logprobs.append({self._token_text(t): lp for t, lp in top_entries(entry, k)})
            result.text_offset.append(offset)
            offset += len(text)
        return result
