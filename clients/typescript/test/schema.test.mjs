// src/schema.ts is what openapi-typescript makes of the OpenAPI document a freshly started
// `tracker serve` serves: regenerated here and compared (run `npm run generate -- --serve` to refresh).
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { after, before, test } from "node:test";
import { renderSchema } from "../scripts/render-schema.mjs";
import { startTracker } from "./support/server.mjs";

let server;
before(async () => {
  server = await startTracker();
});
after(async () => {
  await server?.stop();
});

test("the checked-in schema types are the served OpenAPI document's", async () => {
  const doc = await (await fetch(`${server.url}/openapi.json`)).json();
  const fresh = await renderSchema(doc);
  const committed = readFileSync(new URL("../src/schema.ts", import.meta.url), "utf8");
  assert.ok(fresh.includes("ObserveIn") && fresh.includes("/v1/sessions/{session_id}/observe"));
  assert.equal(committed, fresh, "src/schema.ts is stale: run `npm run generate -- --serve`");
});
