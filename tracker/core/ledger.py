"""The calibration ledger: the provider's own numbers, folded per (fleet, model).

Every ``UsageReported`` and ``ProviderRejected`` event carries its measurement's model, quality
and raw count, so the log's provider reports alone rebuild what calibration knows:

* per (fleet, model) and counter kind (``estimate`` for counts :func:`~tracker.core.calibration.calibrates`
  corrects, ``exact`` for the others), a :class:`~tracker.core.calibration.CalibrationState` of the
  samples *(counted, billed)*: a usage report's billed input, or the count a rejection states;
* per (fleet, model), the lowest input limit learned from rejections (``ProviderRejected.learned_limit``);
* per (fleet, model) and kind of content (a usage report's ``content``: ``latin``, ``cjk``,
  ``other_script``), the estimate samples of that kind alone: a measurement of that kind is
  corrected by its kind's calibration once the kind has ``MIN_SAMPLES`` of its own (a counter
  over-counts each kind by its own factor, so one factor per model cannot fit a fleet that mixes
  code and Chinese documents), else by the model's;
* per (fleet, model), how many usage reports were of decisions anchored on the session's own
  billed count (``UsageReported.anchored``, ``tracker.core.anchor``).

A fleet is :meth:`SessionScope.fleet_of` the session id (the HTTP API's tenants; ``""`` for ids
without a ``:``), so one fleet's reports never move another fleet's decisions.

``CalibrationLedger.fold(fleet, event)`` is a pure step (no I/O, no clock): folding the same
events in the same order gives the same ledger, which is how ``tracker calibration`` and a live
decision agree with the log. A decision records the calibration it used, so replaying it never
needs the ledger as it was then.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, Literal

from tracker.core import events as ev
from tracker.core.calibration import (
    DRIFT_MIN_SAMPLES,
    Calibration,
    CalibrationSample,
    CalibrationState,
    calibrates,
    drift,
    drifted,
    quantile,
)

Kind = Literal["estimate", "exact"]
P90 = Fraction(9, 10)


def kind_of(quality: str) -> Kind:
    return "estimate" if calibrates(quality) else "exact"


@dataclass(frozen=True)
class ModelEntry:
    """What the ledger knows of one model in one fleet, for one counter kind."""

    samples: CalibrationState
    usage_reports: int = 0
    rejections: int = 0
    last_at: float = 0.0
    anchored: int = 0  # usage reports of decisions anchored on the session's billed count


@dataclass(frozen=True)
class ModelSummary:
    """One row of ``tracker calibration`` / ``GET /v1/calibration``."""

    fleet: str
    model: str
    kind: Kind
    usage_reports: int
    rejections: int
    samples: int  # usable samples in the window
    ignored: int  # reports the estimator ignored (absurd ratio, tiny request)
    median: Fraction | None  # billed / counted
    p90: Fraction | None
    calibration: Calibration | None  # the factor decisions use (estimates only)
    drift: Fraction | None  # exact counters: median billed / counted
    drifted: bool
    learned_limit: int | None
    last_at: float
    anchored: int = 0  # of the usage reports, those of anchored decisions
    #: per kind of content with its own calibration: (kind, its calibration or None, usable samples)
    contents: tuple[tuple[str, Calibration | None, int], ...] = ()

    def to_data(self) -> dict[str, Any]:
        def ratio(x: Fraction | None) -> float | None:
            return None if x is None else round(float(x), 4)

        return {
            "fleet": self.fleet,
            "model": self.model,
            "counter": self.kind,
            "usage_reports": self.usage_reports,
            "rejections": self.rejections,
            "samples": self.samples,
            "ignored": self.ignored,
            "median_ratio": ratio(self.median),
            "p90_ratio": ratio(self.p90),
            "factor": ratio(self.calibration.factor) if self.calibration else None,
            "calibration": self.calibration.to_data() if self.calibration else None,
            "drift": ratio(self.drift),
            "drifted": self.drifted,
            "learned_limit": self.learned_limit,
            "last_at": self.last_at,
            "anchored": self.anchored,
            "contents": {
                kind: {"samples": n, "factor": ratio(c.factor) if c else None} for kind, c, n in self.contents
            },
        }


def _empty(kind: Kind) -> ModelEntry:
    if kind == "exact":
        return ModelEntry(CalibrationState(min_samples=DRIFT_MIN_SAMPLES))
    return ModelEntry(CalibrationState())


class CalibrationLedger:
    """The fold of provider reports (see the module docstring). Not thread-safe: its owner locks."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str, Kind], ModelEntry] = {}
        self._limits: dict[tuple[str, str], int] = {}
        self._contents: dict[tuple[str, str, str], CalibrationState] = {}
        self.folded = 0

    def fold(self, fleet: str, event: ev.DomainEvent, session: str = "") -> None:
        """One provider report (other events are ignored); ``session``: the session that reported it
        (a billing shift is one several sessions see: ``tracker.core.calibration``)."""
        content = None
        if isinstance(event, ev.UsageReported):
            billed: int | None = event.billed_tokens
            bump = {"usage_reports": 1, "anchored": int(event.anchored)}
            content = event.content
        elif isinstance(event, ev.ProviderRejected):
            billed = event.input_tokens
            bump = {"rejections": 1}
            if event.learned_limit is not None:
                key = (fleet, event.model)
                known = self._limits.get(key)
                self._limits[key] = event.learned_limit if known is None else min(known, event.learned_limit)
        else:
            return
        self.folded += 1
        kind = kind_of(event.quality)
        ekey = (fleet, event.model, kind)
        entry = self._entries.get(ekey) or _empty(kind)
        samples = entry.samples
        if billed is not None and event.counted_tokens > 0:
            sample = CalibrationSample(event.counted_tokens, billed, session)
            samples = samples.fold(sample)
            if content is not None and kind == "estimate":
                ckey = (fleet, event.model, content)
                self._contents[ckey] = self._contents.get(ckey, CalibrationState()).fold(sample)
        self._entries[ekey] = replace(
            entry,
            samples=samples,
            usage_reports=entry.usage_reports + bump.get("usage_reports", 0),
            rejections=entry.rejections + bump.get("rejections", 0),
            last_at=max(entry.last_at, event.at),
            anchored=entry.anchored + bump.get("anchored", 0),
        )

    def calibration(self, fleet: str, model: str, quality: str, content: str | None = None) -> Calibration | None:
        """The correction decisions use for a count of ``quality`` (None for exact counts, or too few
        samples): its kind of content's, when ``content`` has a calibration of its own, else the model's."""
        if not calibrates(quality):
            return None
        entry = self._entries.get((fleet, model, "estimate"))
        if entry is None:
            return None
        model_wide = entry.samples
        if content is not None and model_wide.calibration is not None:
            # the kind's own, unless the model's billing shifted and the kind has not seen it yet
            own = self._contents.get((fleet, model, content))
            if own is not None and own.calibration is not None and (own.shifted or not model_wide.shifted):
                return own.calibration
        return model_wide.calibration

    def learned_limit(self, fleet: str, model: str) -> int | None:
        return self._limits.get((fleet, model))

    def summaries(self, fleet: str | None = None) -> list[ModelSummary]:
        """One row per (fleet, model, counter kind), sorted; ``fleet``: only that fleet's."""
        rows = []
        limits_only: set[tuple[str, str, Kind]] = {
            (f, m, "estimate") for f, m in self._limits if not self._has_model(f, m)
        }
        keys = set(self._entries) | limits_only
        for f, model, kind in sorted(keys):
            if fleet is not None and f != fleet:
                continue
            entry = self._entries.get((f, model, kind)) or _empty(kind)
            recent = entry.samples.recent
            d = drift(recent) if kind == "exact" else None
            rows.append(
                ModelSummary(
                    fleet=f,
                    model=model,
                    kind=kind,
                    usage_reports=entry.usage_reports,
                    rejections=entry.rejections,
                    samples=len(recent),
                    ignored=entry.samples.ignored,
                    median=drift(recent, min_samples=1) if recent else None,
                    p90=quantile(recent, P90),
                    calibration=entry.samples.calibration if kind == "estimate" else None,
                    drift=d,
                    drifted=drifted(d),
                    learned_limit=self._limits.get((f, model)),
                    last_at=entry.last_at,
                    anchored=entry.anchored,
                    contents=tuple(
                        (c, state.calibration, len(state.recent))
                        for (cf, cm, c), state in sorted(self._contents.items())
                        if kind == "estimate" and (cf, cm) == (f, model)
                    ),
                )
            )
        return rows

    def _has_model(self, fleet: str, model: str) -> bool:
        return (fleet, model, "estimate") in self._entries or (fleet, model, "exact") in self._entries
