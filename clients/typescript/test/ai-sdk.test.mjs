// The AI SDK middleware in a real multi-step generateText loop with tools (AI SDK 6, its own
// MockLanguageModelV3), compacting through a real `tracker serve`.
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, describe, test } from "node:test";
import { generateText, stepCountIs, streamText, tool, wrapLanguageModel } from "ai";
import { MockLanguageModelV3 } from "ai/test";
import { APICallError } from "@ai-sdk/provider";
import { z } from "zod";
import { ContextLimitError, StaleBasis, TrackerClient } from "../dist/index.js";
import { contextTrackerMiddleware, SUMMARY_PREFIX, toRequest } from "../dist/ai-sdk.js";
import { estimateTokens } from "../dist/heuristic.js";
import { MemoryShare } from "../dist/compaction.js";
import { startTracker } from "./support/server.mjs";

// input limit = window 5000 - reserved output 1000 - safety margin 1000 = 3000 tokens; compaction at 80 % (2400)
const MODELS = { "tiny-agent": { provider: "test", window: 5000, max_output_tokens: 1000, counter: "heuristic" } };
const POLICY = { TRACKER_RESERVED_OUTPUT: "1000", TRACKER_SAFETY_MARGIN: "1000" };
const MODEL = "tiny-agent";
const SUMMARY_ASK = "Summarise the conversation below";

const usage = { inputTokens: { total: 10, noCache: 10, cacheRead: 0, cacheWrite: 0 }, outputTokens: { total: 5, text: 5, reasoning: 0 } };
const sid = () => `agent-${randomUUID().slice(0, 12)}`;

/** A page of a long report: about 300 heuristic tokens. */
function page(n) {
  return Array.from({ length: 12 }, (_, i) => `Page ${n} line ${i}: the quarterly figures for region ${n * 12 + i} rose steadily.`).join("\n");
}

/**
 * A mock agent model: asks for pages 1..pages one step at a time, then answers. A summary
 * request (the middleware's default summariser calls the wrapped model) gets a short summary.
 */
function agentModel(pages) {
  const agentPrompts = [];
  const agentCalls = [];
  const summaryPrompts = [];
  const model = new MockLanguageModelV3({
    modelId: "mock-agent",
    doGenerate: async (options) => {
      const { prompt } = options;
      const first = prompt[0];
      if (prompt.length === 1 && first.role === "user" && first.content[0]?.text?.startsWith(SUMMARY_ASK)) {
        summaryPrompts.push(prompt);
        return {
          content: [{ type: "text", text: "The user wants the report read; pages read so far were summarised: figures rose." }],
          finishReason: { unified: "stop", raw: "stop" },
          usage,
          warnings: [],
        };
      }
      agentPrompts.push(prompt);
      agentCalls.push(options);
      const read = prompt.flatMap((m) => (m.role === "tool" ? m.content : [])).length;
      const summarised = prompt.some((m) => m.providerOptions?.contextTracker);
      const n = agentPrompts.length;
      if (n <= pages) {
        return {
          content: [{ type: "tool-call", toolCallId: `call-${n}`, toolName: "read", input: JSON.stringify({ page: n }) }],
          finishReason: { unified: "tool-calls", raw: "tool_calls" },
          usage,
          warnings: [],
        };
      }
      return {
        content: [{ type: "text", text: `Done: ${read} pages in view${summarised ? " after a summary" : ""}.` }],
        finishReason: { unified: "stop", raw: "stop" },
        usage,
        warnings: [],
      };
    },
  });
  return { model, agentPrompts, agentCalls, summaryPrompts };
}

const tools = {
  read: tool({
    description: "Read one page of the report",
    inputSchema: z.object({ page: z.number().int() }),
    execute: async ({ page: n }) => page(n),
  }),
};

/** Every tool result in a prompt follows the call it answers, in the same prompt. */
function assertNoOrphans(prompt) {
  const calls = new Set();
  for (const m of prompt) {
    for (const part of Array.isArray(m.content) ? m.content : []) {
      if (part.type === "tool-call") calls.add(part.toolCallId);
      if (part.type === "tool-result") assert.ok(calls.has(part.toolCallId), `result of ${part.toolCallId} without its call`);
    }
  }
}

async function events(client, sessionId) {
  const out = [];
  for await (const e of client.history(sessionId)) out.push(e);
  return out;
}

let server;
let client;
before(async () => {
  server = await startTracker({ models: MODELS, env: POLICY });
  client = new TrackerClient({ baseUrl: server.url, apiKey: server.token });
});
after(async () => {
  await server?.stop();
});

describe("contextTrackerMiddleware in generateText", () => {
  test("a multi-step tool loop compacts through the tracker and sends the shorter history afterwards", async () => {
    const sessionId = sid();
    const { model, agentPrompts, agentCalls, summaryPrompts } = agentModel(10);
    const usageReports = [];
    const wrapped = wrapLanguageModel({
      model,
      middleware: contextTrackerMiddleware({
        client,
        sessionId,
        model: MODEL,
        keepLast: 2,
        onUsage: (r) => usageReports.push(r),
        log: () => {},
      }),
    });
    const result = await generateText({
      model: wrapped,
      system: "You read reports and answer briefly.",
      prompt: "Read the report page by page, then tell me what happened.",
      tools,
      stopWhen: stepCountIs(20),
    });
    assert.equal(result.steps.length, 11);
    assert.match(result.text, /^Done: .* after a summary\.$/);

    // a committed attempt, made by the default summariser (the wrapped model itself)
    const log = await events(client, sessionId);
    const committed = log.filter((e) => e.type === "CompactionCommitted");
    assert.ok(committed.length >= 1, `no compaction committed: ${log.map((e) => e.type).join(", ")}`);
    assert.ok(summaryPrompts.length >= committed.length);
    assert.ok(summaryPrompts[0][0].content[0].text.includes("Page 1 line 0"), "the summariser saw the span");
    const state = await client.state(sessionId);
    assert.equal(state.revision, 1 + committed.length);
    assert.equal(log.filter((e) => e.type === "MeasurementRefused").length, 0, "no stale basis: compactions are re-applied");

    // tokens_after is the count the tracker makes of the compacted request (the heuristic counter, ported)
    const first = log.indexOf(committed[0]);
    const next = log.slice(first + 1).find((e) => e.type === "ContextMeasured");
    assert.equal(committed[0].data.tokens_after, next.data.measurement.input_tokens);
    assert.ok(committed[0].data.tokens_after < committed[0].data.tokens_before);

    // the model received a shorter prompt after the compaction, opening with the summary
    const at = agentPrompts.findIndex((p) => p.some((m) => m.providerOptions?.contextTracker));
    assert.ok(at > 0, "a prompt after the compaction carries the summary");
    const before = agentPrompts[at - 1];
    const afterwards = agentPrompts[at];
    const size = (p) => estimateTokens(toRequest({ prompt: p, tools: [] }));
    assert.ok(size(afterwards) < size(before), `${size(afterwards)} < ${size(before)}`);
    assert.ok(afterwards.length < before.length);
    const summary = afterwards.find((m) => m.providerOptions?.contextTracker);
    assert.equal(summary.role, "user");
    assert.ok(summary.content[0].text.startsWith(SUMMARY_PREFIX));
    assert.equal(summary.providerOptions.contextTracker.revision, 2);
    assert.equal(afterwards[0].role, "system", "the system prompt is kept");
    // every later step sends the compacted history too, and no prompt has a tool result without its call
    for (const p of agentPrompts.slice(at)) assert.ok(p.some((m) => m.providerOptions?.contextTracker));
    agentPrompts.forEach(assertNoOrphans);
    // the last request the tracker measured is the last prompt the model received
    const measured = log.filter((e) => e.type === "ContextMeasured").at(-1).data;
    assert.equal(measured.measurement.input_tokens, estimateTokens(toRequest(agentCalls.at(-1))));
    // the usage seam: one report per model call, with the basis observed
    assert.equal(usageReports.length, agentPrompts.length);
    assert.match(usageReports.at(-1).basis, /^r\d+:h[0-9a-f]{32}$/);
  });

  test("a summariser of your own gets the AI SDK messages of the span and the budget", async () => {
    const sessionId = sid();
    const { model, agentPrompts } = agentModel(8);
    const asked = [];
    const wrapped = wrapLanguageModel({
      model,
      middleware: contextTrackerMiddleware({
        client,
        sessionId,
        model: MODEL,
        keepLast: 2,
        log: () => {},
        summarize: async (messages, budget) => {
          asked.push({ messages, budget });
          return `Read ${messages.filter((m) => m.role === "tool").length} pages; figures rose.`;
        },
      }),
    });
    await generateText({ model: wrapped, prompt: "Read the report.", tools, stopWhen: stepCountIs(20) });
    assert.ok(asked.length >= 1);
    const span = asked[0].messages;
    assert.equal(span[0].role, "user");
    assert.ok(span.some((m) => m.role === "tool"));
    assert.ok(asked[0].budget >= 32);
    // the span ends on a whole exchange: every call in it has its result in it
    const calls = span.flatMap((m) => (m.role === "assistant" ? m.content.filter((p) => p.type === "tool-call") : []));
    const results = new Set(span.flatMap((m) => (m.role === "tool" ? m.content.map((p) => p.toolCallId) : [])));
    for (const c of calls) assert.ok(results.has(c.toolCallId));
    agentPrompts.forEach(assertNoOrphans);
    assert.ok((await client.state(sessionId)).revision >= 2);
  });

  test("streamText goes through the same middleware", async () => {
    const sessionId = sid();
    const model = new MockLanguageModelV3({
      doStream: async () => ({
        stream: new ReadableStream({
          start(c) {
            c.enqueue({ type: "text-start", id: "t" });
            c.enqueue({ type: "text-delta", id: "t", delta: "hi" });
            c.enqueue({ type: "text-end", id: "t" });
            c.enqueue({ type: "finish", finishReason: { unified: "stop", raw: "stop" }, usage });
            c.close();
          },
        }),
      }),
    });
    const reports = [];
    const wrapped = wrapLanguageModel({
      model,
      middleware: contextTrackerMiddleware({ client, sessionId, model: MODEL, onUsage: (r) => reports.push(r) }),
    });
    const result = streamText({ model: wrapped, prompt: "Say hi." });
    assert.equal(await result.text, "hi");
    const state = await client.state(sessionId);
    assert.equal(state.last.action, "proceed");
    assert.equal(reports.length, 1);
    assert.equal(reports[0].basis, state.last.basis);
  });

  test("at the hard limit with nothing to compact, ContextLimitError reaches the caller and the request is never sent", async () => {
    const sessionId = sid();
    const huge = Array.from({ length: 400 }, (_, i) => `Sentence ${i} of an enormous request.`).join(" ");
    const agent = agentModel(0);
    const wrapped = wrapLanguageModel({
      model: agent.model,
      middleware: contextTrackerMiddleware({
        client,
        sessionId,
        model: MODEL,
        log: () => {},
        // the one message can be summarised, but not below the limit
        summarize: async () => huge,
      }),
    });
    await assert.rejects(generateText({ model: wrapped, prompt: huge }), (err) => {
      assert.ok(err instanceof ContextLimitError, `${err?.constructor?.name}: ${err?.message}`);
      assert.equal(err.code, "context_limit");
      assert.equal(err.status, 409);
      return true;
    });
    assert.equal(agent.model.doGenerateCalls.length, 0, "the refused request never reached the model");
    const log = await events(client, sessionId);
    const rejected = log.find((e) => e.type === "CompactionRejected");
    assert.equal(rejected.data.reject_reason, "summary_over_budget");
    assert.equal(log.at(-1).type, "ContextLimitReached");
  });

  test("at the hard limit while another holder's attempt is open, it waits for that attempt, then compacts", async () => {
    const sessionId = sid();
    // another process holds an automatic attempt on its own basis
    const other = await client.observe(sessionId, { measurement: { basis: "r1:other", input_tokens: 3000, input_limit: 3000 } });
    assert.equal(other.action, "compact");
    const prompt = [{ role: "system", content: "Answer briefly." }];
    for (let i = 1; i <= 10; i++) {
      prompt.push({ role: "user", content: [{ type: "text", text: page(i) }] });
      prompt.push({ role: "assistant", content: [{ type: "text", text: `Noted page ${i}.` }] });
    }
    prompt.push({ role: "user", content: [{ type: "text", text: "What happened?" }] });
    const model = new MockLanguageModelV3({
      doGenerate: async () => ({ content: [{ type: "text", text: "Figures rose." }], finishReason: { unified: "stop", raw: "stop" }, usage, warnings: [] }),
    });
    const wrapped = wrapLanguageModel({
      model,
      middleware: contextTrackerMiddleware({ client, sessionId, model: MODEL, keepLast: 2, log: () => {}, summarize: () => "Ten pages read; figures rose." }),
    });
    assert.ok(estimateTokens(toRequest({ prompt })) >= 3000, "the prompt is at the hard limit");
    const started = performance.now();
    setTimeout(() => {
      client.reject(sessionId, other.attempt.attempt_id, { fencing_token: other.attempt.fencing_token, reject_reason: "gave_up" });
    }, 500);
    const result = await wrapped.doGenerate({ prompt });
    assert.equal(result.content[0].text, "Figures rose.");
    assert.ok(performance.now() - started >= 450, "it waited for the other attempt");
    const log = await events(client, sessionId);
    const actions = log.filter((e) => e.type === "ContextMeasured").map((e) => e.data.action);
    assert.deepEqual(actions.slice(0, 3), ["compact", "wait", "compact"]);
    assert.equal(log.filter((e) => e.type === "CompactionCommitted").length, 1);
    assert.equal(actions.at(-1), "proceed");
    const sent = model.doGenerateCalls[0].prompt;
    assert.ok(sent.length < prompt.length && sent[1].providerOptions?.contextTracker?.revision === 2);
  });

  test("another holder of the same history adopts the compaction from the share (StaleBasis, then adopt)", async () => {
    const sessionId = sid();
    const share = new MemoryShare();
    const first = agentModel(8);
    const mw = (m) =>
      wrapLanguageModel({
        model: m,
        middleware: contextTrackerMiddleware({ client, sessionId, model: MODEL, keepLast: 2, share, log: () => {} }),
      });
    await generateText({ model: mw(first.model), prompt: "Read the report.", tools, stopWhen: stepCountIs(20) });
    assert.ok((await client.state(sessionId)).revision >= 2);
    // a second process holding the history as it was before the compaction, with a share of its own: refused
    const uncompacted = first.agentPrompts.find((p, i) => !p.some((m) => m.providerOptions?.contextTracker) && first.agentPrompts[i + 1]?.some((m) => m.providerOptions?.contextTracker));
    const lonely = new MockLanguageModelV3({ doGenerate: async () => ({ content: [{ type: "text", text: "x" }], finishReason: { unified: "stop", raw: "stop" }, usage, warnings: [] }) });
    const alone = wrapLanguageModel({
      model: lonely,
      middleware: contextTrackerMiddleware({ client, sessionId, model: MODEL, keepLast: 2, share: new MemoryShare(), log: () => {} }),
    });
    await assert.rejects(alone.doGenerate({ prompt: uncompacted, tools: [toolDef()] }), StaleBasis);
    // the same, with the share the holder published to: adopted, and the model gets the compacted prompt
    const adopter = new MockLanguageModelV3({ doGenerate: async () => ({ content: [{ type: "text", text: "ok" }], finishReason: { unified: "stop", raw: "stop" }, usage, warnings: [] }) });
    await mw(adopter).doGenerate({ prompt: uncompacted, tools: [toolDef()] });
    const sent = adopter.doGenerateCalls[0].prompt;
    assert.ok(sent.some((m) => m.providerOptions?.contextTracker?.revision === 2));
    assert.ok(sent.length < uncompacted.length);
    assertNoOrphans(sent);
  });
});

describe("the provider's numbers: usage after each call, a context-length refusal compacted and retried once", () => {
  const answer = (u = usage) => ({ content: [{ type: "text", text: "Figures rose." }], finishReason: { unified: "stop", raw: "stop" }, usage: u, warnings: [] });
  const refusal = (message) =>
    new APICallError({ message, url: "https://provider.test/v1/messages", requestBodyValues: {}, statusCode: 400, responseBody: JSON.stringify({ error: { message } }) });
  /** Six pages: about 1900 heuristic tokens, under the compact level (2400) -- but the provider counts more. */
  function longPrompt() {
    const prompt = [{ role: "system", content: "Answer briefly." }];
    for (let i = 1; i <= 6; i++) {
      prompt.push({ role: "user", content: [{ type: "text", text: page(i) }] });
      prompt.push({ role: "assistant", content: [{ type: "text", text: `Noted page ${i}.` }] });
    }
    prompt.push({ role: "user", content: [{ type: "text", text: "What happened?" }] });
    return prompt;
  }

  test("the provider's usage is reported on the basis observed, cache tokens apart", async () => {
    const sessionId = sid();
    const billed = { inputTokens: { total: 1500, noCache: 1200, cacheRead: 300, cacheWrite: undefined }, outputTokens: { total: 7, text: 7, reasoning: 0 } };
    const model = new MockLanguageModelV3({ doGenerate: async () => answer(billed) });
    const wrapped = wrapLanguageModel({ model, middleware: contextTrackerMiddleware({ client, sessionId, model: MODEL }) });
    await generateText({ model: wrapped, prompt: "Say hi." });
    const log = await events(client, sessionId);
    const reported = log.filter((e) => e.type === "UsageReported");
    assert.equal(reported.length, 1);
    const state = await client.state(sessionId);
    assert.equal(reported[0].data.basis, state.last.basis);
    assert.equal(reported[0].data.input_tokens, 1200);
    assert.equal(reported[0].data.cache_read_tokens, 300);
    assert.equal(reported[0].data.cache_write_tokens, null);
    assert.equal(reported[0].data.output_tokens, 7);
  });

  test("a context-length refusal is reported, the prompt compacted, and the call retried once", async () => {
    const sessionId = sid();
    const message = "prompt is too long: 3120 tokens > 3000 maximum";
    let calls = 0;
    const model = new MockLanguageModelV3({
      doGenerate: async () => {
        calls += 1;
        if (calls === 1) throw refusal(message);
        return answer();
      },
    });
    const logged = [];
    const wrapped = wrapLanguageModel({
      model,
      middleware: contextTrackerMiddleware({ client, sessionId, model: MODEL, keepLast: 2, log: (m) => logged.push(m), summarize: () => "Six pages read; figures rose." }),
    });
    const prompt = longPrompt();
    const counted = estimateTokens(toRequest({ prompt }));
    assert.ok(counted < 2400, `the tracker's count (${counted}) is under the compact level`);
    const result = await wrapped.doGenerate({ prompt });
    assert.equal(result.content[0].text, "Figures rose.");
    assert.equal(model.doGenerateCalls.length, 2, "retried once");
    const retried = model.doGenerateCalls[1].prompt;
    assert.ok(retried.length < prompt.length && retried.some((m) => m.providerOptions?.contextTracker?.revision === 2));
    const log = await events(client, sessionId);
    const types = log.map((e) => e.type);
    const rejected = log.find((e) => e.type === "ProviderRejected");
    assert.equal(rejected.data.input_tokens, 3120);
    assert.equal(rejected.data.form, "anthropic.prompt_too_long");
    const measured = log.filter((e) => e.type === "ContextMeasured");
    assert.equal(measured[0].data.action, "proceed");
    assert.equal(measured[1].data.action, "compact"); // the rejected basis, at the hard limit
    assert.equal(measured[1].data.rejected, true);
    assert.ok(types.indexOf("ProviderRejected") < types.indexOf("CompactionCommitted"));
    assert.equal(measured.at(-1).data.action, "proceed");
    const used = log.filter((e) => e.type === "UsageReported");
    assert.equal(used.length, 1, "the usage of the retried call, not of the refused one");
    assert.equal(used[0].data.basis, measured.at(-1).data.measurement.basis);
    assert.ok(logged.some((m) => m.includes("refused")));
  });

  test("a second refusal reaches the caller; an error that is not about length is never reported", async () => {
    const sessionId = sid();
    const always = new MockLanguageModelV3({ doGenerate: async () => { throw refusal("prompt is too long: 3120 tokens > 3000 maximum"); } });
    const mw = (m) => wrapLanguageModel({ model: m, middleware: contextTrackerMiddleware({ client, sessionId, model: MODEL, keepLast: 2, log: () => {}, summarize: () => "Short." }) });
    await assert.rejects(mw(always).doGenerate({ prompt: longPrompt() }), (err) => APICallError.isInstance(err));
    assert.equal(always.doGenerateCalls.length, 2);
    const other = sid();
    const broken = new MockLanguageModelV3({ doGenerate: async () => { throw refusal("tools.0.input_schema: invalid JSON schema"); } });
    const wrapped = wrapLanguageModel({ model: broken, middleware: contextTrackerMiddleware({ client, sessionId: other, model: MODEL, log: () => {} }) });
    await assert.rejects(wrapped.doGenerate({ prompt: longPrompt() }), (err) => APICallError.isInstance(err));
    assert.equal(broken.doGenerateCalls.length, 1);
    assert.deepEqual((await events(client, other)).filter((e) => e.type === "ProviderRejected"), []);
  });
});

/** The read tool as the AI SDK hands it to the model (for calls made directly on the wrapped model). */
function toolDef() {
  return {
    type: "function",
    name: "read",
    description: "Read one page of the report",
    inputSchema: z.toJSONSchema(z.object({ page: z.number().int() })),
  };
}
