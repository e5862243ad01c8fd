/**
 * @context-tracker/client: the Context Tracker's HTTP API for TypeScript.
 *
 * - {@link TrackerClient}: observe, requestCompaction, commit, reject, wait, reportUsage, reportRejection,
 *   state, sessions, history, policy, calibration
 * - typed errors, one class per error code (`ContextLimitError`, `StaleBasis`, `WaitTimeout`, ...)
 * - the canonical request form and the basis digest (docs/canonical-request.md)
 *
 * The AI SDK middleware is `@context-tracker/client/ai-sdk`.
 */
export * from "./client.js";
export * from "./errors.js";
export {
  basisOf,
  canonicalJson,
  canonicalRequest,
  fingerprint,
  formatFloat,
  historyDigest,
  parseJson,
  PyFloat,
  sha256Hex,
  MAX_NESTING,
  type CanonicalMessage,
  type CanonicalPart,
  type CanonicalRequest,
  type CanonicalTool,
} from "./canonical.js";
export { estimateTokens, heuristicTextTokens } from "./heuristic.js";
export type { components, paths, operations } from "./schema.js";
