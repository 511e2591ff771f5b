"""What completions and chat share: sampling params, prompts tokenized off the event loop, requests run to their
end or streamed as server-sent events."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterable

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from latentserve.engine.chat_renderer import TemplateKwargsError
from latentserve.engine.chat_template import check_chat_kwargs, render_chat, with_chat_template
from latentserve.engine.detokenizer import TokenizerInfo
from latentserve.engine.outputs import CompletionOutput, Logprob, LogprobsOnePosition, RequestOutput
from latentserve.sampling_params import SamplingParams
from latentserve.server.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError, RequestStream
from latentserve.server.protocol import ChatMessage, ChatTemplateFields, SamplingRequest
from latentserve.server.protocol_responses import ErrorInfo, ErrorResponse, PromptLogprob, PromptLogprobs, UsageInfo
from latentserve.server.structured_outputs import SpecError, requested_structured_outputs

Prompt = str | list[int]


class OpenAIError(Exception):
    """An error answered in OpenAI's format with an HTTP status."""

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: int | str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type, param=param, code=code if code is not None else status_code)

    def body(self) -> dict:
        return ErrorResponse(error=self.info).model_dump()


def unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, type="service_unavailable_error")


# The request fields engine errors name: the shared ones, and logprobs (completions'; chat's top_logprobs maps to it).
_PARAMS = {*SamplingRequest.model_fields, "logprobs"}


def param_named_in(message: str) -> str | None:
    """The request field a SamplingParams error message names (its messages start with or contain it)."""
    for word in message.replace("[", " ").replace("=", " ").split():
        if word.strip(":,()") in _PARAMS:
            return word.strip(":,()")
    return None


def sampling_params(req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine's SamplingParams for a request; a value the engine refuses is a 400 naming its field."""
    try:
        structured = requested_structured_outputs(req.structured_outputs, getattr(req, "response_format", None))
    except SpecError as e:
        raise OpenAIError(400, str(e), param=e.param) from e
    try:
        return SamplingParams(
            n=req.n, best_of=req.best_of, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed,
            stop=req.stop, stop_token_ids=req.stop_token_ids, bad_words=req.bad_words,
            include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
            max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else req.prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            truncate_prompt_tokens=req.truncate_prompt_tokens, logit_bias=req.logit_bias,
            allowed_token_ids=req.allowed_token_ids, structured_outputs=structured)
    except ValueError as e:
        raise OpenAIError(400, str(e), param=param_named_in(str(e))) from e


def usage(outputs: list[RequestOutput], num_hidden_tokens: int = 0) -> UsageInfo:
    """Token counts over a batch's requests; `num_hidden_tokens` generated per request are not returned."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(max(len(c.token_ids) - num_hidden_tokens, 0) for o in outputs for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def top_entries(entry: LogprobsOnePosition, k: int) -> list[tuple[int, Logprob]]:
    """The k likeliest (token id, Logprob) pairs of one position (-1: all), likeliest first."""
    return sorted(((t, lp) for t, lp in entry.items() if k == -1 or lp.rank <= k), key=lambda item: item[1].rank)


def sse(payload: BaseModel | dict) -> str:
    text = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {text}\n\n"


@dataclass(frozen=True)
class EventFormat:
    """How a stream writes its events and errors, and what closes it: OpenAI's `data:` lines and `[DONE]` by
    default (the Anthropic route writes its own)."""

    event: Callable[[BaseModel | dict], str] = sse
    error: Callable[[OpenAIError], str] = lambda error: sse(error.body())
    end: str = "data: [DONE]\n\n"


def encode(tokenizer: TokenizerInfo, text: str, add_special_tokens: bool = True) -> tuple[int, Callable[[], list[int]]]:
    """(token count, a function giving the ids) of `text`, as `TokenizerInfo.encode` tokenizes it; the count may
    miss the BOS that the ids get.

    `encode_batch` releases the GIL while it runs, so the event loop keeps going; turning a huge encoding into a
    list does not, so the caller gets the count first and the list only if it wants it.
    """
    encoding = tokenizer.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
    bos = tokenizer.bos_token_id

    def ids() -> list[int]:
        token_ids = encoding.ids
        if add_special_tokens and tokenizer.add_bos_token and bos is not None and token_ids[:1] != [bos]:
            token_ids = [bos] + token_ids
        return token_ids

    return len(encoding), ids


async def _wait_disconnect(raw_request: HTTPRequest) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


async def _last(stream: RequestStream) -> RequestOutput:
    output = None
    async for output in stream:
        pass
    return output


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from all streams as they come; an error in one ends the merge."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
        except BaseException as e:  # handed to the consumer, which raises it
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


class Serving:
    """Runs validated requests on the async engine; subclasses turn outputs into one API's bodies."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, chat_template: str | None = None,
                 default_chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.engine.tokenizer
        if chat_template is not None or default_chat_template_kwargs:
            if self.tokenizer is None:
                raise ValueError("a chat template or its kwargs were given, but the model has no tokenizer to render "
                                 "chat with")
        if chat_template is not None:
            self.tokenizer = with_chat_template(self.tokenizer, chat_template)
        self.default_chat_template_kwargs = default_chat_template_kwargs or {}
        if self.default_chat_template_kwargs:
            check_chat_kwargs(self.tokenizer, self.default_chat_template_kwargs)
        self.generation_defaults: dict = engine.engine.generation_defaults

    def with_defaults(self, req: SamplingRequest) -> SamplingRequest:
        """The request with the fields it leaves unset taken from the model's generation config
        (--generation-config), as vLLM fills them."""
        given = req.model_fields_set
        if "max_completion_tokens" in given:  # chat's other name for max_tokens
            given = given | {"max_tokens"}
        update = {name: value for name, value in self.generation_defaults.items() if name not in given}
        return req.model_copy(update=update) if update else req

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise OpenAIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                              param="model", code="model_not_found")

    async def prompt_ids(self, prompts: list[Prompt], params: SamplingParams, max_tokens: int | None,
                         param: str = "prompt", add_special_tokens: bool = True) -> list[list[int]]:
        """Each prompt's token ids (tokenized on a worker thread), truncated as asked and checked to fit in
        max_model_len together with max_tokens."""
        return await asyncio.to_thread(self._prompt_ids, prompts, params, max_tokens, param, add_special_tokens)

    def _prompt_ids(self, prompts: list[Prompt], params: SamplingParams, max_tokens: int | None, param: str,
                    add_special_tokens: bool) -> list[list[int]]:
        limit, wanted = self.engine.engine.max_model_len, max_tokens or 1
        truncate = params.truncate_prompt_tokens
        keep = None if truncate is None else limit if truncate == -1 else truncate
        result = []
        for prompt in prompts:
            if isinstance(prompt, str) and self.tokenizer is not None:
                count, ids = encode(self.tokenizer, prompt, add_special_tokens)
                if keep is None and count + wanted > limit:  # too long: refused without listing the ids
                    raise self._too_long(count, wanted, param)
                token_ids = ids()
            else:
                try:
                    token_ids = self.engine.engine.tokenize(prompt)
                except ValueError as e:
                    raise OpenAIError(400, str(e), param=param) from e
            if not token_ids:
                raise OpenAIError(400, "the prompt is empty", param=param)
            if keep is not None:
                token_ids = token_ids[-keep:]
            if len(token_ids) + wanted > limit:
                raise self._too_long(len(token_ids), wanted, param)
            result.append(token_ids)
        return result

    def _too_long(self, count: int, wanted: int, param: str) -> OpenAIError:
        limit = self.engine.engine.max_model_len
        return OpenAIError(400, f"this model's maximum context length is {limit} tokens, but the prompt has {count} "
                                f"tokens and asks for {wanted} more ({count + wanted} in all)", param=param)

    async def render(self, messages: list[ChatMessage], fields: ChatTemplateFields,
                     tools: list[dict] | None = None) -> str:
        """The conversation's prompt text (with the tools offered), rendered with the chat template on a worker
        thread as `fields` ask."""
        if self.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer: chat needs one (use /v1/completions with token ids)")
        kwargs = self.default_chat_template_kwargs | (fields.chat_template_kwargs or {})
        rendered = [m.template_message() for m in messages]
        try:
            return await asyncio.to_thread(render_chat, self.tokenizer, rendered, tools,
                                           add_generation_prompt=fields.add_generation_prompt,
                                           continue_final_message=fields.continue_final_message,
                                           chat_template_kwargs=kwargs)
        except TemplateKwargsError as e:
            raise OpenAIError(400, str(e), param="chat_template_kwargs") from e
        except ValueError as e:
            raise OpenAIError(400, str(e), param="messages") from e

    def add_request(self, token_ids: list[int], params: SamplingParams, request_id: str) -> RequestStream:
        if (params.stop or params.bad_words) and self.tokenizer is None:
            name = "stop" if params.stop else "bad_words"
            raise OpenAIError(400, f"{name} needs a tokenizer, and this model has none", param=name)
        try:
            return self.engine.add_request(token_ids, params, request_id)
        except ValueError as e:
            raise OpenAIError(400, str(e), param=param_named_in(str(e))) from e
        except (QueueFullError, EngineDeadError) as e:
            raise unavailable(str(e)) from e

    def add_requests(self, prompts: list[list[int]], params: SamplingParams, request_id: str) -> list[RequestStream]:
        """One engine request per prompt; all or none (a refusal aborts those already added)."""
        if len(prompts) == 1:
            return [self.add_request(prompts[0], params, request_id)]
        streams: list[RequestStream] = []
        try:
            for i, token_ids in enumerate(prompts):
                streams.append(self.add_request(token_ids, params, f"{request_id}-{i}"))
        except OpenAIError:
            for stream in streams:
                self.engine.abort(stream.request_id)
            raise
        return streams

    async def run_to_end(self, streams: list[RequestStream], raw_request: HTTPRequest) -> list[RequestOutput] | None:
        """Each request's final output; None (and the requests aborted) if the client went away first."""
        tasks = [asyncio.ensure_future(_last(s)) for s in streams]
        results = asyncio.ensure_future(asyncio.gather(*tasks))
        # Once the client is gone nobody reads it: its CancelledError would be logged as never retrieved.
        results.add_done_callback(lambda f: f.cancelled() or f.exception())
        disconnect = asyncio.ensure_future(_wait_disconnect(raw_request))
        try:
            await asyncio.wait({results, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            # Cancelled while waiting, the client gone, or one request failed: the others stop too.
            stop = not results.done() or results.exception() is not None
            if stop:
                for task in tasks:
                    task.cancel()
                for stream in streams:
                    if not stream.finished:
                        self.engine.abort(stream.request_id)
        if not results.done():
            return None
        try:
            outputs = results.result()
        except EngineDeadError as e:
            raise unavailable(str(e)) from e
        except ValueError as e:  # the engine refused the request
            raise OpenAIError(400, str(e), param=param_named_in(str(e))) from e
        for output in outputs:
            if output.error is not None:
                raise OpenAIError(400, output.error)
        return outputs

    def stream_response(self, streams: list[RequestStream],
                        chunks: Callable[[int, RequestOutput], Iterable[BaseModel]],
                        usage_chunk: Callable[[UsageInfo], BaseModel] | None,
                        events: EventFormat = EventFormat(), continuous_usage: bool = False) -> StreamingResponse:
        return StreamingResponse(self._events(streams, chunks, usage_chunk, events, continuous_usage),
                                 media_type="text/event-stream")

    async def _events(self, streams: list[RequestStream], chunks: Callable[[int, RequestOutput], Iterable[BaseModel]],
                      usage_chunk: Callable[[UsageInfo], BaseModel] | None, events: EventFormat,
                      continuous_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: the chunks of each output (prompt index, output), each with its prompt's usage so far
        where `continuous_usage`, the usage if asked, then the end ([DONE]), written as `events` says."""
        last: dict[int, RequestOutput] = {}
        try:
            async for i, output in merge(streams):
                if output.error is not None:
                    yield events.error(OpenAIError(400, output.error))
                    break
                last[i] = output
                for chunk in chunks(i, output):
                    if continuous_usage:
                        chunk.usage = usage([output])
                    yield events.event(chunk)
            else:
                if usage_chunk is not None:
                    yield events.event(usage_chunk(usage(list(last.values()))))
        except EngineDeadError as e:
            yield events.error(unavailable(str(e)))
        except ValueError as e:  # the engine refused the request
            yield events.error(OpenAIError(400, str(e)))
        finally:
            for stream in streams:
                if not stream.finished:  # the client went away (this generator was cancelled or closed), or an error
                    self.engine.abort(stream.request_id)
        if events.end:
            yield events.end

    def num_listed_tokens(self, completion: CompletionOutput, skip_special_tokens: bool) -> int:
        """How many of the completion's tokens its logprobs list: not the last ones, whose text a stop string cut
        from the output."""
        ids = completion.token_ids
        if not isinstance(completion.stop_reason, str) or self.tokenizer is None:
            return len(ids)
        count = len(ids)
        while count and len(self.tokenizer.decode(ids[:count - 1], skip_special_tokens)) >= len(completion.text):
            count -= 1
        return count

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @staticmethod
    def logprob_text(token_id: int, logprob: Logprob) -> str:
        """`token_text` of a token the engine decoded with its logprob."""
        return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"

    @staticmethod
    def token_label(token_id: int, text: str, as_id: bool) -> str:
        """How logprobs name a token: its text, or (vLLM's return_tokens_as_token_ids) 'token_id:<id>', which
        names tokens whose bytes are not whole characters."""
        return f"token_id:{token_id}" if as_id else text

    def prompt_logprobs(self, output: RequestOutput, k: int | None) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs: per prompt position (None at the first), token id -> logprob, rank, text."""
        if k is None or output.prompt_logprobs is None:
            return None
        result: PromptLogprobs = []
        for token_id, entry in zip(output.prompt_token_ids, output.prompt_logprobs):
            if entry is None:
                result.append(None)
                continue
            chosen = {token_id: entry[token_id], **dict(top_entries(entry, k))}
            result.append({str(t): PromptLogprob(logprob=lp.logprob, rank=lp.rank,
                                                 decoded_token=self.logprob_text(t, lp)) for t, lp in chosen.items()})
        return result
