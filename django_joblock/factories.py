"""Lower-case public names for classes (``lock()``, ``idempotent()``), declared once.

DESIGN's API calls ``lock(resource, ...)`` and ``idempotent(key, ...)`` like functions; they
are the classes :class:`~django_joblock.Lock` and :class:`~django_joblock.idempotency.Idempotent`
under a function's name, with exactly the classes' parameters (typed through the class's
``__init__``), so the keywords are not declared twice and cannot drift apart.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


def factory(cls: Callable[P, T], name: str, doc: str) -> Callable[P, T]:
    """A function called ``name`` that returns ``cls(*args, **kwargs)``, with ``cls``'s
    signature and ``doc`` as its docstring."""

    def make(*args: P.args, **kwargs: P.kwargs) -> T:
        return cls(*args, **kwargs)

    make.__name__ = make.__qualname__ = name
    make.__module__ = cls.__module__
    make.__doc__ = doc
    signature = inspect.signature(cls).replace(return_annotation=getattr(cls, "__name__", ""))
    make.__signature__ = signature  # type: ignore[attr-defined]
    return make
