"""`Fields`: typed, named access to a raw `config.json` dict, for the config parser and the architecture adapters."""
from __future__ import annotations

from typing import Any

REQUIRED = object()


class Fields:
    """Typed, named access to the raw config dict; every failure names the field."""

    def __init__(self, raw: dict[str, Any], where: str = "config.json") -> None:
        self.raw = raw
        self.where = where

    def _get(self, name: str, default: Any) -> Any:
        if name not in self.raw or (self.raw[name] is None and default is not REQUIRED):
            if default is REQUIRED:
                raise ValueError(f"{self.where}: missing required field {name!r}")
            return default
        return self.raw[name]

    def int(self, name: str, default: Any = REQUIRED, minimum: int = 1) -> Any:
        value = self._get(name, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{self.where}: field {name!r} must be an int >= {minimum}, got {value!r}")
        return value

    def float(self, name: str, default: Any = REQUIRED, positive: bool = True) -> Any:
        value = self._get(name, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and value <= 0):
            kind = "a positive number" if positive else "a number"
            raise ValueError(f"{self.where}: field {name!r} must be {kind}, got {value!r}")
        return float(value)

    def bool(self, name: str, default: Any = REQUIRED) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise ValueError(f"{self.where}: field {name!r} must be true or false, got {value!r}")
        return value

    def str(self, name: str, default: Any = REQUIRED) -> str:
        value = self._get(name, default)
        if not isinstance(value, str):
            raise ValueError(f"{self.where}: field {name!r} must be a string, got {value!r}")
        return value
