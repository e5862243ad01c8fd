"""The counting port: what a counter is given, what it reports, and what a backend promises.

Everything else in :mod:`tracker.counting` is built on these types and nothing here
imports the rest of the package, so counters (shipped or named by import path in a
models file) depend on this module only:

* :class:`ModelSpec`        one model registry entry (data, validated by the registry);
* :class:`CountResult`      what a counter reports (validated into a core ``Measurement``);
* :class:`Counter`          ``name``, declared ``quality``, ``count(request, model)``;
* :class:`CountingBackend`  ``measure(request, *, model, basis, policy) -> Measurement``;
* :func:`deadline_scope` / :func:`remaining_time`  the count's deadline, as seen by counters.

The quality names are the core's (``tracker.core.model.QUALITY_*``), re-exported, not
declared again.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tracker.core.model import QUALITY_EXACT_LOCAL, QUALITY_EXACT_PROVIDER, QUALITY_HEURISTIC, Record

__all__ = [
    "QUALITY_EXACT_LOCAL",  # the core's names, re-exported for counters
    "QUALITY_EXACT_PROVIDER",
    "QUALITY_HEURISTIC",
    "Counter",
    "CountingBackend",
    "CountResult",
    "ModelSpec",
    "deadline_scope",
    "remaining_time",
]

if TYPE_CHECKING:  # pragma: no cover
    from tracker.core.model import Basis, Measurement
    from tracker.core.policy import Policy
    from tracker.counting.request import CanonicalRequest


@dataclass(frozen=True)
class ModelSpec:
    """One entry of the model registry (see :mod:`tracker.counting.registry` for the fields)."""

    name: str
    provider: str
    window: int
    counter: str
    max_output_tokens: int | None = None
    max_input_tokens: int | None = None
    encoding: str | None = None
    api_model: str | None = None
    aliases: tuple[str, ...] = ()
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def provider_model(self) -> str:
        """The name the provider knows this model by."""
        return self.api_model or self.name

    def to_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {"provider": self.provider, "window": self.window, "counter": self.counter}
        for key in ("max_output_tokens", "max_input_tokens", "encoding", "api_model"):
            value = getattr(self, key)
            if value is not None:
                data[key] = value
        if self.aliases:
            data["aliases"] = list(self.aliases)
        if self.options:
            data["options"] = dict(self.options)
        return data


@dataclass(frozen=True)
class CountResult(Record):
    """What a counter reports. Validated into a core ``Measurement`` by ``validate_count``."""

    input_tokens: int
    model: str
    quality: str
    fingerprint: str


@runtime_checkable
class Counter(Protocol):
    """A counter. ``quality`` is declared on the class: the registry reads it before any count.

    A class may also offer ``from_settings(providers: ProviderSettings)`` (used instead of the
    no-argument constructor) and ``needs_encoding = True`` (its models must name an encoding).
    """

    name: str
    quality: str

    def count(self, request: CanonicalRequest, model: ModelSpec) -> CountResult: ...


@runtime_checkable
class CountingBackend(Protocol):
    """Measure a complete request for a model under a policy. Raises the typed ``CountError`` s."""

    def measure(
        self,
        request: dict[str, Any] | CanonicalRequest,
        *,
        model: str,
        basis: Basis | str,
        policy: Policy,
    ) -> Measurement: ...

    def warm(self) -> None: ...

    def close(self) -> None: ...


# -- the count's deadline ---------------------------------------------------------------------
#
# Backends run a counter under a deadline (time.monotonic() seconds). Counters that wait on
# something (the HTTP counters) read it to size their own timeouts; nothing retries past it.

_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("tracker_count_deadline", default=None)


@contextlib.contextmanager
def deadline_scope(deadline: float | None) -> Iterator[None]:
    token = _deadline.set(deadline)
    try:
        yield
    finally:
        _deadline.reset(token)


def remaining_time(default: float) -> float:
    """Seconds left before the current count's deadline (``default`` when none is set)."""
    deadline = _deadline.get()
    if deadline is None:
        return default
    return deadline - time.monotonic()
