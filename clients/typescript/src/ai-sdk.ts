/**
 * AI SDK 6 middleware: `contextTrackerMiddleware` for `wrapLanguageModel`.
 *
 * ```ts
 * import { generateText, wrapLanguageModel } from "ai";
 * import { TrackerClient } from "@context-tracker/client";
 * import { contextTrackerMiddleware } from "@context-tracker/client/ai-sdk";
 *
 * const client = new TrackerClient({ baseUrl: "http://tracker:8080", apiKey: process.env.TRACKER_KEY! });
 * const model = wrapLanguageModel({
 *   model: openai("gpt-4o"),
 *   middleware: contextTrackerMiddleware({ client, sessionId: "session-42", model: "gpt-4o" }),
 * });
 * await generateText({ model, tools, stopWhen: stepCountIs(20), prompt });
 * ```
 *
 * Before every model call (`transformParams`, for generate and stream alike) the complete prompt
 * (system, messages, tools) is observed on the session. On `compact` the older history is
 * summarised by `summarize(messages, budgetTokens)` (default: the wrapped model itself) and
 * replaced by one user message whose `providerOptions.contextTracker.revision` is the history's
 * new revision; a tool call is never separated from its result. On `wait` it waits; at the hard
 * limit `ContextLimitError` is thrown to the caller of `generateText` / `streamText`. See
 * src/compaction.ts for the whole protocol.
 *
 * The AI SDK resends the whole history on every step of a multi-step call, so the middleware
 * remembers the compactions it made (or adopted) for the session and re-applies them to a prompt
 * that arrives without them: every step sends the compacted history.
 *
 * After each call the provider's usage (`inputTokens.noCache` / `cacheRead` / `cacheWrite`,
 * `outputTokens.total`) is reported on the basis observed (`client.reportUsage`): the tracker's
 * calibration of the model's counts learns from it. A report that fails is logged, never thrown.
 * `onUsage` replaces the report (called with the basis and the usage instead).
 *
 * A provider's context-length refusal (an `APICallError` whose text says so) of a generate call is
 * reported (`client.reportRejection`, the tracker reads the count and limit from the text), the
 * prompt is observed again -- the rejected basis now decides at the hard limit, so it is compacted
 * -- and the call retried once with the compacted prompt. A second refusal, or one the tracker
 * cannot act on (`ContextLimitError`), reaches the caller.
 */
import type {
  LanguageModelV3,
  LanguageModelV3CallOptions,
  LanguageModelV3FilePart,
  LanguageModelV3Message,
  LanguageModelV3Middleware,
  LanguageModelV3Prompt,
  LanguageModelV3StreamPart,
  LanguageModelV3ToolResultOutput,
  LanguageModelV3Usage,
} from "@ai-sdk/provider";
import type { TrackerClient, UsageBody } from "./client.js";
import {
  applied,
  ContextGuard,
  MARKER,
  reapply,
  SUMMARY_PREFIX,
  summaryPrompt,
  View,
  type Applied,
  type CountTokens,
  type Item,
  type Replacement,
  type SummaryShare,
} from "./compaction.js";
import { checkSessionId } from "./validate.js";
import { estimateTokens } from "./heuristic.js";
import { InvalidInput } from "./errors.js";
import { APICallError } from "@ai-sdk/provider";
import { MAX_MESSAGE_CHARS } from "./client.js";

export {
  SUMMARY_PREFIX,
  MARKER,
  MemoryShare,
  ContextGuard,
  View,
  cutPoints,
  summaryPrompt,
  type SummaryShare,
  type Item,
  type Replacement,
  type CountTokens,
} from "./compaction.js";

export type SummarizeMessages = (messages: LanguageModelV3Message[], budgetTokens: number) => Promise<string> | string;

export interface ContextTrackerMiddlewareOptions {
  client: TrackerClient;
  /** The session the conversation is tracked as (1-189 of [A-Za-z0-9._:-]). */
  sessionId: string;
  /** The tracker's registry name of the model (e.g. `gpt-4o`). */
  model: string;
  /** `(messages, budgetTokens) => summary`; default: the wrapped model, asked with the Python integrations' prompt. */
  summarize?: SummarizeMessages;
  /** Entries kept verbatim at the end of the history (default 6). */
  keepLast?: number;
  /**
   * Counts a request (the tracker's shape) for `tokens_after` and for choosing the cut. Default:
   * the tracker's heuristic counter (src/heuristic.ts): the server's own number for models the
   * registry counts with `heuristic`, a conservative over-count (about 1.4-2x) for the exact ones.
   */
  countTokens?: CountTokens;
  /** Where compactions are published for other holders of the same history (default: this process). */
  share?: SummaryShare;
  /** Seconds to wait on another holder's attempt before observing again (default 30). */
  waitTimeout?: number;
  /** Called with the basis and the usage after each call, instead of `client.reportUsage`. */
  onUsage?: (report: { sessionId: string; basis: string; usage: LanguageModelV3Usage }) => void | Promise<void>;
  log?: (message: string) => void;
}

// -- AI SDK prompt → the tracker's request shape ----------------------------------------------

function base64(bytes: Uint8Array): string {
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

function filePart(part: LanguageModelV3FilePart): Record<string, unknown> {
  const data = part.data;
  const isUrl = data instanceof URL || (typeof data === "string" && /^(https?:|data:)/.test(data));
  if (part.mediaType.startsWith("image/")) {
    if (isUrl) {
      const url = String(data);
      return url.startsWith("data:") ? { type: "image_url", image_url: url } : { type: "image", source: { type: "url", url } };
    }
    const b64 = typeof data === "string" ? data : base64(data as Uint8Array);
    return { type: "image", source: { type: "base64", media_type: part.mediaType, data: b64 } };
  }
  // documents, audio, video: counted as their description and data (conservative, as the Python integrations do)
  const content = isUrl ? String(data) : typeof data === "string" ? data : base64(data as Uint8Array);
  return { type: "text", text: `[file ${part.mediaType}${part.filename ? ` ${part.filename}` : ""}] ${content}` };
}

function resultContent(output: LanguageModelV3ToolResultOutput): { content: unknown; isError: boolean } {
  switch (output.type) {
    case "text":
      return { content: output.value, isError: false };
    case "json":
      return { content: JSON.stringify(output.value), isError: false };
    case "error-text":
      return { content: output.value, isError: true };
    case "error-json":
      return { content: JSON.stringify(output.value), isError: true };
    case "execution-denied":
      return { content: `execution denied${output.reason ? `: ${output.reason}` : ""}`, isError: true };
    case "content": {
      const parts = output.value.map((p: Record<string, unknown>) => {
        if (p.type === "text") return { type: "text", text: String(p.text) };
        if (p.type === "image-data" || (p.type === "file-data" && String(p.mediaType).startsWith("image/"))) {
          return { type: "image", source: { type: "base64", media_type: String(p.mediaType), data: String(p.data) } };
        }
        if (p.type === "image-url") return { type: "image", source: { type: "url", url: String(p.url) } };
        return { type: "text", text: JSON.stringify(p) };
      });
      return { content: parts, isError: false };
    }
    default:
      return { content: JSON.stringify(output), isError: false };
  }
}

/**
 * One AI SDK prompt message as the tracker's request message(s), with the tool calls it makes /
 * answers: a tool message becomes one request message per part (docs/canonical-request.md, section 4).
 */
export function messageItem(m: LanguageModelV3Message): Item {
  const calls = new Set<string>();
  const results = new Set<string>();
  if (m.role === "system") {
    return { messages: [{ role: "system", content: m.content }], calls, results };
  }
  const content: Record<string, unknown>[] = [];
  for (const part of m.content as unknown as Record<string, unknown>[]) {
    switch (part.type) {
      case "text":
        content.push({ type: "text", text: String(part.text) });
        break;
      case "reasoning": // counted as text: the provider may send it back (conservative)
        content.push({ type: "text", text: String(part.text) });
        break;
      case "file":
        content.push(filePart(part as unknown as LanguageModelV3FilePart));
        break;
      case "tool-call":
        content.push({ type: "tool_call", id: part.toolCallId, name: part.toolName, arguments: part.input ?? {} });
        calls.add(String(part.toolCallId));
        break;
      case "tool-result": {
        const { content: inner, isError } = resultContent(part.output as LanguageModelV3ToolResultOutput);
        content.push({ type: "tool_result", tool_use_id: part.toolCallId, content: inner, is_error: isError });
        results.add(String(part.toolCallId));
        break;
      }
      default: // tool approval responses and anything newer: their JSON text (conservative)
        content.push({ type: "text", text: JSON.stringify(part) });
    }
  }
  if (m.role === "tool") {
    // one request message per result, as LangChain and pydantic-ai hold them (one ToolMessage /
    // OpenAI tool message each), so the same conversation has the same basis in every adapter
    const messages = content.length ? content.map((part) => ({ role: "tool", content: [part] })) : [{ role: "tool", content }];
    return { messages, calls, results };
  }
  return { messages: [{ role: m.role, content }], calls, results };
}

/** The revision written on the newest summary message of the prompt, else 1. */
export function revisionOf(prompt: LanguageModelV3Prompt): number {
  for (let i = prompt.length - 1; i >= 0; i--) {
    const mark = (prompt[i]!.providerOptions as Record<string, Record<string, unknown>> | undefined)?.[MARKER];
    if (mark && Number.isInteger(mark.revision)) return mark.revision as number;
  }
  return 1;
}

function tool(t: Record<string, unknown>): Record<string, unknown> {
  if (t.type === "function") {
    return { name: t.name, description: t.description ?? "", input_schema: t.inputSchema ?? {} };
  }
  return { name: t.name, description: `provider tool ${String(t.id)}`, input_schema: t.args ?? {} };
}

/** The leading system messages (the request's `system`) and the history after them. */
function split(prompt: LanguageModelV3Prompt): { system: LanguageModelV3Message[]; history: LanguageModelV3Message[] } {
  let n = 0;
  while (n < prompt.length && prompt[n]!.role === "system") n++;
  return { system: prompt.slice(0, n), history: prompt.slice(n) };
}

/** The View of a call: system text parts, one item per history message, the tools, the revision. */
export function viewOf(params: LanguageModelV3CallOptions): View {
  const { system, history } = split(params.prompt);
  const systemParts = system.map((m) => ({ type: "text", text: m.content as string }));
  return new View(
    systemParts.length ? systemParts : null,
    history.map(messageItem),
    (params.tools ?? []).map((t) => tool(t as unknown as Record<string, unknown>)),
    revisionOf(params.prompt),
  );
}

/** The complete request a call sends, in the tracker's shape (what is observed). */
export function toRequest(params: LanguageModelV3CallOptions): Record<string, unknown> {
  return viewOf(params).request();
}

export function summaryMessage(text: string, revision: number): LanguageModelV3Message {
  return {
    role: "user",
    content: [{ type: "text", text: SUMMARY_PREFIX + text }],
    providerOptions: { [MARKER]: { revision } },
  };
}

function transcript(messages: LanguageModelV3Message[]): string {
  return messages
    .flatMap((m) => messageItem(m).messages)
    .map((d) => `${String(d.role)}: ${typeof d.content === "string" ? d.content : JSON.stringify(d.content)}`)
    .join("\n");
}

async function summarizeWith(model: LanguageModelV3, messages: LanguageModelV3Message[], budget: number): Promise<string> {
  const result = await model.doGenerate({
    prompt: [{ role: "user", content: [{ type: "text", text: summaryPrompt(transcript(messages), budget) }] }],
  });
  return result.content
    .filter((c): c is { type: "text"; text: string } => c.type === "text")
    .map((c) => c.text)
    .join("");
}

// -- the provider's numbers ------------------------------------------------------------------------

/** The usage report of a call's `usage` (null when the provider gave no input count). */
export function usageBody(basis: string, usage: LanguageModelV3Usage): UsageBody | null {
  const input = usage.inputTokens;
  const cacheRead = input.cacheRead ?? undefined;
  const cacheWrite = input.cacheWrite ?? undefined;
  const uncached = input.noCache ?? (input.total === undefined ? undefined : input.total - (cacheRead ?? 0) - (cacheWrite ?? 0));
  if (uncached === undefined || !Number.isInteger(uncached) || uncached < 0) return null;
  const body: UsageBody = { basis, input_tokens: uncached };
  if (cacheRead !== undefined) body.cache_read_tokens = cacheRead;
  if (cacheWrite !== undefined) body.cache_write_tokens = cacheWrite;
  if (usage.outputTokens.total !== undefined) body.output_tokens = usage.outputTokens.total;
  return body;
}

// the phrases of the context-length wordings the tracker reads (tracker/core/provider_errors.py);
// which one, and its numbers, the tracker decides
const CONTEXT_LENGTH =
  /prompt\s+is\s+too\s+long|exceed\s+context\s+limit|maximum\s+context\s+length|configured\s+limit\s+of|input\s+token\s+count|context\s+window|context_length_exceeded/i;

/** The provider's text of a context-length refusal (an `APICallError` that says so), else null. */
export function contextLengthMessage(exc: unknown): string | null {
  if (!APICallError.isInstance(exc)) return null;
  const text = [exc.message, exc.responseBody ?? ""].join("\n").slice(0, MAX_MESSAGE_CHARS);
  return CONTEXT_LENGTH.test(text) ? text : null;
}

// -- the middleware ------------------------------------------------------------------------------

export function contextTrackerMiddleware(options: ContextTrackerMiddlewareOptions): LanguageModelV3Middleware {
  const { client, summarize, onUsage } = options;
  if (!client || typeof (client as { observe?: unknown }).observe !== "function") {
    throw InvalidInput.of("client", "a TrackerClient is required");
  }
  const sessionId = checkSessionId(options.sessionId);
  const guard = new ContextGuard(client, {
    model: options.model,
    keepLast: options.keepLast,
    countTokens: options.countTokens ?? estimateTokens,
    share: options.share,
    waitTimeout: options.waitTimeout,
    log: options.log,
  });
  const chain: Applied[] = []; // the compactions of this session's history, in order
  const bases = new WeakMap<object, string>();

  const settle = async (params: LanguageModelV3CallOptions, model: LanguageModelV3): Promise<LanguageModelV3CallOptions> => {
    const { system, history } = split(params.prompt);
    const known = await reapply(viewOf(params), chain);
    let entries = history;
    const replaceIn = (list: LanguageModelV3Message[], rep: Replacement) => [
      ...list.slice(0, rep.start),
      summaryMessage(rep.summary, rep.revision),
      ...list.slice(rep.end),
    ];
    for (const rep of known.replacements) entries = replaceIn(entries, rep);
    const out = await guard.beforeCall(
      sessionId,
      known.view,
      (start, end, budget) => {
        const messages = entries.slice(start, end); // entries follow the view the guard summarises
        return summarize ? summarize(messages, budget) : summarizeWith(model, messages, budget);
      },
      async (rep, from) => {
        chain.push(await applied(from, rep));
        entries = replaceIn(entries, rep);
      },
    );
    const next = { ...params, prompt: [...system, ...entries] };
    bases.set(next, out.basis);
    return next;
  };

  const log = options.log ?? (() => {});
  const report = async (params: LanguageModelV3CallOptions, usage: LanguageModelV3Usage | undefined) => {
    const basis = bases.get(params);
    if (!basis || !usage) return;
    if (onUsage) {
      await onUsage({ sessionId, basis, usage });
      return;
    }
    const body = usageBody(basis, usage);
    if (body === null) return;
    try {
      await client.reportUsage(sessionId, body);
    } catch (exc) {
      // the call succeeded: a report the tracker refuses (or cannot take now) never fails it
      log(`session ${sessionId}: usage report on ${basis} failed: ${exc instanceof Error ? exc.message : String(exc)}`);
    }
  };

  /** After a context-length refusal of `params`: report it, observe again (compacting), the params to retry with. */
  const rejected = async (
    params: LanguageModelV3CallOptions,
    model: LanguageModelV3,
    exc: unknown,
  ): Promise<LanguageModelV3CallOptions> => {
    const message = contextLengthMessage(exc);
    const basis = bases.get(params);
    if (message === null || !basis) throw exc;
    try {
      await client.reportRejection(sessionId, { basis, message });
    } catch (failed) {
      log(`session ${sessionId}: rejection report on ${basis} failed: ${failed instanceof Error ? failed.message : String(failed)}`);
      throw exc;
    }
    log(`session ${sessionId}: the provider refused ${basis} as too long; compacting and retrying once`);
    return settle(params, model); // the rejected basis decides at the hard limit: compacted (or ContextLimitError)
  };

  return {
    specificationVersion: "v3",
    transformParams: async ({ params, model }) => settle(params, model),
    wrapGenerate: async ({ doGenerate, params, model }) => {
      let result;
      let sent = params;
      try {
        result = await doGenerate();
      } catch (exc) {
        sent = await rejected(params, model, exc);
        result = await model.doGenerate(sent); // once: a second refusal reaches the caller
      }
      await report(sent, result.usage);
      return result;
    },
    wrapStream: async ({ doStream, params }) => {
      const result = await doStream();
      const stream = result.stream.pipeThrough(
        new TransformStream<LanguageModelV3StreamPart, LanguageModelV3StreamPart>({
          async transform(part, controller) {
            if (part.type === "finish") await report(params, part.usage);
            controller.enqueue(part);
          },
        }),
      );
      return { ...result, stream };
    },
  };
}
