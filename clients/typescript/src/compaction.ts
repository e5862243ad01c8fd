/**
 * The compaction protocol with the tracker, framework-free: a port of
 * tracker/integrations/compaction/guard.py (`Guard.steps`) for the AI SDK middleware.
 *
 * 1. observe the complete request with `basis = r<revision>:h<digest>` (digest of the history's
 *    content, see docs/canonical-request.md);
 * 2. `proceed` → send; `wait` → wait for the other holder's attempt, observe again;
 * 3. `compact` → summarise a span chosen by {@link cutPoints} (never the leading pinned entries,
 *    never the recent tail, never a tool call apart from its results) within the room the
 *    attempt's `history_budget` leaves, count the compacted request, commit it with that count
 *    as `tokens_after` (a failing summariser is rejected as `summarizer_error`, a compacted request
 *    over the budget as `summary_over_budget`, ...), then observe again;
 * 4. `StaleBasis` (another process compacted this history) → adopt that compaction from the
 *    share its holder published it to, observe again; nothing to adopt: the StaleBasis is thrown;
 * 5. `ContextLimitError` and count failures propagate: a request the tracker refused is never sent.
 */
import { historyDigest } from "./canonical.js";
import type { Attempt, Decision, TrackerClient } from "./client.js";
import {
  AttemptNotOpen,
  CountError,
  InvalidInput,
  NotAttemptHolder,
  StaleBasis,
  SummaryTooLarge,
  TrackerError,
  UnknownAttempt,
  WaitTimeout,
} from "./errors.js";

export const SUMMARY_PREFIX = "Summary of the earlier conversation (written by the context tracker):\n\n";
/** The key summary messages carry their revision under (AI SDK: `providerOptions.contextTracker.revision`). */
export const MARKER = "contextTracker";
export const SUMMARY_MARGIN_TOKENS = 24;
export const MIN_SUMMARY_TOKENS = 32;

export const SUMMARIZER_ERROR = "summarizer_error";
export const SUMMARY_OVER_BUDGET = "summary_over_budget";
export const COUNT_FAILED = "count_failed";
export const NOTHING_TO_SUMMARIZE = "nothing_to_summarize";

/** One framework message: the request messages it becomes and the tool calls it makes / answers. */
export interface Item {
  messages: Record<string, unknown>[];
  calls: ReadonlySet<string>;
  results: ReadonlySet<string>;
  pinned?: boolean;
}

export function summaryItem(text: string): Item {
  return { messages: [{ role: "user", content: SUMMARY_PREFIX + text }], calls: new Set(), results: new Set() };
}

export async function digest(items: readonly Item[]): Promise<string> {
  return historyDigest(items.flatMap((it) => it.messages));
}

/** The complete request a framework is about to send: system prompt, history, tools. */
export class View {
  constructor(
    readonly system: unknown,
    readonly items: readonly Item[],
    readonly tools: readonly Record<string, unknown>[] = [],
    readonly revision = 1,
  ) {}

  request(items: readonly Item[] = this.items): Record<string, unknown> {
    return { system: this.system, messages: items.flatMap((it) => it.messages), tools: [...this.tools] };
  }

  get head(): number {
    let n = 0;
    while (n < this.items.length && this.items[n]!.pinned) n++;
    return n;
  }

  async basis(): Promise<string> {
    return `r${this.revision}:h${await digest(this.items)}`;
  }

  apply(rep: Replacement): View {
    const items = [...this.items.slice(0, rep.start), summaryItem(rep.summary), ...this.items.slice(rep.end)];
    return new View(this.system, items, this.tools, rep.revision);
  }
}

/** `items[start:end]` became one summary message; the history is now at `revision`. */
export interface Replacement {
  start: number;
  end: number;
  summary: string;
  revision: number;
  attemptId?: string;
  tokensBefore?: number | null;
  tokensAfter?: number | null;
  adopted?: boolean;
}

/** Where a holder publishes its compaction (before committing) so others can adopt it. */
export interface SummaryShare {
  put(sessionId: string, attemptId: string, payload: Record<string, unknown>): void | Promise<void>;
  get(sessionId: string, attemptId: string): Record<string, unknown> | null | undefined | Promise<Record<string, unknown> | null | undefined>;
}

/** Within one process. */
export class MemoryShare implements SummaryShare {
  readonly #data = new Map<string, Record<string, unknown>>();
  put(sessionId: string, attemptId: string, payload: Record<string, unknown>): void {
    this.#data.set(`${sessionId}\u0000${attemptId}`, structuredClone(payload));
  }
  get(sessionId: string, attemptId: string): Record<string, unknown> | null {
    const found = this.#data.get(`${sessionId}\u0000${attemptId}`);
    return found ? structuredClone(found) : null;
  }
}

export const PROCESS_SHARE = new MemoryShare();

/** Where each item starts in the history's request messages (and, last, their count). */
function offsets(items: readonly Item[]): number[] {
  const out = [0];
  for (const it of items) out.push(out[out.length - 1]! + it.messages.length);
  return out;
}

/**
 * What a holder publishes of its compaction, language-neutral (docs/canonical-request.md, section 6):
 * `start` / `end` are positions in the history's request messages, not in the framework's
 * messages (an AI SDK tool message holding two results is one item of two request messages;
 * LangChain holds them as two messages).
 */
export async function sharePayload(view: View, rep: Replacement): Promise<Record<string, unknown>> {
  const at = offsets(view.items);
  return {
    from_revision: view.revision,
    start: at[rep.start],
    end: at[rep.end],
    span: await digest(view.items.slice(rep.start, rep.end)),
    summary: rep.summary,
  };
}

/**
 * The items `[start, end)` a shared compaction replaces in `view` and its summary; null when it
 * does not apply (another revision, positions off this history's item boundaries, or its span's
 * digest not this history's: a different history under the same session).
 */
export async function sharedSpan(
  view: View,
  payload: Record<string, unknown> | null | undefined,
): Promise<{ start: number; end: number; summary: string } | null> {
  if (!payload || payload.from_revision !== view.revision) return null;
  const { start, end, summary } = payload;
  const at = offsets(view.items);
  if (!(Number.isInteger(start) && Number.isInteger(end))) return null;
  const s = at.indexOf(start as number);
  const e = at.indexOf(end as number);
  if (!((start as number) < (end as number) && s >= 0 && e >= 0)) return null;
  if (typeof summary !== "string" || (await digest(view.items.slice(s, e))) !== payload.span) return null;
  return { start: s, end: e, summary };
}

/**
 * Where the summarised span `items[head:end]` may end, best first: no tool call before the cut
 * is answered after it; the valid cut keeping at least `keepLast` entries nearest first, then
 * cuts keeping fewer, down to summarising all.
 */
export function cutPoints(items: readonly Item[], keepLast: number): number[] {
  const n = items.length;
  let head = 0;
  while (head < n && items[head]!.pinned) head++;
  const valid: number[] = [];
  for (let end = head + 1; end <= n; end++) {
    const made = new Set(items.slice(0, end).flatMap((it) => [...it.calls]));
    const answeredLater = items.slice(end).flatMap((it) => [...it.results]);
    if (!answeredLater.some((id) => made.has(id))) valid.push(end);
  }
  const target = n - keepLast;
  const before = valid.filter((e) => e <= target).sort((a, b) => b - a);
  const after = valid.filter((e) => e > target).sort((a, b) => a - b);
  return [...before, ...after];
}

class SummaryFailed extends Error {
  constructor(
    readonly reason: string,
    detail = "",
  ) {
    super(detail ? `${reason}: ${detail}` : reason);
  }
}

export type Summarize = (start: number, end: number, budgetTokens: number) => Promise<string> | string;
export type CountTokens = (request: Record<string, unknown>) => Promise<number> | number;

export interface GuardOptions {
  model: string;
  keepLast?: number;
  countTokens: CountTokens;
  share?: SummaryShare;
  /** Seconds to wait for another holder's attempt before observing again (default 30). */
  waitTimeout?: number;
  maxRounds?: number;
  log?: (message: string) => void;
}

export interface Outcome {
  view: View;
  replacements: Replacement[];
  /** The basis the request that settled was observed with. */
  basis: string;
  decision: Decision;
}

/** Observe every model call; compact, wait or adopt as the tracker decides. */
export class ContextGuard {
  readonly model: string;
  readonly keepLast: number;
  readonly share: SummaryShare;
  readonly waitTimeout: number;
  readonly maxRounds: number;
  readonly #count: CountTokens;
  readonly #log: (message: string) => void;

  constructor(
    readonly client: TrackerClient,
    options: GuardOptions,
  ) {
    if (typeof options.model !== "string" || !options.model) {
      throw InvalidInput.of("model", "the tracker's registry name of the model is required");
    }
    const keepLast = options.keepLast ?? 6;
    if (!Number.isInteger(keepLast) || keepLast < 0) throw InvalidInput.of("keepLast", `must be an integer >= 0, got ${keepLast}`);
    this.model = options.model;
    this.keepLast = keepLast;
    this.#count = options.countTokens;
    this.share = options.share ?? PROCESS_SHARE;
    this.waitTimeout = options.waitTimeout ?? 30;
    this.maxRounds = options.maxRounds ?? 16;
    this.#log = options.log ?? ((m) => console.warn(m));
  }

  async count(request: Record<string, unknown>): Promise<number> {
    return this.#count(request);
  }

  /** Settle the request with the tracker; the view to send and the replacements made. */
  async beforeCall(
    sessionId: string,
    view: View,
    summarize: Summarize,
    onApply?: (rep: Replacement, from: View) => void | Promise<void>,
  ): Promise<Outcome> {
    const replacements: Replacement[] = [];
    let current = view;
    const use = async (rep: Replacement) => {
      await onApply?.(rep, current);
      current = current.apply(rep);
      replacements.push(rep);
    };
    for (let round = 0; round < this.maxRounds; round++) {
      const basis = await current.basis();
      let result: Decision;
      try {
        result = await this.client.observe(sessionId, { request: current.request(), model: this.model, basis });
      } catch (exc) {
        if (!(exc instanceof StaleBasis)) throw exc;
        const rep = await this.adopt(sessionId, current);
        if (rep === null) throw exc;
        await use(rep);
        continue;
      }
      if (result.action === "proceed") return { view: current, replacements, basis, decision: result };
      if (result.action === "wait") {
        if (result.waiting_on) {
          try {
            await this.client.wait(sessionId, result.waiting_on.attempt_id, { timeout: this.waitTimeout });
          } catch (exc) {
            if (!(exc instanceof WaitTimeout)) throw exc;
          }
        }
        continue;
      }
      if (result.action === "compact") {
        const rep = await this.#compact(sessionId, current, result, summarize);
        if (rep !== null) await use(rep);
        continue;
      }
      throw new TrackerError(`unexpected action ${String(result.action)}`);
    }
    throw new TrackerError(`session ${sessionId}: the request did not settle in ${this.maxRounds} rounds`, {
      body: { session_id: sessionId },
    });
  }

  async #compact(sessionId: string, view: View, result: Decision, summarize: Summarize): Promise<Replacement | null> {
    const attempt = result.attempt as Attempt;
    let rep: Replacement;
    try {
      rep = await this.#summarise(view, attempt, result, summarize);
    } catch (exc) {
      if (!(exc instanceof SummaryFailed)) throw exc;
      this.#log(`session ${sessionId}: compaction ${attempt.attempt_id} rejected: ${exc.message}`);
      await this.#reject(sessionId, attempt, exc.reason);
      return null;
    }
    await this.share.put(sessionId, attempt.attempt_id, await sharePayload(view, rep));
    try {
      const state = await this.client.commit(sessionId, attempt.attempt_id, {
        fencing_token: attempt.fencing_token,
        tokens_after: rep.tokensAfter ?? 0,
      });
      return { ...rep, revision: state.revision };
    } catch (exc) {
      if (exc instanceof SummaryTooLarge) return null; // recorded by the tracker as the rejection summary_too_large
      if (exc instanceof AttemptNotOpen || exc instanceof NotAttemptHolder || exc instanceof UnknownAttempt) {
        this.#log(`session ${sessionId}: commit of ${attempt.attempt_id} refused: ${exc.message}`);
        return null; // lease expired / superseded
      }
      throw exc;
    }
  }

  async #summarise(view: View, attempt: Attempt, decision: Decision, summarize: Summarize): Promise<Replacement> {
    const budget = attempt.history_budget ?? decision.hard_level;
    const target = Math.min(budget, decision.rearm_level - 1); // aim to end the pressure episode
    const head = view.head;
    const cuts = cutPoints(view.items, this.keepLast);
    // a cut summarising less than the preferred one keeps more: the candidates are the preferred
    // cut, then those summarising more (into the recent tail)
    const candidates = cuts.length ? cuts.filter((end) => end >= cuts[0]!) : [];
    let chosen: [number, number] | null = null;
    try {
      const kept = new Map<number, number>();
      for (const goal of new Set([target, budget])) {
        for (const end of candidates) {
          if (!kept.has(end)) {
            kept.set(end, await this.count(view.request([...view.items.slice(0, head), ...view.items.slice(end)])));
          }
          const room = goal - kept.get(end)! - SUMMARY_MARGIN_TOKENS;
          if (room >= MIN_SUMMARY_TOKENS) {
            chosen = [end, room];
            break;
          }
        }
        if (chosen !== null) break;
      }
    } catch (exc) {
      if (exc instanceof CountError || exc instanceof InvalidInput) throw new SummaryFailed(COUNT_FAILED, String(exc));
      throw exc;
    }
    if (chosen === null) {
      if (!cuts.length) throw new SummaryFailed(NOTHING_TO_SUMMARIZE);
      throw new SummaryFailed(SUMMARY_OVER_BUDGET, `what must be kept leaves no room within ${budget} tokens`);
    }
    const [end, room] = chosen;
    let text: unknown;
    try {
      text = await summarize(head, end, room);
    } catch (exc) {
      throw new SummaryFailed(SUMMARIZER_ERROR, exc instanceof Error ? `${exc.name}: ${exc.message}` : String(exc));
    }
    if (typeof text !== "string" || !text.trim()) throw new SummaryFailed(SUMMARIZER_ERROR, "the summariser returned no text");
    const rep: Replacement = {
      start: head,
      end,
      summary: text.trim(),
      revision: view.revision + 1,
      attemptId: attempt.attempt_id,
      tokensBefore: attempt.tokens_before,
    };
    let tokensAfter: number;
    try {
      tokensAfter = await this.count(view.apply(rep).request());
    } catch (exc) {
      if (exc instanceof CountError || exc instanceof InvalidInput) throw new SummaryFailed(COUNT_FAILED, String(exc));
      throw exc;
    }
    if (tokensAfter > budget) {
      throw new SummaryFailed(SUMMARY_OVER_BUDGET, `the compacted request is ${tokensAfter} tokens, budget ${budget}`);
    }
    return { ...rep, tokensAfter };
  }

  async #reject(sessionId: string, attempt: Attempt, reason: string): Promise<void> {
    try {
      await this.client.reject(sessionId, attempt.attempt_id, { fencing_token: attempt.fencing_token, reject_reason: reason });
    } catch (exc) {
      if (!(exc instanceof AttemptNotOpen || exc instanceof NotAttemptHolder || exc instanceof UnknownAttempt)) throw exc;
    }
  }

  /** The compaction that moved this history's revision on, if it applies to this history. */
  async adopt(sessionId: string, view: View): Promise<Replacement | null> {
    let committed: Record<string, unknown> | null = null;
    for await (const event of this.client.history(sessionId)) {
      const data = event.data as Record<string, unknown>;
      if (event.type === "CompactionCommitted" && data.new_revision === view.revision + 1) committed = data;
    }
    if (committed === null) return null;
    const found = await sharedSpan(view, await this.share.get(sessionId, String(committed.attempt_id)));
    if (found === null) return null;
    return {
      start: found.start,
      end: found.end,
      summary: found.summary,
      revision: view.revision + 1,
      attemptId: String(committed.attempt_id),
      tokensBefore: (committed.tokens_before as number | undefined) ?? null,
      tokensAfter: (committed.tokens_after as number | undefined) ?? null,
      adopted: true,
    };
  }
}

/** The instruction a chat-model summariser gets (the same words as the Python integrations). */
export function summaryPrompt(transcript: string, budgetTokens: number): string {
  const words = Math.max(20, Math.floor(budgetTokens * 0.6));
  return (
    "Summarise the conversation below so an agent can continue the task from the summary alone. " +
    "Keep the user's goal, decisions made, facts learned from tool results, files touched and the next " +
    `steps. Use at most ${words} words. Reply with the summary only.\n\n<conversation>\n${transcript}\n</conversation>`
  );
}

/** A compaction this process made or adopted, kept to re-apply to the same history when it comes again. */
export interface Applied {
  fromRevision: number;
  start: number;
  end: number;
  span: string;
  summary: string;
  revision: number;
}

export async function applied(view: View, rep: Replacement): Promise<Applied> {
  return {
    fromRevision: view.revision,
    start: rep.start,
    end: rep.end,
    span: await digest(view.items.slice(rep.start, rep.end)),
    summary: rep.summary,
    revision: rep.revision,
  };
}

/**
 * Re-apply known compactions to a history that arrives without them (a framework that resends
 * its whole history every call): each applies only to the revision it was made from and only
 * when its span's digest matches, so a different history is left alone.
 */
export async function reapply(view: View, chain: readonly Applied[]): Promise<{ view: View; replacements: Replacement[] }> {
  let current = view;
  const replacements: Replacement[] = [];
  for (const a of chain) {
    if (a.fromRevision !== current.revision || a.end > current.items.length) continue;
    if ((await digest(current.items.slice(a.start, a.end))) !== a.span) continue;
    const rep: Replacement = { start: a.start, end: a.end, summary: a.summary, revision: a.revision, adopted: true };
    current = current.apply(rep);
    replacements.push(rep);
  }
  return { view: current, replacements };
}
