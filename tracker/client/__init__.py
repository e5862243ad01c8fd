"""Clients for a ``tracker serve`` endpoint that behave like an embedded ``Tracker``.

``TrackerClient`` (sync) and ``AsyncTrackerClient`` have the ``Tracker``'s method names,
arguments, results and typed errors, so agent code switches between embedded and remote by
construction alone::

    tracker = Tracker.from_settings()                                   # embedded
    tracker = TrackerClient("http://tracker:8080", api_key=os.environ["TRACKER_KEY"])  # remote

    r = tracker.observe("session-42", request=request, model="gpt-4o", basis="msg-87")

Behaviour on the wire:

* every mutating call carries an ``idempotency_key`` (yours, or one generated for the call)
  and a retry of that call reuses it, so a retried call gets the original answer and never
  records twice;
* connection errors, ``503`` and a ``504`` that is not the tracker's own recorded
  ``count_timeout`` are retried with exponential backoff (``retries`` times); every other
  error is raised at once as the same typed error the embedded ``Tracker`` raises;
* ``wait`` long-polls (at most 30 s per request) until the attempt ends or ``timeout``.

Transport: plain HTTP/1.1 on kept-alive connections of the client's own (a socket per
connection, one small response parser for both clients), which costs a call a fraction of
a general-purpose client's CPU. httpx is used instead when it has something to add: a
``transport=`` given (an ``httpx.MockTransport`` in tests, say), a proxy the environment
names for the URL (``HTTP(S)_PROXY``, ``NO_PROXY``), or (async) an event loop other than
asyncio's. HTTPS takes httpx's own TLS context (its certificates, ``SSL_CERT_FILE``).

The package: ``calls`` (the one table from the Tracker's commands to HTTP calls), ``http11`` (the
wire), ``base`` (settings, retries), ``sync`` and ``aio`` (the two transports, each method one line
over the table).
"""

from __future__ import annotations

from tracker.client.aio import AsyncTrackerClient
from tracker.client.calls import FleetPolicy
from tracker.client.sync import TrackerClient

__all__ = ["AsyncTrackerClient", "FleetPolicy", "TrackerClient"]
