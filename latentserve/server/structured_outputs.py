"""A request's output constraint: OpenAI's `response_format` or vLLM's `structured_outputs` field, checked up front
(a bad spec is a 400 naming the field, before the request reaches the engine)."""
from __future__ import annotations

from latentserve.engine.structured.backend import build_grammar
from latentserve.server.protocol import ResponseFormat
from latentserve.structured_params import StructuredOutputsParams


class SpecError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _from_response_format(fmt: ResponseFormat) -> StructuredOutputsParams | None:
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.type == "json_schema":
        # Without a schema, json_schema asks for any JSON object (as vLLM).
        schema = fmt.json_schema.json_schema
        return StructuredOutputsParams(json=schema) if schema is not None else StructuredOutputsParams(json_object=True)
    return None


def requested_structured_outputs(structured_outputs: dict | None,
                                 response_format: ResponseFormat | None) -> StructuredOutputsParams | None:
    """The constraint a request asks for, its spec parsed (a cheap check; compiling is the engine's); SpecError
    names the field at fault."""
    by_format = _from_response_format(response_format) if response_format is not None else None
    if structured_outputs is not None and by_format is not None:
        raise SpecError("send one of structured_outputs and response_format, not both", "structured_outputs")
    if by_format is not None:
        param, params = "response_format", by_format
    elif structured_outputs is not None:
        param = "structured_outputs"
        try:
            params = StructuredOutputsParams.from_dict(structured_outputs)
        except (ValueError, TypeError) as e:
            raise SpecError(str(e), param) from e
    else:
        return None
    try:
        build_grammar(params)
    except ValueError as e:
        message = str(e)
        if param == "response_format":
            message = message.replace("structured_outputs.json", "response_format.json_schema.schema", 1)
        raise SpecError(message, param) from e
    return params
