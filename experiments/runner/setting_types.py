"""A system's settings checked against its constructor's annotations before it is built, so that a value of the
wrong type (`system.sink=abc`) is one line naming the setting rather than a TypeError from deep in the class,
and so that a sweep refuses it before its first job. Only plain annotations are checked (int, float, bool, str,
None and unions of them); a setting annotated otherwise, or not at all, is the class's to check. A class whose
constructor takes **settings names the dataclass that reads them in `settings_class` (CLO: CLOConfig)."""

from __future__ import annotations

import functools
import inspect
import types
import typing
from typing import Any

from kvoffload.errors import ConfigError

PLAIN = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}


def fits(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, kind)


@functools.cache
def plain_annotations(target: str) -> dict[str, tuple[type, ...]]:
    """The constructor parameters of `target` (a class's dotted path) whose annotation is plain: name -> the
    types it allows."""
    from hydra.utils import get_class

    try:
        cls = get_class(target)
        takes_any = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values())
        settings = getattr(cls, "settings_class", None) if takes_any else None  # __init__(**settings): its dataclass
        hints = typing.get_type_hints(settings or cls.__init__)
    except Exception:  # noqa: BLE001 - a target that does not import, or annotations that do not resolve: the job's
        return {}  # to meet when it builds the system, and to record
    plain = {}
    for name, hint in hints.items():
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        kinds = typing.get_args(hint) if union else (hint,)
        if all(k in PLAIN for k in kinds):
            plain[name] = kinds
    return plain


def check_system_settings(system: dict) -> None:
    """system: the run's resolved `system` config (with `_target_`). Refuses the first setting whose value its
    constructor's plain annotation does not allow."""
    target = system.get("_target_")
    if not target:
        return
    allowed = plain_annotations(target)
    for key, value in system.items():
        kinds = allowed.get(key)
        if kinds is not None and not any(fits(value, k) for k in kinds):
            expected = " or ".join(PLAIN[k] for k in kinds)
            owner = target.rsplit(".", 1)[-1]
            quote = (
                f"; true/false/on/off/yes/no are read as booleans: give one of its words, quoted (system.{key}='on')"
                if isinstance(value, bool) and str in kinds
                else ""
            )
            raise ConfigError(f"system.{key}={value!r}: expected {expected} ({owner}'s {key}){quote}")
