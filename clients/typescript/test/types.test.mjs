// The declarations a consumer compiles against: bodies are the API's (generated) types, so a
// missing or misspelt field is a compile error, and the middleware fits wrapLanguageModel.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

const root = fileURLToPath(new URL("..", import.meta.url));
const tsc = join(root, "node_modules", "typescript", "bin", "tsc");

function compile(source) {
  const dir = mkdtempSync(join(root, "test", ".types-"));
  try {
    writeFileSync(join(dir, "consumer.ts"), source);
    const args = ["--noEmit", "--strict", "--module", "nodenext", "--moduleResolution", "nodenext", "--target", "es2022", "--skipLibCheck", join(dir, "consumer.ts")];
    try {
      execFileSync(process.execPath, [tsc, ...args], { cwd: root, encoding: "utf8" });
      return "";
    } catch (exc) {
      return String(exc.stdout);
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

const header = `
import { TrackerClient, ContextLimitError, StaleBasis, type Decision, type SessionState } from "../../dist/index.js";
import { contextTrackerMiddleware } from "../../dist/ai-sdk.js";
import { wrapLanguageModel } from "ai";
import { MockLanguageModelV3 } from "ai/test";
const client = new TrackerClient({ baseUrl: "http://127.0.0.1:1", apiKey: "k" });
`;

test("a consumer compiles against the declarations", () => {
  const out = compile(`${header}
export async function run(): Promise<number> {
  const d: Decision = await client.observe("s1", { request: { messages: [] }, model: "gpt-4o", basis: "r1:h0" });
  if (d.action === "compact" && d.attempt) {
    const s: SessionState = await client.commit("s1", d.attempt.attempt_id, { fencing_token: d.attempt.fencing_token, tokens_after: 10 });
    return s.revision;
  }
  const w = await client.wait("s1", "a1", { timeout: 1 });
  const status: "committed" | "rejected" = w.status;
  for await (const e of client.history("s1")) console.log(e.type, e.version, status);
  const model = wrapLanguageModel({ model: new MockLanguageModelV3(), middleware: contextTrackerMiddleware({ client, sessionId: "s1", model: "gpt-4o" }) });
  console.log(model.modelId, new ContextLimitError("x").code, StaleBasis.code);
  return 0;
}
`);
  assert.equal(out, "");
});

test("a body with a missing or misspelt field does not compile", () => {
  const out = compile(`${header}
export async function run() {
  await client.commit("s1", "a1", { fencing_token: 1 });
  await client.reject("s1", "a1", { fencing_token: 1, rejectReason: "x" });
}
`);
  assert.match(out, /tokens_after/);
  assert.match(out, /rejectReason/);
});
