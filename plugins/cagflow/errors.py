"""The one base of every error CAGFlow raises on purpose, and how its reason code crosses process
boundaries.

Each error carries a stable, machine-readable ``code`` (a class default, or set per instance where one
class covers several reasons). Code that reacts to an error (the router choosing a fallback reason, a
metric label, an exit status) reads the code, never the message, so messages can be reworded freely.
Between Triton and the router the code travels as a prefix of the error message: ``[code] message``.
"""

from __future__ import annotations

import re
from typing import ClassVar

_CODED = re.compile(r"^\[(?P<code>[a-z][a-z0-9_]*)\] (?P<message>.*)\Z", re.DOTALL)
INTERNAL = "internal"


class CagflowError(Exception):
    """Base of CAGFlow's errors; ``code`` says what went wrong in words a program can match."""

    code: ClassVar[str] = "error"

    def __init__(self, message: str = "", *, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code  # type: ignore[misc]  # one class, several reasons


def error_code(exc: BaseException) -> str:
    """The reason code of any exception: its own for CAGFlow's errors, ``internal`` for the rest."""
    return exc.code if isinstance(exc, CagflowError) else INTERNAL


def with_code(code: str, message: str) -> str:
    """A message that carries its code across a boundary that only passes text (a Triton error)."""
    return f"[{code}] {message}"


def split_code(text: str) -> tuple[str | None, str]:
    """The code and the message of a text made by ``with_code``; ``(None, text)`` for any other text."""
    match = _CODED.match(text or "")
    return (match["code"], match["message"]) if match else (None, text)
