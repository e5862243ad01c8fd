/**
 * Every error the tracker answers with, as one class tree mirroring tracker/errors.py.
 *
 * The HTTP API answers every error as JSON `{code, error, message, ...details}` with a stable
 * `code` (tracker/http/errors.py). {@link errorFromBody} picks the class by `code` (else by the
 * class name in `error`), so `err instanceof StaleBasis` and `err.code === "stale_basis"` agree.
 * test/errors.test.mjs checks this tree against the Python one: the same names, codes, parents
 * and HTTP statuses.
 */

/** The body of an error answer (`ErrorBody` in the OpenAPI document): code, class, message, details. */
export interface ErrorBody {
  code: string;
  error?: string;
  message?: string;
  field?: string | null;
  [detail: string]: unknown;
}

const RESERVED = new Set(["code", "error", "message", "name", "stack", "cause", "status", "body", "details"]);

export class TrackerError extends Error {
  static readonly code: string = "tracker_error";
  /** The HTTP status the API answers this error with (tracker/http/errors.py ERROR_STATUS). */
  static readonly status: number = 500;
  /** The stable error code (the API's `code`). */
  readonly code: string;
  /** The HTTP status it came with; for a refusal made before any request, the status the server gives it. */
  readonly status: number;
  /** The field that is wrong, where there is one (bad input). */
  readonly field?: string;
  /** Every field of the error body besides code, error and message (`field`, `attempt_id`, `errors`, ...). */
  readonly details: Record<string, unknown>;
  /** The error body as the API sent it (or as it would have). */
  readonly body: ErrorBody;
  [detail: string]: unknown;

  constructor(message = "", options: { status?: number; body?: Partial<ErrorBody>; cause?: unknown } = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    const cls = new.target as typeof TrackerError;
    this.name = cls.name;
    const body: ErrorBody = { error: cls.name, message, ...options.body, code: options.body?.code ?? cls.code };
    this.code = body.code;
    this.status = options.status ?? cls.status;
    this.body = body;
    const details: Record<string, unknown> = {};
    for (const [k, v] of Object.entries(body)) {
      if (k === "code" || k === "error" || k === "message") continue;
      details[k] = v;
      if (!RESERVED.has(k)) (this as Record<string, unknown>)[k] = v;
    }
    this.details = details;
    if (typeof body.field === "string") this.field = body.field;
  }
}

// -- bad input -----------------------------------------------------------------------------------

/** Bad caller input; `field` names what is wrong; nothing is written. */
export class InvalidInput extends TrackerError {
  static override readonly code: string = "invalid_input";
  static override readonly status: number = 422;
  /** `field: problem`, the way the server words it. */
  static of(field: string, problem: string, details: Record<string, unknown> = {}): InvalidInput {
    return new this(`${field}: ${problem}`, { body: { field, ...details } });
  }
}
export class InvalidPolicy extends InvalidInput {
  static override readonly code: string = "invalid_policy";
}
export class InvalidSetting extends InvalidInput {
  static override readonly code: string = "invalid_setting";
}
export class InvalidSessionId extends InvalidInput {
  static override readonly code: string = "invalid_session_id";
}
export class PayloadTooLarge extends InvalidInput {
  static override readonly code: string = "payload_too_large";
  static override readonly status: number = 413;
}

// -- counting ------------------------------------------------------------------------------------

/** A count that could not be trusted (recorded as CountFailed). */
export class CountError extends TrackerError {
  static override readonly code: string = "count_failed";
  static override readonly status: number = 422;
}
export class CountTimeout extends CountError {
  static override readonly code: string = "count_timeout";
  static override readonly status: number = 504;
}
export class InvalidCountModel extends CountError {
  static override readonly code: string = "invalid_count_model";
}
export class QualityMismatch extends CountError {
  static override readonly code: string = "quality_mismatch";
}
export class MalformedMeasurement extends CountError {
  static override readonly code: string = "malformed_measurement";
}
export class ContextLimitUnknown extends CountError {
  static override readonly code: string = "context_limit_unknown";
}
export class RankFileError extends TrackerError {
  static override readonly code: string = "rank_file_error";
}

// -- decisions -----------------------------------------------------------------------------------

/** The request is at the hard limit and no automatic compaction is eligible (recorded). */
export class ContextLimitError extends TrackerError {
  static override readonly code: string = "context_limit";
  static override readonly status: number = 409;
}
/** The measurement's revision is older than the session's (another process compacted; recorded). */
export class StaleBasis extends TrackerError {
  static override readonly code: string = "stale_basis";
  static override readonly status: number = 409;
}
/** commit / reject / wait refused. */
export class AttemptError extends TrackerError {
  static override readonly code: string = "attempt_error";
  static override readonly status: number = 409;
}
export class UnknownAttempt extends AttemptError {
  static override readonly code: string = "unknown_attempt";
  static override readonly status: number = 404;
}
export class AttemptNotOpen extends AttemptError {
  static override readonly code: string = "attempt_not_open";
}
export class NotAttemptHolder extends AttemptError {
  static override readonly code: string = "not_attempt_holder";
}
export class ManualAttemptOpen extends AttemptError {
  static override readonly code: string = "manual_attempt_open";
}
/** tokens_after >= input_limit (recorded as the rejection summary_too_large). */
export class SummaryTooLarge extends AttemptError {
  static override readonly code: string = "summary_too_large";
}
/** wait() gave up before the attempt ended. */
export class WaitTimeout extends TrackerError {
  static override readonly code: string = "wait_timeout";
  static override readonly status: number = 408;
}

// -- storage -------------------------------------------------------------------------------------

export class StoreError extends TrackerError {
  static override readonly code: string = "store_error";
}
/** The database (or, from this client, the tracker) cannot be reached; nothing was written. */
export class StoreUnavailable extends StoreError {
  static override readonly code: string = "store_unavailable";
  static override readonly status: number = 503;
}
export class ConcurrencyConflict extends StoreError {
  static override readonly code: string = "concurrency_conflict";
  static override readonly status: number = 409;
}
export class SchemaOutOfDate extends StoreError {
  static override readonly code: string = "schema_out_of_date";
  static override readonly status: number = 503;
}
export class IntegrityError extends StoreError {
  static override readonly code: string = "integrity_error";
}
export class UnknownSession extends StoreError {
  static override readonly code: string = "unknown_session";
  static override readonly status: number = 404;
}
/** The session was archived (`tracker archive`): an operator restores it with `tracker restore`. */
export class ArchivedSession extends StoreError {
  static override readonly code: string = "session_archived";
  static override readonly status: number = 409;
}

// -- fleets and keys (CLI-side in Python; listed so every code has its class) ---------------------

export class FleetError extends TrackerError {
  static override readonly code: string = "fleet_error";
}
export class UnknownFleet extends FleetError {
  static override readonly code: string = "unknown_fleet";
}
export class UnknownKey extends FleetError {
  static override readonly code: string = "unknown_key";
}
export class FleetExists extends FleetError {
  static override readonly code: string = "fleet_exists";
}

// -- HTTP-only refusals --------------------------------------------------------------------------

export class HttpError extends TrackerError {
  static override readonly code: string = "http_error";
}
/** Missing, malformed, unknown or revoked API key. */
export class Unauthorized extends HttpError {
  static override readonly code: string = "unauthorized";
  static override readonly status: number = 401;
}
export class NotFound extends HttpError {
  static override readonly code: string = "not_found";
  static override readonly status: number = 404;
}
export class MethodNotAllowed extends HttpError {
  static override readonly code: string = "method_not_allowed";
  static override readonly status: number = 405;
}
/** The fleet's cap on concurrent long-polls is reached; `retry_after_s` says when to retry. */
export class TooManyWaits extends HttpError {
  static override readonly code: string = "too_many_waits";
  static override readonly status: number = 429;
}
export class BodyTimeout extends HttpError {
  static override readonly code: string = "body_timeout";
  static override readonly status: number = 408;
}

/** Every error class, root first (the same set tracker/errors.py defines). */
export const ERROR_CLASSES: readonly (typeof TrackerError)[] = [
  TrackerError,
  InvalidInput,
  InvalidPolicy,
  InvalidSetting,
  InvalidSessionId,
  PayloadTooLarge,
  CountError,
  CountTimeout,
  InvalidCountModel,
  QualityMismatch,
  MalformedMeasurement,
  ContextLimitUnknown,
  RankFileError,
  ContextLimitError,
  StaleBasis,
  AttemptError,
  UnknownAttempt,
  AttemptNotOpen,
  NotAttemptHolder,
  ManualAttemptOpen,
  SummaryTooLarge,
  WaitTimeout,
  StoreError,
  StoreUnavailable,
  ConcurrencyConflict,
  SchemaOutOfDate,
  IntegrityError,
  UnknownSession,
  ArchivedSession,
  FleetError,
  UnknownFleet,
  UnknownKey,
  FleetExists,
  HttpError,
  Unauthorized,
  NotFound,
  MethodNotAllowed,
  TooManyWaits,
  BodyTimeout,
];

const BY_CODE = new Map(ERROR_CLASSES.map((c) => [c.code, c]));
const BY_NAME = new Map(ERROR_CLASSES.map((c) => [c.name, c]));

/** The class with this stable `code` (`TrackerError` when none has it). */
export function errorClass(code: string): typeof TrackerError {
  return BY_CODE.get(code) ?? TrackerError;
}

/** The typed error of an API error body (by `code`, else by the class name in `error`). */
export function errorFromBody(body: ErrorBody, status?: number): TrackerError {
  let cls = errorClass(String(body.code ?? ""));
  if (cls === TrackerError && typeof body.error === "string") cls = BY_NAME.get(body.error) ?? TrackerError;
  return new cls(String(body.message ?? ""), { status: status ?? cls.status, body });
}
