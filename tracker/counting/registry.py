"""The model registry: which models exist, their context sizes, and how each is counted.

Shipped defaults live in ``models.json`` beside this file. They can be overridden
or extended by a JSON file (``TRACKER_MODELS_FILE``, passed in by the composition root)
or by a dict, with the same shape (``{"models": {name: entry}}`` or just ``{name: entry}``).
An override entry for a known model is merged field by field onto it; ``null``
removes the model; a new model needs ``provider``, ``window`` and ``counter``.
The format, with an example, is documented for users in ``docs/models.md``.

Entry fields:

``provider``           ``openai`` | ``anthropic`` | ``google`` | any string
``window``             context window in tokens (int > 0)
``max_output_tokens``  largest reply (int > 0, optional)
``max_input_tokens``   largest prompt when the provider caps it below the window (optional)
``counter``            ``exact_local`` | ``heuristic`` | ``anthropic_http`` | ``openai_http``,
                       or the import path ``"package.module:Class"`` of any class that
                       follows :class:`~tracker.counting.base.Counter` (its ``quality``
                       class attribute is the quality it declares)
``encoding``           ``o200k_base`` | ``cl100k_base`` (required by ``exact_local``)
``api_model``          the name sent to the provider, when it differs from the registry name
``aliases``            other names of the same entry (no prefix matching: unknown is unknown)
``options``            counter options (``image_base_tokens``, ``image_tile_tokens``,
                       ``anthropic_beta``, test-counter knobs)

When the :class:`~tracker.settings.ProviderSettings` given to :meth:`ModelRegistry.load`
hold an Anthropic (or OpenAI) API key, shipped entries of that provider whose counter is
``heuristic`` count with the provider's HTTP endpoint instead; entries given by a models
file or dict are used exactly as written. An unknown model is :class:`ContextLimitUnknown`
— before any counting. The registry never reads the environment.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from tracker.core.model import QUALITIES, is_int, resolve_input_limit
from tracker.counting.base import Counter, ModelSpec
from tracker.errors import ContextLimitUnknown, InvalidCountModel, InvalidInput, an_object

if TYPE_CHECKING:  # pragma: no cover
    from tracker.core.policy import Policy
    from tracker.settings import ProviderSettings

DEFAULTS_PATH = Path(__file__).with_name("models.json")

# The shipped counters by name; any other counter name is an import path "module:Class".
SHIPPED_COUNTERS: dict[str, str] = {
    "exact_local": "tracker.counting.counters:ExactLocalCounter",
    "heuristic": "tracker.counting.counters:HeuristicCounter",
    "anthropic_http": "tracker.counting.http:AnthropicHttpCounter",
    "openai_http": "tracker.counting.http:OpenAIHttpCounter",
}
# With the provider's API key configured, shipped heuristic entries count over HTTP instead.
PROVIDER_HTTP_COUNTERS: dict[str, tuple[str, str]] = {
    "anthropic": ("anthropic_http", "anthropic_api_key"),
    "openai": ("openai_http", "openai_api_key"),
}
ENCODING_NAMES = ("o200k_base", "cl100k_base")
_FIELDS = (
    "provider",
    "window",
    "max_output_tokens",
    "max_input_tokens",
    "counter",
    "encoding",
    "api_model",
    "aliases",
    "options",
)


# -- counter names ---------------------------------------------------------------------------

_counter_classes: dict[str, type[Counter]] = {}
_counter_classes_lock = threading.Lock()


class UnknownCounter(ValueError):
    """A counter name that is neither shipped nor an importable counter class."""


def counter_class(name: str) -> type[Counter]:
    """The class a counter name stands for: a shipped name, or ``"package.module:Class"``.

    The class must have a ``count`` method and declare a ``quality`` the core knows.
    Raises :class:`UnknownCounter` saying why not.
    """
    cls = _counter_classes.get(name)
    if cls is not None:
        return cls
    path = SHIPPED_COUNTERS.get(name, name)
    module_name, sep, qualname = path.partition(":")
    if not sep or not module_name or not qualname:
        raise UnknownCounter(
            f"unknown counter {name!r} (one of {', '.join(SHIPPED_COUNTERS)}, or an import path 'module:Class')"
        )
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except ImportError as exc:
        raise UnknownCounter(f"cannot import counter {name!r}: {type(exc).__name__}: {exc}") from None
    except AttributeError:
        raise UnknownCounter(f"cannot import counter {name!r}: {module_name} has no {qualname}") from None
    if not isinstance(obj, type) or not callable(getattr(obj, "count", None)):
        raise UnknownCounter(f"{name!r} is not a counter class (a class with a count method)")
    quality = getattr(obj, "quality", None)
    if quality not in QUALITIES:
        raise UnknownCounter(f"counter {name!r} declares quality {quality!r}, not one of {', '.join(QUALITIES)}")
    with _counter_classes_lock:
        return _counter_classes.setdefault(name, obj)


def declared_quality(counter_name: str) -> str | None:
    """The quality a counter declares (its class's ``quality``), or None for an unknown counter name."""
    try:
        return counter_class(counter_name).quality
    except UnknownCounter:
        return None


def make_counter(counter_name: str, providers: ProviderSettings) -> Counter:
    """A new counter: ``Class.from_settings(providers)`` when the class offers it, else ``Class()``."""
    try:
        cls = counter_class(counter_name)
    except UnknownCounter as exc:
        raise InvalidCountModel(str(exc)) from None
    factory = getattr(cls, "from_settings", None)
    return factory(providers) if factory is not None else cls()


# -- entries ---------------------------------------------------------------------------------


def spec_from_data(name: str, data: Mapping[str, Any]) -> ModelSpec:
    """Validate one registry entry into a :class:`ModelSpec` (``InvalidInput`` naming the field)."""
    where = f"models.{name}"
    if not isinstance(name, str) or not name:
        raise InvalidInput("models", f"model names must be non-empty strings, got {name!r}")
    an_object(where, data)
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
    max_output = _optional_positive(data.get("max_output_tokens"), f"{where}.max_output_tokens")
    max_input = _optional_positive(data.get("max_input_tokens"), f"{where}.max_input_tokens")
    counter = data["counter"]
    if not isinstance(counter, str) or not counter:
        raise InvalidInput(f"{where}.counter", f"must be a counter name, got {counter!r}")
    try:
        cls = counter_class(counter)
    except UnknownCounter as exc:
        raise InvalidInput(f"{where}.counter", str(exc)) from None
    encoding = data.get("encoding")
    if encoding is not None and encoding not in ENCODING_NAMES:
        raise InvalidInput(f"{where}.encoding", f"must be one of {', '.join(ENCODING_NAMES)}, got {encoding!r}")
    if getattr(cls, "needs_encoding", False) and encoding is None:
        raise InvalidInput(f"{where}.encoding", f"the {counter} counter needs an encoding (o200k_base or cl100k_base)")
    api_model = data.get("api_model")
    if api_model is not None and (not isinstance(api_model, str) or not api_model):
        raise InvalidInput(f"{where}.api_model", f"must be a non-empty string, got {api_model!r}")
    aliases = data.get("aliases") or ()
    if not isinstance(aliases, (list, tuple)) or not all(isinstance(a, str) and a for a in aliases):
        raise InvalidInput(f"{where}.aliases", "must be a list of non-empty strings")
    options = data.get("options") or {}
    an_object(f"{where}.options", options)
    return ModelSpec(
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


def _positive(value: Any, where: str) -> int:
    if not is_int(value) or value <= 0:
        raise InvalidInput(where, f"must be an integer > 0, got {value!r}")
    return int(value)


def _optional_positive(value: Any, where: str) -> int | None:
    return None if value is None else _positive(value, where)


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
    """Model name -> :class:`ModelSpec`, input limits (behaviour.md "Policy") and counters."""

    def __init__(self, models: Mapping[str, ModelSpec], providers: ProviderSettings | None = None) -> None:
        self._models = dict(models)
        self._by_name: dict[str, ModelSpec] = {}
        for spec in self._models.values():
            self._by_name[spec.name] = spec
        for spec in self._models.values():
            for alias in spec.aliases:
                self._by_name.setdefault(alias, spec)
        self.providers: ProviderSettings = providers if providers is not None else _default_providers()
        self._counters: dict[str, Counter] = {}
        self._lock = threading.Lock()

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        overrides: Mapping[str, Any] | str | os.PathLike[str] | None = None,
        *,
        providers: ProviderSettings | None = None,
        defaults: bool = True,
    ) -> ModelRegistry:
        """Shipped defaults (unless ``defaults=False``), then ``overrides`` (a dict or a models file path).

        ``providers`` (default: no API keys, the public base URLs) configures the HTTP counters and
        switches shipped heuristic entries of a provider with an API key to its HTTP counter.
        """
        providers = providers if providers is not None else _default_providers()
        raw: dict[str, dict[str, Any]] = {}
        if defaults:
            shipped = _entries(json.loads(DEFAULTS_PATH.read_text(encoding="utf-8")), "models.json")
            for name, entry in shipped.items():
                entry = dict(entry)
                http = PROVIDER_HTTP_COUNTERS.get(entry.get("provider", ""))
                if http is not None and entry.get("counter") == "heuristic":
                    counter, key_field = http
                    key = getattr(providers, key_field, None)
                    if key is not None and key.get_secret_value():
                        entry["counter"] = counter
                raw[name] = entry
        if overrides is not None:
            extra = (
                load_models_file(overrides)
                if isinstance(overrides, (str, os.PathLike))
                else _entries(overrides, "models")
            )
            for name, entry in extra.items():
                if entry is None:
                    raw.pop(name, None)
                elif name in raw and isinstance(entry, Mapping):
                    raw[name] = {**raw[name], **entry}
                else:
                    raw[name] = entry  # validated below
        models = {name: spec_from_data(name, entry) for name, entry in raw.items()}
        return cls(models, providers=providers)

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
            raise ContextLimitUnknown(
                f"{name}: unknown model (not in the model registry); add it in a models file named by "
                f"TRACKER_MODELS_FILE, format in docs/models.md",
                model=str(name),
            )
        return spec

    def input_limit(self, name: str | ModelSpec, policy: Policy) -> int:
        """behaviour.md "Policy" input limit of the model under ``policy``; fails closed with ContextLimitUnknown."""
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
        """The quality the model's counter declares (its class's ``quality``), before any count."""
        spec = self.get(name)  # type: ignore[arg-type]
        quality = declared_quality(spec.counter)
        if quality is None:  # pragma: no cover - refused when the entry is loaded
            raise InvalidCountModel(f"{spec.name}: unknown counter {spec.counter!r}", model=spec.name)
        return quality

    def counter_for(self, name: str | ModelSpec) -> Counter:
        """The counter instance for a model (one per counter kind, shared, thread-safe)."""
        spec = self.get(name)  # type: ignore[arg-type]
        counter = self._counters.get(spec.counter)
        if counter is not None:
            return counter
        with self._lock:
            counter = self._counters.get(spec.counter)
            if counter is None:
                counter = make_counter(spec.counter, self.providers)
                self._counters[spec.counter] = counter
        return counter

    def close(self) -> None:
        """Release what the counters made so far hold (a provider counter's HTTP connections);
        a later count makes its counter again."""
        with self._lock:
            counters, self._counters = list(self._counters.values()), {}
        for counter in counters:
            close = getattr(counter, "close", None)
            if close is not None:
                close()

    def encodings(self) -> set[str]:
        """The exact local encodings this registry's models use (to load them ahead of a count)."""
        return {spec.encoding for spec in self._models.values() if spec.encoding is not None}

    def to_data(self) -> dict[str, Any]:
        return {"models": {name: spec.to_data() for name, spec in sorted(self._models.items())}}


def _default_providers() -> ProviderSettings:
    """Provider settings with every default and no API key (never read from the environment)."""
    from tracker.settings import ProviderSettings

    return ProviderSettings.model_construct()
