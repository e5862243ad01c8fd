// The error tree is the Python one: the same class names, codes, parents and HTTP statuses
// (tracker/errors.py, tracker/http/errors.py ERROR_STATUS), read from the Python package itself.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { test } from "node:test";
import * as pkg from "../dist/index.js";
import { ERROR_CLASSES, errorFromBody, TrackerError } from "../dist/index.js";
import { PYTHON } from "./support/server.mjs";

const PY = `
import json
from tracker.errors import TrackerError
from tracker.http.errors import status_of
out = []
def walk(cls):
    out.append({"name": cls.__name__, "code": cls.code, "parent": next((b.__name__ for b in cls.__mro__[1:] if issubclass(b, TrackerError)), None), "status": status_of(cls)})
    for sub in cls.__subclasses__():
        walk(sub)
walk(TrackerError)
print(json.dumps(out))
`;

const python = JSON.parse(execFileSync(PYTHON, ["-c", PY], { encoding: "utf8" }));

test("one exported class per Python error class, with its code, parent and status", () => {
  const ours = ERROR_CLASSES.map((c) => ({
    name: c.name,
    code: c.code,
    parent: c === TrackerError ? null : Object.getPrototypeOf(c).name,
    status: c.status,
  }));
  const byName = (a, b) => a.name.localeCompare(b.name);
  assert.deepEqual([...ours].sort(byName), [...python].sort(byName));
  for (const c of ERROR_CLASSES) assert.equal(pkg[c.name], c, `${c.name} is exported by name`);
});

test("an error body becomes its class, with code, status and the API's fields", () => {
  for (const { name, code, status } of python) {
    const err = errorFromBody({ code, error: name, message: "m", field: "f", attempt_id: "a1" }, status);
    assert.equal(err.constructor.name, name);
    assert.ok(err instanceof TrackerError && err instanceof Error);
    assert.equal(err.code, code);
    assert.equal(err.status, status);
    assert.equal(err.message, "m");
    assert.equal(err.field, "f");
    assert.equal(err.attempt_id, "a1");
    assert.deepEqual(err.details, { field: "f", attempt_id: "a1" });
  }
  const unknown = errorFromBody({ code: "internal_error", error: "KeyError", message: "internal error" }, 500);
  assert.equal(unknown.constructor, TrackerError);
  assert.equal(unknown.code, "internal_error");
  assert.equal(errorFromBody({ code: "nope", error: "StaleBasis" }).constructor.name, "StaleBasis");
});
