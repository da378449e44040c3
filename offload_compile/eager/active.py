"""The session whose ``with`` block is active in this context, and its step's executor.

A leaf of the eager door: it imports only the executor's type, so the hooks that must
find the running step (``skip_offload``'s opaque calls, the compiled-module hooks) read
it here instead of importing the session. One ``ContextVar``: threads and asyncio tasks
each see their own (none unless they entered a session themselves).
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Protocol

from .executor_base import BaseExecutor

__all__ = ["ActiveSession", "activate", "active_executor", "current_session", "deactivate"]


class ActiveSession(Protocol):
    """What the hooks need of an active ``OffloadSession``."""

    @property
    def executor(self) -> BaseExecutor | None:
        """The executor of the step in progress (None between steps)."""
        ...


_ACTIVE: ContextVar[ActiveSession | None] = ContextVar("hyper_offload_session", default=None)


def current_session() -> ActiveSession | None:
    """The ``OffloadSession`` whose ``with`` block is active in this context, if any."""
    return _ACTIVE.get()


def active_executor() -> BaseExecutor | None:
    """The active session's executor while its step runs (None outside a step or once the
    executor is closed: nothing is tracked then)."""
    session = _ACTIVE.get()
    executor = None if session is None else session.executor
    return None if executor is None or executor.closed else executor


def activate(session: ActiveSession) -> Token[ActiveSession | None]:
    """Make ``session`` the active one; pass the token to :func:`deactivate`."""
    return _ACTIVE.set(session)


def deactivate(token: Token[ActiveSession | None]) -> None:
    """Restore whatever was active before the matching :func:`activate`."""
    _ACTIVE.reset(token)
