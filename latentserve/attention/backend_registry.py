"""Enum-based backend registries, shared by prefill and decode backends (vLLM's registry shape).

A member's value is the backend's class path. `CUSTOM` has none until registered; `register()`
adds members at run time; overrides replace a member's class path without changing its name.
"""
from __future__ import annotations

import enum
import importlib
import re
from typing import Any, Callable

_OVERRIDES: dict[enum.Enum, str] = {}
_NAME_RE = re.compile(r"^[A-Z][A-Z0-9_]*$")


def _import_class(class_path: str) -> type:
    module_name, _, class_name = class_path.rpartition(".")
    if not module_name:
        raise ValueError(f"class path {class_path!r} must look like 'package.module.ClassName'")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"cannot import backend class {class_path!r}: {e}") from e


class BackendEnum(enum.Enum):
    """Base for backend registries; subclasses list their built-in members."""

    @classmethod
    def lookup(cls, name: str) -> "BackendEnum":
        """The member called `name` (case-insensitive)."""
        try:
            return cls[name.upper()]
        except KeyError:
            valid = ", ".join(m.name for m in cls)
            raise ValueError(f"unknown {cls.__name__} name {name!r}; valid names: {valid}") from None

    @classmethod
    def register(cls, name: str, class_path: str) -> "BackendEnum":
        """Add a new member at run time."""
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"invalid backend name {name!r}: use UPPER_SNAKE_CASE letters, digits and '_'")
        if name in cls.__members__:
            raise ValueError(f"{cls.__name__} member {name!r} already exists")
        if not class_path:
            raise ValueError(f"backend {name!r} needs a class path")
        member = object.__new__(cls)
        member._name_ = name
        member._value_ = class_path
        cls._member_map_[name] = member
        cls._member_names_.append(name)
        cls._value2member_map_.setdefault(class_path, member)
        type.__setattr__(cls, name, member)
        return member

    def get_path(self) -> str:
        path = _OVERRIDES.get(self, self.value)
        if not path:
            raise ValueError(f"{type(self).__name__}.{self.name} must be registered before use")
        return path

    def get_class(self) -> type:
        return _import_class(self.get_path())

    def is_overridden(self) -> bool:
        return self in _OVERRIDES

    def clear_override(self) -> None:
        _OVERRIDES.pop(self, None)

    def set_override(self, class_path: str) -> None:
        _OVERRIDES[self] = class_path


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def make_register_function(enum_cls: type[BackendEnum]) -> Callable[..., Any]:
    """`register(member_or_name, class_path=None)`: a direct call, or a class decorator when no path is given.

    An existing member is overridden; a new name becomes a new member.
    """

    def register(member_or_name: BackendEnum | str, class_path: str | None = None) -> Any:
        def apply(path: str) -> BackendEnum:
            if isinstance(member_or_name, enum_cls):
                member_or_name.set_override(path)
                return member_or_name
            if not isinstance(member_or_name, str):
                raise TypeError(f"expected a {enum_cls.__name__} member or a name, got {member_or_name!r}")
            if member_or_name.upper() in enum_cls.__members__:
                member = enum_cls[member_or_name.upper()]
                member.set_override(path)
                return member
            return enum_cls.register(member_or_name, path)

        if class_path is not None:
            return apply(class_path)

        def decorator(cls: type) -> type:
            apply(_class_path(cls))
            return cls

        return decorator

    register.__name__ = f"register_{enum_cls.__name__}"
    return register
