// The basis digest as a contract: docs/vectors/basis.json (expected values computed by the Python
// implementation, checked there by tests/unit/test_basis_vectors.py) against this package.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import {
  basisOf,
  canonicalJson,
  canonicalRequest,
  fingerprint,
  historyDigest,
  InvalidInput,
  parseJson,
  PyFloat,
} from "../dist/index.js";
import { estimateTokens } from "../dist/heuristic.js";
import { viewOf } from "../dist/ai-sdk.js";

const file = new URL("../../../docs/vectors/basis.json", import.meta.url);
const { vectors, numbers, conversations } = JSON.parse(readFileSync(file, "utf8"));

test("the vectors file has both kinds of case", () => {
  assert.ok(vectors.filter((v) => !v.error).length >= 10);
  assert.ok(vectors.filter((v) => v.error).length >= 10);
  assert.ok(numbers.length >= 200);
});

for (const v of vectors) {
  test(`vector: ${v.name}`, async () => {
    if (v.error) {
      assert.throws(
        () => canonicalRequest(v.request),
        (exc) => exc instanceof InvalidInput && exc.code === v.error.code && exc.field === v.error.field,
      );
      return;
    }
    const canonical = canonicalRequest(v.request);
    assert.equal(canonicalJson(canonical), v.canonical);
    assert.equal(await fingerprint(v.request), v.fingerprint);
    assert.equal(await historyDigest(v.request.messages), v.history_digest);
    assert.equal(await basisOf(v.revision, v.request.messages), v.basis);
    assert.equal(estimateTokens(v.request), v.heuristic_tokens);
    // the canonical form is a fixed point (read as Python reads JSON text)
    assert.equal(canonicalJson(canonicalRequest(parseJson(v.canonical))), v.canonical);
  });
}

// one conversation as LangChain and the AI SDK hold it: the AI SDK adapter gives the basis the LangChain one does
for (const c of conversations) {
  test(`conversation: ${c.name}`, async () => {
    assert.ok(c.ai_sdk.prompt.length > 0 && c.basis);
    const view = viewOf({ prompt: c.ai_sdk.prompt });
    const history = view.request().messages;
    assert.equal(canonicalJson(canonicalRequest({ messages: history })), c.history_canonical);
    assert.equal(await historyDigest(history), c.history_digest);
    assert.equal(await view.basis(), c.basis);
  });
}

test("numbers: JSON text read as Python reads it is written as Python writes it", () => {
  const wrong = numbers.filter((n) => canonicalJson(parseJson(n.json)) !== n.canonical);
  assert.deepEqual(wrong.map((n) => [n.json, canonicalJson(parseJson(n.json)), n.canonical]), []);
});

test("numbers: a JavaScript number is written as Python writes the value JSON.stringify sends", () => {
  // integral values below 1e21 travel as integers; others as floats
  for (const n of numbers) {
    const value = parseJson(n.json);
    if (!(value instanceof PyFloat)) continue;
    const x = value.value;
    const sent = JSON.parse(JSON.stringify(x)); // what the server would read
    const asPython = Number.isInteger(sent) && Math.abs(sent) < 1e21 ? String(BigInt(sent)) : n.canonical;
    assert.equal(canonicalJson(x), Object.is(x, -0) ? "0" : asPython, n.json);
  }
});

test("JavaScript-only values are refused or dropped as JSON would", () => {
  const req = (input) => ({ messages: [{ role: "assistant", content: [{ type: "tool_use", id: "a", name: "f", input }] }] });
  assert.throws(() => canonicalRequest(req({ x: NaN })), (e) => e.field === "messages[0].content[0].input.x");
  assert.throws(() => canonicalRequest(req({ x: Infinity })), (e) => e.code === "invalid_input");
  assert.equal(
    canonicalJson(canonicalRequest(req({ x: undefined, y: [undefined] }))),
    canonicalJson(canonicalRequest(req({ y: [null] }))),
  );
  assert.equal(canonicalJson({ big: 12345678901234567890n }), '{"big":12345678901234567890}');
});
