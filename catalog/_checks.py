"""Argument checks shared by the catalog's operations.

Each check raises `InvalidArgument` with a message naming the argument and the rule, and
runs before anything is written.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from catalog._errors import InvalidArgument
from catalog._models import NAME_LENGTH
from history import Frontier

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def check_name(what: str, name: object) -> str:
    """A name of an instance, replica, collection, dataflow or import: an identifier
    usable unquoted in SQL and on a command line."""
    if not isinstance(name, str) or not _NAME.match(name) or len(name) > NAME_LENGTH:
        raise InvalidArgument(
            f"{what} name {name!r} is invalid: use letters, digits and underscores, "
            f"not starting with a digit, at most {NAME_LENGTH} characters"
        )
    return name


def check_text(what: str, value: object, *, max_length: int = NAME_LENGTH) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > max_length:
        raise InvalidArgument(
            f"{what} must be a non-empty string of at most {max_length} characters"
        )
    return value


def check_int(what: str, value: object, *, minimum: int) -> int:
    if type(value) is not int or value < minimum:
        raise InvalidArgument(f"{what} must be an int >= {minimum}, not {value!r}")
    return value


def check_frontier(what: str, value: object, *, allow_empty: bool) -> Frontier:
    if not isinstance(value, Frontier):
        raise InvalidArgument(f"{what} must be a history.Frontier, not {value!r}")
    if value.is_empty and not allow_empty:
        raise InvalidArgument(f"{what} must not be the empty frontier")
    return value


def check_conf(what: str, conf: object) -> dict[str, str]:
    if not isinstance(conf, Mapping):
        raise InvalidArgument(f"{what} must be a mapping of strings to strings")
    result: dict[str, str] = {}
    for key, value in conf.items():
        if not isinstance(key, str) or not key.strip() or not isinstance(value, str):
            raise InvalidArgument(f"{what}: {key!r}: {value!r} is not a pair of strings")
        result[key] = value
    return result
