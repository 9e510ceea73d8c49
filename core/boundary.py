"""The one parsing boundary every byte a client sends crosses on the aggregator.

A client's reply is untrusted input handed to parsers we do not own (numpy's
``.npy`` header reader tokenises it with :mod:`tokenize` and
:func:`ast.literal_eval`; Flower's records; our own codecs). Whatever such a
parser raises on hostile bytes (``tokenize.TokenError``, ``SyntaxError``,
``RecursionError``, ``MemoryError``, ...) must reject that one reply, never
end the run. :func:`rejects_any` wraps a reply parser so that anything it
raises leaves as the caller's rejection error, with a one-line reason.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from core.errors import QuorumError, UpdateRejected

__all__ = ["rejects_any", "one_line", "MAX_REASON_CHARS"]

#: The longest reason a rejection keeps: it goes to the store, a log line and a page.
MAX_REASON_CHARS = 300

_P = ParamSpec("_P")
_T = TypeVar("_T")


def one_line(exc: BaseException, limit: int = MAX_REASON_CHARS) -> str:
    """``exc`` as ``'TypeName: first line of its message'``, at most ``limit`` characters."""
    text = " ".join(str(exc).split())  # every line break and run of blanks becomes one space
    line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return line if len(line) <= limit else line[:limit - 3] + "..."


def rejects_any(what: str, error: type[QuorumError] = UpdateRejected
                ) -> Callable[[Callable[_P, _T]], Callable[_P, _T]]:
    """Decorate a parser of untrusted bytes so that any exception it raises becomes ``error``.

    ``error`` itself (the parser's own, reasoned rejection) passes through
    unchanged; any other :class:`Exception` becomes ``error("<what> could not
    be parsed: <Type>: <message>")`` on one line. ``KeyboardInterrupt`` and
    ``SystemExit`` are not exceptions a client can cause, and pass.

    Parameters
    ----------
    what : str
        What is parsed, for the reason: ``"train reply"``, ``"masked input"``.
    error : type[QuorumError]
        The rejection the caller catches: :class:`~core.errors.UpdateRejected`,
        or a protocol's own (secure aggregation's ``SecAggProtocolError``).
    """

    def wrap(parse: Callable[_P, _T]) -> Callable[_P, _T]:
        @functools.wraps(parse)
        def parsed(*args: _P.args, **kwargs: _P.kwargs) -> _T:
            try:
                return parse(*args, **kwargs)
            except error:
                raise
            except Exception as exc:  # the boundary: whatever a client's bytes cause
                raise error(f"{what} could not be parsed: {one_line(exc)}") from exc
        return parsed

    return wrap
