"""Hooks: what a ``Tracker`` does, for subscribers (metrics, traces) that must never change it.

In the manner of dramatiq's middleware: every method of :class:`TrackerHooks` is a no-op, a
subscriber overrides the ones it needs, and the Tracker only emits (``Tracker(store,
hooks=[...])``; ``Tracker.from_settings`` attaches the default ones, see ``tracker.bootstrap``):

    command(name, session_id, attempt_id, basis)   a context manager around one public command
                                                   (observe, manual, commit, reject, wait)
    after_command(name, session_id, result)        what that command returns (not when it raises)
    phase(name)                                    a context manager around one step of recording:
                                                   ``coordination`` (the lock held: load, decide,
                                                   append), ``decide``, ``append``
    after_record(op, session_id, outcome)          events appended: a decision, a refusal on the
                                                   record, a lease expiry (never for a replay)

``command`` and ``phase`` wrap (a span must be current while the step runs, and see its
exception); the rest observe. Either may return ``None``: nothing to wrap this time.

A hook that raises is logged once (per hook and method) and ignored: the decision, its record
and what the caller gets are the same with it, without it, or with a broken one. Only the
methods a hook overrides are ever called, so with no hooks (or only no-op ones) a command
costs one attribute test and each phase one shared no-op context manager.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from tracker.core.outcome import Outcome

log = logging.getLogger("tracker.hooks")

NOTHING: AbstractContextManager[Any] = nullcontext()  # reusable: a nullcontext keeps no state between uses


class TrackerHooks:
    """A subscriber of what a Tracker does. Every method is a no-op: override the ones you need."""

    def command(
        self, name: str, session_id: str, attempt_id: str | None, basis: str | None
    ) -> AbstractContextManager[Any] | None:
        """Around one public command; ``basis`` and ``attempt_id`` as the caller gave them."""
        return None

    def after_command(self, name: str, session_id: str, result: Any) -> None:
        """``result``: what the command returns (a ``Result``, an ``Attempt``, a ``SessionState``, a str)."""

    def phase(self, name: str) -> AbstractContextManager[Any] | None:
        """Around one step of recording (``coordination``, ``decide``, ``append``); retries repeat it."""
        return None

    def after_record(self, op: str, session_id: str, outcome: Outcome) -> None:
        """``outcome.events`` were appended by ``op`` (observe, manual, commit, reject, expire);
        ``outcome.error`` is the refusal raised after they are on the record, if any."""


def _overrides(hooks: tuple[TrackerHooks, ...], method: str) -> tuple[TrackerHooks, ...]:
    default = getattr(TrackerHooks, method)
    return tuple(h for h in hooks if getattr(type(h), method, default) is not default)


def _no_phase(name: str) -> AbstractContextManager[Any]:
    return NOTHING


class Hooks:
    """The hooks of one Tracker, called so that none can break or change what it decides.

    ``commands`` is False when no hook wraps or watches commands (the Tracker then calls the
    command directly); ``phase`` is a shared no-op when no hook wraps phases.
    """

    __slots__ = (
        "all",
        "commands",
        "phase",
        "_command",
        "_after_command",
        "_phase",
        "_after_record",
        "_logged",
        "_lock",
    )

    def __init__(self, hooks: Iterable[TrackerHooks] = ()) -> None:
        self.all = tuple(hooks)
        for h in self.all:
            if not isinstance(h, TrackerHooks):
                raise TypeError(f"a hook must be a tracker.hooks.TrackerHooks, got {type(h).__name__}")
        self._command = _overrides(self.all, "command")
        self._after_command = _overrides(self.all, "after_command")
        self._phase = _overrides(self.all, "phase")
        self._after_record = _overrides(self.all, "after_record")
        self.commands = bool(self._command or self._after_command)
        self.phase: Callable[[str], AbstractContextManager[Any]] = self._phases if self._phase else _no_phase
        self._logged: set[tuple[int, str]] = set()
        self._lock = threading.Lock()

    def command(self, name: str, session_id: str, attempt_id: str | None, basis: str | None) -> _Guarded:
        return _Guarded(self, "command", self._call(self._command, "command", name, session_id, attempt_id, basis))

    def after_command(self, name: str, session_id: str, result: Any) -> None:
        self._call(self._after_command, "after_command", name, session_id, result)

    def _phases(self, name: str) -> AbstractContextManager[Any]:
        wrappers = self._call(self._phase, "phase", name)
        return _Guarded(self, "phase", wrappers) if wrappers else NOTHING

    def after_record(self, op: str, session_id: str, outcome: Outcome) -> None:
        self._call(self._after_record, "after_record", op, session_id, outcome)

    def _call(
        self, hooks: tuple[TrackerHooks, ...], method: str, *args: Any
    ) -> list[tuple[TrackerHooks, AbstractContextManager[Any]]]:
        """``method(*args)`` of each of ``hooks``, in order; one that raises is logged and skipped
        (a hook never breaks a command). What they return that is not None: the context managers to wrap."""
        wrappers = []
        for h in hooks:
            try:
                cm = getattr(h, method)(*args)
            except Exception:  # noqa: BLE001 - a hook never breaks a command
                self.failed(h, method)
                continue
            if cm is not None:
                wrappers.append((h, cm))
        return wrappers

    def failed(self, hook: TrackerHooks, method: str) -> None:
        """Log the exception being handled: the first time for this hook and method, at debug level after."""
        key = (id(hook), method)
        with self._lock:
            first = key not in self._logged
            self._logged.add(key)
        if first:
            log.exception("hook %s.%s raised; ignored (logged once)", type(hook).__name__, method)
        else:
            log.debug("hook %s.%s raised again; ignored", type(hook).__name__, method, exc_info=True)


class _Guarded:
    """The hooks' context managers as one, entered in order and left in reverse; an exception in
    one is logged and ignored, and none may swallow the exception of what they wrap."""

    __slots__ = ("_owner", "_method", "_wrappers", "_entered")

    def __init__(
        self, owner: Hooks, method: str, wrappers: list[tuple[TrackerHooks, AbstractContextManager[Any]]]
    ) -> None:
        self._owner = owner
        self._method = method
        self._wrappers = wrappers
        self._entered: list[tuple[TrackerHooks, AbstractContextManager[Any]]] = []

    def __enter__(self) -> None:
        for h, cm in self._wrappers:
            try:
                cm.__enter__()
            except Exception:  # noqa: BLE001
                self._owner.failed(h, self._method)
                continue
            self._entered.append((h, cm))

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        while self._entered:
            h, cm = self._entered.pop()
            try:
                cm.__exit__(exc_type, exc, tb)  # what it returns is ignored: it cannot swallow ``exc``
            except Exception as raised:  # noqa: BLE001
                if raised is not exc:
                    self._owner.failed(h, self._method)
