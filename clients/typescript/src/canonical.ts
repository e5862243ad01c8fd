/**
 * The canonical form of a request / history and its digest: a port of
 * tracker/counting/request.py (`CanonicalRequest.from_dict`, `canonical_json`) and of the
 * history digest of tracker/integrations/compaction/. docs/canonical-request.md is the
 * contract; docs/vectors/basis.json holds inputs with the digests Python computes, checked here
 * (test/canonical.test.mjs) and in Python (tests/unit/test_basis_vectors.py).
 *
 *   canonicalRequest(request)     the canonical form (system, messages, tools), or InvalidInput naming the field
 *   canonicalJson(value)          Python's json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
 *   fingerprint(request)          SHA-256 hex of the canonical JSON (UTF-8): what a count proves it counted
 *   historyDigest(messages)       first 32 hex digits of the fingerprint of {"messages": messages}
 *   basisOf(revision, messages)   `r<revision>:h<digest>`: the basis the integrations observe with
 */
import { InvalidInput } from "./errors.js";

export const ROLES = ["system", "developer", "user", "assistant", "tool"] as const;
export const IMAGE_DETAILS = ["auto", "low", "high"] as const;
const TEXT_TYPES = ["text", "input_text", "output_text"];
const IMAGE_TYPES = ["image", "image_url", "input_image"];
/** How deep a JSON value inside a request (tool arguments, a tool's input schema) may nest. */
export const MAX_NESTING = 64;

/**
 * A number Python holds as a float although it may be integral (`1.0`), as the JSON text wrote it.
 * JavaScript cannot tell `1.0` from `1`; {@link parseJson} keeps the distinction for JSON text
 * (OpenAI's tool-call argument strings), and callers may wrap a value themselves.
 */
export class PyFloat {
  constructor(readonly value: number) {}
  toJSON(): number {
    return this.value;
  }
}

export type CanonicalPart =
  | { type: "text"; text: string }
  | { type: "image"; width?: number; height?: number; detail?: string; source?: Record<string, string> }
  | { type: "tool_call"; id: string; name: string; arguments: unknown; raw?: true }
  | { type: "tool_result"; tool_call_id: string; content: CanonicalPart[]; is_error?: true };

export interface CanonicalMessage {
  role: (typeof ROLES)[number];
  content: CanonicalPart[];
  name?: string;
}

export interface CanonicalTool {
  name: string;
  description: string;
  parameters: unknown;
}

export interface CanonicalRequest {
  system: { type: "text"; text: string }[];
  messages: CanonicalMessage[];
  tools: CanonicalTool[];
}

type Obj = Record<string, unknown>;

const bad = (field: string, problem: string): InvalidInput => InvalidInput.of(field, problem);
const isObj = (v: unknown): v is Obj =>
  typeof v === "object" && v !== null && !Array.isArray(v) && !(v instanceof PyFloat);
const has = (o: Obj, k: string): boolean => Object.prototype.hasOwnProperty.call(o, k) && o[k] !== undefined;
/** Python's `d.get(k)`: undefined (absent) reads as None. */
const get = (o: Obj, k: string): unknown => (has(o, k) ? o[k] : null);
const isNone = (v: unknown): boolean => v === null || v === undefined;

function typeName(v: unknown): string {
  if (isNone(v)) return "NoneType";
  if (typeof v === "string") return "str";
  if (typeof v === "boolean") return "bool";
  if (typeof v === "bigint") return "int";
  if (typeof v === "number") return Number.isInteger(v) ? "int" : "float";
  if (v instanceof PyFloat) return "float";
  if (Array.isArray(v)) return "list";
  if (typeof v === "object") return "dict";
  return typeof v;
}

/** Python's truthiness (`bool(value)`). */
function truthy(v: unknown): boolean {
  if (isNone(v) || v === false || v === 0 || v === "" || v === 0n) return false;
  if (v instanceof PyFloat) return v.value !== 0;
  if (Array.isArray(v)) return v.length > 0;
  if (isObj(v)) return Object.keys(v).some((k) => v[k] !== undefined);
  return Boolean(v);
}

function str(value: unknown, field: string, allowEmpty = true): string {
  if (typeof value !== "string") {
    throw bad(field, `must be a string, got ${isNone(value) ? "missing" : typeName(value)}`);
  }
  if (!allowEmpty && !value) throw bad(field, "must be a non-empty string");
  return value;
}

// -- parsing (CanonicalRequest.from_dict) ---------------------------------------------------------

/** The canonical form of a request; bad input is refused with `InvalidInput` naming the field's path. */
export function canonicalRequest(data: unknown): CanonicalRequest {
  if (!isObj(data)) throw bad("request", `must be an object with 'messages', got ${typeName(data)}`);
  const system = parseSystem(get(data, "system"));
  if (!has(data, "messages")) throw bad("messages", "missing (a list of {role, content} objects)");
  const rawMessages = data.messages;
  if (!Array.isArray(rawMessages)) throw bad("messages", `must be a list, got ${typeName(rawMessages)}`);
  const messages = rawMessages.map((m, i) => parseMessage(m, `messages[${i}]`));
  const rawTools = get(data, "tools");
  let tools: CanonicalTool[] = [];
  if (!isNone(rawTools)) {
    if (!Array.isArray(rawTools)) throw bad("tools", `must be a list, got ${typeName(rawTools)}`);
    tools = rawTools.map((t, i) => parseTool(t, `tools[${i}]`));
  }
  const request: CanonicalRequest = { system, messages, tools };
  const field = unencodable({ system: get(data, "system"), messages: rawMessages, tools: rawTools }, "");
  if (field !== null || unencodable(request, "") !== null) {
    throw bad(field || "request", "is not valid Unicode text (a lone surrogate)");
  }
  return request;
}

function parseSystem(value: unknown): { type: "text"; text: string }[] {
  if (isNone(value)) return [];
  if (typeof value === "string") return value ? [{ type: "text", text: value }] : [];
  if (Array.isArray(value)) {
    return value.map((p, i) => {
      const field = `system[${i}]`;
      if (typeof p === "string") return { type: "text", text: p };
      if (!isObj(p) || !TEXT_TYPES.includes(get(p, "type") as string)) {
        throw bad(field, "must be a text part {'type': 'text', 'text': ...}");
      }
      return { type: "text", text: str(get(p, "text"), field + ".text") };
    });
  }
  throw bad("system", `must be a string, a list of text parts or null, got ${typeName(value)}`);
}

function parseMessage(m: unknown, field: string): CanonicalMessage {
  if (!isObj(m)) throw bad(field, `must be an object with 'role' and 'content', got ${typeName(m)}`);
  const role = get(m, "role");
  if (!(ROLES as readonly unknown[]).includes(role)) {
    throw bad(field + ".role", `must be one of ${ROLES.join(", ")}, got ${pyRepr(role)}`);
  }
  let name: string | undefined;
  if (!isNone(get(m, "name"))) name = str(m.name, field + ".name", false);
  const parts: CanonicalPart[] = [];
  if (!has(m, "content") && !has(m, "tool_calls")) throw bad(field + ".content", "missing");
  const content = get(m, "content");
  if (role === "tool" && has(m, "tool_call_id")) {
    // OpenAI tool message: the whole content is the result of one call.
    const callId = str(get(m, "tool_call_id"), field + ".tool_call_id", false);
    const inner = parseResultContent(content, field + ".content");
    parts.push(toolResult(callId, inner, truthy(get(m, "is_error"))));
  } else {
    parts.push(...parseContent(content, field + ".content", role as string));
  }
  const toolCalls = get(m, "tool_calls");
  if (!isNone(toolCalls)) {
    if (role !== "assistant") {
      throw bad(field + ".tool_calls", `only assistant messages make tool calls, role is ${pyRepr(role)}`);
    }
    if (!Array.isArray(toolCalls)) throw bad(field + ".tool_calls", `must be a list, got ${typeName(toolCalls)}`);
    toolCalls.forEach((call, j) => parts.push(parseOpenAiToolCall(call, `${field}.tool_calls[${j}]`)));
  }
  const out: CanonicalMessage = { role: role as CanonicalMessage["role"], content: parts };
  if (name !== undefined) out.name = name;
  return out;
}

function parseContent(content: unknown, field: string, role: string): CanonicalPart[] {
  if (isNone(content)) return [];
  if (typeof content === "string") return content ? [{ type: "text", text: content }] : [];
  if (!Array.isArray(content)) {
    throw bad(field, `must be a string, a list of parts or null, got ${typeName(content)}`);
  }
  return content.map((p, i) => parsePart(p, `${field}[${i}]`, role));
}

function parsePart(p: unknown, field: string, role: string): CanonicalPart {
  if (typeof p === "string") return { type: "text", text: p };
  if (!isObj(p)) throw bad(field, `must be a content part object, got ${typeName(p)}`);
  const kind = get(p, "type");
  if (TEXT_TYPES.includes(kind as string)) return { type: "text", text: str(get(p, "text"), field + ".text") };
  if (IMAGE_TYPES.includes(kind as string)) return parseImage(p, field);
  if (kind === "tool_use" || kind === "tool_call" || kind === "function_call") {
    if (role !== "assistant") {
      throw bad(field + ".type", `${pyRepr(kind)} parts belong to assistant messages, role is ${pyRepr(role)}`);
    }
    if (kind === "tool_use") {
      return toolCall(get(p, "id"), get(p, "name"), has(p, "input") ? p.input : {}, field, "input", false);
    }
    if (kind === "tool_call") {
      const raw = has(p, "raw") ? p.raw : false;
      if (typeof raw !== "boolean") throw bad(field + ".raw", `must be true or false, got ${pyRepr(raw)}`);
      if (raw) {
        return {
          type: "tool_call",
          id: str(get(p, "id"), field + ".id", false),
          name: str(get(p, "name"), field + ".name", false),
          arguments: str(get(p, "arguments"), field + ".arguments"),
          raw: true,
        };
      }
      return toolCall(get(p, "id"), get(p, "name"), has(p, "arguments") ? p.arguments : {}, field, "arguments", false);
    }
    // OpenAI responses item: arguments is a JSON string
    const id = has(p, "call_id") || Object.prototype.hasOwnProperty.call(p, "call_id") ? get(p, "call_id") : get(p, "id");
    return toolCall(id, get(p, "name"), has(p, "arguments") ? p.arguments : "{}", field, "arguments", true);
  }
  if (kind === "tool_result" || kind === "function_call_output") {
    const own = (k: string) => Object.prototype.hasOwnProperty.call(p, k);
    const callId = own("tool_use_id") ? get(p, "tool_use_id") : own("tool_call_id") ? get(p, "tool_call_id") : get(p, "call_id");
    const id = str(callId, field + ".tool_use_id", false);
    const innerKey = own("content") ? "content" : "output";
    const inner = parseResultContent(get(p, innerKey), `${field}.${innerKey}`);
    const isError = has(p, "is_error") ? p.is_error : false;
    if (typeof isError !== "boolean") throw bad(field + ".is_error", `must be true or false, got ${pyRepr(isError)}`);
    return toolResult(id, inner, isError);
  }
  throw bad(
    field + ".type",
    `unknown content part type ${pyRepr(kind)} (text, image, image_url, input_image, tool_use, tool_result)`,
  );
}

function toolResult(id: string, content: CanonicalPart[], isError: boolean): CanonicalPart {
  const part: CanonicalPart = { type: "tool_result", tool_call_id: id, content };
  if (isError) part.is_error = true;
  return part;
}

function parseResultContent(content: unknown, field: string): CanonicalPart[] {
  if (isNone(content)) return [];
  if (typeof content === "string") return content ? [{ type: "text", text: content }] : [];
  if (!Array.isArray(content)) {
    throw bad(field, `must be a string, a list of text/image parts or null, got ${typeName(content)}`);
  }
  return content.map((p, i) => {
    if (isObj(p) && ![...TEXT_TYPES, ...IMAGE_TYPES].includes(get(p, "type") as string)) {
      throw bad(`${field}[${i}].type`, "a tool result holds only text and image parts");
    }
    return parsePart(p, `${field}[${i}]`, "tool");
  });
}

function optDim(value: unknown, field: string): number | undefined {
  if (isNone(value)) return undefined;
  if (typeof value !== "number" || !Number.isInteger(value) || value <= 0) {
    throw bad(field, `must be a positive integer, got ${pyRepr(value)}`);
  }
  return value;
}

function parseImage(p: Obj, field: string): CanonicalPart {
  const width = optDim(get(p, "width"), field + ".width");
  const height = optDim(get(p, "height"), field + ".height");
  let detail = get(p, "detail");
  let source: Record<string, string> | undefined;
  if (!isNone(get(p, "source"))) {
    const src = p.source;
    if (!isObj(src) || (get(src, "type") !== "base64" && get(src, "type") !== "url")) {
      throw bad(field + ".source", "must be {'type': 'base64', 'media_type', 'data'} or {'type': 'url', 'url'}");
    }
    if (src.type === "base64") {
      source = {
        type: "base64",
        media_type: str(get(src, "media_type"), field + ".source.media_type", false),
        data: str(get(src, "data"), field + ".source.data", false),
      };
    } else {
      source = { type: "url", url: str(get(src, "url"), field + ".source.url", false) };
    }
  } else if (!isNone(get(p, "image_url"))) {
    const iu = p.image_url;
    let url: string;
    if (isObj(iu)) {
      url = str(get(iu, "url"), field + ".image_url.url", false);
      if (Object.prototype.hasOwnProperty.call(iu, "detail")) detail = get(iu, "detail");
    } else {
      url = str(iu, field + ".image_url", false);
    }
    source = sourceFromUrl(url);
  }
  if (!isNone(detail) && !(IMAGE_DETAILS as readonly unknown[]).includes(detail)) {
    throw bad(field + ".detail", `must be one of ${IMAGE_DETAILS.join(", ")}, got ${pyRepr(detail)}`);
  }
  const part: CanonicalPart = { type: "image" };
  if (width !== undefined) part.width = width;
  if (height !== undefined) part.height = height;
  if (!isNone(detail)) part.detail = detail as string;
  if (source !== undefined) part.source = source;
  return part;
}

function sourceFromUrl(url: string): Record<string, string> {
  if (url.startsWith("data:") && url.includes(";base64,")) {
    const at = url.indexOf(";base64,");
    const head = url.slice(5, at);
    return { type: "base64", media_type: head || "application/octet-stream", data: url.slice(at + 8) };
  }
  return { type: "url", url };
}

function parseOpenAiToolCall(call: unknown, field: string): CanonicalPart {
  if (!isObj(call)) throw bad(field, `must be an object, got ${typeName(call)}`);
  const fn = get(call, "function");
  if (!isObj(fn)) throw bad(field + ".function", "must be an object with 'name' and 'arguments'");
  return toolCall(get(call, "id"), get(fn, "name"), has(fn, "arguments") ? fn.arguments : "{}", field, "function.arguments", true);
}

function toolCall(callId: unknown, name: unknown, args: unknown, field: string, argsField: string, parse: boolean): CanonicalPart {
  const id = str(callId, field + ".id", false);
  const toolName = str(name, field + ".name", false);
  if (parse) {
    if (typeof args !== "string") throw bad(`${field}.${argsField}`, `must be a JSON string, got ${typeName(args)}`);
    let parsed: unknown;
    try {
      parsed = parseJson(args);
    } catch (exc) {
      if (exc instanceof NestingError) throw bad(`${field}.${argsField}`, `nests deeper than ${MAX_NESTING} levels`);
      return { type: "tool_call", id, name: toolName, arguments: args, raw: true };
    }
    args = parsed;
  }
  return { type: "tool_call", id, name: toolName, arguments: checkJson(args, `${field}.${argsField}`) };
}

function parseTool(t: unknown, field: string): CanonicalTool {
  if (!isObj(t)) throw bad(field, `must be an object, got ${typeName(t)}`);
  let fn: Obj;
  let prefix: string;
  let schemaKey: string;
  if (isObj(get(t, "function"))) {
    fn = t.function as Obj;
    prefix = field + ".function";
    schemaKey = "parameters";
  } else {
    fn = t;
    prefix = field;
    schemaKey = Object.prototype.hasOwnProperty.call(t, "input_schema") ? "input_schema" : "parameters";
  }
  const name = str(get(fn, "name"), prefix + ".name", false);
  const rawDescription = get(fn, "description");
  const description = truthy(rawDescription) ? rawDescription : "";
  if (typeof description !== "string") throw bad(prefix + ".description", `must be a string, got ${typeName(description)}`);
  let schema = get(fn, schemaKey);
  if (isNone(schema)) schema = {};
  if (!isObj(schema)) throw bad(`${prefix}.${schemaKey}`, `must be a JSON schema object, got ${typeName(schema)}`);
  return { name, description, parameters: checkJson(schema, `${prefix}.${schemaKey}`) };
}

/** A JSON value checked as Python's `_check_json` does, as the wire would carry it (undefined dropped). */
function checkJson(value: unknown, field: string, depth = 0): unknown {
  if (value === null || typeof value === "string" || typeof value === "boolean" || typeof value === "bigint") return value;
  if (typeof value === "number" || value instanceof PyFloat) {
    const n = typeof value === "number" ? value : value.value;
    if (!Number.isFinite(n)) throw bad(field, `must be finite, got ${pyRepr(value)}`);
    return value;
  }
  if (typeof value === "object" && depth >= MAX_NESTING) throw bad(field, `nests deeper than ${MAX_NESTING} levels`);
  if (Array.isArray(value)) {
    return value.map((v, i) => checkJson(v === undefined ? null : v, `${field}[${i}]`, depth + 1));
  }
  if (isObj(value)) {
    const out: Obj = {};
    for (const [k, v] of Object.entries(value)) {
      if (v === undefined) continue;
      out[k] = checkJson(v, `${field}.${k}`, depth + 1);
    }
    return out;
  }
  throw bad(field, `is not JSON (${typeof value})`);
}

const LONE_SURROGATE = /[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]/;

/** The path of the first string (or key) that UTF-8 cannot encode, if any (Python's `_unencodable`). */
function unencodable(value: unknown, field: string, depth = 0): string | null {
  if (typeof value === "string") return LONE_SURROGATE.test(value) ? field || "request" : null;
  if (depth > MAX_NESTING + 8) return null;
  if (Array.isArray(value)) {
    for (let i = 0; i < value.length; i++) {
      const found = unencodable(value[i], `${field}[${i}]`, depth + 1);
      if (found !== null) return found;
    }
  } else if (isObj(value)) {
    for (const [k, v] of Object.entries(value)) {
      const path = field ? `${field}.${k}` : k;
      if (LONE_SURROGATE.test(k)) return path;
      const found = unencodable(v, path, depth + 1);
      if (found !== null) return found;
    }
  }
  return null;
}

/** A short Python-like rendering of a value for error messages (`'x'`, `None`, `3`). */
function pyRepr(v: unknown): string {
  if (isNone(v)) return "None";
  if (typeof v === "string") return `'${v}'`;
  if (typeof v === "boolean") return v ? "True" : "False";
  if (v instanceof PyFloat) return formatFloat(v.value);
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : formatFloat(v);
  try {
    return JSON.stringify(v) ?? String(v);
  } catch {
    return String(v);
  }
}

// -- JSON text, as Python's json.loads reads it ---------------------------------------------------

class NestingError extends Error {}

/**
 * JSON text parsed the way Python's `json.loads` parses it, as far as the canonical form can
 * tell: a number with a fraction or an exponent is a float ({@link PyFloat}, so `1.0` stays
 * `1.0`), an integer beyond 2^53 stays exact (a `bigint`), `NaN` / `Infinity` / `-Infinity`
 * are read (and then refused as not finite). Throws SyntaxError where Python raises ValueError.
 */
export function parseJson(text: string): unknown {
  let i = 0;
  const ws = () => {
    while (i < text.length && " \t\n\r".includes(text[i]!)) i++;
  };
  const fail = (): never => {
    throw new SyntaxError(`invalid JSON at ${i}`);
  };
  const value = (depth: number): unknown => {
    if (depth > 900) throw new NestingError();
    ws();
    const c = text[i];
    if (c === "{") {
      i++;
      const out: Obj = {};
      ws();
      if (text[i] === "}") {
        i++;
        return out;
      }
      for (;;) {
        ws();
        if (text[i] !== '"') fail();
        const key = string();
        ws();
        if (text[i] !== ":") fail();
        i++;
        out[key] = value(depth + 1);
        ws();
        if (text[i] === ",") {
          i++;
          continue;
        }
        if (text[i] === "}") {
          i++;
          return out;
        }
        fail();
      }
    }
    if (c === "[") {
      i++;
      const out: unknown[] = [];
      ws();
      if (text[i] === "]") {
        i++;
        return out;
      }
      for (;;) {
        out.push(value(depth + 1));
        ws();
        if (text[i] === ",") {
          i++;
          continue;
        }
        if (text[i] === "]") {
          i++;
          return out;
        }
        fail();
      }
    }
    if (c === '"') return string();
    for (const [word, v] of [
      ["null", null],
      ["true", true],
      ["false", false],
      ["NaN", new PyFloat(NaN)],
      ["Infinity", new PyFloat(Infinity)],
      ["-Infinity", new PyFloat(-Infinity)],
    ] as const) {
      if (text.startsWith(word, i)) {
        i += word.length;
        return v;
      }
    }
    const m = /^-?(?:0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?/.exec(text.slice(i));
    if (!m) return fail();
    i += m[0].length;
    if (m[1] !== undefined || m[2] !== undefined) return new PyFloat(Number(m[0]));
    const n = Number(m[0]);
    return Number.isSafeInteger(n) ? n : BigInt(m[0]);
  };
  const string = (): string => {
    i++; // the opening quote
    let out = "";
    for (;;) {
      const c = text[i];
      if (c === undefined) return fail();
      if (c === '"') {
        i++;
        return out;
      }
      if (c === "\\") {
        const e = text[i + 1];
        const simple: Record<string, string> = { '"': '"', "\\": "\\", "/": "/", b: "\b", f: "\f", n: "\n", r: "\r", t: "\t" };
        if (e !== undefined && e in simple) {
          out += simple[e];
          i += 2;
        } else if (e === "u" && /^[0-9a-fA-F]{4}$/.test(text.slice(i + 2, i + 6))) {
          out += String.fromCharCode(parseInt(text.slice(i + 2, i + 6), 16));
          i += 6;
        } else fail();
        continue;
      }
      if (c < " ") fail(); // strict: no control characters inside strings
      out += c;
      i++;
    }
  };
  const result = value(0);
  ws();
  if (i !== text.length) fail();
  return result;
}

// -- canonical JSON -------------------------------------------------------------------------------

/** Compare strings by code point, as Python sorts `str` keys (JavaScript's `<` compares UTF-16 units). */
function byCodePoint(a: string, b: string): number {
  const x = [...a];
  const y = [...b];
  for (let i = 0; i < Math.min(x.length, y.length); i++) {
    const d = x[i]!.codePointAt(0)! - y[i]!.codePointAt(0)!;
    if (d !== 0) return d;
  }
  return x.length - y.length;
}

/**
 * Python's `repr(float)`: the shortest digits that round-trip (as JavaScript's), written in
 * exponent form when the decimal exponent is below -4 or at least 16 (`1e-05`, `1e+16`,
 * two-digit exponents at least), else positionally with at least one fractional digit (`3.0`).
 */
export function formatFloat(x: number): string {
  if (Number.isNaN(x)) return "NaN";
  if (!Number.isFinite(x)) return x > 0 ? "Infinity" : "-Infinity";
  if (x === 0) return Object.is(x, -0) ? "-0.0" : "0.0";
  const [mantissa, exp] = x.toExponential().split("e") as [string, string];
  const sign = mantissa.startsWith("-") ? "-" : "";
  const digits = mantissa.replace("-", "").replace(".", "");
  const e = Number(exp);
  if (e < -4 || e >= 16) {
    const m = digits.length > 1 ? `${digits[0]}.${digits.slice(1)}` : digits;
    const ee = Math.abs(e).toString().padStart(2, "0");
    return `${sign}${m}e${e < 0 ? "-" : "+"}${ee}`;
  }
  if (e < 0) return `${sign}0.${"0".repeat(-e - 1)}${digits}`;
  const whole = digits.slice(0, e + 1).padEnd(e + 1, "0");
  const frac = digits.slice(e + 1) || "0";
  return `${sign}${whole}.${frac}`;
}

function number(x: number): string {
  if (!Number.isFinite(x)) throw bad("request", `is not representable as JSON: Out of range float values are not JSON compliant: ${x}`);
  // An integral value below 1e21 is what JSON.stringify writes as an integer, and Python reads back as an int.
  if (Number.isInteger(x) && Math.abs(x) < 1e21) return Object.is(x, -0) ? "0" : x.toFixed(0);
  return formatFloat(x);
}

/**
 * `json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)`:
 * keys sorted by code point, no whitespace, non-ASCII kept, `"` `\\` and control characters
 * escaped (`\n`-style where JSON has a short escape, else `\u00XX`), numbers as Python writes them.
 */
export function canonicalJson(value: unknown): string {
  if (value === null || value === undefined) return "null";
  if (value === true) return "true";
  if (value === false) return "false";
  if (typeof value === "string") return JSON.stringify(value);
  if (typeof value === "bigint") return value.toString();
  if (typeof value === "number") return number(value);
  if (value instanceof PyFloat) {
    if (!Number.isFinite(value.value)) return number(value.value);
    return formatFloat(value.value);
  }
  if (Array.isArray(value)) return `[${value.map((v) => canonicalJson(v === undefined ? null : v)).join(",")}]`;
  if (typeof value === "object") {
    const obj = value as Obj;
    const keys = Object.keys(obj)
      .filter((k) => obj[k] !== undefined)
      .sort(byCodePoint);
    return `{${keys.map((k) => `${JSON.stringify(k)}:${canonicalJson(obj[k])}`).join(",")}}`;
  }
  throw bad("request", `is not representable as JSON: ${typeof value}`);
}

// -- digests --------------------------------------------------------------------------------------

export async function sha256Hex(text: string): Promise<string> {
  const bytes = new TextEncoder().encode(text);
  const hash = await globalThis.crypto.subtle.digest("SHA-256", bytes);
  return Array.from(new Uint8Array(hash), (b) => b.toString(16).padStart(2, "0")).join("");
}

/** SHA-256 hex of the request's canonical JSON (UTF-8): the `fingerprint` of a count. */
export async function fingerprint(request: unknown): Promise<string> {
  return sha256Hex(canonicalJson(canonicalRequest(request)));
}

/** The digest of a history (messages only, never ids): the first 32 hex digits of fingerprint({messages}). */
export async function historyDigest(messages: readonly unknown[]): Promise<string> {
  return (await fingerprint({ messages })).slice(0, 32);
}

/** `r<revision>:h<digest>`: the basis an integration observes a history with. */
export async function basisOf(revision: number, messages: readonly unknown[]): Promise<string> {
  if (!Number.isInteger(revision) || revision < 1) throw bad("basis.revision", `must be an integer >= 1, got ${revision}`);
  return `r${revision}:h${await historyDigest(messages)}`;
}
