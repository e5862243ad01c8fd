"""Counting bench, on a realistic agent request (system prompt, code, prose, JSON tool output,
non-ASCII text, a base64 attachment, tool definitions):

- ``exact_tokens_per_s``: the offline o200k encoding built from bpe-openai's rank file;
- ``tiktoken_tokens_per_s``: tiktoken's own ``get_encoding("o200k_base")`` over the same text
  (fed the same rank file through a private cache, so no network), and the ratio;
- ``inprocess_*``: complete ``InProcessCounting.measure`` calls (parse, fingerprint, registry,
  worker thread with deadline, count, validation);
- with a broker: ``celery_*``: the same through a real worker subprocess this bench starts
  (prefork, concurrency 2): sequential latency, and throughput with 8 callers.

The backends come from the composition root (``tracker.bootstrap``), configured by the
process's ``Settings`` with only the broker and a private queue replaced.
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
from collections.abc import Callable
from typing import Any

from tracker.bench.stats import concurrent_rate, latency_ms, ratio, throughput, timed_calls
from tracker.core import Basis, Policy
from tracker.counting.counters import load_encoding, load_rank_bytes
from tracker.counting.request import CanonicalRequest
from tracker.settings import Settings, mask

MODEL = "gpt-4o"
_TIKTOKEN_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
_env_lock = threading.Lock()


def sample_request(seed: int = 7, turns: int = 12) -> dict[str, Any]:
    """A realistic coding-agent request of roughly 10-15k tokens."""
    import argparse
    import textwrap

    rng = random.Random(seed)
    code = inspect.getsource(textwrap) + inspect.getsource(argparse)[:20_000]
    prose = (json.__doc__ or "") + (inspect.getdoc(argparse.ArgumentParser) or "")
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Please refactor the argument parser and explain the changes."}
    ]
    for i in range(turns):
        start = rng.randrange(0, len(code) - 1500)
        call_id = f"call_{i}"
        messages.append(
            {
                "role": "assistant",
                "content": f"Step {i}: reading more of the module.",
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": "read_file",
                            "arguments": json.dumps({"path": "argparse.py", "offset": start}),
                        },
                    }
                ],
            }
        )
        output: Any = code[start : start + rng.randint(300, 1500)]
        if i % 4 == 1:
            output = json.dumps(
                {"matches": [{"line": rng.randint(1, 2000), "text": prose[j * 40 : j * 40 + 60]} for j in range(15)]},
                indent=1,
            )
        if i % 4 == 2:
            output = "Résumé — 文档 📄 " + base64.b64encode(rng.randbytes(600)).decode()
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
    messages.append({"role": "user", "content": prose[:1500]})
    return {
        "system": "You are a careful senior engineer. Use the tools; never invent file contents.",
        "messages": messages,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "read_file",
                    "description": "Read part of a file",
                    "parameters": {
                        "type": "object",
                        "properties": {"path": {"type": "string"}, "offset": {"type": "integer"}},
                        "required": ["path"],
                    },
                },
            },
            {
                "type": "function",
                "function": {
                    "name": "run",
                    "description": "Run a shell command",
                    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
                },
            },
        ],
    }


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


def _tokens_per_s(encode: Callable[[str], list[int]], text: str, seconds: float) -> float:
    tokens = 0
    started = time.perf_counter()
    while True:
        tokens += len(encode(text))
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return throughput(tokens, elapsed)


def run_counting_bench(settings: Settings, quick: bool = True, broker_url: str | None = None) -> dict[str, Any]:
    """Encoding speed, in-process counts and (with ``broker_url``) Celery counts; ``quick`` keeps it ~20 s.

    A Celery failure (broker down, worker not starting) leaves the in-process figures in place and
    puts ``"error"`` in the result, which makes the section count as failed.
    """
    from tracker.bootstrap import build_registry
    from tracker.counting import InProcessCounting

    span = 1.0 if quick else 5.0
    request = sample_request()
    text = CanonicalRequest.from_dict(request).canonical_json() * (2 if quick else 8)
    policy = Policy()
    basis = Basis(1, "bench")
    out: dict[str, Any] = {"model": MODEL}

    exact = load_encoding("o200k_base")
    reference = _tiktoken_o200k()
    if exact.encode_ordinary(text) != reference.encode_ordinary(text):  # pragma: no cover - would be a bug
        raise RuntimeError("the offline encoding and tiktoken disagree")
    out["text_chars"] = len(text)
    out["exact_tokens_per_s"] = round(_tokens_per_s(exact.encode_ordinary, text, span))
    out["tiktoken_tokens_per_s"] = round(_tokens_per_s(reference.encode_ordinary, text, span))
    out["exact_vs_tiktoken"] = ratio(out["exact_tokens_per_s"], out["tiktoken_tokens_per_s"])

    registry = build_registry(settings)
    local = InProcessCounting(registry)
    local.warm()
    measured = local.measure(request, model=MODEL, basis=basis, policy=policy)
    out["request_tokens"] = measured.input_tokens
    lat, elapsed = timed_calls(lambda: local.measure(request, model=MODEL, basis=basis, policy=policy), 2 * span)
    figures = latency_ms(lat)
    out["inprocess_counts_per_s"] = throughput(len(lat), elapsed)
    out["inprocess_ms_p50"] = figures["ms_p50"]
    out["inprocess_ms_p99"] = figures["ms_p99"]

    if broker_url:
        try:
            out.update(_celery_bench(settings, broker_url, registry, request, measured.input_tokens, span))
        except Exception as exc:  # noqa: BLE001 - the Celery half reports why it could not run
            out["error"] = f"celery on {mask(broker_url)}: {type(exc).__name__}: {exc}"
        else:
            out["celery_overhead_ms_p50"] = round(out["celery_ms_p50"] - out["inprocess_ms_p50"], 3)
    return out


def _celery_bench(
    settings: Settings, broker_url: str, registry: Any, request: dict[str, Any], expected_tokens: int, span: float
) -> dict[str, Any]:
    from tracker.bench.procs import WorkerProcess
    from tracker.bootstrap import build_counting
    from tracker.counting.celery import CeleryCounting

    queue = f"ct-bench-{uuid.uuid4().hex[:10]}"
    counting = settings.counting.model_copy(update={"broker_url": broker_url, "count_queue": queue})
    remote = build_counting(settings.model_copy(update={"counting": counting}), registry=registry)
    if not isinstance(remote, CeleryCounting):  # pragma: no cover - build_counting picks Celery for a broker
        raise RuntimeError(f"expected Celery counting for a broker, got {type(remote).__name__}")
    app = remote.app
    worker = WorkerProcess(broker=broker_url, backend=str(app.conf.result_backend), queue=queue, concurrency=2)
    policy = Policy()
    basis = Basis(1, "bench")
    started = time.perf_counter()
    worker.start()
    try:
        worker.wait_ready(app, timeout=30)
        startup_s = time.perf_counter() - started
        first = remote.measure(request, model=MODEL, basis=basis, policy=policy)
        if first.input_tokens != expected_tokens:  # pragma: no cover - would be a bug
            raise RuntimeError("the worker's count differs from the in-process count")

        def call() -> Any:
            return remote.measure(request, model=MODEL, basis=basis, policy=policy)

        lat, elapsed = timed_calls(call, 2 * span)
        figures = latency_ms(lat)
        return {
            "result_backend": mask(app.conf.result_backend),
            "celery_worker_startup_s": round(startup_s, 2),
            "celery_counts_per_s": concurrent_rate(call, threads=8, seconds=2 * span),
            "celery_sequential_counts_per_s": throughput(len(lat), elapsed),
            "celery_ms_p50": figures["ms_p50"],
            "celery_ms_p99": figures["ms_p99"],
        }
    finally:
        worker.stop()
        remote.close()
