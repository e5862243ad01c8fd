// A real `tracker serve` for the tests: SQLite file database in a temp dir, two fleets and an API key
// each (made by fleets.py), on a free loopback port; stop() ends it and
// removes the directory. The Python interpreter is $PYTHON (else python3); the tracker package
// it imports is the one on its path ($PYTHONPATH in a worktree).
import { execFile, spawn } from "node:child_process";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

const run = promisify(execFile);
export const PYTHON = process.env.PYTHON || "python3";

function freePort() {
  return new Promise((resolve, reject) => {
    const srv = createServer();
    srv.on("error", reject);
    srv.listen(0, "127.0.0.1", () => {
      const { port } = srv.address();
      srv.close(() => resolve(port));
    });
  });
}

async function python(env, ...args) {
  const { stdout } = await run(PYTHON, args, { env, timeout: 120_000 });
  return stdout;
}

// the database, two fleets and their keys, made by one Python process (fleets.py says why)
const FLEETS = fileURLToPath(new URL("fleets.py", import.meta.url));

/**
 * @param {{ models?: object, env?: Record<string,string> }} [options]
 *   models: a models file (TRACKER_MODELS_FILE) merged onto the shipped registry.
 */
export async function startTracker(options = {}) {
  const dir = await mkdtemp(join(tmpdir(), "ct-ts-"));
  // The first count of a server loads the tokenizer's encoding; on a loaded 2-core machine that can
  // take longer than the default 2 s count timeout, so these servers allow 10 s (no test measures it).
  const env = {
    ...process.env,
    TRACKER_DATABASE_URL: `sqlite:///${join(dir, "tracker.db")}`,
    TRACKER_COUNT_TIMEOUT_S: "10",
  };
  for (const name of ["TRACKER_REDIS_URL", "TRACKER_BROKER_URL"]) delete env[name];
  if (options.models) {
    const file = join(dir, "models.json");
    await writeFile(file, JSON.stringify({ models: options.models }));
    env.TRACKER_MODELS_FILE = file;
  }
  Object.assign(env, options.env || {});
  const stamp = Date.now().toString(36);
  const [{ fleet, key }, { key: otherKey }] = JSON.parse(
    await python(env, FLEETS, env.TRACKER_DATABASE_URL, `ts-${stamp}`, `ts-other-${stamp}`),
  );
  const port = await freePort();
  const proc = spawn(PYTHON, ["-m", "tracker.cli", "serve", "--port", String(port), "--no-access-log"], {
    env,
    stdio: ["ignore", "ignore", "pipe"],
  });
  let stderr = "";
  proc.stderr.on("data", (chunk) => {
    stderr = (stderr + chunk).slice(-4000);
  });
  const url = `http://127.0.0.1:${port}`;
  const stop = async () => {
    if (proc.exitCode === null && proc.signalCode === null) {
      const exited = new Promise((resolve) => proc.once("exit", resolve));
      proc.kill("SIGTERM");
      const timer = setTimeout(() => proc.kill("SIGKILL"), 15_000);
      await exited;
      clearTimeout(timer);
    }
    await rm(dir, { recursive: true, force: true });
  };
  const deadline = Date.now() + 60_000;
  for (;;) {
    if (proc.exitCode !== null) {
      await stop();
      throw new Error(`tracker serve exited: ${stderr}`);
    }
    try {
      const r = await fetch(`${url}/readyz`);
      if (r.status === 200) break;
    } catch {
      // not listening yet
    }
    if (Date.now() > deadline) {
      await stop();
      throw new Error(`tracker serve did not become ready: ${stderr}`);
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  return { url, token: key.token, otherToken: otherKey.token, fleet, env, dir, stop };
}
