"""Reading a checkpoint's processor parameters (its ``preprocessor_config.json``): the
helpers each family's parser shares. Every key is either taken, required to hold the one
value mmwire reproduces, or refused."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mmwire.transport.errors import ConfigurationError

__all__ = ["height_width", "leftover", "required", "take", "triple"]


def required(given: dict[str, Any], key: str, want: object, why: str) -> None:
    if key in given and given.pop(key) != want:
        raise ConfigurationError(f"`{key}` must be {want!r}: {why}")


def height_width(given: dict[str, Any]) -> tuple[int, int] | None:
    """``size`` as ``{"height": h, "width": w}``, taken out of ``given``: ``(h, w)``, or
    ``None`` when the config has no ``size``."""
    size = given.pop("size", None)
    if size is None:
        return None
    rest = dict(size)
    h, w = rest.pop("height", None), rest.pop("width", None)
    if rest or h is None or w is None:
        raise ConfigurationError(f"`size` must give `height` and `width`, got {size}")
    return int(h), int(w)


def triple(value: Any) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    a, b, c = (float(v) for v in value)
    return (a, b, c)


def take(
    given: dict[str, Any], out: dict[str, Any], keys: Mapping[str, Callable[[Any], Any]]
) -> None:
    for key, convert in keys.items():
        if key in given:
            out[key] = convert(given.pop(key))


def leftover(given: dict[str, Any]) -> None:
    if given:
        raise ConfigurationError(
            f"processor parameters {sorted(given)} are not read by this family: mmwire would "
            "preprocess without them"
        )
