// One side of the cross-language race (tests/e2e/test_cross_language_race.py): an AI SDK agent.
//
//     node test/support/race-agent.mjs SPEC.json
//
// The spec and the stdin / stdout protocol are those of tests/support/race_agent.py (the LangChain
// side): `ready`, wait for `go`, one generateText call through contextTrackerMiddleware with a
// DirectoryShare; the summariser prints `summarizing` and waits for `summarize`; the client prints
// `waiting` before it waits on another holder's attempt; last, one JSON line. The history is held as
// AI SDK messages: one tool message per step holding every result of that step.
import { readFileSync } from "node:fs";
import { createInterface } from "node:readline";
import { generateText, wrapLanguageModel } from "ai";
import { MockLanguageModelV3 } from "ai/test";
import { canonicalJson, canonicalRequest, historyDigest, TrackerClient } from "../../dist/index.js";
import { contextTrackerMiddleware, SUMMARY_PREFIX, toRequest } from "../../dist/ai-sdk.js";
import { DirectoryShare } from "../../dist/directory-share.js";

const say = (line) => process.stdout.write(`${line}\n`);

const lines = [];
const waiters = [];
createInterface({ input: process.stdin }).on("line", (line) => {
  const next = waiters.shift();
  if (next) next(line);
  else lines.push(line);
});
const readLine = () => (lines.length ? Promise.resolve(lines.shift()) : new Promise((resolve) => waiters.push(resolve)));

function aiSdkHistory(history) {
  return history.map((turn) => {
    if (turn.role === "user") return { role: "user", content: turn.text };
    if (turn.role === "assistant") {
      const text = turn.text ? [{ type: "text", text: turn.text }] : [];
      const calls = (turn.calls ?? []).map((c) => ({ type: "tool-call", toolCallId: c.id, toolName: c.name, input: c.args }));
      return { role: "assistant", content: [...text, ...calls] };
    }
    return {
      role: "tool",
      content: turn.results.map((r) => ({ type: "tool-result", toolCallId: r.id, toolName: r.name, output: { type: "text", value: r.text } })),
    };
  });
}

const spec = JSON.parse(readFileSync(process.argv[2], "utf8"));
const client = new TrackerClient({ baseUrl: spec.url, apiKey: spec.token });
const wait = client.wait.bind(client);
client.wait = (...args) => {
  say("waiting");
  return wait(...args);
};
let summarizerCalls = 0;
const prompts = [];
const usage = { inputTokens: { total: 10, noCache: 10, cacheRead: 0, cacheWrite: 0 }, outputTokens: { total: 5, text: 5, reasoning: 0 } };
const model = wrapLanguageModel({
  model: new MockLanguageModelV3({
    doGenerate: async ({ prompt }) => {
      prompts.push(prompt);
      return { content: [{ type: "text", text: "All ten cities read." }], finishReason: { unified: "stop", raw: "stop" }, usage, warnings: [] };
    },
  }),
  middleware: contextTrackerMiddleware({
    client,
    sessionId: spec.session,
    model: spec.model,
    share: new DirectoryShare(spec.share_dir),
    summarize: async (messages) => {
      summarizerCalls++;
      say("summarizing");
      await readLine(); // "summarize"
      return `Written by the TypeScript agent: ${messages.length} messages, the weather of ten cities read.`;
    },
  }),
});
const messages = aiSdkHistory(spec.history);
say("ready");
await readLine(); // "go"
await generateText({ model, system: spec.system, messages });
const [sent] = prompts;
const history = toRequest({ prompt: sent }).messages;
const summaries = sent
  .filter((m) => m.role === "user" && m.content[0]?.text?.startsWith(SUMMARY_PREFIX))
  .map((m) => m.content[0].text.slice(SUMMARY_PREFIX.length));
say(
  JSON.stringify({
    side: "typescript",
    history_canonical: canonicalJson(canonicalRequest({ messages: history })),
    history_digest: await historyDigest(history),
    summarizer_calls: summarizerCalls,
    prompts: prompts.length,
    summaries,
  }),
);
process.exit(0);
