/// <reference types="node" />
/**
 * A {@link SummaryShare} on a directory, for Node: the file layout of Python's
 * `tracker.integrations.DirectoryShare`, so an AI SDK agent and a Python agent (LangChain,
 * pydantic-ai, OpenAI Agents) on one machine adopt each other's compactions. Its own entry point
 * (`@context-tracker/client/directory-share`) keeps `node:fs` out of the middleware, which also
 * runs where there is no file system.
 */
import { randomBytes } from "node:crypto";
import { mkdirSync } from "node:fs";
import { readFile, rename, writeFile } from "node:fs/promises";
import { join } from "node:path";
import type { SummaryShare } from "./compaction.js";

/**
 * Across processes of one machine, whatever their language: one JSON file per attempt,
 * `<dir>/<sessionId>__<attemptId>.json`, written to a temporary file in `dir` and renamed into
 * place (the layout of Python's `tracker.integrations.DirectoryShare`; docs/canonical-request.md, section 6).
 */
export class DirectoryShare implements SummaryShare {
  readonly dir: string;
  constructor(dir: string) {
    this.dir = dir;
    mkdirSync(dir, { recursive: true });
  }
  #file(sessionId: string, attemptId: string): string {
    return join(this.dir, `${sessionId}__${attemptId}.json`); // both are [A-Za-z0-9._:-]
  }
  async put(sessionId: string, attemptId: string, payload: Record<string, unknown>): Promise<void> {
    const tmp = join(this.dir, `tmp${randomBytes(8).toString("hex")}.tmp`);
    await writeFile(tmp, JSON.stringify(payload), { encoding: "utf8", flag: "wx" });
    await rename(tmp, this.#file(sessionId, attemptId));
  }
  async get(sessionId: string, attemptId: string): Promise<Record<string, unknown> | null> {
    try {
      return JSON.parse(await readFile(this.#file(sessionId, attemptId), "utf8")) as Record<string, unknown>;
    } catch (exc) {
      if ((exc as NodeJS.ErrnoException).code === "ENOENT") return null;
      throw exc;
    }
  }
}

