"""Enum-based backend registries, shared by prefill and decode backends (vLLM's registry semantics).

A member's value is the backend's class path. `CUSTOM` has none until registered; `register()` adds members
at run time; an override replaces the class path a member resolves to without changing its name.
"""
from __future__ import annotations

import enum
import importlib
from typing import Any, Callable

_OVERRIDES: dict[enum.Enum, str] = {}


def _import_class(class_path: str) -> type:
    module_name, _, class_name = class_path.rpartition(".")
    if not module_name:
        raise ValueError(f"class path {class_path!r} must look like 'package.module.ClassName'")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"cannot import backend class {class_path!r}: {e}") from e


class _BackendEnumMeta(enum.EnumMeta):
    """`Enum[name]` of an unknown name raises ValueError listing the valid names, as vLLM's registries do."""

    def __getitem__(cls, name: str) -> Any:
        try:
            return super().__getitem__(name)
        except KeyError:
            valid = ", ".join(cls.__members__)
            raise ValueError(f"unknown {cls.__name__} name {name!r}; valid names: {valid}") from None


class BackendEnum(enum.Enum, metaclass=_BackendEnumMeta):
    """Base for backend registries; subclasses list their built-in members."""

    @classmethod
    def lookup(cls, name: str) -> "BackendEnum":
        """The member called `name`, else the one called `name.upper()`."""
        members = cls.__members__
        return members[name] if name in members else cls[name.upper()]

    @classmethod
    def register(cls, name: str, class_path: str) -> "BackendEnum":
        """Add a new member at run time; its value may be "" when a decorator override supplies the class."""
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
            raise ValueError(f"invalid backend name {name!r}: use a Python identifier not starting with '_'")
        if name in cls.__members__:
            raise ValueError(f"{cls.__name__} member {name!r} already exists; override it by passing the member")
        if hasattr(cls, name):
            raise ValueError(f"invalid backend name {name!r}: {cls.__name__}.{name} is reserved")
        member = object.__new__(cls)
        member._name_ = name
        member._value_ = class_path
        cls._member_map_[name] = member
        cls._member_names_.append(name)
        if class_path:  # "" is CUSTOM's value: a lookup by value must keep finding CUSTOM
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


def make_register_function(enum_cls: type[BackendEnum]) -> Callable[..., Callable[[type], type]]:
    """`register(member_or_name, class_path=None)`, with vLLM's semantics.

    The backend is overridden to `class_path`, or, used as a class decorator without one, to the decorated
    class. A new name first becomes a member (value `class_path`, or "" in the decorator form, so that
    `clear_override()` leaves it unregistered); an existing name overrides that member. Returns a decorator
    (the identity when `class_path` is given), so both forms also work as `@register(...)`.
    """

    def register(member_or_name: BackendEnum | str, class_path: str | None = None) -> Callable[[type], type]:
        if isinstance(member_or_name, str):
            members = enum_cls.__members__
            name = member_or_name if member_or_name in members else member_or_name.upper()
            member = members[name] if name in members else enum_cls.register(member_or_name, class_path or "")
        elif isinstance(member_or_name, enum_cls):
            member = member_or_name
        else:
            raise TypeError(f"expected a {enum_cls.__name__} member or a name, got {member_or_name!r}")

        if class_path is not None:
            member.set_override(class_path)
            return lambda cls: cls

        def decorator(cls: type) -> type:
            member.set_override(_class_path(cls))
            return cls

        return decorator

    register.__name__ = f"register_{enum_cls.__name__}"
    return register
