"""``tracker demo``: a small simulated fleet through the real Tracker.

Several worker processes each run several agent sessions. Every step sends
the complete, growing request to be counted (real counting: the exact local
counter, in-process or on Celery workers), decided, coordinated and recorded
(real store). Sessions compact for real when told to, one asks for a manual
compaction, the counter is slow now and then (a recorded ``CountTimeout``),
and one session's compactor is broken so it ends in ``ContextLimitError``.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracker.bootstrap import build_store, build_tracker
from tracker.core import Basis, SessionProjector
from tracker.core import events as ev
from tracker.demo.agent import Agent
from tracker.errors import ContextLimitError, CountError
from tracker.queries import session_state
from tracker.settings import Settings
from tracker.store.migrate import upgrade

DEMO_MODELS = Path(__file__).resolve().parent / "models.json"
MODEL = "demo-agent-40k"
SLOW_MODEL = "demo-agent-slow"


@dataclass(frozen=True)
class Plan:
    session_id: str
    seed: int
    steps: int
    broken_compactor: bool = False
    manual_at: int | None = None
    slow_every: int = 0  # every n-th step is counted by the slow counter (0 = never)


def plan_fleet(run_id: str, workers: int, sessions_per_worker: int, steps: int) -> list[list[Plan]]:
    plans: list[list[Plan]] = [[] for _ in range(workers)]
    n = 0
    for w in range(workers):
        for _ in range(sessions_per_worker):
            plans[w].append(
                Plan(
                    session_id=f"demo-{run_id}-{n + 1}",
                    seed=n * 7919 + 17,
                    steps=steps,
                    broken_compactor=(n == 1),
                    manual_at=(steps // 3 if n == 2 else None),
                    slow_every=(11 if n % 3 == 0 else 0),
                )
            )
            n += 1
    return plans


def _run_session(tracker: Any, plan: Plan, progress: Any) -> dict[str, Any]:
    agent = Agent(plan.session_id, plan.seed)
    revision = 1
    outcome = "finished"
    for step in range(1, plan.steps + 1):
        agent.step()
        basis = f"r{revision}:{agent.through}"
        model = SLOW_MODEL if plan.slow_every and step % plan.slow_every == 0 else MODEL
        try:
            if plan.manual_at == step:
                a = tracker.request_compaction(plan.session_id)
                if _compact(tracker, agent, plan, a, revision):
                    revision += 1
                    basis = f"r{revision}:{agent.through}"
            r = tracker.observe(plan.session_id, request=agent.request(), model=model, basis=basis)
        except ContextLimitError:
            outcome = "ContextLimitError"
            progress.put(("step", plan.session_id, plan.steps - step + 1))
            break
        except CountError:
            progress.put(("step", plan.session_id, 1))
            continue  # the count could not be trusted: nothing was decided on a guess; carry on
        if r.action == "compact":
            a = r.attempt
            if plan.broken_compactor:
                tracker.reject(plan.session_id, a.attempt_id, a.fencing_token, "summarizer_error")
            elif _compact(tracker, agent, plan, a, revision):
                revision += 1
        elif r.action == "wait":
            tracker.wait(plan.session_id, r.decision.waiting_on.attempt_id, timeout=30)
        progress.put(("step", plan.session_id, 1))
    return {"session_id": plan.session_id, "outcome": outcome}


def _compact(tracker: Any, agent: Any, plan: Plan, attempt: Any, revision: int) -> bool:
    """Compact the agent's history, count the result and commit; reject if the count can't be trusted."""
    before = list(agent.messages)
    agent.compact()
    try:
        after = tracker.counting.measure(
            agent.request(), model=MODEL, basis=Basis(revision, agent.through), policy=tracker.policy
        ).input_tokens
    except CountError:
        agent.messages = before  # the compaction is not applied: its size is unknown
        tracker.reject(plan.session_id, attempt.attempt_id, attempt.fencing_token, "count_failed")
        return False
    tracker.commit(plan.session_id, attempt.attempt_id, attempt.fencing_token, after)
    return True


def _worker(plans: list[Plan], settings: Settings, progress: Any) -> list[dict[str, Any]]:
    out = []
    with build_tracker(settings) as tracker:
        for plan in plans:
            out.append(_run_session(tracker, plan, progress))
    return out


def demo_settings(settings: Settings | None = None) -> Settings:
    """``settings`` (default ``Settings.load()``) with the demo's models when no models file is set."""
    s = settings if settings is not None else Settings.load()
    if s.counting.models_file:
        return s
    return s.model_copy(update={"counting": s.counting.model_copy(update={"models_file": str(DEMO_MODELS)})})


def run_demo(
    workers: int = 3,
    sessions_per_worker: int = 2,
    steps: int = 40,
    console: Any = None,
    *,
    settings: Settings | None = None,
) -> dict[str, Any]:
    """Run the fleet (``workers`` processes × ``sessions_per_worker`` sessions × ``steps``) and summarize
    it from the record. ``settings``: default ``Settings.load()``; the worker processes get the same."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    settings = demo_settings(settings)
    url = settings.store.database_url
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
    revision = upgrade(url)  # the demo sets up its own schema; production runs `tracker db upgrade`
    run_id = uuid.uuid4().hex[:6]
    plans = plan_fleet(run_id, workers, sessions_per_worker, steps)
    total = sum(p.steps for ps in plans for p in ps)
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    queue = manager.Queue()
    started = time.monotonic()
    with ctx.Pool(workers) as pool:
        results = [pool.apply_async(_worker, (ps, settings, queue)) for ps in plans]
        with Progress(
            TextColumn("[bold]fleet[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
            disable=console is None,
        ) as bar:
            task = bar.add_task("steps", total=total)
            done = 0
            while done < total:
                if all(r.ready() for r in results):
                    while not queue.empty():
                        done += queue.get()[2]
                    break
                try:
                    kind, sid, n = queue.get(timeout=0.2)
                except queue_module.Empty:
                    continue
                done += n
                bar.update(task, completed=min(done, total))
            bar.update(task, completed=total)
        outcomes = {o["session_id"]: o["outcome"] for r in results for o in r.get()}
    elapsed = time.monotonic() - started
    manager.shutdown()
    return {
        "run_id": run_id,
        "database_url": url,
        "schema_revision": revision,
        "elapsed_s": round(elapsed, 1),
        "sessions": _summaries(settings, outcomes),
        "staged": _staged(plans),
        "distributed": {"redis": bool(settings.coordination.redis_url), "broker": bool(settings.counting.broker_url)},
    }


def _staged(plans: list[list[Plan]]) -> dict[str, Any]:
    """The failures the demo causes on purpose, to show those paths (not faults of the tracker)."""
    flat = [p for ps in plans for p in ps]
    return {
        "broken_compactor": [p.session_id for p in flat if p.broken_compactor],
        "manual_compaction": [p.session_id for p in flat if p.manual_at is not None],
        "slow_counter": [p.session_id for p in flat if p.slow_every],
        "slow_every": max((p.slow_every for p in flat), default=0),
    }


def _summaries(settings: Settings, outcomes: dict[str, str]) -> list[dict[str, Any]]:
    """The closing summary comes from the record (the store), not from what the workers remember."""
    store = build_store(settings.store, projector=SessionProjector())
    try:
        rows = []
        for sid, outcome in sorted(outcomes.items()):
            st = session_state(store, sid)
            c = st.counts
            committed = c.get(ev.CompactionCommitted.TYPE, 0)
            rows.append(
                {
                    "session_id": sid,
                    "events": st.version,
                    "measurements": c.get(ev.ContextMeasured.TYPE, 0),
                    "revision": st.revision,
                    "compactions_committed": committed,
                    "compactions_rejected": c.get(ev.CompactionRejected.TYPE, 0),
                    "count_failures": c.get(ev.CountFailed.TYPE, 0),
                    "context_limit_errors": c.get(ev.ContextLimitReached.TYPE, 0),
                    "pressure": st.pressure,
                    "tokens_now": st.last.input_tokens if st.last else None,
                    "input_limit": st.last.input_limit if st.last else None,
                    "outcome": outcome,
                }
            )
        return rows
    finally:
        store.close()
