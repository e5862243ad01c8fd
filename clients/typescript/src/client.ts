/**
 * `TrackerClient`: the HTTP API of `tracker serve`, with the Python client's behaviour on the wire
 * (tracker/client/):
 *
 * - every mutating call carries an `idempotency_key` (yours, or one generated for the call) and a
 *   retry of that call reuses it, so a retried call gets the original answer and never records twice;
 * - connection errors (and timeouts), 502, 503 and a 504 that is not the tracker's own recorded
 *   `count_timeout` are retried with full-jitter exponential backoff (`retries` times, pause
 *   `random(0, backoffMs * 2^attempt)`); every other error is thrown at once as its typed error;
 * - `wait` long-polls (at most 30 s per request) until the attempt ends or `timeout` seconds pass;
 * - bad input is refused before any request, with the code and field the server would answer.
 *
 * Bodies and answers are the API's JSON, named exactly as the API names them (snake_case); their
 * types come from the OpenAPI document (src/schema.ts).
 */
import { canonicalRequest } from "./canonical.js";
import { errorFromBody, InvalidInput, StoreUnavailable, TrackerError, WaitTimeout, type ErrorBody } from "./errors.js";
import type { components } from "./schema.js";
import {
  checkAttemptId,
  checkInt,
  checkKeys,
  checkMeasurement,
  checkNumber,
  checkObject,
  checkSessionId,
  checkText,
  JSON_SAFE_INT,
  present,
} from "./validate.js";

type Schemas = components["schemas"];
export type ObserveBody = Schemas["ObserveIn"];
export type MeasurementBody = Schemas["MeasurementIn"];
export type ManualBody = Schemas["ManualIn"];
export type CommitBody = Schemas["CommitIn"];
export type RejectBody = Schemas["RejectIn"];
export type Decision = Schemas["DecisionOut"];
export type Attempt = Schemas["AttemptOut"];
export type SessionState = Schemas["SessionStateOut"];
export type WaitResult = Schemas["WaitOut"];
export type HistoryPage = Schemas["HistoryOut"];
export type StoredEvent = Schemas["EventOut"];
export type SessionsPage = Schemas["SessionsOut"];
export type SessionRow = Schemas["SessionRowOut"];
export type FleetPolicy = Schemas["PolicyOut"];
export type PolicyFields = Schemas["PolicyFieldsOut"];
export type UsageBody = Schemas["UsageIn"];
export type RejectionBody = Schemas["RejectionIn"];
export type UsageReport = Schemas["UsageReportOut"];
export type RejectionReport = Schemas["RejectionReportOut"];
export type Calibration = Schemas["CalibrationOut"];
export type ModelCalibration = Schemas["ModelCalibrationOut"];
export type Pressure = "normal" | "compact" | "hard_limit";

export const API_PREFIX = "/v1";
export const MAX_WAIT_PER_REQUEST_S = 30;
export const RETRY_STATUSES: ReadonlySet<number> = new Set([502, 503, 504]);
export const HISTORY_PAGE = 500;

export interface TrackerClientOptions {
  /** e.g. `http://tracker:8080` (a trailing slash is ignored). */
  baseUrl: string;
  /** A fleet's API key (`tracker key create <fleet>`), sent as `Authorization: Bearer <key>`. */
  apiKey: string;
  /** Per HTTP request, in milliseconds (default 35 000: a 30 s long-poll fits). */
  timeoutMs?: number;
  /** How many times a retryable failure is retried (default 3). */
  retries?: number;
  /** The backoff base in milliseconds (default 200). */
  backoffMs?: number;
  /** The `fetch` to use (default the platform's). */
  fetch?: typeof globalThis.fetch;
}

export interface SessionsParams {
  pressure?: Pressure;
  /** Only sessions active at or after this time: a Date, seconds since the epoch, or ISO 8601 text. */
  since?: Date | number | string;
  /** Page size (1-1000, default 100). */
  limit?: number;
}

export interface HistoryParams {
  /** The first version to return (default 1). */
  from_version?: number;
  /** Page size (1-1000, default 500). */
  limit?: number;
}

interface Call {
  method: "GET" | "POST";
  path: string;
  body?: unknown;
  query?: Record<string, string>;
}

const OBSERVE_KEYS = [
  "measurement",
  "request",
  "model",
  "basis",
  "compaction_threshold",
  "scope",
  "scope_confidence",
  "overhead_tokens",
  "idempotency_key",
] as const;

const USAGE_KEYS = [
  "basis",
  "input_tokens",
  "model",
  "output_tokens",
  "cache_read_tokens",
  "cache_write_tokens",
  "idempotency_key",
] as const;
const REJECTION_KEYS = ["basis", "message", "input_tokens", "input_limit", "model", "idempotency_key"] as const;
/** The longest provider message a rejection carries (tracker/core/provider_errors.py MAX_MESSAGE_CHARS). */
export const MAX_MESSAGE_CHARS = 65_536;

function checkReportBasis(b: Record<string, unknown>): void {
  if (!present(b.basis)) throw InvalidInput.of("basis", "is required: the measured basis the request covered");
  checkText("basis", b.basis, 220);
}

function newKey(): string {
  return globalThis.crypto.randomUUID().replaceAll("-", "");
}

function path(...parts: string[]): string {
  return API_PREFIX + parts.map((p) => "/" + encodeURIComponent(p)).join("");
}

function idempotencyKey(body: Record<string, unknown>): string {
  if (!present(body.idempotency_key)) return newKey();
  return checkText("idempotency_key", body.idempotency_key, 200);
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

export class TrackerClient {
  readonly baseUrl: string;
  readonly timeoutMs: number;
  readonly retries: number;
  readonly backoffMs: number;
  readonly #headers: Record<string, string>;
  readonly #fetch: typeof globalThis.fetch;

  constructor(options: TrackerClientOptions) {
    const o = checkObject("options", options);
    checkKeys("", o, ["baseUrl", "apiKey", "timeoutMs", "retries", "backoffMs", "fetch"]);
    const baseUrl = checkText("baseUrl", o.baseUrl, 2000);
    if (!/^https?:\/\//.test(baseUrl)) throw InvalidInput.of("baseUrl", `must be an http(s) URL, got ${baseUrl}`);
    if (typeof o.apiKey !== "string" || !o.apiKey) throw InvalidInput.of("apiKey", "a fleet's API key is required");
    this.baseUrl = baseUrl.replace(/\/+$/, "");
    this.timeoutMs = present(o.timeoutMs) ? checkNumber("timeoutMs", o.timeoutMs, 1) : 35_000;
    this.retries = present(o.retries) ? checkInt("retries", o.retries, 0, 100) : 3;
    this.backoffMs = present(o.backoffMs) ? checkNumber("backoffMs", o.backoffMs, 0) : 200;
    if (present(o.fetch) && typeof o.fetch !== "function") throw InvalidInput.of("fetch", "must be a function");
    this.#fetch = (o.fetch as typeof globalThis.fetch | undefined) ?? globalThis.fetch.bind(globalThis);
    this.#headers = {
      Authorization: `Bearer ${o.apiKey}`,
      "User-Agent": "context-tracker-client-ts",
      Accept: "application/json",
    };
  }

  // -- the wire --------------------------------------------------------------------------------

  #delay(attempt: number): number {
    return Math.random() * this.backoffMs * 2 ** attempt; // full jitter
  }

  async #run<T>(call: Call): Promise<T> {
    const url = new URL(this.baseUrl + call.path);
    for (const [k, v] of Object.entries(call.query ?? {})) url.searchParams.set(k, v);
    const headers: Record<string, string> = { ...this.#headers };
    let payload: string | undefined;
    if (call.body !== undefined) {
      headers["Content-Type"] = "application/json";
      payload = JSON.stringify(call.body); // once: every retry sends the same bytes, idempotency key included
    }
    for (let attempt = 0; ; attempt++) {
      let response: Response;
      try {
        response = await this.#fetch(url, {
          method: call.method,
          headers,
          body: payload,
          signal: AbortSignal.timeout(this.timeoutMs),
        });
      } catch (exc) {
        if (attempt >= this.retries) {
          const what = exc instanceof Error ? `${exc.name}: ${exc.message}` : String(exc);
          throw new StoreUnavailable(`the tracker could not be reached: ${what}`, { status: 0, cause: exc });
        }
        await sleep(this.#delay(attempt));
        continue;
      }
      const text = await response.text();
      if (response.status === 200 || response.status === 201) return JSON.parse(text) as T;
      let body: unknown;
      try {
        body = JSON.parse(text);
      } catch {
        body = undefined;
      }
      const coded = typeof body === "object" && body !== null && "code" in body;
      const retryable =
        RETRY_STATUSES.has(response.status) &&
        !(response.status === 504 && coded && (body as ErrorBody).code === "count_timeout");
      if (retryable && attempt < this.retries) {
        await sleep(this.#delay(attempt));
        continue;
      }
      if (coded) throw errorFromBody(body as ErrorBody, response.status);
      throw new TrackerError(`HTTP ${response.status} from the tracker: ${text.slice(0, 200)}`, {
        status: response.status,
      });
    }
  }

  // -- commands ----------------------------------------------------------------------------------

  /**
   * Record a measurement (`{measurement}`) or have the tracker count a request (`{request, model,
   * basis}`) and decide: `proceed`, `compact` (an attempt is opened for you, `attempt`), `wait`
   * (`waiting_on`). At the hard limit with nothing eligible it throws `ContextLimitError`.
   */
  async observe(sessionId: string, body: ObserveBody): Promise<Decision> {
    const sid = checkSessionId(sessionId);
    const b = checkObject("body", body);
    checkKeys("", b, OBSERVE_KEYS);
    if (present(b.request) === present(b.measurement)) {
      throw InvalidInput.of("request", "give exactly one of request or measurement");
    }
    if (present(b.measurement)) {
      if (present(b.model) || present(b.basis)) {
        throw InvalidInput.of("measurement", "model and basis belong inside the measurement when one is given");
      }
      checkMeasurement(b.measurement);
    } else {
      checkObject("request", b.request);
      if (!present(b.model)) throw InvalidInput.of("model", "is required when counting a request");
      checkText("model", b.model, 200);
      if (!present(b.basis)) throw InvalidInput.of("basis", "is required when counting a request");
      checkText("basis", b.basis, 220);
      canonicalRequest(b.request); // the tracker would refuse it with the same field
    }
    if (present(b.compaction_threshold)) checkNumber("compaction_threshold", b.compaction_threshold);
    if (present(b.scope)) checkText("scope", b.scope, 100);
    if (present(b.scope_confidence)) checkNumber("scope_confidence", b.scope_confidence);
    if (present(b.overhead_tokens)) checkInt("overhead_tokens", b.overhead_tokens, 0);
    const sent = { ...b, idempotency_key: idempotencyKey(b) };
    return this.#run({ method: "POST", path: path("sessions", sid, "observe"), body: sent });
  }

  /** Open a manual compaction attempt (regardless of pressure; at most one manual attempt open). */
  async requestCompaction(sessionId: string, body: ManualBody = {}): Promise<Attempt> {
    const sid = checkSessionId(sessionId);
    const b = checkObject("body", body);
    checkKeys("", b, ["basis", "overhead_tokens", "idempotency_key"]);
    if (present(b.basis)) checkText("basis", b.basis, 220);
    if (present(b.overhead_tokens)) checkInt("overhead_tokens", b.overhead_tokens, 0);
    const sent = { ...b, idempotency_key: idempotencyKey(b) };
    return this.#run({ method: "POST", path: path("sessions", sid, "compactions"), body: sent });
  }

  /** Commit an open attempt you hold; `tokens_after` is the counted size of the compacted request. */
  async commit(sessionId: string, attemptId: string, body: CommitBody): Promise<SessionState> {
    const sid = checkSessionId(sessionId);
    const aid = checkAttemptId(attemptId);
    const b = checkObject("body", body);
    checkKeys("", b, ["fencing_token", "tokens_after", "idempotency_key"]);
    checkInt("fencing_token", b.fencing_token, -JSON_SAFE_INT);
    checkInt("tokens_after", b.tokens_after, 0);
    const sent = { ...b, idempotency_key: idempotencyKey(b) };
    return this.#run({ method: "POST", path: path("sessions", sid, "compactions", aid, "commit"), body: sent });
  }

  /** Reject an open attempt you hold (the compaction failed); its basis is exhausted. */
  async reject(sessionId: string, attemptId: string, body: RejectBody): Promise<SessionState> {
    const sid = checkSessionId(sessionId);
    const aid = checkAttemptId(attemptId);
    const b = checkObject("body", body);
    checkKeys("", b, ["fencing_token", "reject_reason", "idempotency_key"]);
    checkInt("fencing_token", b.fencing_token, -JSON_SAFE_INT);
    checkText("reject_reason", b.reject_reason, 200);
    const sent = { ...b, idempotency_key: idempotencyKey(b) };
    return this.#run({ method: "POST", path: path("sessions", sid, "compactions", aid, "reject"), body: sent });
  }

  /**
   * Report what the provider billed for the request of a measured `basis` (its response's usage):
   * `input_tokens` uncached, `cache_read_tokens` / `cache_write_tokens` apart. A calibration sample
   * for the measured model in this fleet; a retry with its `idempotency_key` records nothing more.
   */
  async reportUsage(sessionId: string, body: UsageBody): Promise<UsageReport> {
    const sid = checkSessionId(sessionId);
    const b = checkObject("body", body);
    checkKeys("", b, USAGE_KEYS);
    checkReportBasis(b);
    if (!present(b.input_tokens)) throw InvalidInput.of("input_tokens", "is required: the input tokens the provider billed");
    for (const field of ["input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens"] as const) {
      if (present(b[field])) checkInt(field, b[field], 0);
    }
    if (present(b.model)) checkText("model", b.model, 301);
    const sent = { ...b, idempotency_key: idempotencyKey(b) };
    return this.#run({ method: "POST", path: path("sessions", sid, "usage"), body: sent });
  }

  /**
   * Report that the provider refused the request of a measured `basis` as too long: `message` (its
   * error text; the tracker reads the count and limit from it) and/or `input_tokens` / `input_limit`.
   * From then on that basis decides at the hard limit (`compact`, `wait`, or `ContextLimitError`).
   */
  async reportRejection(sessionId: string, body: RejectionBody): Promise<RejectionReport> {
    const sid = checkSessionId(sessionId);
    const b = checkObject("body", body);
    checkKeys("", b, REJECTION_KEYS);
    checkReportBasis(b);
    if (present(b.message)) {
      // the provider's text as it came (newlines included): the tracker keeps it with control characters as spaces
      if (typeof b.message !== "string") throw InvalidInput.of("message", "must be the provider's error text");
      const length = [...b.message].length;
      if (length < 1 || length > MAX_MESSAGE_CHARS) {
        throw InvalidInput.of("message", `must be a string of 1-${MAX_MESSAGE_CHARS} characters`);
      }
    }
    if (present(b.input_tokens)) checkInt("input_tokens", b.input_tokens, 0);
    if (present(b.input_limit)) checkInt("input_limit", b.input_limit, 1);
    if (present(b.model)) checkText("model", b.model, 301);
    const sent = { ...b, idempotency_key: idempotencyKey(b) };
    return this.#run({ method: "POST", path: path("sessions", sid, "rejection"), body: sent });
  }

  /**
   * Wait until the attempt ends (`outcome` is `committed` or `rejected:<reason>`), long-polling at
   * most 30 s per request; still open after `timeout` seconds (default 30): `WaitTimeout`.
   */
  async wait(sessionId: string, attemptId: string, options: { timeout?: number } = {}): Promise<WaitResult> {
    const sid = checkSessionId(sessionId);
    const aid = checkAttemptId(attemptId);
    const o = checkObject("options", options);
    checkKeys("", o, ["timeout"]);
    const timeout = present(o.timeout) ? checkNumber("timeout", o.timeout, 0) : 30;
    const deadline = performance.now() + timeout * 1000;
    const p = path("sessions", sid, "compactions", aid, "wait");
    for (;;) {
      const left = Math.max(0, (deadline - performance.now()) / 1000);
      try {
        return await this.#run<WaitResult>({
          method: "GET",
          path: p,
          query: { timeout: String(Math.min(left, MAX_WAIT_PER_REQUEST_S)) },
        });
      } catch (exc) {
        if (!(exc instanceof WaitTimeout)) throw exc;
        if (performance.now() >= deadline) {
          throw new WaitTimeout(`attempt ${aid} still open after ${timeout}s`, {
            status: exc.status,
            body: { attempt_id: aid },
          });
        }
      }
    }
  }

  // -- reads -------------------------------------------------------------------------------------

  /** The session's state: the fold of its log (`UnknownSession` when it has none). */
  async state(sessionId: string): Promise<SessionState> {
    const sid = checkSessionId(sessionId);
    return this.#run({ method: "GET", path: path("sessions", sid) });
  }

  /** One page of the session's events (`next_from_version`, `has_more`). */
  async historyPage(sessionId: string, params: HistoryParams = {}): Promise<HistoryPage> {
    const sid = checkSessionId(sessionId);
    const p = checkObject("params", params);
    checkKeys("", p, ["from_version", "limit"]);
    const from = present(p.from_version) ? checkInt("from_version", p.from_version, 1, 2 ** 31 - 1) : 1;
    const limit = present(p.limit) ? checkInt("limit", p.limit, 1, 1000) : HISTORY_PAGE;
    return this.#run({
      method: "GET",
      path: path("sessions", sid, "history"),
      query: { from_version: String(from), limit: String(limit) },
    });
  }

  /** Every event of the session from `from_version` on, fetched page by page: `for await (const e of ...)`. */
  async *history(sessionId: string, params: HistoryParams = {}): AsyncGenerator<StoredEvent, void, undefined> {
    let from = params.from_version ?? 1;
    for (;;) {
      const page = await this.historyPage(sessionId, { ...params, from_version: from });
      yield* page.events;
      if (!page.has_more) return;
      from = page.next_from_version;
    }
  }

  /** One page of the fleet's sessions, most recently active first (`next_cursor` for the next). */
  async sessionsPage(params: SessionsParams & { cursor?: string } = {}): Promise<SessionsPage> {
    const p = checkObject("params", params);
    checkKeys("", p, ["pressure", "since", "limit", "cursor"]);
    const query: Record<string, string> = {};
    query.limit = String(present(p.limit) ? checkInt("limit", p.limit, 1, 1000) : 100);
    if (present(p.pressure)) {
      if (!["normal", "compact", "hard_limit"].includes(p.pressure as string)) {
        throw InvalidInput.of("pressure", `must be one of normal, compact, hard_limit, got ${String(p.pressure)}`);
      }
      query.pressure = p.pressure as string;
    }
    if (present(p.since)) query.since = sinceText(p.since);
    if (present(p.cursor)) query.cursor = checkText("cursor", p.cursor, 1000);
    return this.#run({ method: "GET", path: path("sessions"), query });
  }

  /** The fleet's sessions, most recently active first, fetched page by page: `for await (const row of ...)`. */
  async *sessions(params: SessionsParams = {}): AsyncGenerator<SessionRow, void, undefined> {
    let cursor: string | undefined;
    for (;;) {
      const page = await this.sessionsPage({ ...params, ...(cursor ? { cursor } : {}) });
      yield* page.sessions;
      if (!page.next_cursor) return;
      cursor = page.next_cursor;
    }
  }

  /**
   * The policy this key's fleet's new sessions start with: the fleet's own (`source: "fleet"`, set
   * with `tracker fleet policy`), else the server's (`source: "server"`, `version` 0,
   * `changed_at` null). A session keeps the policy it started with. Retried like every read.
   */
  async policy(): Promise<FleetPolicy> {
    return this.#run({ method: "GET", path: path("policy") });
  }

  /**
   * What this key's fleet's usage reports and rejections taught, per model and counter kind:
   * samples, median and p90 of billed / counted, the factor decisions use, drift, the learned limit.
   */
  async calibration(): Promise<ModelCalibration[]> {
    const answer = await this.#run<Calibration>({ method: "GET", path: path("calibration") });
    return answer.models;
  }
}

function sinceText(since: unknown): string {
  if (since instanceof Date) {
    if (Number.isNaN(since.getTime())) throw InvalidInput.of("since", "must be a valid date");
    return since.toISOString();
  }
  if (typeof since === "number" && Number.isFinite(since)) return new Date(since * 1000).toISOString();
  if (typeof since === "string" && !Number.isNaN(Date.parse(since))) return since;
  throw InvalidInput.of("since", `must be a Date, seconds since the epoch or ISO 8601 text, got ${String(since)}`);
}
