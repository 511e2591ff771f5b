"""POST /v1/completions."""
from __future__ import annotations

from fastapi import Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse

from latentserve.engine.outputs import CompletionOutput, LogprobsOnePosition, RequestOutput
from latentserve.server.async_engine import RequestStream
from latentserve.server.protocol import CompletionRequest, answer_id, random_id
from latentserve.server.protocol_responses import CompletionChoice, CompletionLogprobs, CompletionResponse, UsageInfo
from latentserve.server.serving import Serving, sampling_params, top_entries, usage


class ServingCompletion(Serving):
    async def create(self, req: CompletionRequest, raw_request: HTTPRequest) -> CompletionResponse | Response:
        self.check_model(req.model)
        req = self.with_defaults(req)
        # echo with max_tokens=0 scores the prompt: the request generates one token, which is not returned.
        max_tokens = 1 if req.max_tokens == 0 else req.max_tokens
        prompt_k = req.prompt_logprobs
        if req.echo and req.logprobs is not None:  # the echoed prompt lists its top logprobs too
            prompt_k = -1 if prompt_k == -1 else max(req.logprobs, prompt_k or 0)
        params = sampling_params(req, max_tokens, req.logprobs, prompt_k)
        prompts = await self.prompt_ids(req.prompts, params, max_tokens, add_special_tokens=req.add_special_tokens)
        request_id = random_id("cmpl")
        response_id = answer_id(request_id, "cmpl", req)
        streams = self.add_requests(prompts, params, request_id)
        if req.stream:
            return self._stream(req, streams, response_id)
        outputs = await self.run_to_end(streams, raw_request)
        if outputs is None:
            return Response(status_code=499)  # nobody is listening
        hidden = int(req.max_tokens == 0)
        choices = [self._choice(req, i, output, completion, hidden)
                   for i, output in enumerate(outputs) for completion in output.outputs]
        return CompletionResponse(id=response_id, model=self.model_name, choices=choices, usage=usage(outputs, hidden))

    def _choice(self, req: CompletionRequest, prompt_index: int, output: RequestOutput, completion: CompletionOutput,
                hidden: int) -> CompletionChoice:
        listed = self.num_listed_tokens(completion, req.skip_special_tokens)
        token_ids = completion.token_ids[: min(listed, len(completion.token_ids) - hidden)]
        entries = completion.logprobs[: len(token_ids)] if completion.logprobs is not None else None
        text = "" if hidden else completion.text
        logprobs = None
        if req.echo:
            prompt_text = self._prompt_text(req, prompt_index, output)
            logprobs = self._echo_logprobs(output, req.logprobs, req.return_tokens_as_token_ids)
            text = prompt_text + text
            offset = len(prompt_text)
        else:
            offset = 0
        generated = self._logprobs(token_ids, entries, req.logprobs, offset, req.return_tokens_as_token_ids)
        if generated is not None:
            logprobs = generated if logprobs is None else _concat(logprobs, generated)
        ids = req.return_token_ids
        return CompletionChoice(index=prompt_index * req.n + completion.index, text=text, logprobs=logprobs,
                                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                                prompt_logprobs=self.prompt_logprobs(output, req.prompt_logprobs),
                                prompt_token_ids=output.prompt_token_ids if ids else None,
                                token_ids=completion.token_ids[:len(completion.token_ids) - hidden] if ids else None)

    def _prompt_text(self, req: CompletionRequest, prompt_index: int, output: RequestOutput) -> str:
        prompt = req.prompts[prompt_index]
        if isinstance(prompt, str) and req.truncate_prompt_tokens is None:
            return prompt
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=req.skip_special_tokens)

    def _echo_logprobs(self, output: RequestOutput, k: int | None, as_ids: bool) -> CompletionLogprobs | None:
        """The prompt's tokens in OpenAI's legacy logprobs (the first token has no logprob)."""
        if k is None or output.prompt_logprobs is None:
            return None
        result, offset = CompletionLogprobs(), 0
        for token_id, entry in zip(output.prompt_token_ids, output.prompt_logprobs):
            text = self.token_text(token_id)
            result.tokens.append(self.token_label(token_id, text, as_ids))
            result.token_logprobs.append(None if entry is None else entry[token_id].logprob)
            result.top_logprobs.append(None if entry is None else self._top(entry, k, as_ids))
            result.text_offset.append(offset)
            offset += len(text)
        return result

    def _stream(self, req: CompletionRequest, streams: list[RequestStream], response_id: str) -> StreamingResponse:
        sent: dict[int, tuple[int, int]] = {}  # choice index -> (chars, tokens) sent

        def chunks(prompt_index: int, output: RequestOutput) -> list[CompletionResponse]:
            result = []
            for completion in output.outputs:
                index = prompt_index * req.n + completion.index
                first = index not in sent
                echo = req.echo and first
                chars, tokens = sent.get(index, (0, 0))
                delta = completion.text[chars:]
                if not delta and not echo and not completion.finished():
                    continue
                listed = self.num_listed_tokens(completion, req.skip_special_tokens)
                token_ids = completion.token_ids[tokens:listed]
                entries = completion.logprobs[tokens:listed] if completion.logprobs is not None else None
                logprobs = self._logprobs(token_ids, entries, req.logprobs, chars, req.return_tokens_as_token_ids)
                sent[index] = (len(completion.text), len(completion.token_ids))
                if echo:
                    delta = self._prompt_text(req, prompt_index, output) + delta
                    prompt_logprobs = self._echo_logprobs(output, req.logprobs, req.return_tokens_as_token_ids)
                    if prompt_logprobs is not None and logprobs is not None:
                        logprobs = _concat(prompt_logprobs, logprobs)
                ids = req.return_token_ids
                choice = CompletionChoice(index=index, text=delta, logprobs=logprobs,
                                          finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                                          prompt_token_ids=output.prompt_token_ids if ids and first else None,
                                          token_ids=completion.token_ids[tokens:] if ids else None)
                result.append(CompletionResponse(id=response_id, model=self.model_name, choices=[choice]))
            return result

        def usage_chunk(info: UsageInfo) -> CompletionResponse:
            return CompletionResponse(id=response_id, model=self.model_name, choices=[], usage=info)

        options = req.stream_options
        include_usage = options is not None and options.include_usage
        return self.stream_response(streams, chunks, usage_chunk if include_usage else None,
                                    continuous_usage=options is not None and options.continuous_usage_stats)

    def _logprobs(self, token_ids: list[int], entries: list[LogprobsOnePosition] | None, k: int | None,
                  offset: int, as_ids: bool) -> CompletionLogprobs | None:
        """OpenAI's legacy logprobs: each token's text (or id: `as_ids`), logprob, top-k alternatives and text
        offset."""
        if entries is None or k is None:
            return None
        result = CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries):
            chosen = entry[token_id]
            text = self.logprob_text(token_id, chosen)
            result.tokens.append(self.token_label(token_id, text, as_ids))
            result.token_logprobs.append(chosen.logprob)
            result.top_logprobs.append(self._top(entry, k, as_ids))
            result.text_offset.append(offset)
            offset += len(text)
        return result

    def _top(self, entry: LogprobsOnePosition, k: int, as_ids: bool) -> dict[str, float]:
        return {self.token_label(t, self.logprob_text(t, lp), as_ids): lp.logprob for t, lp in top_entries(entry, k)}


def _concat(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=first.tokens + second.tokens,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              top_logprobs=first.top_logprobs + second.top_logprobs,
                              text_offset=first.text_offset + second.text_offset)
