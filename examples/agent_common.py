"""What the two agent examples share: the model, the scripted repository, the summariser's shape, the report
and the command line. Nothing here is specific to LangChain or pydantic-ai; each example keeps only the lines
that are (its agent, its fake model, its middleware or capability).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tracker import Tracker, TrackerError
from tracker.integrations import RedisShare
from tracker.settings import Settings
from tracker.store.migrate import upgrade

MODEL = "example-agent-small"  # the tracker's registry name for the agent's model
# input limit = min(window - max_output_tokens, max_input_tokens) - safety_margin = 11000 - 8192 = 2808 tokens
MODELS = {
    "models": {
        MODEL: {
            "provider": "openai",
            "window": 20000,
            "max_output_tokens": 1000,
            "max_input_tokens": 11000,
            "counter": "exact_local",
            "encoding": "o200k_base",
        }
    }
}
SYSTEM = "You are a careful engineer. Read the files you need, one at a time, then say what is wrong."
QUESTION = "What is wrong with the lease handling?"
WORDS = (
    "timeout",
    "retry",
    "budget",
    "batch",
    "cache",
    "lock",
    "queue",
    "worker",
    "parse",
    "flush",
    "index",
    "token",
    "window",
    "commit",
    "lease",
    "fence",
    "shard",
    "replica",
    "cursor",
    "stream",
)


def source_file(path: str) -> str:
    """One source file of the scripted repository: the same text for the same path, a few hundred tokens."""
    rng = random.Random(hashlib.sha256(path.encode()).hexdigest())
    lines = [f"# {path}"]
    for n in range(14):
        a, b, c = rng.sample(WORDS, 3)
        lines.append(f"def {a}_{b}_{n}(x):  # {c} handling, see {rng.choice(WORDS)} notes")
    return "\n".join(lines)


class SummarizerBase:
    """A deterministic summariser (a real agent passes a chat model): lists the files read so far.

    Each example says how to find the paths read in its framework's messages (``files_read``).
    ``fail``: True = every call fails; a number = how many calls fail first (-1: all)."""

    def __init__(self, delay_s: float = 0.0, fail: bool | int = False) -> None:
        self.delay_s, self.calls = delay_s, 0
        self.fail = -1 if fail is True else int(fail)

    def files_read(self, messages: list[Any]) -> list[str]:
        raise NotImplementedError

    def __call__(self, messages: list[Any], budget_tokens: int) -> str:
        self.calls += 1
        if self.fail < 0 or self.calls <= self.fail:
            raise RuntimeError("the summariser is unavailable")
        time.sleep(self.delay_s)
        read = self.files_read(messages)
        return f"The user asked what is wrong. Files already read ({len(read)}): {', '.join(read)}. Nothing conclusive yet."


def compaction_events(tracker: Tracker, session: str) -> list[dict[str, Any]]:
    """The session's compaction and context-limit events, with the fields a reader looks at."""
    return [
        {
            "type": e.type,
            **{
                k: e.data[k]
                for k in ("attempt_id", "tokens_before", "tokens_after", "reject_reason", "basis", "input_tokens")
                if k in e.data
            },
        }
        for e in tracker.history(session)
        if e.type.startswith("Compaction") or e.type == "ContextLimitReached"
    ]


def main(
    argv: Sequence[str] | None,
    *,
    description: str,
    session: str,
    prefix: str,
    run: Callable[..., dict[str, Any]],
    summarizer: Callable[..., Any],
) -> int:
    """The examples' command line: open a Tracker (a SQLite file in a temp dir by default), run the agent once
    with ``run(tracker, session, steps=, summarizer=, share=)``, print its report."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--database-url", help="default: a SQLite file in a temporary directory")
    p.add_argument("--redis-url")
    p.add_argument("--session", default=session)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--failing-summarizer", action="store_true")
    p.add_argument("--summary-delay", type=float, default=0.0, help="seconds the summariser takes")
    p.add_argument("--share-redis", action="store_true", help="publish compactions to Redis for other processes")
    p.add_argument("--no-upgrade", action="store_true", help="the database is already migrated")
    p.add_argument("--start-at", type=float, default=0.0, help="wall-clock time to start at (line processes up)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    models_file = workdir / "models.json"
    models_file.write_text(json.dumps(MODELS))
    url = args.database_url or f"sqlite:///{workdir / 'tracker.db'}"
    if not args.no_upgrade:
        upgrade(url)
    settings = Settings.of(database_url=url, redis_url=args.redis_url, models_file=str(models_file))
    share = RedisShare(args.redis_url, prefix=f"ct-example:{args.session}:") if args.share_redis else None
    summarize = summarizer(delay_s=args.summary_delay, fail=args.failing_summarizer)
    with Tracker.from_settings(settings) as tracker:
        tracker.counting.warm()  # load the encodings now, not inside the first count's time limit
        time.sleep(max(0.0, args.start_at - time.time()))
        report = run(tracker, args.session, steps=args.steps, summarizer=summarize, share=share)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"answer: {report['answer']}" if report["answer"] else f"stopped: {report['error']['message']}")
        print("model requests (tokens):", report["model_requests"])
        for e in report["events"]:
            print(" ", e)
    return 0 if report["answer"] else 1


def run_main(main: Callable[[], int]) -> None:
    """``sys.exit(main())``; a tracker error (a bad setting, a store that is down) as JSON on stderr, exit 2."""
    try:
        sys.exit(main())
    except TrackerError as exc:
        print(json.dumps(exc.to_dict()), file=sys.stderr)
        sys.exit(2)
