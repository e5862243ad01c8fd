"""The model registry: which models exist, their context sizes, and how each is counted.

Shipped defaults live in ``models.json`` beside this file. They can be overridden
or extended by a JSON file named by ``TRACKER_MODELS_FILE`` or by a dict passed
in, with the same shape (``{"models": {name: entry}}`` or just ``{name: entry}``).
An override entry for a known model is merged field by field onto it; ``null``
removes the model; a new model needs ``provider``, ``window`` and ``counter``.

Entry fields:

``provider``           ``openai`` | ``anthropic`` | ``google`` | any string
``window``             context window in tokens (int > 0)
``max_output_tokens``  largest reply (int > 0, optional)
``max_input_tokens``   largest prompt when the provider caps it below the window (optional)
``counter``            ``exact_local`` | ``heuristic`` | ``anthropic_http`` | ``openai_http``
                       (or a test counter of :mod:`tracker.counting.testing`)
``encoding``           ``o200k_base`` | ``cl100k_base`` (required by ``exact_local``)
``api_model``          the name sent to the provider, when it differs from the registry name
``aliases``            other names of the same entry (no prefix matching: unknown is unknown)
``options``            counter options (``image_base_tokens``, ``image_tile_tokens``,
                       ``anthropic_beta``, test-counter knobs)

When ``TRACKER_ANTHROPIC_API_KEY`` (or ``TRACKER_OPENAI_API_KEY``) is set, shipped
entries of that provider whose counter is ``heuristic`` count with the provider's
HTTP endpoint instead; entries given by a models file or dict are used exactly as
written. An unknown model is :class:`ContextLimitUnknown` — before any counting.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

from tracker.core.model import is_int, resolve_input_limit
from tracker.errors import ContextLimitUnknown, InvalidCountModel, InvalidInput

if TYPE_CHECKING:  # pragma: no cover
    from tracker.core.policy import Policy
    from tracker.counting.counters import Counter

DEFAULTS_PATH = Path(__file__).with_name("models.json")

SHIPPED_COUNTERS: dict[str, str] = {
    "exact_local": "exact_local",
    "heuristic": "heuristic_estimate",
    "anthropic_http": "exact_provider",
    "openai_http": "exact_provider",
}
ENCODING_NAMES = ("o200k_base", "cl100k_base")
_FIELDS = ("provider", "window", "max_output_tokens", "max_input_tokens", "counter", "encoding", "api_model", "aliases", "options")


@dataclass(frozen=True)
class ModelSpec:
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

    @classmethod
    def from_data(cls, name: str, data: Mapping[str, Any]) -> "ModelSpec":
        where = f"models.{name}"
        if not isinstance(name, str) or not name:
            raise InvalidInput("models", f"model names must be non-empty strings, got {name!r}")
        if not isinstance(data, Mapping):
            raise InvalidInput(where, f"must be an object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise InvalidInput(f"{where}.{unknown[0]}", f"is not a model field ({', '.join(_FIELDS)})")
        for key in ("provider", "window", "counter"):
            if data.get(key) is None:
                raise InvalidInput(f"{where}.{key}", "missing")
        provider = data["provider"]
        if not isinstance(provider, str) or not provider:
            raise InvalidInput(f"{where}.provider", f"must be a non-empty string, got {provider!r}")
        window = _positive(data["window"], f"{where}.window")
        max_output = _positive(data.get("max_output_tokens"), f"{where}.max_output_tokens", optional=True)
        max_input = _positive(data.get("max_input_tokens"), f"{where}.max_input_tokens", optional=True)
        counter = data["counter"]
        if not isinstance(counter, str) or not counter:
            raise InvalidInput(f"{where}.counter", f"must be a counter name, got {counter!r}")
        if declared_quality(counter) is None:
            raise InvalidInput(
                f"{where}.counter", f"unknown counter {counter!r} (one of {', '.join(SHIPPED_COUNTERS)})"
            )
        encoding = data.get("encoding")
        if encoding is not None and encoding not in ENCODING_NAMES:
            raise InvalidInput(f"{where}.encoding", f"must be one of {', '.join(ENCODING_NAMES)}, got {encoding!r}")
        if counter == "exact_local" and encoding is None:
            raise InvalidInput(f"{where}.encoding", "the exact_local counter needs an encoding (o200k_base or cl100k_base)")
        api_model = data.get("api_model")
        if api_model is not None and (not isinstance(api_model, str) or not api_model):
            raise InvalidInput(f"{where}.api_model", f"must be a non-empty string, got {api_model!r}")
        aliases = data.get("aliases") or ()
        if not isinstance(aliases, (list, tuple)) or not all(isinstance(a, str) and a for a in aliases):
            raise InvalidInput(f"{where}.aliases", "must be a list of non-empty strings")
        options = data.get("options") or {}
        if not isinstance(options, Mapping):
            raise InvalidInput(f"{where}.options", f"must be an object, got {type(options).__name__}")
        return cls(
            name=name,
            provider=provider,
            window=window,
            counter=counter,
            max_output_tokens=max_output,
            max_input_tokens=max_input,
            encoding=encoding,
            api_model=api_model,
            aliases=tuple(aliases),
            options=MappingProxyType(dict(options)),
        )


def _positive(value: Any, where: str, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if not is_int(value) or value <= 0:
        raise InvalidInput(where, f"must be an integer > 0, got {value!r}")
    return value


def declared_quality(counter_name: str) -> str | None:
    """The quality a counter declares, or None for an unknown counter name."""
    quality = SHIPPED_COUNTERS.get(counter_name)
    if quality is not None:
        return quality
    from tracker.counting import testing

    spec = testing.TEST_COUNTERS.get(counter_name)
    return spec[1] if spec is not None else None


def _entries(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise InvalidInput(where, f"must be a JSON object, got {type(data).__name__}")
    if "models" in data:
        models = data["models"]
        if not isinstance(models, Mapping):
            raise InvalidInput(f"{where}.models", "must be an object of model entries")
        return dict(models)
    return {k: v for k, v in data.items() if not k.startswith("_")}


def load_models_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidInput("TRACKER_MODELS_FILE", f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise InvalidInput("TRACKER_MODELS_FILE", f"{str(path)!r} is not valid JSON: {exc}") from None
    return _entries(data, "TRACKER_MODELS_FILE")


class ModelRegistry:
    """Model name -> :class:`ModelSpec`, input limits (SPEC §3) and counters."""

    def __init__(self, models: Mapping[str, ModelSpec], settings: Mapping[str, str] | None = None) -> None:
        self._models = dict(models)
        self._by_name: dict[str, ModelSpec] = {}
        for spec in self._models.values():
            self._by_name[spec.name] = spec
        for spec in self._models.values():
            for alias in spec.aliases:
                self._by_name.setdefault(alias, spec)
        self.settings: Mapping[str, str] = dict(settings) if settings is not None else dict(os.environ)
        self._counters: dict[str, "Counter"] = {}
        self._lock = threading.Lock()

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        overrides: Mapping[str, Any] | str | os.PathLike[str] | None = None,
        *,
        settings: Mapping[str, str] | None = None,
        defaults: bool = True,
    ) -> "ModelRegistry":
        """Shipped defaults (unless ``defaults=False``), then ``overrides`` (a dict or a file path)."""
        env = dict(os.environ) if settings is None else dict(settings)
        raw: dict[str, dict[str, Any]] = {}
        if defaults:
            shipped = _entries(json.loads(DEFAULTS_PATH.read_text(encoding="utf-8")), "models.json")
            for name, entry in shipped.items():
                entry = dict(entry)
                provider_http = {"anthropic": "anthropic_http", "openai": "openai_http"}.get(entry.get("provider", ""))
                key_var = {"anthropic": "TRACKER_ANTHROPIC_API_KEY", "openai": "TRACKER_OPENAI_API_KEY"}.get(
                    entry.get("provider", "")
                )
                if provider_http and key_var and env.get(key_var) and entry.get("counter") == "heuristic":
                    entry["counter"] = provider_http
                raw[name] = entry
        if overrides is not None:
            extra = load_models_file(overrides) if isinstance(overrides, (str, os.PathLike)) else _entries(overrides, "models")
            for name, entry in extra.items():
                if entry is None:
                    raw.pop(name, None)
                elif name in raw and isinstance(entry, Mapping):
                    raw[name] = {**raw[name], **entry}
                else:
                    raw[name] = entry  # validated below
        models = {name: ModelSpec.from_data(name, entry) for name, entry in raw.items()}
        return cls(models, settings=env)

    @classmethod
    def from_settings(cls, env: Mapping[str, str] | None = None) -> "ModelRegistry":
        """Defaults plus ``TRACKER_MODELS_FILE`` when set."""
        env = dict(os.environ) if env is None else dict(env)
        path = env.get("TRACKER_MODELS_FILE") or None
        return cls.load(path, settings=env)

    # -- lookups -----------------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._models)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def get(self, name: str) -> ModelSpec:
        """The entry for ``name`` (or one of its aliases). Unknown -> ContextLimitUnknown."""
        if isinstance(name, ModelSpec):
            return name
        spec = self._by_name.get(name) if isinstance(name, str) else None
        if spec is None:
            raise ContextLimitUnknown(f"{name}: unknown model (not in the model registry)", model=str(name))
        return spec

    def input_limit(self, name: str | ModelSpec, policy: "Policy") -> int:
        """SPEC §3 input limit of the model under ``policy``; fails closed with ContextLimitUnknown."""
        spec = self.get(name)  # type: ignore[arg-type]
        return resolve_input_limit(
            window=spec.window,
            max_output_tokens=spec.max_output_tokens,
            max_input_tokens=spec.max_input_tokens,
            reserved_output=policy.reserved_output,
            safety_margin=policy.safety_margin,
            model=spec.name,
        )

    def declared_quality(self, name: str | ModelSpec) -> str:
        spec = self.get(name)  # type: ignore[arg-type]
        quality = declared_quality(spec.counter)
        if quality is None:  # pragma: no cover - refused when the entry is loaded
            raise InvalidCountModel(f"{spec.name}: unknown counter {spec.counter!r}", model=spec.name)
        return quality

    def counter_for(self, name: str | ModelSpec) -> "Counter":
        """The counter instance for a model (one per counter kind, shared, thread-safe)."""
        spec = self.get(name)  # type: ignore[arg-type]
        counter = self._counters.get(spec.counter)
        if counter is not None:
            return counter
        with self._lock:
            counter = self._counters.get(spec.counter)
            if counter is None:
                counter = make_counter(spec.counter, self.settings)
                self._counters[spec.counter] = counter
        return counter

    def to_data(self) -> dict[str, Any]:
        return {"models": {name: spec.to_data() for name, spec in sorted(self._models.items())}}


def make_counter(counter_name: str, settings: Mapping[str, str]) -> "Counter":
    from tracker.counting import counters, http

    if counter_name == "exact_local":
        return counters.ExactLocalCounter()
    if counter_name == "heuristic":
        return counters.HeuristicCounter()
    if counter_name == "anthropic_http":
        return http.AnthropicHttpCounter.from_settings(settings)
    if counter_name == "openai_http":
        return http.OpenAIHttpCounter.from_settings(settings)
    from tracker.counting import testing

    spec = testing.TEST_COUNTERS.get(counter_name)
    if spec is None:
        raise InvalidCountModel(f"unknown counter {counter_name!r}")
    return spec[0]()
