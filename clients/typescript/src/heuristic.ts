/**
 * The tracker's heuristic counter, ported from tracker/counting/counters.py
 * (`heuristic_text_tokens`, `chat_tokens`, `heuristic_image_tokens`): the same number the server
 * counts for a model whose registry entry says `"counter": "heuristic"`, and a conservative
 * over-count (built never to undercount o200k_base / cl100k_base) for the exact ones.
 * test/heuristic.test.mjs compares it with the server's count of the same requests.
 *
 * Per message (the system prompt first, as a "system" message): 3 + tokens(role) + tokens(parts)
 * [+ tokens(name) + 1], then 3 to prime the reply, then tokens(canonical JSON of each tool).
 */
import { canonicalJson, canonicalRequest, type CanonicalPart, type CanonicalRequest } from "./canonical.js";

const TOKENS_PER_MESSAGE = 3;
const TOKENS_PER_NAME = 1;
const REPLY_PRIMING = 3;
const DEFAULT_IMAGE_BASE = 85;
const DEFAULT_IMAGE_TILE = 170;

const WORDS = /[A-Za-z]+/g;
const DIGITS = /[0-9]+/g;
const SPACE_RUNS = /[ \t]{2,}/g;
const SPACE_SUBRUNS = / +|\t+/g;
const LONE_SPACE = /(?<![ \t]) (?![ \tA-Za-z!-\/:-@\[-`{-~])|(?<![ \t])\t(?![ \t])/g;
const NEWLINES_AFTER_PUNCT = /(?<=[!-\/:-@\[-`{-~])[\r\n]+/g;
const NEWLINES_ALONE = /(?<![!-\/:-@\[-`{-~\r\n])[\r\n]+/g;
const PUNCT_RUNS = /[!-\/:-@\[-`{-~]+/g;
const CONTROL = /[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]/g;
const NON_ASCII = /[^\x00-\x7f]/gu;
const ASTRAL = /[\u{10000}-\u{10ffff}]/gu;
const SYMBOLS = /[\u2000-\u2bff]/gu;
const CJK = /[\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff]/gu;
const SUBWORDS = /[A-Z]?[a-z]+|[A-Z]+(?![a-z])/g;
const BLOB = /[A-Za-z0-9+\/=_\-]{8,}/g;

// Letter pairs that make up 98.5% of the pairs inside English / code words (the Python set, sorted).
const PAIRS = "abacadagaiakalamanaparasatauavawaybabcbebibjblbobrbsbubycacccechcickclcocrctcudadddedidldodsdtdueaecedeeefegeielemeneoepeqeresetevewexeyfafefffiflfofrftfufygageggghgiglgngrgsguhahehihohrhthuiaibicidieifigiliminioipirisitivixizjekekikskwlaldlelflilllolplsltlulymambmemimmmompmsmunancndnenfngninknlnnnonpnsntnunvnyoaobocodoeofogoiolomonoooporosotouovowpapepiplpoppprpsptpupyqurarcrdrergrirkrlrmrnrorprrrsrtrurvrwrysascsesgshsislsospssstsusytatctdtethtitltotptrtstttutwtyuaubucudueuguiulumunupurusutvaveviwawewhwiwnwowrxcxexixpxtyiyoypyrysytze";
const COMMON_PAIRS = new Set(Array.from({ length: PAIRS.length / 2 }, (_, i) => PAIRS.slice(2 * i, 2 * i + 2)));

const all = (re: RegExp, text: string): string[] => text.match(re) ?? [];
const ceilDiv = (a: number, b: number): number => Math.ceil(a / b);

const wordCache = new Map<string, number>();

function wordTokens(word: string): number {
  const cached = wordCache.get(word);
  if (cached !== undefined) return cached;
  let total = 0;
  for (const sub of all(SUBWORDS, word)) {
    const n = sub.length;
    if (n <= 2) {
      total += 1;
      continue;
    }
    const low = sub.toLowerCase();
    let rare = 0;
    for (let i = 0; i < n - 1; i++) if (!COMMON_PAIRS.has(low.slice(i, i + 2))) rare++;
    if (![...low].some((c) => "aeiouy".includes(c))) rare += Math.floor(n / 2);
    const upper = sub === sub.toUpperCase();
    total += upper ? 1 + Math.floor((n - 1) / 2) + rare : 1 + Math.floor((n - 1) / 4) + rare;
  }
  if (wordCache.size > 65536) wordCache.clear();
  wordCache.set(word, total);
  return total;
}

function looksRandom(s: string): boolean {
  let digits = 0;
  let upper = 0;
  let lower = 0;
  let changes = 0;
  let prev = -1;
  for (const c of s) {
    let k: number;
    if (c >= "a" && c <= "z") {
      k = 0;
      lower++;
    } else if (c >= "A" && c <= "Z") {
      k = 1;
      upper++;
    } else if (c >= "0" && c <= "9") {
      k = 2;
      digits++;
    } else k = 3;
    if (k !== prev) {
      changes++;
      prev = k;
    }
  }
  if (Number(digits > 0) + Number(upper > 1) + Number(lower > 1) < 2) return false;
  return changes * (digits ? 3 : 2) >= s.length;
}

/** A conservative token estimate of one text, from character classes. */
export function heuristicTextTokens(input: string): number {
  if (!input) return 0;
  let text = input;
  let blobTokens = 0;
  if ([...text].length >= 8) {
    text = text.replace(BLOB, (s) => {
      if (!looksRandom(s)) return s;
      blobTokens += ceilDiv(s.length * 17, 20); // 0.85 per character
      return "\x00"; // keeps neighbours apart; costs one more token, conservatively
    });
  }
  let total = blobTokens;
  for (const w of all(WORDS, text)) total += wordTokens(w);
  for (const d of all(DIGITS, text)) total += ceilDiv(d.length, 3);
  for (const run of all(SPACE_RUNS, text)) for (const r of all(SPACE_SUBRUNS, run)) total += 1 + Math.floor(r.length / 16);
  total += all(LONE_SPACE, text).length;
  for (const n of all(NEWLINES_AFTER_PUNCT, text)) total += n[0] === "\n" ? ceilDiv(n.length - 1, 2) : ceilDiv(n.length, 2);
  for (const n of all(NEWLINES_ALONE, text)) total += ceilDiv(n.length, 2);
  for (const p of all(PUNCT_RUNS, text)) total += p.length - Math.floor(p.length / 3);
  total += all(CONTROL, text).length;
  if (!/^[\x00-\x7f]*$/.test(text)) {
    const nAll = all(NON_ASCII, text).length;
    const nAstral = all(ASTRAL, text).length;
    const nSymbols = all(SYMBOLS, text).length;
    const nCjk = all(CJK, text).length;
    const nRest = nAll - nAstral - nSymbols - nCjk;
    const halves = 8 * nAstral + 6 * nSymbols + 4 * nCjk + 3 * nRest;
    total += ceilDiv(halves, 2);
  }
  return total + Math.floor(total / 8) + 3;
}

function imageTiles(width?: number, height?: number): number {
  if (!width || !height) return 8;
  let w = width;
  let h = height;
  if (Math.max(w, h) > 2048) {
    const scale = 2048 / Math.max(w, h);
    w *= scale;
    h *= scale;
  }
  if (Math.min(w, h) > 768) {
    const scale = 768 / Math.min(w, h);
    w *= scale;
    h *= scale;
  }
  return Math.ceil(w / 512) * Math.ceil(h / 512);
}

function imageTokens(part: Extract<CanonicalPart, { type: "image" }>, base: number, tile: number): number {
  const openai = part.detail === "low" ? base : base + tile * imageTiles(part.width, part.height);
  const anthropic = part.width && part.height ? Math.min(1600, Math.ceil((part.width * part.height) / 750)) : 1600;
  return Math.max(openai, anthropic);
}

function argumentsText(part: Extract<CanonicalPart, { type: "tool_call" }>): string {
  return part.raw ? String(part.arguments) : canonicalJson(part.arguments);
}

/**
 * The heuristic count of a complete request (any shape `canonicalRequest` accepts). `image`: the
 * model's `image_base_tokens` / `image_tile_tokens` where its registry entry sets them.
 */
export function estimateTokens(request: unknown, image: { base?: number; tile?: number } = {}): number {
  const r: CanonicalRequest = canonicalRequest(request);
  const base = image.base ?? DEFAULT_IMAGE_BASE;
  const tile = image.tile ?? DEFAULT_IMAGE_TILE;
  const part = (p: CanonicalPart): number => {
    switch (p.type) {
      case "text":
        return heuristicTextTokens(p.text);
      case "tool_call":
        return heuristicTextTokens(p.name) + heuristicTextTokens(argumentsText(p));
      case "tool_result":
        return p.content.reduce((sum, c) => sum + part(c), 0);
      case "image":
        return imageTokens(p, base, tile);
    }
  };
  const messages = r.system.length ? [{ role: "system", content: r.system, name: undefined }, ...r.messages] : r.messages;
  let total = 0;
  for (const m of messages) {
    total += TOKENS_PER_MESSAGE + heuristicTextTokens(m.role);
    if (m.name !== undefined) total += heuristicTextTokens(m.name) + TOKENS_PER_NAME;
    for (const p of m.content as CanonicalPart[]) total += part(p);
  }
  total += REPLY_PRIMING;
  for (const t of r.tools) total += heuristicTextTokens(canonicalJson(t));
  return total;
}
