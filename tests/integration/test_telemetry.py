"""Traces, logs and metrics, end to end with real parts.

* One trace across two processes: an HTTP ``observe`` served by a real uvicorn server (in this
  process, its spans caught by the OpenTelemetry SDK's in-memory exporter) that counts on a real
  prefork Celery worker (a subprocess configured only by the standard ``OTEL_*`` variables; it
  exports over OTLP/HTTP to a collector on loopback that this test runs and decodes with the
  OTLP protobuf definitions). The worker's span must name the caller's span as its parent.
* Every metric the shipped dashboard and alert rules query is exported by that server or worker,
  and ``promtool check rules`` passes on the rules.
* ``tracker serve`` with ``TRACKER_LOG_FORMAT=json``: every line parses, decision lines carry the
  fleet, session, attempt and trace ids, and no line holds the database password or a key.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.bench import WorkerProcess, free_port, start_server
from tests.support.db import REDIS_URL, create_pg_database, drop_pg_database
from tests.support.db import sqlalchemy_url as _sqlalchemy_url
from tracker.counting.celery import make_celery_app
from tracker.settings import Settings

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.celery, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MODELS = ROOT / "tracker" / "demo" / "models.json"  # a 40k-window model: a few kB of text reach `compact`
MODEL = "demo-agent-40k"


# -- a collector: OTLP/HTTP (protobuf) on loopback ---------------------------------------------------


class Collector:
    """Receives ``POST /v1/traces`` (OTLP/HTTP protobuf) and keeps the spans, decoded."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceRequest,
                    ExportTraceServiceResponse,
                )

                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                collector.add(req)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, req: Any) -> None:
        def value(v: Any) -> Any:
            return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None

        with self.lock:
            for rs in req.resource_spans:
                resource = {a.key: value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        self.spans.append(
                            {
                                "name": sp.name,
                                "trace_id": sp.trace_id.hex(),
                                "span_id": sp.span_id.hex(),
                                "parent_id": sp.parent_span_id.hex() or None,
                                "attributes": {a.key: value(a.value) for a in sp.attributes},
                                "service": resource.get("service.name"),
                            }
                        )

    def wait_for(self, name: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                found = [s for s in self.spans if s["name"] == name]
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"no {name} span reached the collector in {timeout}s: {self.spans}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def otel_env(collector: Collector, service: str) -> dict[str, str]:
    """The standard variables only: OTLP/HTTP to the collector, short batch delay."""
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": collector.url + "/v1/traces",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_SERVICE_NAME": service,
    }


# -- the in-process side: the SDK's in-memory exporter ---------------------------------------------------


def in_memory_exporter() -> Any:
    """An in-memory exporter on this process's tracer provider (installed once per process)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    assert isinstance(trace.get_tracer_provider(), TracerProvider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def as_dict(span: Any) -> dict[str, Any]:
    return {
        "name": span.name,
        "trace_id": format(span.context.trace_id, "032x"),
        "span_id": format(span.context.span_id, "016x"),
        "parent_id": format(span.parent.span_id, "016x") if span.parent else None,
        "attributes": dict(span.attributes or {}),
    }


def ancestors(span: dict[str, Any], spans: list[dict[str, Any]]) -> list[str]:
    """The span ids above ``span``, nearest first."""
    by_id = {s["span_id"]: s for s in spans}
    out, parent = [], span["parent_id"]
    while parent is not None and parent in by_id:
        out.append(parent)
        parent = by_id[parent]["parent_id"]
    return out


def finished(exporter: Any, done: Any, timeout: float = 30.0) -> list[dict[str, Any]]:
    """The finished spans, once ``done(spans)`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        spans = [as_dict(s) for s in exporter.get_finished_spans()]
        if done(spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.02)


class ThreadServer:
    """A real uvicorn server on loopback, serving ``app`` from a thread of this process."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


# -- the stack: Postgres, Redis broker, a real worker, the server -------------------------------------------


@pytest.fixture(scope="module")
def stack():
    from tracker.http.app import create_app
    from tracker.store import upgrade
    from tracker.store.engine import make_engine
    from tracker.store.fleets import FleetStore

    name, url = create_pg_database("ct_otel")
    db_url = _sqlalchemy_url(url)
    queue = f"ct-otel-{uuid.uuid4().hex[:8]}"
    collector = Collector()
    exporter = in_memory_exporter()
    worker_port = free_port()
    worker = server = None
    try:
        upgrade(db_url)
        engine = make_engine(db_url)
        fleets = FleetStore(engine)
        fleet = fleets.create_fleet(f"otel-{uuid.uuid4().hex[:6]}")
        _, token = fleets.create_key(fleet["fleet_id"])
        engine.dispose()
        worker = WorkerProcess(
            broker=REDIS_URL,
            backend=REDIS_URL,
            queue=queue,
            concurrency=1,
            env={
                **otel_env(collector, "tracker-worker"),
                "TRACKER_MODELS_FILE": str(MODELS),
                "TRACKER_WORKER_METRICS_PORT": str(worker_port),
            },
        ).start()
        settings = Settings.of(
            database_url=db_url,
            redis_url=REDIS_URL,
            broker_url=REDIS_URL,
            result_backend=REDIS_URL,
            count_queue=queue,
            models_file=str(MODELS),
            count_timeout_s=10.0,
        )
        ping_app = make_celery_app(settings.counting, default_timeout_s=10.0)
        worker.wait_ready(ping_app)
        ping_app.close()
        server = ThreadServer(create_app(settings=settings))
        yield {
            "url": server.url,
            "token": token,
            "fleet": fleet,
            "collector": collector,
            "exporter": exporter,
            "worker_metrics": f"http://127.0.0.1:{worker_port}/metrics",
            "worker": worker,
        }
    finally:
        if server is not None:
            server.stop()
        if worker is not None:
            worker.stop()
        exporter.shutdown()
        collector.close()
        drop_pg_database(name)


def long_request(words: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * words}]}


def test_one_http_observe_is_one_trace_across_the_celery_worker(stack):
    exporter, collector = stack["exporter"], stack["collector"]
    exporter.clear()
    sid = f"otel-{uuid.uuid4().hex[:8]}"
    fleet_id = stack["fleet"]["fleet_id"]
    with httpx.Client(base_url=stack["url"], headers={"Authorization": f"Bearer {stack['token']}"}, timeout=60) as c:
        # ~36k tokens of a 40k window (less the reply and margin): over the compact level → an attempt opens
        r = c.post(
            f"/v1/sessions/{sid}/observe",
            json={"request": long_request(3300), "model": MODEL, "basis": "msg-1"},
        )
        assert r.status_code == 200, r.text
        decision = r.json()
        assert decision["action"] == "compact", decision
        attempt = decision["attempt"]
        # a refused commit (wrong fencing token) carries its error code
        r = c.post(
            f"/v1/sessions/{sid}/compactions/{attempt['attempt_id']}/commit",
            json={"fencing_token": attempt["fencing_token"] + 7, "tokens_after": 1000},
        )
        assert r.status_code == 409, r.text
        code = r.json()["code"]

    # a server span ends just after its response is sent: wait until both requests' have
    mine = finished(exporter, lambda spans: sum(s["name"].startswith("POST /v1/") for s in spans) >= 2)
    http = [s for s in mine if s["name"] == "POST /v1/sessions/{session_id}/observe"]
    assert len(http) == 1, "\n".join(
        str((s["name"], s["span_id"], s["parent_id"], s["trace_id"][:6], s["attributes"])) for s in mine
    )
    trace_id = http[0]["trace_id"]
    in_trace = {s["name"]: s for s in mine if s["trace_id"] == trace_id}
    for name in ("tracker.observe", "tracker.count", "tracker.coordination", "tracker.decide", "tracker.append"):
        assert name in in_trace, (name, sorted(in_trace))
    observe, count = in_trace["tracker.observe"], in_trace["tracker.count"]
    # the tree: HTTP > [the framework's span of the endpoint] > observe > (count, coordination > (decide, append))
    assert http[0]["span_id"] in ancestors(observe, mine)
    assert count["parent_id"] == observe["span_id"]
    assert in_trace["tracker.coordination"]["parent_id"] == observe["span_id"]
    for name in ("tracker.decide", "tracker.append"):
        assert in_trace[name]["parent_id"] == in_trace["tracker.coordination"]["span_id"]

    # the worker's span, exported by the worker process, is in the same trace under the count span
    task = [s for s in collector.wait_for("tracker.count_task") if s["trace_id"] == trace_id]
    assert len(task) == 1, collector.spans
    assert task[0]["parent_id"] == count["span_id"]
    assert task[0]["service"] == "tracker-worker"
    assert task[0]["attributes"]["tracker.count_quality"] == "exact_local"
    assert task[0]["attributes"]["tracker.model"] == MODEL

    # the attributes
    assert http[0]["attributes"]["tracker.fleet"] == fleet_id
    assert http[0]["attributes"]["http.response.status_code"] == 200
    a = observe["attributes"]
    assert a["tracker.fleet"] == fleet_id
    assert a["tracker.session_id"] == f"{fleet_id}:{sid}"
    assert a["tracker.basis"] == decision["basis"]
    assert a["tracker.action"] == "compact"
    assert a["tracker.pressure"] == decision["pressure"]
    assert a["tracker.occupancy_bp"] == decision["occupancy_bp"]
    assert a["tracker.attempt_id"] == attempt["attempt_id"]
    assert a["tracker.count_quality"] == "exact_local"
    assert count["attributes"]["tracker.count_quality"] == "exact_local"
    # the refused commit: its own trace, the error code on the command's span and the HTTP span
    commits = [s for s in mine if s["name"] == "tracker.commit"]
    assert len(commits) == 1 and commits[0]["trace_id"] != trace_id
    assert commits[0]["attributes"]["tracker.error_code"] == code
    assert commits[0]["attributes"]["tracker.attempt_id"] == attempt["attempt_id"]
    commit_http = [s for s in mine if s["name"] == "POST /v1/sessions/{session_id}/compactions/{attempt_id}/commit"]
    assert len(commit_http) == 1 and commit_http[0]["span_id"] in ancestors(commits[0], mine)
    assert commit_http[0]["attributes"]["tracker.error_code"] == code
    assert commit_http[0]["attributes"]["http.response.status_code"] == 409


# -- the shipped dashboard and rules query what is exported -----------------------------------------------

PROMETHEUS_OWN = {"up"}  # made by Prometheus for every scrape target, not by an exporter


def queried_metrics() -> set[str]:
    """Every metric name in the dashboard's and the rules' PromQL expressions."""
    import yaml

    exprs: list[str] = []
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text(encoding="utf-8"))
    for group in rules["groups"]:
        exprs += [r["expr"] for r in group["rules"]]
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "tracker.json").read_text(encoding="utf-8"))
    for panel in dashboard["panels"]:
        exprs += [t["expr"] for t in panel.get("targets", ())]
    names = set()
    for expr in exprs:
        names |= {n for n in re.findall(r"\b(tracker_[a-z0-9_]+|up)\b", expr)}
    assert len(exprs) >= 10 and names, exprs
    return names


def exported(text: str) -> set[str]:
    """Names of the series a /metrics page exposes (histograms' ``_bucket``/``_sum``/``_count`` too)."""
    out = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            out.add(name)
            if kind == "histogram":
                out |= {name + "_bucket", name + "_sum", name + "_count"}
            if kind == "counter" and not name.endswith("_total"):
                out.add(name + "_total")
        elif line and not line.startswith("#"):
            out.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return out


def test_every_metric_the_dashboard_and_rules_query_is_exported(stack):
    with httpx.Client(base_url=stack["url"], headers={"Authorization": f"Bearer {stack['token']}"}, timeout=60) as c:
        r = c.post(
            f"/v1/sessions/m-{uuid.uuid4().hex[:8]}/observe",
            json={"request": long_request(50), "model": MODEL, "basis": "m1"},
        )
        assert r.status_code == 200, r.text
        server_page = c.get("/metrics").text
    worker_page = httpx.get(stack["worker_metrics"], timeout=10).text
    available = exported(server_page) | exported(worker_page)
    missing = sorted(queried_metrics() - available - PROMETHEUS_OWN)
    assert not missing, f"queried but exported by neither the server nor the worker: {missing}"
    # the worker's own page: this count's latency, by the counter's quality (summed over the pool)
    assert re.search(r'^tracker_worker_count_duration_seconds_count\{quality="exact_local"\} [1-9]', worker_page, re.M)
    # the fleet gauges: every pressure of the fleet, from the store
    fleet = re.escape(stack["fleet"]["name"])
    for pressure in ("normal", "compact", "hard_limit"):
        assert re.search(rf'^tracker_sessions\{{fleet="{fleet}",pressure="{pressure}"\}} \d', server_page, re.M)
    assert re.search(r"^tracker_store_up 1", server_page, re.M)


def test_promtool_checks_the_rules():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus; .ci/run does)")
    proc = subprocess.run(
        [promtool, "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_promtool_fires_the_provider_alerts_on_drift_and_rejections(tmp_path):
    """``promtool test rules`` on series shaped like ours: an exact counter billed 4 % over its
    count fires the drift alert (one 1 % off does not), one rejection fires the rejection alert
    for ten minutes."""
    import yaml

    from tracker.metrics import DRIFT_BUCKETS

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus; .ci/run does)")

    def drift(model: str, ratio: float, per_minute: int) -> list[dict[str, str]]:
        series = [
            {
                "series": f'tracker_count_drift_ratio_bucket{{model="{model}",counter="exact",le="{le}"}}',
                "values": f"0+{per_minute if le == '+Inf' or ratio <= float(le) else 0}x90",
            }
            for le in [*map(str, DRIFT_BUCKETS), "+Inf"]
        ]
        count = f'tracker_count_drift_ratio_count{{model="{model}",counter="exact"}}'
        return [*series, {"series": count, "values": f"0+{per_minute}x90"}]

    rejected = {"series": 'tracker_provider_rejections_total{model="claude-sonnet-4-5"}', "values": "0 0 0" + " 1" * 30}
    warning = {"severity": "warning"}
    tests = {
        "rule_files": [str(DEPLOY / "prometheus" / "alerts.yml")],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [*drift("gpt-4o", 1.04, 2), *drift("gpt-4.1", 0.99, 2), rejected],
                "alert_rule_test": [
                    {"eval_time": "10m", "alertname": "TrackerExactCounterDrift", "exp_alerts": []},
                    {
                        "eval_time": "50m",
                        "alertname": "TrackerExactCounterDrift",
                        "exp_alerts": [
                            {
                                "exp_labels": {**warning, "model": "gpt-4o"},
                                "exp_annotations": {
                                    "summary": "Model gpt-4o: the provider bills 3.5% away from the exact count (median)",
                                    "description": "",
                                },
                            }
                        ],
                    },
                    {
                        "eval_time": "5m",
                        "alertname": "TrackerProviderRejection",
                        "exp_alerts": [
                            {
                                "exp_labels": {**warning, "model": "claude-sonnet-4-5"},
                                "exp_annotations": {
                                    "summary": "Model claude-sonnet-4-5: the provider rejected requests as too long (1 in 10 min)",
                                    "description": "",
                                },
                            }
                        ],
                    },
                    {"eval_time": "20m", "alertname": "TrackerProviderRejection", "exp_alerts": []},
                ],
            }
        ],
    }
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text(encoding="utf-8"))
    descriptions = {r["alert"]: r["annotations"].get("description", "") for g in rules["groups"] for r in g["rules"]}
    for case in tests["tests"][0]["alert_rule_test"]:
        for alert in case["exp_alerts"]:
            alert["exp_annotations"]["description"] = descriptions[case["alertname"]]
    path = tmp_path / "provider_alerts_test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False), encoding="utf-8")
    proc = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


def test_promtool_fires_the_feed_alert_while_a_transaction_holds_the_feed_back(tmp_path):
    """``promtool test rules``: the feed held back for more than a minute, for five minutes, fires
    ``TrackerFeedHeldBack``; a feed that catches up within the minute does not."""
    import yaml

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus; .ci/run does)")
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text(encoding="utf-8"))
    (rule,) = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "TrackerFeedHeldBack"]

    def case(values: str, at: str, firing: bool, seconds: str = "") -> dict[str, Any]:
        expected = {
            "exp_labels": {"severity": "warning"},
            "exp_annotations": {
                "summary": f"The event feed has held committed events back for {seconds}",
                "description": rule["annotations"]["description"],
            },
        }
        return {
            "interval": "1m",
            "input_series": [{"series": "tracker_feed_held_seconds", "values": values}],
            "alert_rule_test": [
                {"eval_time": at, "alertname": "TrackerFeedHeldBack", "exp_alerts": [expected] if firing else []}
            ],
        }

    tests = {
        "rule_files": [str(DEPLOY / "prometheus" / "alerts.yml")],
        "evaluation_interval": "1m",
        "tests": [
            case("0+60x20", "5m", False),  # held 300 s, but over 60 s only since minute 2
            case("0+60x20", "8m", True, "8m 0s"),
            case("0 30 0 45 0 50 0 30 0 20 0 10 0", "10m", False),  # caught up within every minute
        ],
    }
    path = tmp_path / "feed_alert_test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False), encoding="utf-8")
    proc = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


def test_the_dashboard_draws_drift_and_rejections_without_overlapping_panels():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "tracker.json").read_text(encoding="utf-8"))
    panels = dashboard["panels"]
    exprs = {p["title"]: " ".join(t["expr"] for t in p.get("targets", ())) for p in panels}
    drift = [t for t, e in exprs.items() if "tracker_count_drift_ratio_bucket" in e]
    rejections = [t for t, e in exprs.items() if "tracker_provider_rejections_total" in e]
    assert drift and rejections, exprs
    assert "by (model, counter, le)" in exprs[drift[0]]  # per model and counter kind
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for p in panels:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine


# -- JSON logs: parse, carry the ids, hold no secret ----------------------------------------------------


def test_json_logs_carry_the_ids_and_no_secrets(tmp_path):
    from tracker.store import upgrade
    from tracker.store.engine import make_engine
    from tracker.store.fleets import FleetStore

    password = f"pw-{uuid.uuid4().hex}"
    provider_key = f"sk-{uuid.uuid4().hex}"
    name, url = create_pg_database("ct_logs")
    plain = _sqlalchemy_url(url)
    # trust authentication ignores the password, so a URL with one connects like any other
    from sqlalchemy.engine import make_url

    db_url = make_url(plain).set(username="postgres", password=password).render_as_string(hide_password=False)
    assert password in db_url
    collector = Collector()
    log_path = tmp_path / "serve.log"
    proc = None
    try:
        upgrade(db_url)
        engine = make_engine(db_url)
        fleet = FleetStore(engine).create_fleet(f"logs-{uuid.uuid4().hex[:6]}")
        _, token = FleetStore(engine).create_key(fleet["fleet_id"])
        engine.dispose()
        env = {
            **os.environ,
            **otel_env(collector, "tracker-api"),
            "TRACKER_DATABASE_URL": db_url,
            "TRACKER_LOG_FORMAT": "json",
            "TRACKER_OPENAI_API_KEY": provider_key,
        }
        for var in ("TRACKER_BROKER_URL", "TRACKER_REDIS_URL"):
            env.pop(var, None)
        port = free_port()
        with open(log_path, "wb") as log_file:
            proc = start_server(env, port, log_file=log_file)
            with httpx.Client(
                base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"}, timeout=30
            ) as c:
                sid = f"log-{uuid.uuid4().hex[:8]}"
                r = c.post(
                    f"/v1/sessions/{sid}/observe",
                    json={"measurement": {"basis": "m1", "input_tokens": 90_000, "input_limit": 100_000}},
                )
                assert r.status_code == 200 and r.json()["action"] == "compact", r.text
                attempt = r.json()["attempt"]
                r = c.post(
                    f"/v1/sessions/{sid}/compactions/{attempt['attempt_id']}/commit",
                    json={"fencing_token": attempt["fencing_token"], "tokens_after": 1000},
                )
                assert r.status_code == 200, r.text
                assert httpx.get(f"http://127.0.0.1:{port}/v1/sessions", timeout=10).status_code == 401
            collector.wait_for("tracker.commit")
            proc.terminate()
            proc.wait(15)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        collector.close()
        drop_pg_database(name)

    text = log_path.read_text(encoding="utf-8")
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]  # every line is one JSON object
    assert len(lines) >= 4, text
    assert all({"ts", "level", "logger", "message"} <= set(x) for x in lines)
    assert not [x for x in lines if x["level"] in ("warning", "error", "critical")], text
    decisions = [x for x in lines if x["logger"] == "tracker.service"]
    observed = [x for x in decisions if x["message"] == "observe: compact"]
    committed = [x for x in decisions if x["message"] == "commit: ok"]
    assert observed and committed, decisions
    internal = f"{fleet['fleet_id']}:{sid}"
    for x in observed + committed:
        assert x["fleet"] == fleet["fleet_id"] and x["session_id"] == internal, x
        assert x["attempt_id"] == attempt["attempt_id"], x
        assert re.fullmatch(r"[0-9a-f]{32}", x["trace_id"]) and re.fullmatch(r"[0-9a-f]{16}", x["span_id"]), x
    # the trace id in the log is the trace the collector received for that command
    traced = {s["trace_id"] for s in collector.spans if s["name"] == "tracker.commit"}
    assert committed[0]["trace_id"] in traced
    # no secret in any line: the database password, the API key, the provider key
    for secret in (password, token, provider_key):
        assert secret not in text
    assert "Bearer" not in text


def test_the_monitoring_profile_provisions_the_shipped_files():
    """docker-compose's `monitoring` profile mounts these rules, this dashboard and a datasource."""
    import yaml

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
    services = compose["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    assert "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro" in services["grafana"]["volumes"]
    assert services["worker"]["environment"]["TRACKER_WORKER_METRICS_PORT"] == "9100"
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text(encoding="utf-8"))
    assert config["rule_files"] == ["alerts.yml"]
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert jobs == {"tracker-api", "tracker-worker"}  # the rules' `up{job="tracker-worker"}`
    datasource = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text(encoding="utf-8")
    )
    uid = datasource["datasources"][0]["uid"]
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "tracker.json").read_text(encoding="utf-8"))
    assert all(p["datasource"]["uid"] == uid for p in dashboard["panels"])
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus; .ci/run does)")
    proc = subprocess.run(
        [promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- the decision metrics are the Tracker's hook: counted once per HTTP call, on the app's registry ---------


def test_an_http_decision_is_counted_once_on_the_apps_metrics(tmp_path):
    from fastapi.testclient import TestClient
    from prometheus_client import REGISTRY

    from tracker.http.app import create_app
    from tracker.metrics import DecisionMetrics

    app = create_app(settings=Settings.of(database_url=f"sqlite:///{tmp_path / 't.db'}"))
    runtime = app.state.runtime
    with TestClient(app) as client:
        fleet = runtime.fleets().create_fleet(f"m-{uuid.uuid4().hex[:6]}")
        _, token = runtime.fleets().create_key(fleet["fleet_id"])
        (hook,) = [h for h in runtime.tracker().hooks.all if isinstance(h, DecisionMetrics)]
        assert hook is runtime.metrics.domain  # the one metrics hook, on the app's registry

        def counted() -> tuple[float, float]:
            labels = {"action": "compact"}
            return (
                runtime.metrics.registry.get_sample_value("tracker_decisions_total", labels) or 0.0,
                REGISTRY.get_sample_value("tracker_decisions_total", labels) or 0.0,
            )

        before = counted()
        r = client.post(
            f"/v1/sessions/h-{uuid.uuid4().hex[:8]}/observe",
            json={"measurement": {"basis": "m1", "input_tokens": 90_000, "input_limit": 100_000}},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert r.status_code == 200 and r.json()["action"] == "compact", r.text
        after = counted()
        assert after[0] - before[0] == 1  # once on the app's /metrics, not again by the HTTP layer
        assert after[1] == before[1]  # and not on the process's default registry as well
        page = client.get("/metrics").text
        assert re.search(r'^tracker_decisions_total\{action="compact"\} 1\.0$', page, re.M), page
        assert re.search(r'^tracker_attempts_started_total\{reason="automatic"\} 1\.0$', page, re.M), page
        assert re.search(r'^tracker_http_requests_total\{.*route="/v1/sessions/\{session_id\}/observe"', page, re.M)


def test_a_library_tracker_with_the_telemetry_hook_makes_the_command_spans(tmp_path):
    from tracker import Tracker
    from tracker.errors import NotAttemptHolder
    from tracker.store import open_store
    from tracker.telemetry import TelemetryHooks

    exporter = in_memory_exporter()
    try:
        with Tracker.from_settings(
            Settings.of(database_url=f"sqlite:///{tmp_path / 't.db'}"), hooks=[TelemetryHooks()]
        ) as t:
            sid = f"lib-{uuid.uuid4().hex[:8]}"
            measurement = {"basis": "m1", "input_tokens": 90_000, "input_limit": 100_000}
            attempt = t.observe(sid, measurement=measurement).attempt
            with pytest.raises(NotAttemptHolder):
                t.commit(sid, attempt.attempt_id, attempt.fencing_token + 1, 10)
        with Tracker(open_store(f"sqlite:///{tmp_path / 't.db'}")) as untraced:  # no hooks: no spans
            untraced.observe(f"{sid}-x", measurement=measurement)  # (the one observe span is the first's)
        spans = [as_dict(s) for s in exporter.get_finished_spans()]
    finally:
        exporter.shutdown()
    (observe,) = [s for s in spans if s["name"] == "tracker.observe"]
    by_name = {s["name"]: s for s in spans if s["trace_id"] == observe["trace_id"]}
    assert observe["attributes"]["tracker.session_id"] == sid
    assert observe["attributes"]["tracker.action"] == "compact"
    assert observe["attributes"]["tracker.attempt_id"] == attempt.attempt_id
    assert by_name["tracker.coordination"]["parent_id"] == observe["span_id"]
    for name in ("tracker.decide", "tracker.append"):
        assert by_name[name]["parent_id"] == by_name["tracker.coordination"]["span_id"]
    (commit,) = [s for s in spans if s["name"] == "tracker.commit"]  # its own trace, its refusal's code
    assert commit["trace_id"] != observe["trace_id"]
    assert commit["attributes"]["tracker.error_code"] == "not_attempt_holder"
