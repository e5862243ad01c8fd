// Regenerates src/schema.ts from the OpenAPI document a `tracker serve` serves.
//
//   node scripts/generate-schema.mjs http://127.0.0.1:8080/openapi.json   # from a running server
//   node scripts/generate-schema.mjs path/to/openapi.json                # from a saved document
//   node scripts/generate-schema.mjs --serve                             # starts a throwaway server (python3)
//
// test/client.test.mjs regenerates it the same way from a freshly started server and fails when
// the checked-in file differs.
import { readFile, writeFile } from "node:fs/promises";
import { fileURLToPath } from "node:url";
import { renderSchema } from "./render-schema.mjs";

const out = fileURLToPath(new URL("../src/schema.ts", import.meta.url));
const arg = process.argv[2];
if (!arg) {
  console.error("usage: generate-schema.mjs <openapi.json url | file | --serve>");
  process.exit(2);
}
let doc;
if (arg === "--serve") {
  const { startTracker } = await import("../test/support/server.mjs");
  const server = await startTracker();
  try {
    doc = await (await fetch(`${server.url}/openapi.json`)).json();
  } finally {
    await server.stop();
  }
} else if (/^https?:/.test(arg)) {
  doc = await (await fetch(arg)).json();
} else {
  doc = JSON.parse(await readFile(arg, "utf8"));
}
await writeFile(out, await renderSchema(doc));
console.log(`wrote ${out}`);
