"""What a request's output must match (vLLM's `StructuredOutputsParams`): one of a JSON schema, any JSON object,
a regex, a choice list or an EBNF grammar. Only the shape is checked here; the grammar engine checks the spec."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema (text or parsed)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF dialect), with a `root` rule
    json_object: bool | None = None  # any JSON object
    # Compact JSON (no whitespace between tokens): small models loop on whitespace when the grammar allows any.
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            named = ", ".join(given) if given else "none"
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got {named}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (object or string), got {type(self.json).__name__}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise ValueError(f"structured_outputs.choice must be a list of strings, got {self.choice!r}")
            if not self.choice:
                raise ValueError("structured_outputs.choice must not be empty: no output could match")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice entries must be non-empty strings, got {self.choice!r}")
            object.__setattr__(self, "choice", list(self.choice))
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """Identifies the compiled grammar: equal keys share one compilation."""
        value = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return self.kind, text, self.disable_any_whitespace

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StructuredOutputsParams":
        """From a request body's `structured_outputs` object; unknown fields are refused by name."""
        if not isinstance(data, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unsupported fields {unknown}; supported: {sorted(known)}")
        return cls(**data)
