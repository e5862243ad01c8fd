"""The measurement the tests record most (a count the caller made, of a gpt-4o request, exact), the
body of an HTTP observe (``measure``) and a fresh session id (``sid``)."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any


def measurement(basis: str, used: int, limit: int = 1000, quality: str = "exact_local") -> dict[str, Any]:
    """A measurement of ``used`` tokens of ``limit`` on ``basis`` (its fingerprint: the SHA-256 of the basis)."""
    return {
        "basis": basis,
        "input_tokens": used,
        "input_limit": limit,
        "quality": quality,
        "model": {"provider": "openai", "name": "gpt-4o"},
        "fingerprint": hashlib.sha256(basis.encode()).hexdigest(),
    }


def measure(basis: str, tokens: int, limit: int = 100_000, **extra: Any) -> dict[str, Any]:
    """The JSON body of ``POST /v1/sessions/{id}/observe`` with a measurement (and ``extra`` fields)."""
    return {"measurement": {"basis": basis, "input_tokens": tokens, "input_limit": limit}, **extra}


def sid(label: str = "s") -> str:
    """A session id no other test uses: ``<label>-<10 hex digits>``."""
    return f"{label}-{uuid.uuid4().hex[:10]}"
