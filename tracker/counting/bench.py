"""Counting benchmarks (``tracker bench`` calls :func:`run_counting_bench`).

Measures, on a realistic agent request (system prompt, code, prose, JSON tool output,
non-ASCII text, a base64 attachment, tool definitions):

- ``exact_tokens_per_s`` — the offline o200k encoding built from bpe-openai's rank file;
- ``tiktoken_tokens_per_s`` — tiktoken's own ``get_encoding("o200k_base")`` over the same
  text (fed the same rank file through a private cache, so no network), and the ratio;
- ``inprocess_*`` — complete ``InProcessCounting.measure`` calls (parse, fingerprint,
  registry, worker thread with deadline, count, validation);
- with a broker: ``celery_*`` — the same through a real worker subprocess this function
  starts (prefork, concurrency 2): sequential latency, and throughput with 8 callers.
"""

from __future__ import annotations

import base64
import hashlib
import inspect
import json
import os
import random
import tempfile
import threading
import time
import uuid
from typing import Any, Callable

from tracker.core.model import Basis
from tracker.core.policy import Policy
from tracker.counting.counters import load_encoding, load_rank_bytes
from tracker.counting.registry import ModelRegistry
from tracker.counting.request import CanonicalRequest
from tracker.counting.service import CeleryCounting, InProcessCounting

MODEL = "gpt-4o"
_TIKTOKEN_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
_env_lock = threading.Lock()


def sample_request(seed: int = 7, turns: int = 12) -> dict[str, Any]:
    """A realistic coding-agent request of roughly 10-15k tokens."""
    import argparse
    import json as json_mod
    import textwrap

    rng = random.Random(seed)
    code = inspect.getsource(textwrap) + inspect.getsource(argparse)[:20_000]
    prose = (json_mod.__doc__ or "") + (inspect.getdoc(argparse.ArgumentParser) or "")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Please refactor the argument parser and explain the changes."}]
    for i in range(turns):
        start = rng.randrange(0, len(code) - 1500)
        call_id = f"call_{i}"
        messages.append(
            {
                "role": "assistant",
                "content": f"Step {i}: reading more of the module.",
                "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "read_file", "arguments": json.dumps({"path": "argparse.py", "offset": start})}}],
            }
        )
        output: Any = code[start : start + rng.randint(300, 1500)]
        if i % 4 == 1:
            output = json.dumps({"matches": [{"line": rng.randint(1, 2000), "text": prose[j * 40 : j * 40 + 60]} for j in range(15)]}, indent=1)
        if i % 4 == 2:
            output = "Résumé — 文档 📄 " + base64.b64encode(rng.randbytes(600)).decode()
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
    messages.append({"role": "user", "content": prose[:1500]})
    return {
        "system": "You are a careful senior engineer. Use the tools; never invent file contents.",
        "messages": messages,
        "tools": [
            {"type": "function", "function": {"name": "read_file", "description": "Read part of a file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "offset": {"type": "integer"}}, "required": ["path"]}}},
            {"type": "function", "function": {"name": "run", "description": "Run a shell command", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}},
        ],
    }


def _text_of(request: dict[str, Any]) -> str:
    return CanonicalRequest.from_dict(request).canonical_json()


def _tiktoken_o200k() -> Any:
    """tiktoken's own o200k encoding, fed bpe-openai's rank file via a private cache (no network)."""
    import tiktoken

    with _env_lock, tempfile.TemporaryDirectory(prefix="ct-tiktoken-") as cache:
        with open(os.path.join(cache, hashlib.sha1(_TIKTOKEN_URL.encode()).hexdigest()), "wb") as fh:
            fh.write(load_rank_bytes("o200k_base"))
        old = os.environ.get("TIKTOKEN_CACHE_DIR")
        os.environ["TIKTOKEN_CACHE_DIR"] = cache
        try:
            return tiktoken.get_encoding("o200k_base")
        finally:
            if old is None:
                os.environ.pop("TIKTOKEN_CACHE_DIR", None)
            else:
                os.environ["TIKTOKEN_CACHE_DIR"] = old


def _throughput(encode: Callable[[str], list[int]], text: str, seconds: float) -> float:
    tokens = 0
    started = time.perf_counter()
    while True:
        tokens += len(encode(text))
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return tokens / elapsed


def _latencies(call: Callable[[], Any], seconds: float, max_calls: int = 100_000) -> list[float]:
    out: list[float] = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds and len(out) < max_calls:
        t0 = time.perf_counter()
        call()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def _concurrent_rate(call: Callable[[], Any], threads: int, seconds: float) -> float:
    done = [0] * threads
    stop = time.perf_counter() + seconds

    def work(i: int) -> None:
        while time.perf_counter() < stop:
            call()
            done[i] += 1

    started = time.perf_counter()
    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return sum(done) / (time.perf_counter() - started)


def run_counting_bench(quick: bool = True, broker_url: str | None = None, *, result_backend: str | None = None) -> dict[str, Any]:
    """Run the counting benchmarks; ``quick`` keeps the whole run around 20 s or less."""
    span = 1.0 if quick else 5.0
    request = sample_request()
    text = _text_of(request) * (2 if quick else 8)
    policy = Policy()
    basis = Basis(1, "bench")
    out: dict[str, Any] = {"quick": quick, "model": MODEL}

    exact = load_encoding("o200k_base")
    reference = _tiktoken_o200k()
    if exact.encode_ordinary(text) != reference.encode_ordinary(text):  # pragma: no cover - would be a bug
        raise AssertionError("the offline encoding and tiktoken disagree")
    out["text_chars"] = len(text)
    out["exact_tokens_per_s"] = round(_throughput(exact.encode_ordinary, text, span))
    out["tiktoken_tokens_per_s"] = round(_throughput(reference.encode_ordinary, text, span))
    out["exact_vs_tiktoken"] = round(out["exact_tokens_per_s"] / out["tiktoken_tokens_per_s"], 3)

    registry = ModelRegistry.load(settings={})
    local = InProcessCounting(registry)
    local.warm()
    measured = local.measure(request, model=MODEL, basis=basis, policy=policy)
    out["request_tokens"] = measured.input_tokens
    lat = _latencies(lambda: local.measure(request, model=MODEL, basis=basis, policy=policy), 2 * span)
    out["inprocess_counts_per_s"] = round(len(lat) / (sum(lat) / 1000), 1)
    out["inprocess_ms_p50"] = _pct(lat, 0.50)
    out["inprocess_ms_p99"] = _pct(lat, 0.99)

    if broker_url:
        out.update(_celery_bench(broker_url, result_backend, request, registry, measured.input_tokens, span, out["inprocess_ms_p50"]))
    return out


def _celery_bench(
    broker_url: str,
    result_backend: str | None,
    request: dict[str, Any],
    registry: ModelRegistry,
    expected_tokens: int,
    span: float,
    inprocess_p50: float,
) -> dict[str, Any]:
    from workers.app import WorkerProcess, make_app, result_backend_url

    backend_url = result_backend or result_backend_url({"TRACKER_BROKER_URL": broker_url})
    queue = f"ct-bench-{uuid.uuid4().hex[:10]}"
    app = make_app({}, broker=broker_url, backend=backend_url, queue=queue)
    worker = WorkerProcess(broker=broker_url, backend=backend_url, queue=queue, concurrency=2)
    policy = Policy()
    basis = Basis(1, "bench")
    started = time.perf_counter()
    worker.start()
    try:
        worker.wait_ready(app, timeout=30)
        startup_s = time.perf_counter() - started
        remote = CeleryCounting(app, registry, queue=queue)
        first = remote.measure(request, model=MODEL, basis=basis, policy=policy)
        if first.input_tokens != expected_tokens:  # pragma: no cover - would be a bug
            raise AssertionError("the worker's count differs from the in-process count")

        def call() -> Any:
            return remote.measure(request, model=MODEL, basis=basis, policy=policy)

        lat = _latencies(call, 2 * span)
        rate = _concurrent_rate(call, threads=8, seconds=2 * span)
        p50 = _pct(lat, 0.50)
        return {
            "celery_worker_startup_s": round(startup_s, 2),
            "celery_counts_per_s": round(rate, 1),
            "celery_sequential_counts_per_s": round(len(lat) / (sum(lat) / 1000), 1),
            "celery_ms_p50": p50,
            "celery_ms_p99": _pct(lat, 0.99),
            "celery_overhead_ms_p50": round(p50 - inprocess_p50, 3),
        }
    finally:
        worker.stop()
        app.close()


if __name__ == "__main__":  # python -m tracker.counting.bench [--full] [broker_url]
    import sys

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    print(json.dumps(run_counting_bench(quick="--full" not in sys.argv, broker_url=args[0] if args else None), indent=2))
