"""Which lock the running code holds: :func:`current_lock`, a ``contextvars`` variable, so each
thread, RQ job and asyncio task sees its own."""

from __future__ import annotations

import contextvars
from typing import Any

_current: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "django_joblock_current_lock", default=None
)


def current_lock() -> Any:
    """The :class:`~django_joblock.Lock` entered by the code running in this context, or None."""
    return _current.get()


def set_current_lock(held: Any) -> contextvars.Token[Any]:
    """Make ``held`` the :func:`current_lock`; undo with :func:`reset_current_lock`."""
    return _current.set(held)


def reset_current_lock(token: contextvars.Token[Any], held: Any = None) -> None:
    """Undo :func:`set_current_lock` in whatever context, never raising: ``ContextVar.reset``
    refuses a token made in another (``__enter__`` and ``__exit__`` run by two ``sync_to_async``
    calls); then, if ``held`` (when given) is still current, the previous value is put back."""
    try:
        _current.reset(token)
    except ValueError:
        if held is None or _current.get() is held:
            previous = token.old_value
            _current.set(None if previous is contextvars.Token.MISSING else previous)
