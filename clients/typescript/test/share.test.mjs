// Sharing a compaction across processes and languages (docs/canonical-request.md, section 6): the
// payload's span in request-message positions, and DirectoryShare's file layout (Python's).
import assert from "node:assert/strict";
import { mkdtemp, readdir, readFile, rm } from "node:fs/promises";
import { readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { viewOf } from "../dist/ai-sdk.js";
import { digest, sharedSpan, sharePayload } from "../dist/compaction.js";
import { DirectoryShare } from "../dist/directory-share.js";

const { conversations } = JSON.parse(readFileSync(new URL("../../../docs/vectors/basis.json", import.meta.url), "utf8"));
// an AI SDK history whose third message holds two tool results: items of 1, 1, 2, 1, 1, 1 request messages
const view = viewOf({ prompt: conversations[0].ai_sdk.prompt });

test("the payload's span is in request messages, and maps back onto the adapter's items", async () => {
  assert.deepEqual(view.items.map((it) => it.messages.length), [1, 1, 2, 1, 1, 1]);
  const payload = await sharePayload(view, { start: 0, end: 3, summary: "S", revision: 2 });
  assert.deepEqual(payload, {
    from_revision: 1,
    start: 0,
    end: 4, // after the tool message of two results: four request messages
    span: await digest(view.items.slice(0, 3)),
    summary: "S",
  });
  assert.deepEqual(await sharedSpan(view, payload), { start: 0, end: 3, summary: "S" });
});

test("a shared compaction that does not fit this history is not adopted", async () => {
  const payload = await sharePayload(view, { start: 0, end: 3, summary: "S", revision: 2 });
  assert.equal(await sharedSpan(view, { ...payload, end: 3 }), null); // between the two results of one message
  assert.equal(await sharedSpan(view, { ...payload, from_revision: 2 }), null);
  assert.equal(await sharedSpan(view, { ...payload, span: "0".repeat(32) }), null);
  assert.equal(await sharedSpan(view, { ...payload, end: 99 }), null);
  assert.equal(await sharedSpan(view, { ...payload, summary: 7 }), null);
  assert.equal(await sharedSpan(view, null), null);
});

test("DirectoryShare: one JSON file per attempt, <session>__<attempt>.json, no temporary file left", async () => {
  const dir = await mkdtemp(join(tmpdir(), "ct-share-"));
  try {
    const share = new DirectoryShare(join(dir, "nested"));
    assert.equal(await share.get("s-1", "a1"), null);
    const payload = { from_revision: 1, start: 0, end: 4, span: "ab", summary: "héllo ✓" };
    await share.put("s-1", "a1", payload);
    await share.put("s-1", "a1", { ...payload, summary: "again" }); // replaced whole
    assert.deepEqual(await readdir(join(dir, "nested")), ["s-1__a1.json"]);
    assert.deepEqual(JSON.parse(await readFile(join(dir, "nested", "s-1__a1.json"), "utf8")), { ...payload, summary: "again" });
    assert.deepEqual(await share.get("s-1", "a1"), { ...payload, summary: "again" });
    assert.equal(await share.get("s-1", "a2"), null);
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});
