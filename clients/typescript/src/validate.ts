/**
 * Checks made before any request, with the codes and fields the server would answer
 * (tracker/http/schemas.py, tracker/http/routes.py): bad input never leaves the process.
 */
import { InvalidInput, InvalidSessionId } from "./errors.js";

/** The largest integer every JSON reader keeps exactly: the bound on counts at every door. */
export const JSON_SAFE_INT = Number.MAX_SAFE_INTEGER;
/** 200 internal characters minus the `<fleet_id>:` prefix the server adds. */
export const MAX_SESSION_ID = 189;
const SESSION_ID = new RegExp(`^[A-Za-z0-9._:-]{1,${MAX_SESSION_ID}}$`);
// C0 and C1 control characters and lone surrogates (tracker/core/model.py _UNSAFE_TEXT)
const UNSAFE_TEXT = /[\u0000-\u001f\u007f-\u009f]|[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]/;

function shown(value: unknown): string {
  if (value === undefined || value === null) return "missing";
  try {
    return (typeof value === "string" ? JSON.stringify(value) : String(value)).slice(0, 60);
  } catch {
    return typeof value;
  }
}

const bad = (field: string, problem: string): InvalidInput => InvalidInput.of(field, problem);

export function checkSessionId(value: unknown): string {
  if (typeof value !== "string") {
    throw new InvalidSessionId(`session_id: must be a string, got ${shown(value)}`, { body: { field: "session_id" } });
  }
  if (!SESSION_ID.test(value)) {
    throw new InvalidSessionId(`session_id: must be 1-${MAX_SESSION_ID} characters of [A-Za-z0-9._:-], got ${shown(value)}`, {
      body: { field: "session_id" },
    });
  }
  return value;
}

export function checkAttemptId(value: unknown): string {
  if (typeof value !== "string" || value.length < 1 || value.length > 200) {
    throw bad("attempt_id", `must be a string of 1-200 characters, got ${shown(value)}`);
  }
  return value;
}

/** Text of 1-`max` characters (UTF-16 code units are not characters: counted by code point). */
export function checkText(field: string, value: unknown, max: number, min = 1): string {
  if (typeof value !== "string") throw bad(field, `must be a string, got ${shown(value)}`);
  const length = [...value].length;
  if (length < min || length > max) throw bad(field, `must be a string of ${min}-${max} characters, got ${shown(value)}`);
  if (UNSAFE_TEXT.test(value)) throw bad(field, "must not contain control characters or lone surrogates");
  return value;
}

export function checkInt(field: string, value: unknown, min: number, max = JSON_SAFE_INT): number {
  if (typeof value !== "number" || !Number.isInteger(value)) {
    throw bad(field, `must be an integer, got ${shown(value)}`);
  }
  if (value < min || value > max) throw bad(field, `must be an integer in ${min}..${max}, got ${value}`);
  return value;
}

export function checkNumber(field: string, value: unknown, min = -Infinity, max = Infinity): number {
  if (typeof value !== "number" || !Number.isFinite(value)) throw bad(field, `must be a finite number, got ${shown(value)}`);
  if (value < min || value > max) throw bad(field, `must be a number in ${min}..${max}, got ${value}`);
  return value;
}

export function checkObject(field: string, value: unknown): Record<string, unknown> {
  if (typeof value !== "object" || value === null || Array.isArray(value)) {
    throw bad(field, `must be an object, got ${Array.isArray(value) ? "an array" : shown(value)}`);
  }
  return value as Record<string, unknown>;
}

/** Unknown fields are refused, as the server's `extra="forbid"` models do (the field is the name). */
export function checkKeys(prefix: string, value: Record<string, unknown>, allowed: readonly string[]): void {
  for (const key of Object.keys(value)) {
    if (!allowed.includes(key)) throw bad(prefix + key, "Extra inputs are not permitted");
  }
}

const QUALITIES = ["exact_provider", "exact_local", "heuristic_estimate"];

/** A measurement you made yourself (`MeasurementIn`). */
export function checkMeasurement(value: unknown): void {
  const m = checkObject("measurement", value);
  checkKeys("measurement.", m, ["basis", "input_tokens", "input_limit", "model", "fingerprint", "quality"]);
  checkText("measurement.basis", m.basis, 220);
  checkInt("measurement.input_tokens", m.input_tokens, 0);
  checkInt("measurement.input_limit", m.input_limit, 1);
  if (m.model !== undefined && m.model !== null) {
    if (typeof m.model === "string") checkText("measurement.model", m.model, 200);
    else {
      const ref = checkObject("measurement.model", m.model);
      checkKeys("measurement.model.", ref, ["provider", "name"]);
      if (ref.provider !== undefined) checkText("measurement.model.provider", ref.provider, 100);
      checkText("measurement.model.name", ref.name, 200);
    }
  }
  if (m.fingerprint !== undefined && m.fingerprint !== null) {
    if (typeof m.fingerprint !== "string" || !/^[0-9a-f]{64}$/.test(m.fingerprint)) {
      throw bad("measurement.fingerprint", "must be the SHA-256 hex (64 of [0-9a-f]) of the counted request");
    }
  }
  if (m.quality !== undefined && !QUALITIES.includes(m.quality as string)) {
    throw bad("measurement.quality", `must be one of ${QUALITIES.join(", ")}, got ${shown(m.quality)}`);
  }
}

export function present(value: unknown): boolean {
  return value !== undefined && value !== null;
}
