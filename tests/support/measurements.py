"""The measurement the tests record most: a count the caller made, of a gpt-4o request, exact."""

from __future__ import annotations

import hashlib
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
