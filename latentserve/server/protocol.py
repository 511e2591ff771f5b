"""OpenAI API request bodies (the subset latentserve serves) and their shared validators, as pydantic models.

The response bodies are in `protocol_responses`."""
from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator
from pydantic_core import PydanticCustomError

from latentserve.engine.chat_reasoning import turn_reasoning, with_reasoning
from latentserve.server.tool_protocol import ChatTool, NamedToolChoice, ToolCallIn, ToolChoice

# logit_bias values beyond this magnitude are refused (OpenAI's range).
MAX_LOGIT_BIAS = 100.0
# Parallel samples per request at most (n and best_of): each holds its own KV blocks and decode slot.
MAX_SAMPLES = 16
# OpenAI and vLLM fields latentserve knows but does not implement: refused with a 400 naming them, never ignored.
UNSUPPORTED = {
    "suffix": "suffix is not supported: this server has no fill-in-the-middle mode",
    "functions": "functions are not supported yet",
    "function_call": "function_call is not supported yet",
    "guided_json": "vLLM's older guided_json is not supported: send structured_outputs={\"json\": ...}",
    "guided_regex": "vLLM's older guided_regex is not supported: send structured_outputs={\"regex\": ...}",
    "guided_choice": "vLLM's older guided_choice is not supported: send structured_outputs={\"choice\": ...}",
    "guided_grammar": "vLLM's older guided_grammar is not supported: send structured_outputs={\"grammar\": ...}",
    "use_beam_search": "beam search is not supported",
    "length_penalty": "length_penalty is not supported (it applies to beam search)",
    "reasoning_effort": "reasoning_effort is not supported",
    "audio": "audio output is not supported",
    "modalities": "modalities other than text are not supported",
    "prediction": "predicted outputs are not supported",
}


def refuse_unsupported(data: dict, unsupported: dict[str, str]) -> dict:
    """`data` without the fields of `unsupported` (name -> why) set to null, which ask for nothing; a 400 naming the
    first one set to anything else (a field known and not implemented is refused, never ignored)."""
    for name, reason in unsupported.items():
        if data.get(name) is not None:
            raise PydanticCustomError("unsupported", "{field}: " + reason, {"field": name})
    return {k: v for k, v in data.items() if not (k in unsupported and v is None)}


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def answer_id(engine_id: str, prefix: str, req: SamplingRequest) -> str:
    """The id an answer carries: `prefix-<request_id>` when the request names one (vLLM's field), else the engine's
    id; the engine's ids stay unique whatever clients send."""
    return engine_id if req.request_id is None else f"{prefix}-{req.request_id}"


def find_lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string in `value` (JSON data) that is not valid Unicode, or None."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, list):
        # A prompt of token ids can have a million items: only those that may hold a string are visited.
        items = ((i, x) for i, x in enumerate(value) if type(x) is not int) if value else ()
    else:
        items = value.items() if isinstance(value, dict) else ()
    for key, item in items:
        if isinstance(key, str) and find_lone_surrogate(key) is not None:
            return path or "body"
        found = find_lone_surrogate(item, f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]")
        if found is not None:
            return found.lstrip(".")
    return None


class StrictModel(BaseModel):
    """Unknown fields are refused (400), NaN and infinities too. Booleans are StrictBool: OpenAI refuses "yes" or 1
    for true, which pydantic would take."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class EchoedModel(StrictModel):
    """A part of a conversation that clients send back as they received it (a content block, an output item). A key
    set to null that this server does not know is dropped: newer clients add optional fields, echoed back empty,
    which ask for nothing; any other unknown key is refused."""

    @model_validator(mode="before")
    @classmethod
    def _drop_unknown_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in cls.model_fields}
        return data


class UnicodeModel(StrictModel):
    """A request body: a string in it that is not valid Unicode (a lone surrogate, which JSON can carry and no
    tokenizer can encode) is refused by its path."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        path = find_lone_surrogate(data)
        if path is not None:
            raise PydanticCustomError("lone_surrogate", "{field}: the string is not valid Unicode (a lone surrogate)",
                                      {"field": path})
        return data


class StreamOptions(StrictModel):
    include_usage: StrictBool = False  # a last chunk with the usage
    continuous_usage_stats: StrictBool = False  # vLLM's: every chunk carries its prompt's usage so far

    @model_validator(mode="after")
    def _usage_first(self):
        if self.continuous_usage_stats and not self.include_usage:
            raise PydanticCustomError("stream_options", "{field}: continuous_usage_stats needs include_usage=true",
                                      {"field": "stream_options"})
        return self


class JsonSchemaFormat(StrictModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    name: str = Field(max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = Field(None, description="outputs always match the schema: true and false are the same here")


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_format(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("response_format", "{field}: json_schema is required with type 'json_schema' "
                                      "and only allowed with it", {"field": "response_format"})
        return self


class SamplingRequest(UnicodeModel):
    """The sampling fields that completions and chat share (OpenAI's, then vLLM's extensions)."""

    model: str
    n: int = Field(1, ge=1, le=MAX_SAMPLES, description="choices returned per prompt")
    best_of: int | None = Field(None, ge=1, le=MAX_SAMPLES, description="samples generated per prompt (>= n)")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    temperature: float = Field(1.0, ge=0.0, le=1e6)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="accepted and not used (OpenAI's end-user id)")
    metadata: dict[str, str] | None = Field(None, description="accepted and not used")
    store: StrictBool | None = Field(None, description="accepted and not used: nothing is stored")
    # vLLM's extensions
    top_k: int = Field(0, ge=-1, description="0 or -1: no top-k")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=1e6)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: StrictBool = False
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: StrictBool = False
    allowed_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    return_token_ids: StrictBool = Field(False, description="the choices' token ids (and the prompt's) in the answer")
    return_tokens_as_token_ids: StrictBool = Field(False, description="logprobs name tokens as 'token_id:<id>'")
    request_id: str | None = Field(None, min_length=1, max_length=256, description="the answer's id ends with it")
    priority: int = Field(0, description="only 0: requests are scheduled first come, first served")
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="keep the last k prompt tokens (-1: all fit)")
    prompt_logprobs: int | None = Field(None, ge=-1, description="-1: the whole vocabulary")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's: one of json (a schema), regex, choice, grammar, json_object")

    @model_validator(mode="before")
    @classmethod
    def _check_raw(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return refuse_unsupported(data, {k: v for k, v in UNSUPPORTED.items() if k not in cls.model_fields})

    @model_validator(mode="after")
    def _check_common(self):
        for token, bias in (self.logit_bias or {}).items():
            if abs(bias) > MAX_LOGIT_BIAS:
                raise PydanticCustomError("logit_bias", "logit_bias: values must be in [-100, 100], got {bias} for "
                                          "token {token}", {"field": "logit_bias", "bias": bias, "token": token})
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if self.priority != 0:
            raise PydanticCustomError("priority", "{field}: latentserve schedules requests first come, first served "
                                      "(vLLM's default policy), so only 0 is taken", {"field": "priority"})
        if self.best_of is not None and self.best_of < self.n:
            raise PydanticCustomError("best_of", "best_of: must be >= n, got n={n} and best_of={best_of}",
                                      {"field": "best_of", "n": self.n, "best_of": self.best_of})
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise PydanticCustomError("best_of", "best_of: cannot be larger than n when streaming",
                                      {"field": "best_of"})
        return self


# Tried left to right: smart-mode unions validate a million-id prompt ten times slower. Strict ints, so that a
# list of numeric strings stays a batch of text prompts.
Prompt = str | list[StrictInt] | list[list[StrictInt]] | list[str]


class CompletionRequest(SamplingRequest):
    prompt: Prompt = Field(union_mode="left_to_right",
                           description="a string, a list of token ids, or a batch of either")
    max_tokens: int | None = Field(16, ge=0, description="0 only with echo: score the prompt, generate nothing")
    logprobs: int | None = Field(None, ge=0)
    echo: StrictBool = False
    add_special_tokens: StrictBool = True

    @model_validator(mode="after")
    def _check_completion(self):
        if self.prompt in ("", []) or (isinstance(self.prompt, list) and "" in self.prompt):
            raise PydanticCustomError("prompt", "prompt: the prompt is empty", {"field": "prompt"})
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError("max_tokens", "max_tokens: 0 is only allowed with echo=true",
                                      {"field": "max_tokens"})
        if self.max_tokens == 0 and self.stream:
            raise PydanticCustomError("max_tokens", "max_tokens: 0 is not allowed with stream=true",
                                      {"field": "max_tokens"})
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: one prompt per element (a single prompt is a batch of one)."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages: the calls it made
    tool_call_id: str | None = None  # tool messages: the call this is the result of
    # Assistant messages: the turn's reasoning sent back, for the template to keep or drop (`reasoning` is its newer
    # name; both with different text are refused).
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _check_tool_fields(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls is only allowed in assistant messages")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool messages need a tool_call_id, and only they may have one")
        turn_reasoning(self.role, self.reasoning_content, self.reasoning)
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template gets it: content as text, the reasoning under both its names."""
        reasoning = turn_reasoning(self.role, self.reasoning_content, self.reasoning)
        return with_reasoning(self.model_dump(exclude_none=True) | {"content": self.text()}, reasoning)


class ChatTemplateFields(UnicodeModel):
    """How chat messages are rendered (vLLM's fields): `chat_template_kwargs` are more variables for the template
    (e.g. DeepSeek-V3.1's `thinking`, GLM's `enable_thinking`), over the server's --default-chat-template-kwargs."""

    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_ending(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise PydanticCustomError("continue_final_message", "{field}: needs add_generation_prompt=false",
                                      {"field": "continue_final_message"})
        return self


class ChatCompletionRequest(SamplingRequest, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI: use max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=-1, description="-1: the whole vocabulary")
    add_special_tokens: StrictBool = Field(False, description="the template writes the special tokens itself")
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = Field(None, description="default: auto with tools, none without")
    parallel_tool_calls: StrictBool | None = Field(None, description="false: at most one call")

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise PydanticCustomError("tools", "{field}: function names must be unique", {"field": "tools"})
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise PydanticCustomError("tool_choice", "{field}: needs tools", {"field": "tool_choice"})
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise PydanticCustomError("tool_choice", "{field}: no tool is named '{name}'",
                                      {"field": "tool_choice", "name": choice.function.name})
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(ChatTemplateFields):
    """vLLM's POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        chat_only = sorted(self.model_fields_set & ChatTemplateFields.model_fields.keys())
        if self.prompt is not None and chat_only:
            raise PydanticCustomError("chat_only", "{field}: renders messages; this request sends a prompt",
                                      {"field": chat_only[0]})
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]
