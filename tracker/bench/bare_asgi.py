"""The floor under the HTTP bench: ``observe`` behind a bare ASGI app.

No framework, no middleware, no authentication: the body is validated by the API's own
``ObserveIn`` and the command is the API's own (``ObserveIn.to_command``, run by ``Tracker.run`` for the
fleet's scope) in the same thread pool,
and the answer is one ``json.dumps``. What a request costs here is what any Python HTTP server
would cost on this machine for this work; what ``tracker serve`` costs beyond it is the
framework's and the tracker's middlewares'. For the bench only (``run_http_bench`` starts it
with ``uvicorn tracker.bench.bare_asgi:create_app --factory``); never serve it.
"""

from __future__ import annotations

import json
from typing import Any

FLEET = "floor"  # sessions are stored as "floor:<session_id>", like a fleet's


def create_app() -> Any:
    import anyio.to_thread

    from tracker.http.runtime import Caller, Runtime
    from tracker.http.schemas import ObserveIn
    from tracker.settings import Settings

    runtime = Runtime(Settings.load())
    caller = Caller(FLEET)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            runtime.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        status, data = 200, {"status": "ok"}
        parts = scope["path"].split("/")  # /v1/sessions/<id>/observe
        if scope["method"] == "POST" and len(parts) == 5 and parts[4] == "observe":
            command = ObserveIn.model_validate_json(b"".join(chunks)).to_command(parts[3])
            result = await anyio.to_thread.run_sync(lambda: runtime.tracker().run(command, caller))
            data = result.to_data()
            data["session_id"] = parts[3]
        out = json.dumps(data, separators=(",", ":")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": out})

    return app
