"""What completions and chat share: sampling params, running a request to its end or as a server-sent stream."""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable, Iterable

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from latentserve.engine.outputs import RequestOutput
from latentserve.engine.request import Logprobs
from latentserve.sampling_params import SamplingParams
from latentserve.server.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError, RequestStream
from latentserve.server.protocol import ErrorInfo, ErrorResponse, SamplingRequest, UsageInfo


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


def sampling_params(req: SamplingRequest, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    try:
        return SamplingParams(n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                              max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
                              ignore_eos=req.ignore_eos, logprobs=logprobs)
    except ValueError as e:
        raise OpenAIError(400, str(e)) from e


def usage(output: RequestOutput) -> UsageInfo:
    prompt, completion = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def top_entries(entry: Logprobs, k: int) -> list[tuple[int, float]]:
    """The k likeliest (token id, logprob) pairs of one position, likeliest first."""
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def sse(payload: BaseModel | dict) -> str:
    text = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {text}\n\n"


async def _wait_disconnect(raw_request: HTTPRequest) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


async def _last(stream: RequestStream) -> RequestOutput:
    output = None
    async for output in stream:
        pass
    return output


class Serving:
    """Runs validated requests on the async engine; subclasses turn outputs into one API's bodies."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.engine.tokenizer

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise OpenAIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                              param="model", code="model_not_found")

    def tokenize(self, prompt: str | list[int], max_tokens: int | None) -> list[int]:
        """Prompt token ids, checked to fit in max_model_len together with max_tokens."""
        try:
            token_ids = self.engine.engine.tokenize(prompt)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="prompt") from e
        if not token_ids:
            raise OpenAIError(400, "the prompt is empty", param="prompt")
        limit = self.engine.engine.max_model_len
        wanted = len(token_ids) + (max_tokens or 1)
        if wanted > limit:
            raise OpenAIError(400, f"this model's maximum context length is {limit} tokens, but the prompt has "
                                   f"{len(token_ids)} tokens and asks for {max_tokens or 1} more ({wanted} in all)",
                              param="prompt")
        return token_ids

    def add_request(self, token_ids: list[int], params: SamplingParams, request_id: str) -> RequestStream:
        if params.stop and self.tokenizer is None:
            raise OpenAIError(400, "stop strings need a tokenizer, and this model has none", param="stop")
        try:
            return self.engine.add_request(token_ids, params, request_id)
        except ValueError as e:
            raise OpenAIError(400, str(e)) from e
        except (QueueFullError, EngineDeadError) as e:
            raise unavailable(str(e)) from e

    async def run_to_end(self, stream: RequestStream, raw_request: HTTPRequest) -> RequestOutput | None:
        """The final output; None (and the request aborted) if the client went away first."""
        result = asyncio.ensure_future(_last(stream))
        disconnect = asyncio.ensure_future(_wait_disconnect(raw_request))
        try:
            await asyncio.wait({result, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            if not result.done():
                result.cancel()
                self.engine.abort(stream.request_id)
        if not result.done() or result.cancelled():
            return None
        try:
            output = result.result()
        except EngineDeadError as e:
            raise unavailable(str(e)) from e
        except ValueError as e:  # the scheduler refused the request
            raise OpenAIError(400, str(e)) from e
        if output.error is not None:
            raise OpenAIError(400, output.error)
        return output

    def stream_response(self, stream: RequestStream, chunks: Callable[[RequestOutput], Iterable[BaseModel]],
                        usage_chunk: Callable[[UsageInfo], BaseModel] | None) -> StreamingResponse:
        return StreamingResponse(self._events(stream, chunks, usage_chunk), media_type="text/event-stream")

    async def _events(self, stream: RequestStream, chunks: Callable[[RequestOutput], Iterable[BaseModel]],
                      usage_chunk: Callable[[UsageInfo], BaseModel] | None) -> AsyncIterator[str]:
        """Server-sent events: the chunks of each output, the usage if asked, then [DONE]."""
        try:
            async for output in stream:
                if output.error is not None:
                    yield sse(OpenAIError(400, output.error).body())
                    break
                for chunk in chunks(output):
                    yield sse(chunk)
                if output.finished and usage_chunk is not None:
                    yield sse(usage_chunk(usage(output)))
        except EngineDeadError as e:
            yield sse(unavailable(str(e)).body())
        except ValueError as e:  # the scheduler refused the request
            yield sse(OpenAIError(400, str(e)).body())
        finally:
            if not stream.finished:  # the client went away (this generator was cancelled or closed)
                self.engine.abort(stream.request_id)
        yield "data: [DONE]\n\n"
