"""Exact counting in fresh interpreters: no network and no tiktoken cache needed, and the fingerprint the same
in every process (hash seeds differ). The in-process counting tests are in tests/unit/test_counting_exact.py."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

from tests.support.agent_request import AGENT_REQUEST
from tracker.counting import CanonicalRequest, ExactLocalCounter, ModelRegistry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REGISTRY = ModelRegistry.load()
O200K_MODEL = REGISTRY.get("gpt-4o")
CL100K_MODEL = REGISTRY.get("gpt-4-turbo")


# -- tiktoken itself, fed the same rank data through its own cache (no network) --------------


def test_exact_counter_works_with_no_network_and_empty_tiktoken_cache(tmp_path):
    """A fresh interpreter with outbound sockets blocked and an empty TIKTOKEN_CACHE_DIR."""
    cache = tmp_path / "empty-cache"
    cache.mkdir()
    script = textwrap.dedent(
        """
        import json, socket, sys

        attempts = []

        def _loopback(address):
            host = address[0] if isinstance(address, tuple) else address
            return isinstance(host, str) and (host.startswith("127.") or host in ("::1", "localhost"))

        _connect = socket.socket.connect
        def guarded_connect(self, address):
            if self.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address):
                attempts.append(repr(address))
                raise OSError("network disabled by test: " + repr(address))
            return _connect(self, address)
        socket.socket.connect = guarded_connect
        _create = socket.create_connection
        def guarded_create(address, *a, **k):
            if not _loopback(address):
                attempts.append(repr(address))
                raise OSError("network disabled by test: " + repr(address))
            return _create(address, *a, **k)
        socket.create_connection = guarded_create
        def no_dns(*a, **k):
            attempts.append("getaddrinfo " + repr(a[:1]))
            raise OSError("dns disabled by test")
        socket.getaddrinfo = no_dns

        from tracker.counting import CanonicalRequest, ExactLocalCounter, ModelRegistry
        reg = ModelRegistry.load()
        req = CanonicalRequest.from_dict(json.loads(sys.argv[1]))
        out = {m: ExactLocalCounter().count(req, reg.get(m)).input_tokens for m in ("gpt-4o", "gpt-4-turbo")}
        print(json.dumps({"counts": out, "attempts": attempts, "modules": "requests" in sys.modules}))
        """
    )
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(cache), "PYTHONPATH": ROOT}
    env.pop("DATA_GYM_CACHE_DIR", None)
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(AGENT_REQUEST)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["attempts"] == []
    assert list(cache.iterdir()) == []  # tiktoken's cache neither read nor written
    here = CanonicalRequest.from_dict(AGENT_REQUEST)
    assert out["counts"] == {
        "gpt-4o": ExactLocalCounter().count(here, O200K_MODEL).input_tokens,
        "gpt-4-turbo": ExactLocalCounter().count(here, CL100K_MODEL).input_tokens,
    }


def test_fingerprint_is_pinned_and_stable_across_processes():
    raw = {"system": "Be brief.", "messages": [{"role": "user", "content": "Hi — ok?"}]}
    pinned = hashlib.sha256(
        '{"messages":[{"content":[{"text":"Hi — ok?","type":"text"}],"role":"user"}],"system":[{"text":"Be brief.","type":"text"}],"tools":[]}'.encode()
    ).hexdigest()
    assert CanonicalRequest.from_dict(raw).fingerprint == pinned
    code = "import json,sys; from tracker.counting import CanonicalRequest; print(CanonicalRequest.from_dict(json.loads(sys.argv[1])).fingerprint)"
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps(AGENT_REQUEST)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": ROOT},
            timeout=60,
        )
        assert out.stdout.strip() == CanonicalRequest.from_dict(AGENT_REQUEST).fingerprint, out.stderr
