// TrackerClient against a real `tracker serve` (SQLite file database, two fleets and their keys):
// the whole lifecycle, typed errors by class and code, bad input refused before any request with the
// server's own code and field, and the retry rules against fake HTTP servers on loopback; and
// src/schema.ts is what openapi-typescript makes of the OpenAPI document that server serves:
// regenerated here and compared (run `npm run generate -- --serve` to refresh).
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { randomUUID } from "node:crypto";
import { readFileSync } from "node:fs";
import { createServer } from "node:http";
import { after, before, describe, test } from "node:test";
import {
  AttemptNotOpen,
  ContextLimitError,
  CountTimeout,
  InvalidInput,
  InvalidSessionId,
  ManualAttemptOpen,
  NotAttemptHolder,
  StaleBasis,
  StoreUnavailable,
  SummaryTooLarge,
  TooManyWaits,
  TrackerClient,
  TrackerError,
  Unauthorized,
  UnknownAttempt,
  UnknownSession,
  WaitTimeout,
} from "../dist/index.js";
import { promisify } from "node:util";
import { renderSchema } from "../scripts/render-schema.mjs";
import { PYTHON, startTracker } from "./support/server.mjs";

const LIMIT = 100_000;
const sid = (label = "s") => `${label}-${randomUUID().slice(0, 10)}`;
const measurement = (basis, tokens, limit = LIMIT) => ({ measurement: { basis, input_tokens: tokens, input_limit: limit } });

/** Rejects with an error of `cls` whose code (and status, field) are as given. */
async function rejectsWith(promise, cls, code, extra = {}) {
  await assert.rejects(promise, (err) => {
    assert.ok(err instanceof cls, `expected ${cls.name}, got ${err?.constructor?.name}: ${err?.message}`);
    assert.ok(err instanceof TrackerError);
    assert.equal(err.code, code);
    for (const [k, v] of Object.entries(extra)) assert.equal(err[k], v, k);
    return true;
  });
}

let server;
let client;
before(async () => {
  server = await startTracker();
  client = new TrackerClient({ baseUrl: server.url, apiKey: server.token });
});
after(async () => {
  await server?.stop();
});

test("the checked-in schema types are the served OpenAPI document's", async () => {
  const doc = await (await fetch(`${server.url}/openapi.json`)).json();
  const fresh = await renderSchema(doc);
  const committed = readFileSync(new URL("../src/schema.ts", import.meta.url), "utf8");
  assert.ok(fresh.includes("ObserveIn") && fresh.includes("/v1/sessions/{session_id}/observe"));
  assert.equal(committed, fresh, "src/schema.ts is stale: run `npm run generate -- --serve`");
});

describe("the lifecycle against tracker serve", () => {
  test("observe a measurement, then a request the tracker counts", async () => {
    const s = sid();
    const d = await client.observe(s, measurement("m1", 10));
    assert.equal(d.session_id, s);
    assert.equal(d.action, "proceed");
    assert.equal(d.pressure, "normal");
    assert.equal(d.version, 2); // SessionStarted, ContextMeasured
    const counted = await client.observe(s, {
      request: { system: "be brief", messages: [{ role: "user", content: "hello" }] },
      model: "gpt-4o",
      basis: "r1:h-two",
    });
    assert.equal(counted.action, "proceed");
    assert.equal(counted.basis, "r1:h-two");
    const state = await client.state(s);
    assert.equal(state.version, 3);
    assert.equal(state.last.basis, "r1:h-two");
    assert.ok(state.last.input_tokens > 0);
  });

  test("a manual attempt: open, wait times out, commit, wait says committed, the old basis is stale", async () => {
    const s = sid();
    await client.observe(s, measurement("m1", 50_000));
    const attempt = await client.requestCompaction(s, { basis: "r1:m1" });
    assert.equal(attempt.reason, "manual");
    assert.equal(typeof attempt.attempt_id, "string");
    await rejectsWith(client.requestCompaction(s), ManualAttemptOpen, "manual_attempt_open", { status: 409 });
    assert.equal((await client.state(s)).open_attempts.length, 1);
    const started = performance.now();
    await rejectsWith(client.wait(s, attempt.attempt_id, { timeout: 0.3 }), WaitTimeout, "wait_timeout", {
      status: 408,
      attempt_id: attempt.attempt_id,
    });
    assert.ok(performance.now() - started >= 250);
    await rejectsWith(
      client.commit(s, attempt.attempt_id, { fencing_token: attempt.fencing_token + 7, tokens_after: 10 }),
      NotAttemptHolder,
      "not_attempt_holder",
      { status: 409 },
    );
    const waiting = client.wait(s, attempt.attempt_id, { timeout: 20 });
    const state = await client.commit(s, attempt.attempt_id, { fencing_token: attempt.fencing_token, tokens_after: 1200 });
    assert.equal(state.revision, 2);
    assert.deepEqual(await waiting, { attempt_id: attempt.attempt_id, outcome: "committed", status: "committed", reject_reason: null });
    await rejectsWith(
      client.commit(s, attempt.attempt_id, { fencing_token: attempt.fencing_token, tokens_after: 10 }),
      AttemptNotOpen,
      "attempt_not_open",
    );
    await rejectsWith(client.observe(s, measurement("r1:m2", 10)), StaleBasis, "stale_basis", { status: 409 });
    await rejectsWith(
      client.commit(s, "no-such-attempt", { fencing_token: 1, tokens_after: 1 }),
      UnknownAttempt,
      "unknown_attempt",
      { status: 404 },
    );
  });

  test("compact, reject, then the hard limit with nothing eligible is ContextLimitError", async () => {
    const s = sid();
    const d = await client.observe(s, measurement("m1", LIMIT));
    assert.equal(d.action, "compact");
    assert.equal(d.attempt.reason, "automatic");
    const rejected = await client.reject(s, d.attempt.attempt_id, {
      fencing_token: d.attempt.fencing_token,
      reject_reason: "summarizer_error",
    });
    assert.deepEqual(rejected.exhausted, ["r1:m1"]);
    const outcome = await client.wait(s, d.attempt.attempt_id, { timeout: 1 });
    assert.equal(outcome.outcome, "rejected:summarizer_error");
    assert.equal(outcome.reject_reason, "summarizer_error");
    await rejectsWith(client.observe(s, measurement("m1", LIMIT)), ContextLimitError, "context_limit", { status: 409 });
    const types = [];
    for await (const e of client.history(s)) types.push(e.type);
    assert.equal(types.at(-1), "ContextLimitReached"); // recorded before the answer
  });

  test("a summary at the input limit is SummaryTooLarge, recorded as a rejection", async () => {
    const s = sid();
    const d = await client.observe(s, measurement("m1", 90_000));
    assert.equal(d.action, "compact");
    await rejectsWith(
      client.commit(s, d.attempt.attempt_id, { fencing_token: d.attempt.fencing_token, tokens_after: LIMIT }),
      SummaryTooLarge,
      "summary_too_large",
      { status: 409 },
    );
    assert.equal((await client.wait(s, d.attempt.attempt_id, { timeout: 1 })).outcome, "rejected:summary_too_large");
  });

  test("a retried call with the same idempotency key gets the original answer and records once", async () => {
    const s = sid();
    const key = `k-${randomUUID()}`;
    const first = await client.observe(s, { ...measurement("m1", 10), idempotency_key: key });
    const again = await client.observe(s, { ...measurement("m1", 10), idempotency_key: key });
    assert.deepEqual(again, first);
    assert.equal((await client.state(s)).version, 2);
  });

  test("history and sessions page through everything", async () => {
    const s = sid("paged");
    for (let i = 1; i <= 5; i++) await client.observe(s, measurement(`m${i}`, 10 * i));
    const all = [];
    for await (const e of client.history(s, { limit: 2 })) all.push(e);
    assert.deepEqual(
      all.map((e) => e.version),
      [1, 2, 3, 4, 5, 6],
    );
    assert.equal(all[0].type, "SessionStarted");
    assert.equal(all[0].session_id, s);
    const page = await client.historyPage(s, { from_version: 5, limit: 10 });
    assert.deepEqual(
      page.events.map((e) => e.version),
      [5, 6],
    );
    assert.equal(page.has_more, false);
    const ids = [];
    for await (const row of client.sessions({ limit: 1 })) ids.push(row.session_id);
    assert.ok(ids.includes(s));
    assert.equal(new Set(ids).size, ids.length, "pages never overlap");
    const recent = [];
    for await (const row of client.sessions({ since: new Date(Date.now() + 3600_000) })) recent.push(row);
    assert.deepEqual(recent, []);
  });

  test("sessions are per fleet; a bad key is Unauthorized", async () => {
    const s = sid();
    await client.observe(s, measurement("m1", 10));
    const other = new TrackerClient({ baseUrl: server.url, apiKey: server.otherToken });
    await rejectsWith(other.state(s), UnknownSession, "unknown_session", { status: 404 });
    const nobody = new TrackerClient({ baseUrl: server.url, apiKey: "ctk_nope_nope", retries: 0 });
    await rejectsWith(nobody.state(s), Unauthorized, "unauthorized", { status: 401 });
  });
});

describe("the provider's reports (reportUsage, reportRejection, calibration)", () => {
  const heuristic = (basis, tokens) => ({
    measurement: { basis, input_tokens: tokens, input_limit: LIMIT, quality: "heuristic_estimate", model: { provider: "test", name: "ts-model" } },
  });

  test("a usage report, retried with its key, records once; calibration lists it", async () => {
    const s = sid("usage");
    await client.observe(s, heuristic("m1", 20_000));
    const body = { basis: "m1", input_tokens: 15_000, cache_read_tokens: 1_000, output_tokens: 40, idempotency_key: "u-1" };
    const first = await client.reportUsage(s, body);
    assert.equal(first.type, "UsageReported");
    assert.equal(first.session_id, s);
    assert.equal(first.basis, "r1:m1");
    assert.equal(first.counted_tokens, 20_000);
    assert.equal(first.cache_read_tokens, 1_000);
    assert.deepEqual(await client.reportUsage(s, body), first);
    const types = [];
    for await (const e of client.history(s)) types.push(e.type);
    assert.deepEqual(types, ["SessionStarted", "ContextMeasured", "UsageReported"]);
    await rejectsWith(client.reportUsage(s, { basis: "m9", input_tokens: 1 }), InvalidInput, "invalid_input", { field: "basis" });
    // the book may read a report just recorded a moment later (the log's safe horizon): awaited, with a deadline
    const deadline = Date.now() + 30_000;
    let row;
    while (!(row = (await client.calibration()).find((r) => r.model === "ts-model" && r.usage_reports === 1))) {
      assert.ok(Date.now() < deadline, "the calibration never listed the report");
      await new Promise((resolve) => setTimeout(resolve, 50));
    }
    assert.equal(row.counter, "estimate");
    assert.equal(row.median_ratio, 0.8);
    assert.equal("fleet" in row, false);
  });

  test("a rejection: the count and limit read from the message; the basis then compacts", async () => {
    const s = sid("rejected");
    assert.equal((await client.observe(s, heuristic("m1", 50_000))).action, "proceed");
    const r = await client.reportRejection(s, { basis: "m1", message: "prompt is too long: 100234 tokens > 100000 maximum" });
    assert.equal(r.type, "ProviderRejected");
    assert.equal(r.input_tokens, 100_234);
    assert.equal(r.input_limit, 100_000);
    assert.equal(r.form, "anthropic.prompt_too_long");
    const d = await client.observe(s, heuristic("m1", 50_000));
    assert.equal(d.action, "compact");
    assert.equal(d.rejected, true);
    assert.equal(d.pressure, "hard_limit");
  });
});

describe("the fleet's policy (GET /v1/policy)", () => {
  /** `tracker <args> --json` against the suite's server's database. */
  const cliJson = async (...args) => {
    const { stdout } = await promisify(execFile)(PYTHON, ["-m", "tracker.cli", ...args, "--json"], {
      env: server.env,
      timeout: 120_000,
    });
    return JSON.parse(stdout);
  };

  test("a fleet with its own policy reads it, one without reads the server's; a bad key is Unauthorized", async () => {
    const before = Date.now() - 5_000;
    const fleet = await cliJson("fleet", "create", `ts-pol-${randomUUID().slice(0, 8)}`, "--compact-at", "6500", "--rearm-below", "3000");
    const { token } = await cliJson("key", "create", fleet.name);
    const own = new TrackerClient({ baseUrl: server.url, apiKey: token });
    const mine = await own.policy();
    assert.equal(mine.source, "fleet");
    assert.equal(mine.version, 1);
    assert.ok(mine.changed_at !== null);
    const at = Date.parse(mine.changed_at);
    assert.ok(before <= at && at <= Date.now() + 5_000, mine.changed_at);
    assert.equal(mine.policy.compact_at_bp, 6500);
    assert.equal(mine.policy.rearm_below_bp, 3000);
    assert.deepEqual(mine.policy, fleet.policy); // what the CLI recorded, every field
    // the suite's other fleet never had a policy: the server's (compact at 8000 bp)
    const theirs = await new TrackerClient({ baseUrl: server.url, apiKey: server.otherToken }).policy();
    assert.deepEqual(theirs, {
      source: "server",
      version: 0,
      changed_at: null,
      policy: {
        automatic: true,
        compact_at_bp: 8000,
        rearm_below_bp: 6000,
        counter_policy: "allow_conservative",
        reserved_output: 16384,
        safety_margin: 8192,
        count_timeout_s: 10, // the suite's servers allow 10 s (support/server.mjs)
        turn_delta: null,
        max_automatic_per_episode: 3,
        attempt_lease_s: 60,
      },
    });
    // a change is the new version at once (GET /v1/policy reads the store)
    const changed = await cliJson("fleet", "policy", fleet.name, "--compact-at", "6000");
    assert.equal(changed.version, 2);
    const now = await own.policy();
    assert.equal(now.version, 2);
    assert.equal(now.policy.compact_at_bp, 6000);
    assert.equal(now.policy.rearm_below_bp, 3000);
    assert.ok(Date.parse(now.changed_at) >= at);
    const nobody = new TrackerClient({ baseUrl: server.url, apiKey: "ctk_nope_nope", retries: 0 });
    await rejectsWith(nobody.policy(), Unauthorized, "unauthorized", { status: 401 });
  });
});

describe("bad input is refused before any request, as the server refuses it", () => {
  /** A client whose fetch counts what it sends. */
  function counting() {
    const sent = [];
    const c = new TrackerClient({
      baseUrl: server.url,
      apiKey: server.token,
      fetch: (url, init) => {
        sent.push(url);
        return fetch(url, init);
      },
    });
    return { c, sent };
  }

  /** The server's answer to the same input sent raw. */
  async function serverSays(method, path, body) {
    const r = await fetch(server.url + path, {
      method,
      headers: { Authorization: `Bearer ${server.token}`, "Content-Type": "application/json" },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    assert.ok(r.status >= 400, `${path} ${JSON.stringify(body)} was accepted`);
    const b = await r.json();
    return { code: b.code, field: b.field, status: r.status };
  }

  const cases = [
    ["a non-string session id", (c) => c.state(42), "GET", "/v1/sessions/4%202"],
    ["a session id with a space", (c) => c.state("a b"), "GET", "/v1/sessions/a%20b"],
    ["an empty session id", (c) => c.observe("", measurement("m1", 1)), null],
    ["negative input_tokens", (c) => c.observe("s1", measurement("m1", -1)), "POST", "/v1/sessions/s1/observe", measurement("m1", -1)],
    ["fractional input_tokens", (c) => c.observe("s1", measurement("m1", 1.5)), "POST", "/v1/sessions/s1/observe", measurement("m1", 1.5)],
    ["a string count", (c) => c.observe("s1", measurement("m1", "7")), "POST", "/v1/sessions/s1/observe", measurement("m1", "7")],
    ["a zero input_limit", (c) => c.observe("s1", measurement("m1", 1, 0)), "POST", "/v1/sessions/s1/observe", measurement("m1", 1, 0)],
    [
      "both request and measurement",
      (c) => c.observe("s1", { ...measurement("m1", 1), request: { messages: [] } }),
      "POST",
      "/v1/sessions/s1/observe",
      { ...measurement("m1", 1), request: { messages: [] } },
    ],
    ["an unknown field", (c) => c.observe("s1", { ...measurement("m1", 1), extra: 1 }), "POST", "/v1/sessions/s1/observe", { ...measurement("m1", 1), extra: 1 }],
    [
      "negative overhead_tokens",
      (c) => c.observe("s1", { ...measurement("m1", 1), overhead_tokens: -3 }),
      "POST",
      "/v1/sessions/s1/observe",
      { ...measurement("m1", 1), overhead_tokens: -3 },
    ],
    [
      "a bad message role in the request",
      (c) => c.observe("s1", { request: { messages: [{ role: "robot", content: "x" }] }, model: "gpt-4o", basis: "b1" }),
      "POST",
      "/v1/sessions/s1/observe",
      { request: { messages: [{ role: "robot", content: "x" }] }, model: "gpt-4o", basis: "b1" },
    ],
    [
      "a request without a model",
      (c) => c.observe("s1", { request: { messages: [] }, basis: "b1" }),
      "POST",
      "/v1/sessions/s1/observe",
      { request: { messages: [] }, basis: "b1" },
    ],
    [
      "a request without a basis",
      (c) => c.observe("s1", { request: { messages: [] }, model: "gpt-4o" }),
      "POST",
      "/v1/sessions/s1/observe",
      { request: { messages: [] }, model: "gpt-4o" },
    ],
    [
      "a tool result part with a non-boolean is_error",
      (c) => c.observe("s1", { request: { messages: [{ role: "user", content: [{ type: "tool_result", tool_use_id: "t", is_error: 1 }] }] }, model: "gpt-4o", basis: "b1" }),
      "POST",
      "/v1/sessions/s1/observe",
      { request: { messages: [{ role: "user", content: [{ type: "tool_result", tool_use_id: "t", is_error: 1 }] }] }, model: "gpt-4o", basis: "b1" },
    ],
    [
      "negative tokens_after",
      (c) => c.commit("s1", "a1", { fencing_token: 1, tokens_after: -1 }),
      "POST",
      "/v1/sessions/s1/compactions/a1/commit",
      { fencing_token: 1, tokens_after: -1 },
    ],
    [
      "non-integer tokens_after",
      (c) => c.commit("s1", "a1", { fencing_token: 1, tokens_after: 2.5 }),
      "POST",
      "/v1/sessions/s1/compactions/a1/commit",
      { fencing_token: 1, tokens_after: 2.5 },
    ],
    [
      "a string fencing token",
      (c) => c.commit("s1", "a1", { fencing_token: "1", tokens_after: 2 }),
      "POST",
      "/v1/sessions/s1/compactions/a1/commit",
      { fencing_token: "1", tokens_after: 2 },
    ],
    [
      "an empty reject_reason",
      (c) => c.reject("s1", "a1", { fencing_token: 1, reject_reason: "" }),
      "POST",
      "/v1/sessions/s1/compactions/a1/reject",
      { fencing_token: 1, reject_reason: "" },
    ],
    [
      "a control character in reject_reason",
      (c) => c.reject("s1", "a1", { fencing_token: 1, reject_reason: "bad\u001b[31m" }),
      "POST",
      "/v1/sessions/s1/compactions/a1/reject",
      { fencing_token: 1, reject_reason: "bad\u001b[31m" },
    ],
    ["a negative wait timeout", (c) => c.wait("s1", "a1", { timeout: -1 }), "GET", "/v1/sessions/s1/compactions/a1/wait?timeout=-1"],
    [
      "a negative usage count",
      (c) => c.reportUsage("s1", { basis: "m1", input_tokens: -1 }),
      "POST",
      "/v1/sessions/s1/usage",
      { basis: "m1", input_tokens: -1 },
    ],
    [
      "a fractional cache read count",
      (c) => c.reportUsage("s1", { basis: "m1", input_tokens: 1, cache_read_tokens: 0.5 }),
      "POST",
      "/v1/sessions/s1/usage",
      { basis: "m1", input_tokens: 1, cache_read_tokens: 0.5 },
    ],
    ["a usage report without input_tokens", (c) => c.reportUsage("s1", { basis: "m1" }), "POST", "/v1/sessions/s1/usage", { basis: "m1" }],
    ["a usage report without a basis", (c) => c.reportUsage("s1", { input_tokens: 3 }), "POST", "/v1/sessions/s1/usage", { input_tokens: 3 }],
    [
      "an unknown field in a usage report",
      (c) => c.reportUsage("s1", { basis: "m1", input_tokens: 3, cached: 1 }),
      "POST",
      "/v1/sessions/s1/usage",
      { basis: "m1", input_tokens: 3, cached: 1 },
    ],
    [
      "a zero input_limit in a rejection",
      (c) => c.reportRejection("s1", { basis: "m1", input_limit: 0 }),
      "POST",
      "/v1/sessions/s1/rejection",
      { basis: "m1", input_limit: 0 },
    ],
    [
      "a rejection message that is not text",
      (c) => c.reportRejection("s1", { basis: "m1", message: 42 }),
      "POST",
      "/v1/sessions/s1/rejection",
      { basis: "m1", message: 42 },
    ],
    [
      "negative overhead on a manual attempt",
      (c) => c.requestCompaction("s1", { overhead_tokens: -1 }),
      "POST",
      "/v1/sessions/s1/compactions",
      { overhead_tokens: -1 },
    ],
  ];

  for (const [name, call, method, path, body] of cases) {
    test(name, async () => {
      const { c, sent } = counting();
      let local;
      await assert.rejects(call(c), (err) => {
        assert.ok(err instanceof InvalidInput, `${err?.constructor?.name}: ${err?.message}`);
        local = err;
        return true;
      });
      assert.deepEqual(sent, [], "nothing was sent");
      if (method) {
        const remote = await serverSays(method, path, body);
        assert.deepEqual({ code: local.code, field: local.field, status: local.status }, remote);
      }
    });
  }

  test("a non-string session id is InvalidSessionId", async () => {
    await rejectsWith(client.observe(null, measurement("m1", 1)), InvalidSessionId, "invalid_session_id", {
      field: "session_id",
      status: 422,
    });
  });

  test("client options are checked", () => {
    assert.throws(() => new TrackerClient({ baseUrl: server.url, apiKey: "k", retries: -1 }), InvalidInput);
    assert.throws(() => new TrackerClient({ baseUrl: "ftp://x", apiKey: "k" }), InvalidInput);
    assert.throws(() => new TrackerClient({ baseUrl: server.url }), InvalidInput);
  });
});

describe("retries, as the Python client does them", () => {
  /** A loopback HTTP server answering from a script of (status, body) and recording each request body. */
  async function scripted(answers) {
    const bodies = [];
    const srv = createServer((req, res) => {
      let data = "";
      req.on("data", (c) => (data += c));
      req.on("end", () => {
        bodies.push(data ? JSON.parse(data) : null);
        const [status, body, headers] = answers[Math.min(bodies.length - 1, answers.length - 1)];
        res.writeHead(status, { "Content-Type": "application/json", ...(headers ?? {}) });
        res.end(typeof body === "string" ? body : JSON.stringify(body));
      });
    });
    await new Promise((r) => srv.listen(0, "127.0.0.1", r));
    const url = `http://127.0.0.1:${srv.address().port}`;
    return { url, bodies, close: () => new Promise((r) => srv.close(r)) };
  }
  const decision = { session_id: "s1", version: 2, action: "proceed" };
  const unavailable = { code: "store_unavailable", error: "StoreUnavailable", message: "the database is unavailable" };

  test("502/503/504 are retried with one idempotency key for the call", async () => {
    const fake = await scripted([
      [503, unavailable],
      [502, "<html>bad gateway</html>"],
      [504, "gateway timeout"],
      [200, decision],
    ]);
    try {
      const c = new TrackerClient({ baseUrl: fake.url, apiKey: "k", retries: 3, backoffMs: 1 });
      assert.deepEqual(await c.observe("s1", measurement("m1", 1)), decision);
      assert.equal(fake.bodies.length, 4);
      const keys = new Set(fake.bodies.map((b) => b.idempotency_key));
      assert.equal(keys.size, 1);
      assert.match([...keys][0], /^[0-9a-f]{32}$/);
      await c.observe("s1", measurement("m1", 1));
      assert.notEqual(fake.bodies[4].idempotency_key, fake.bodies[0].idempotency_key, "a new call, a new key");
    } finally {
      await fake.close();
    }
  });

  test("after the last retry the typed error is thrown", async () => {
    const fake = await scripted([[503, unavailable]]);
    try {
      const c = new TrackerClient({ baseUrl: fake.url, apiKey: "k", retries: 2, backoffMs: 1 });
      await rejectsWith(c.state("s1"), StoreUnavailable, "store_unavailable", { status: 503 });
      assert.equal(fake.bodies.length, 3);
    } finally {
      await fake.close();
    }
  });

  test("the tracker's own count_timeout (504), 429 and 4xx are not retried", async () => {
    const countTimeout = { code: "count_timeout", error: "CountTimeout", message: "no valid count within the count timeout" };
    const tooMany = { code: "too_many_waits", error: "TooManyWaits", message: "cap", retry_after_s: 1 };
    for (const [status, body, cls] of [
      [504, countTimeout, CountTimeout],
      [429, tooMany, TooManyWaits],
      [409, { code: "stale_basis", error: "StaleBasis", message: "old" }, StaleBasis],
    ]) {
      const fake = await scripted([[status, body]]);
      try {
        const c = new TrackerClient({ baseUrl: fake.url, apiKey: "k", retries: 3, backoffMs: 1 });
        await rejectsWith(c.observe("s1", measurement("m1", 1)), cls, body.code, { status });
        assert.equal(fake.bodies.length, 1, `${status} was not retried`);
      } finally {
        await fake.close();
      }
    }
  });

  test("an answer without a code is a TrackerError with its status", async () => {
    const fake = await scripted([[500, "oops"]]);
    try {
      const c = new TrackerClient({ baseUrl: fake.url, apiKey: "k", retries: 3, backoffMs: 1 });
      await rejectsWith(c.state("s1"), TrackerError, "tracker_error", { status: 500 });
      assert.equal(fake.bodies.length, 1);
    } finally {
      await fake.close();
    }
  });

  test("a tracker that cannot be reached is StoreUnavailable after every retry", async () => {
    const fake = await scripted([[200, decision]]);
    const url = fake.url;
    await fake.close(); // nothing listens there now
    let calls = 0;
    const c = new TrackerClient({
      baseUrl: url,
      apiKey: "k",
      retries: 2,
      backoffMs: 1,
      fetch: (...args) => {
        calls++;
        return fetch(...args);
      },
    });
    await rejectsWith(c.state("s1"), StoreUnavailable, "store_unavailable", { status: 0 });
    assert.equal(calls, 3);
  });

  test("a request that outlives timeoutMs is retried, then StoreUnavailable", async () => {
    const srv = createServer(() => {}); // never answers
    await new Promise((r) => srv.listen(0, "127.0.0.1", r));
    try {
      const c = new TrackerClient({ baseUrl: `http://127.0.0.1:${srv.address().port}`, apiKey: "k", timeoutMs: 100, retries: 1, backoffMs: 1 });
      const started = performance.now();
      await rejectsWith(c.state("s1"), StoreUnavailable, "store_unavailable");
      assert.ok(performance.now() - started >= 190);
    } finally {
      srv.closeAllConnections();
      await new Promise((r) => srv.close(r));
    }
  });
});
