"""A fresh database with fleets and one API key each, for the TypeScript tests' ``tracker serve``.

One Python process instead of a ``tracker db upgrade``, a ``tracker fleet create`` and a ``tracker key
create`` per fleet (each CLI process costs about a second of start-up on the test machine; the CLI
itself is tested in tests/e2e). Usage: ``python3 fleets.py DATABASE_URL NAME...``; prints a JSON list,
per name ``{"fleet": <as tracker fleet create --json>, "key": <as tracker key create --json>}``.
"""

import json
import sys

from tracker.store import FleetStore, make_engine, upgrade

url, *names = sys.argv[1:]
upgrade(url)
engine = make_engine(url)
fleets = FleetStore(engine)
made = []
for name in names:
    fleet = fleets.create_fleet(name)
    record, token = fleets.create_key(fleet["name"])
    made.append({"fleet": fleet, "key": {**record, "token": token}})
engine.dispose()
print(json.dumps(made, default=str))
