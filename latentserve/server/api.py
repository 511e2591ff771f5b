"""The FastAPI app: OpenAI routes (the stateless Responses API among them) and Anthropic's /v1/messages, health,
metrics, API key, draining, and errors in OpenAI's format (Anthropic's on its route)."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from latentserve.server.anthropic_protocol import (
    AnthropicCountTokensRequest,
    AnthropicCountTokensResponse,
    AnthropicErrorResponse,
    AnthropicMessagesRequest,
    AnthropicMessagesResponse,
    anthropic_error,
)
from latentserve.server.async_engine import AsyncLLMEngine, Engine
from latentserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from latentserve.server.responses_protocol import ResponsesRequest, ResponsesResponse
from latentserve.server.protocol_responses import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from latentserve.server.serving import OpenAIError, unavailable
from latentserve.server.serving_chat import ServingChat
from latentserve.server.serving_completion import ServingCompletion
from latentserve.server.serving_messages import AnthropicServingMessages
from latentserve.server.serving_responses import ServingResponses
from latentserve.server.serving_tokens import ServingTokens
from latentserve.server.tool_parsers import get_tool_parser

logger = logging.getLogger(__name__)

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 408, 413, 503)}
_ANTHROPIC_ERRORS = {status: {"model": AnthropicErrorResponse} for status in _ERRORS}
# Anthropic's routes: their errors are in Anthropic's shape, and their clients send the API key as x-api-key.
ANTHROPIC_PREFIX = "/v1/messages"
# Largest request body by default: room for a prompt far past any context window, small enough to parse quickly.
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
# Seconds a request body may stall before its end.
DEFAULT_BODY_READ_TIMEOUT = 30.0


@dataclass
class ServerState:
    """What the HTTP layer and the process's shutdown share."""

    draining: bool = False  # set on SIGTERM: new requests get 503
    in_flight: int = 0  # HTTP requests being answered, streams included


@dataclass(frozen=True)
class CORS:
    """Which browser origins may call the server (vLLM's --allowed-origins and friends)."""

    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


class _Gate:
    """ASGI middleware: refuses requests while draining (503) or without the API key (401); counts in-flight ones."""

    def __init__(self, app: ASGIApp, state: ServerState, api_key: str | None) -> None:
        self.app = app
        self.state = state
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.state.draining:
            error = unavailable("the server is shutting down")
        elif self.api_key is not None and scope["path"].startswith("/v1") and not self._authorized(scope):
            how = "'Authorization: Bearer <key>' or 'x-api-key: <key>'" if _is_anthropic(scope["path"]) else \
                "'Authorization: Bearer <key>'"
            error = OpenAIError(401, f"missing or wrong API key (send {how})", type="authentication_error",
                                code="invalid_api_key")
        else:
            self.state.in_flight += 1
            try:
                return await self.app(scope, receive, send)
            finally:
                self.state.in_flight -= 1
        await _error_response(error, scope["path"])(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        key = self.api_key.encode()
        if _is_anthropic(scope["path"]) and b"x-api-key" in headers:
            return hmac.compare_digest(headers[b"x-api-key"], key)
        return hmac.compare_digest(headers.get(b"authorization", b""), b"Bearer " + key)


class _BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413, refused from its Content-Length or as it streams;
    one that stops arriving for `read_timeout` seconds before its end gets 408 (else a client that sends less than its
    Content-Length would hold the connection forever)."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_bytes:
            return await _error_response(self._error(), scope["path"])(scope, receive, send)
        received, body_done = 0, False

        async def limited_receive() -> dict:
            nonlocal received, body_done
            if body_done:  # afterwards the app waits for the disconnect, as long as the response takes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout)
            except asyncio.TimeoutError:
                raise StarletteHTTPException(408, f"the request body stopped arriving: nothing for {self.read_timeout}"
                                                  " s before its end") from None
            received += len(message.get("body", b""))
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            if received > self.max_bytes:
                raise StarletteHTTPException(413, self._error().info.message)
            return message

        await self.app(scope, limited_receive, send)

    def _error(self) -> OpenAIError:
        return OpenAIError(413, f"the request body is larger than this server's limit of {self.max_bytes} bytes "
                                "(--max-request-bytes)", code="request_too_large")


def _is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def _error_response(error: OpenAIError, path: str) -> JSONResponse:
    """The error in the format of the API `path` belongs to."""
    body = anthropic_error(error).model_dump() if _is_anthropic(path) else error.body()
    return JSONResponse(body, status_code=error.status_code)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        if err.get("type") == "extra_forbidden":
            parts.append(f"unrecognized request argument supplied: {'.'.join(loc)}")
            param = param or (loc[-1] if loc else None)
            continue
        field = err.get("ctx", {}).get("field")  # our validators name the field they refuse
        param = param or field or (loc[0] if loc else None)
        message = str(err.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{'.'.join(loc)}: {message}" if loc and not field else message)
    return "; ".join(parts) or "invalid request", param


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return _error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error_response(OpenAIError(400, message, param=param), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error_response(OpenAIError(exc.status_code, str(exc.detail), type=error_type), request.url.path)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error")
        return _error_response(OpenAIError(500, f"internal error: {exc!r}", type="server_error"), request.url.path)


def _version() -> str:
    try:
        return version("latentserve")
    except PackageNotFoundError:
        return "unknown"


def build_app(engine: Engine, model_name: str, api_key: str | None = None, max_waiting: int | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, metrics_prefix: str = "latentserve",
              tool_call_parser: str | None = None, body_read_timeout: float = DEFAULT_BODY_READ_TIMEOUT,
              chat_template: str | None = None, cors: CORS | None = None,
              default_chat_template_kwargs: dict | None = None) -> FastAPI:
    """The OpenAI-compatible app over `engine` (one process's, or the front end of data-parallel ranks); its
    lifespan starts and stops the engine thread. `chat_template` replaces the tokenizer's, and
    `default_chat_template_kwargs` are its variables where a request gives none; `cors` None sends no CORS headers
    (browsers then refuse other origins' pages)."""
    async_engine = AsyncLLMEngine(engine, max_waiting, model_name, metrics_prefix)
    state = ServerState()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="latentserve", summary="OpenAI-compatible server for MLA models", lifespan=lifespan)
    app.state.engine = async_engine
    app.state.server_state = state
    app.add_middleware(_BodyLimit, max_bytes=max_request_bytes, read_timeout=body_read_timeout)
    app.add_middleware(_Gate, state=state, api_key=api_key)
    if cors is not None:  # outermost: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins, allow_methods=cors.allowed_methods,
                           allow_headers=cors.allowed_headers, allow_credentials=cors.allow_credentials)
    _add_error_handlers(app)
    completions = ServingCompletion(async_engine, model_name)
    tool_parser = get_tool_parser(tool_call_parser)() if tool_call_parser is not None else None
    chat = ServingChat(async_engine, model_name, tool_parser, chat_template, default_chat_template_kwargs)
    messages = AnthropicServingMessages(chat)
    responses = ServingResponses(chat)
    tokens = ServingTokens(async_engine, model_name, chat_template, default_chat_template_kwargs)
    card = ModelCard(id=model_name, max_model_len=engine.max_model_len)

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> dict:
        if not async_engine.is_alive:
            raise unavailable("the engine is not running")
        return {"status": "ok"}

    @app.get("/ping", responses={503: {"model": ErrorResponse}})
    async def ping() -> Response:
        """As /health, with an empty body (vLLM's, for SageMaker)."""
        await health()
        return Response(status_code=200)

    app.add_api_route("/ping", ping, methods=["POST"], operation_id="ping_post",
                      responses={503: {"model": ErrorResponse}})

    @app.get("/version")
    async def get_version() -> VersionResponse:
        return VersionResponse(version=_version())

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(async_engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=_ERRORS)
    async def models() -> ModelList:
        return ModelList(data=[card])

    @app.get("/v1/models/{model_id:path}", responses=_ERRORS)
    async def model(model_id: str) -> ModelCard:
        completions.check_model(model_id)
        return card

    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        return await tokens.tokenize(req)

    @app.post("/detokenize", responses=_ERRORS)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        return await tokens.detokenize(req)

    @app.post("/v1/completions", responses=_ERRORS, response_model=CompletionResponse)
    async def create_completion(req: CompletionRequest, raw_request: Request):
        return await completions.create(req, raw_request)

    @app.post("/v1/chat/completions", responses=_ERRORS, response_model=ChatCompletionResponse)
    async def create_chat_completion(req: ChatCompletionRequest, raw_request: Request):
        return await chat.create(req, raw_request)

    @app.post("/v1/responses", responses=_ERRORS, response_model=ResponsesResponse)
    async def create_response(req: ResponsesRequest, raw_request: Request):
        """OpenAI's Responses API, stateless: nothing is stored."""
        return await responses.create(req, raw_request)

    @app.post(ANTHROPIC_PREFIX, responses=_ANTHROPIC_ERRORS, response_model=AnthropicMessagesResponse)
    async def create_messages(req: AnthropicMessagesRequest, raw_request: Request):
        """Anthropic's Messages API."""
        return await messages.create_messages(req, raw_request)

    @app.post(f"{ANTHROPIC_PREFIX}/count_tokens", responses=_ANTHROPIC_ERRORS)
    async def count_tokens(req: AnthropicCountTokensRequest) -> AnthropicCountTokensResponse:
        return await messages.count_tokens(req)

    return app
