"""Local counters: exact (OpenAI BPE encodings, no network) and a conservative heuristic.

Both count the complete request with the same chat-format rule (OpenAI's
documented rule for chat models)::

    per message (the system prompt is the first message, role "system"):
        3 + tokens(role) + tokens(content parts) [+ tokens(name) + 1 if named]
    + 3 to prime the reply
    + tokens(canonical JSON of each tool definition)

Content parts: text -> its tokens; a tool call -> tokens(name) + tokens(arguments as
canonical JSON); a tool result -> its content; an image -> OpenAI's tile rule
(``detail: low`` -> base; otherwise the image is fitted into 2048x2048, its
short side scaled to 768, and each 512-px tile costs ``tile``; an image of
unknown size is charged the largest case, 8 tiles). ``base`` / ``tile`` are
85 / 170 unless the model entry sets ``image_base_tokens`` / ``image_tile_tokens``.

Exact encodings are built from the rank files that ``bpe-openai`` ships
(``bpe_openai/data/*.tiktoken.gz``): decompressed, checked against the SHA-256
that ``tiktoken`` pins for the same file, and given tiktoken's own split
pattern and special tokens. Nothing is downloaded and tiktoken's cache is never
read or written.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import math
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tracker._lru import LRU
from tracker.counting.base import QUALITY_EXACT_LOCAL, QUALITY_HEURISTIC, CountResult, ModelSpec
from tracker.counting.request import (
    CanonicalRequest,
    ImagePart,
    Part,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    canonical_json,
)
from tracker.errors import InvalidCountModel, RankFileError

if TYPE_CHECKING:  # pragma: no cover
    import tiktoken


# -- long texts' counts, remembered --------------------------------------------------------------

#: a text of at least this many characters has its count remembered (shorter ones count faster than
#: they hash)
MEMO_MIN_CHARS = 256
#: texts remembered per counting function (each entry: a 16-byte digest and an int; no text is held)
MEMO_ENTRIES = 16_384


def memoized(count: Callable[[str], int], maxsize: int = MEMO_ENTRIES) -> Callable[[str], int]:
    """``count`` (a pure function of a text), remembering the counts of long texts by their digest.

    An agent's requests grow by appending: each one repeats every message of the one before, so
    counting a complete request again tokenizes only what is new. The count of a text is the same
    whenever it is counted, so a remembered count is the count (a BLAKE2b-128 digest of the UTF-8
    text is its key). Thread-safe: one ``LRU``."""
    memo: LRU[tuple[int, bytes], int] = LRU(maxsize)

    def counted(text: str) -> int:
        if len(text) < MEMO_MIN_CHARS:
            return count(text)
        key = (len(text), hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest())
        hit = memo.get(key)
        if hit is None:
            hit = count(text)
            memo.put(key, hit)
        return hit

    return counted


# -- exact encodings without network ---------------------------------------------------------


@dataclass(frozen=True)
class EncodingSource:
    name: str
    sha256: str  # what tiktoken_ext/openai_public.py expects for the same rank file
    pat_str: str
    special_tokens: dict[str, int]


ENDOFTEXT = "<|endoftext|>"
FIM_PREFIX = "<|fim_prefix|>"
FIM_MIDDLE = "<|fim_middle|>"
FIM_SUFFIX = "<|fim_suffix|>"
ENDOFPROMPT = "<|endofprompt|>"

# Split patterns and special tokens as in tiktoken_ext/openai_public.py (tiktoken 0.7-0.14);
# tests/unit/test_counting_exact.py checks they are identical to the installed tiktoken's.
ENCODINGS: dict[str, EncodingSource] = {
    "cl100k_base": EncodingSource(
        name="cl100k_base",
        sha256="223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
        pat_str=r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""",
        special_tokens={
            ENDOFTEXT: 100257,
            FIM_PREFIX: 100258,
            FIM_MIDDLE: 100259,
            FIM_SUFFIX: 100260,
            ENDOFPROMPT: 100276,
        },
    ),
    "o200k_base": EncodingSource(
        name="o200k_base",
        sha256="446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
        pat_str="|".join(
            [
                r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
                r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
                r"""\p{N}{1,3}""",
                r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
                r"""\s*[\r\n]+""",
                r"""\s+(?!\S)""",
                r"""\s+""",
            ]
        ),
        special_tokens={ENDOFTEXT: 199999, ENDOFPROMPT: 200018},
    ),
}

_encoding_lock = threading.Lock()
_encodings: dict[str, tiktoken.Encoding] = {}


def rank_file_path(encoding_name: str) -> str:
    """Where bpe-openai keeps the gzipped rank file (found without importing bpe_openai)."""
    spec = importlib.util.find_spec("bpe_openai")
    if spec is None or not spec.submodule_search_locations:
        raise RankFileError("the bpe-openai package is not installed")
    for base in spec.submodule_search_locations:
        path = os.path.join(base, "data", f"{encoding_name}.tiktoken.gz")
        if os.path.isfile(path):
            return path
    raise RankFileError(f"bpe-openai ships no rank file for {encoding_name}")


def load_rank_bytes(encoding_name: str) -> bytes:
    """The decompressed ``.tiktoken`` rank file, verified against tiktoken's pinned SHA-256."""
    source = ENCODINGS.get(encoding_name)
    if source is None:
        raise RankFileError(f"no exact local encoding {encoding_name!r} (known: {', '.join(sorted(ENCODINGS))})")
    with open(rank_file_path(encoding_name), "rb") as fh:
        data = gzip.decompress(fh.read())
    digest = hashlib.sha256(data).hexdigest()
    if digest != source.sha256:
        raise RankFileError(f"{encoding_name}: rank file SHA-256 {digest} is not the expected {source.sha256}")
    return data


def parse_ranks(data: bytes) -> dict[bytes, int]:
    import base64

    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def load_encoding(encoding_name: str) -> tiktoken.Encoding:
    """A ``tiktoken.Encoding`` for ``o200k_base`` / ``cl100k_base``, built offline, cached per process."""
    enc = _encodings.get(encoding_name)
    if enc is not None:
        return enc
    with _encoding_lock:
        enc = _encodings.get(encoding_name)
        if enc is None:
            import tiktoken

            ranks = parse_ranks(load_rank_bytes(encoding_name))  # refuses unknown names and bad files
            source = ENCODINGS[encoding_name]
            enc = tiktoken.Encoding(
                name=source.name,
                pat_str=source.pat_str,
                mergeable_ranks=ranks,
                special_tokens=dict(source.special_tokens),
            )
            _encodings[encoding_name] = enc
    return enc


def warm_encodings(names: tuple[str, ...] = ("o200k_base", "cl100k_base")) -> None:
    """Load encodings now (e.g. in a Celery parent before it forks its pool)."""
    for name in names:
        load_encoding(name)


# -- the chat-format rule --------------------------------------------------------------------

TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
REPLY_PRIMING = 3
DEFAULT_IMAGE_BASE = 85
DEFAULT_IMAGE_TILE = 170


def image_tiles(width: int | None, height: int | None) -> int:
    """OpenAI's high-detail tiling: fit in 2048x2048, short side to 768, count 512-px tiles."""
    if not width or not height:
        return 8  # unknown size: the largest case (768 x 2048 -> 2 x 4 tiles)
    w, h = float(width), float(height)
    if max(w, h) > 2048:
        scale = 2048 / max(w, h)
        w, h = w * scale, h * scale
    if min(w, h) > 768:
        scale = 768 / min(w, h)
        w, h = w * scale, h * scale
    return math.ceil(w / 512) * math.ceil(h / 512)


def openai_image_tokens(part: ImagePart, base: int = DEFAULT_IMAGE_BASE, tile: int = DEFAULT_IMAGE_TILE) -> int:
    if part.detail == "low":
        return base
    return base + tile * image_tiles(part.width, part.height)


def chat_tokens(
    request: CanonicalRequest,
    text_tokens: Callable[[str], int],
    image_tokens: Callable[[ImagePart], int],
    *,
    per_message: int = TOKENS_PER_MESSAGE,
    per_name: int = TOKENS_PER_NAME,
    priming: int = REPLY_PRIMING,
) -> int:
    """The complete request's tokens under the chat-format rule (see the module docstring)."""

    def part_tokens(part: Part) -> int:
        if isinstance(part, TextPart):
            return text_tokens(part.text)
        if isinstance(part, ToolCallPart):
            return text_tokens(part.name) + text_tokens(part.arguments_text())
        if isinstance(part, ToolResultPart):
            return sum(part_tokens(p) for p in part.content)
        if isinstance(part, ImagePart):
            return image_tokens(part)
        raise TypeError(f"unknown part {part!r}")  # pragma: no cover

    total = 0
    for message in request.all_messages():
        total += per_message + text_tokens(message.role)
        if message.name is not None:
            total += text_tokens(message.name) + per_name
        for part in message.content:
            total += part_tokens(part)
    total += priming
    for tool in request.tools:
        total += text_tokens(canonical_json(tool.to_data()))
    return total


def _image_costs(model: ModelSpec) -> tuple[int, int]:
    opts = model.options
    return int(opts.get("image_base_tokens", DEFAULT_IMAGE_BASE)), int(
        opts.get("image_tile_tokens", DEFAULT_IMAGE_TILE)
    )


# -- exact local -----------------------------------------------------------------------------


@functools.cache
def _exact_text_tokens(encoding: str) -> Callable[[str], int]:
    """The exact token count of a text under ``encoding`` (one memo per encoding)."""
    encode = load_encoding(encoding).encode_ordinary
    return memoized(lambda text: len(encode(text)) if text else 0)


class ExactLocalCounter:
    """Exact BPE count for OpenAI encodings, in process, with no network."""

    name = "exact_local"
    quality = QUALITY_EXACT_LOCAL
    needs_encoding = True  # the registry refuses an exact_local entry without one

    def count(self, request: CanonicalRequest, model: ModelSpec) -> CountResult:
        if model.encoding not in ENCODINGS:
            raise InvalidCountModel(
                f"{model.name}: the exact local counter needs encoding o200k_base or cl100k_base, got {model.encoding!r}",
                model=model.name,
            )
        base, tile = _image_costs(model)
        tokens = chat_tokens(
            request, _exact_text_tokens(model.encoding), lambda image: openai_image_tokens(image, base, tile)
        )
        return CountResult(tokens, model.name, self.quality, request.fingerprint)


# -- heuristic -------------------------------------------------------------------------------

_WORDS = re.compile(r"[A-Za-z]+")
_DIGITS = re.compile(r"[0-9]+")
_SPACE_RUNS = re.compile(r"[ \t]{2,}")
_SPACE_SUBRUNS = re.compile(r" +|\t+")
# a lone space joins the word or punctuation after it; otherwise (and a lone tab) it is a token
_LONE_SPACE = re.compile(r"(?<![ \t]) (?![ \tA-Za-z!-/:-@\[-`{-~])|(?<![ \t])\t(?![ \t])")
_NEWLINES_AFTER_PUNCT = re.compile(r"(?<=[!-/:-@\[-`{-~])[\r\n]+")
_NEWLINES_ALONE = re.compile(r"(?<![!-/:-@\[-`{-~\r\n])[\r\n]+")
_PUNCT_RUNS = re.compile(r"[!-/:-@\[-`{-~]+")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_NON_ASCII = re.compile(r"[^\x00-\x7f]")
_ASTRAL = re.compile(r"[\U00010000-\U0010ffff]")
_SYMBOLS = re.compile(r"[\u2000-\u2bff]")
_CJK = re.compile(r"[\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff]")
_SUBWORDS = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])")
_BLOB = re.compile(r"[A-Za-z0-9+/=_\-]{8,}")


# Letter pairs that make up 98.5% of the pairs inside English / code words (measured on
# licence texts and stdlib sources). A pair outside this set usually forces a BPE split.
_COMMON_PAIRS = frozenset(
    "abacadagaiakalamanaparasatauavawaybabcbebibjblbobrbsbubycacccechcickclcocrctcudadddedidldodsdtdueaecedeeefegeielem"
    "eneoepeqeresetevewexeyfafefffiflfofrftfufygageggghgiglgngrgsguhahehihohrhthuiaibicidieifigiliminioipirisitivixizjeke"
    "kikskwlaldlelflilllolplsltlulymambmemimmmompmsmunancndnenfngninknlnnnonpnsntnunvnyoaobocodoeofogoiolomonoooporosotouo"
    "vowpapepiplpoppprpsptpupyqurarcrdrergrirkrlrmrnrorprrrsrtrurvrwrysascsesgshsislsospssstsusytatctdtethtitltotptrtstttu"
    "twtyuaubucudueuguiulumunupurusutvaveviwawewhwiwnwowrxcxexixpxtyiyoypyrysytze"[i : i + 2]
    for i in range(0, 540, 2)
)


@functools.lru_cache(maxsize=65536)
def _word_tokens(word: str) -> int:
    """A run of ASCII letters: per case-run, 1 + length / 4 (/ 2 in capitals) + 1 per rare letter pair."""
    total = 0
    for sub in _SUBWORDS.findall(word):
        n = len(sub)
        if n <= 2:
            total += 1
            continue
        low = sub.lower()
        rare = sum(1 for i in range(n - 1) if low[i : i + 2] not in _COMMON_PAIRS)
        if not any(c in "aeiouy" for c in low):
            rare += n // 2  # no vowel: an abbreviation or noise, split often
        if sub.isupper():
            total += 1 + (n - 1) // 2 + rare
        else:
            total += 1 + (n - 1) // 4 + rare
    return total


def _looks_random(s: str) -> bool:
    """Base64, hashes, ids: several character classes and many class changes."""
    digits = upper = lower = 0
    changes = 0
    prev = -1
    for c in s:
        if "a" <= c <= "z":
            k = 0
            lower += 1
        elif "A" <= c <= "Z":
            k = 1
            upper += 1
        elif "0" <= c <= "9":
            k = 2
            digits += 1
        else:
            k = 3
        if k != prev:
            changes += 1
            prev = k
    if (digits > 0) + (upper > 1) + (lower > 1) < 2:
        return False
    # camelCase identifiers change class about once per 3 characters; random text more often
    return changes * (3 if digits else 2) >= len(s)


def heuristic_text_tokens(text: str) -> int:
    """A conservative token estimate from character classes (see HeuristicCounter)."""
    if not text:
        return 0
    blob_tokens = 0
    if len(text) >= 8:

        def take_blob(m: re.Match[str]) -> str:
            nonlocal blob_tokens
            s = m.group()
            if not _looks_random(s):
                return s
            blob_tokens += -(-len(s) * 17 // 20)  # 0.85 per character
            return "\x00"  # keeps neighbours apart; costs one more token, conservatively

        text = _BLOB.sub(take_blob, text)
    total = blob_tokens
    total += sum(map(_word_tokens, _WORDS.findall(text)))
    total += sum(-(-len(d) // 3) for d in _DIGITS.findall(text))
    total += sum(1 + len(r) // 16 for run in _SPACE_RUNS.findall(text) for r in _SPACE_SUBRUNS.findall(run))
    total += len(_LONE_SPACE.findall(text))
    # a newline right after punctuation joins it (the split patterns' "[\r\n]*" tail)
    total += sum(
        -(-(len(n) - 1) // 2) if n[0] == "\n" else -(-len(n) // 2) for n in _NEWLINES_AFTER_PUNCT.findall(text)
    )
    total += sum(-(-len(n) // 2) for n in _NEWLINES_ALONE.findall(text))
    total += sum(len(p) - len(p) // 3 for p in _PUNCT_RUNS.findall(text))
    total += len(_CONTROL.findall(text))
    if not text.isascii():
        # other scripts: 1.5 per letter, 2 per CJK / kana / hangul character, 3 per symbol
        # of U+2000-U+2BFF, 4 per astral character (emoji); counted in half tokens
        n_all = len(_NON_ASCII.findall(text))
        n_astral = len(_ASTRAL.findall(text))
        n_symbols = len(_SYMBOLS.findall(text))
        n_cjk = len(_CJK.findall(text))
        n_rest = n_all - n_astral - n_symbols - n_cjk
        halves = 8 * n_astral + 6 * n_symbols + 4 * n_cjk + 3 * n_rest
        total += -(-halves // 2)
    # slack for what the classes cannot see (a word split once more than its shape suggests)
    return total + total // 8 + 3


class HeuristicCounter:
    """A conservative estimate for models with no local tokenizer (quality ``heuristic_estimate``).

    Text is estimated by character class: ASCII words per case-run at ``1 + len/4``
    (``1 + len/2`` in capitals) plus one per letter pair that is rare inside English / code
    words; digits by threes; punctuation runs at two thirds of their length; random-looking
    blobs (base64, hashes, ids) at 0.85 per character; other scripts at 1.5 per letter,
    2 per CJK character, 3 per symbol, 4 per emoji; then ``+ 1/8 + 3`` of slack per text.
    The same chat-format rule as the exact counter is applied, and images are charged the
    larger of OpenAI's tile rule and Anthropic's ``w*h/750`` (1600 when the size is unknown).

    It is built never to undercount ``o200k_base`` / ``cl100k_base``: over realistic
    requests it runs about 1.4-2x the exact count (prose ~1.7x, code ~1.8x, non-ASCII
    text up to ~3x on o200k); measured in tests/unit/test_counting_exact.py, including a
    hypothesis property over generated text. Random letter noise can still undercount;
    the policy's ``safety_margin`` is there for that.
    """

    name = "heuristic"
    quality = QUALITY_HEURISTIC

    def count(self, request: CanonicalRequest, model: ModelSpec) -> CountResult:
        return CountResult(heuristic_request_tokens(request, model), model.name, self.quality, request.fingerprint)


def heuristic_image_tokens(part: ImagePart, base: int = DEFAULT_IMAGE_BASE, tile: int = DEFAULT_IMAGE_TILE) -> int:
    openai = openai_image_tokens(part, base, tile)
    if part.width and part.height:
        anthropic = min(1600, math.ceil(part.width * part.height / 750))
    else:
        anthropic = 1600
    return max(openai, anthropic)


_heuristic_memo = memoized(heuristic_text_tokens)
#: a non-ASCII text's CJK and non-ASCII characters, as ``cjk << 32 | non_ascii`` (one memo for both)
_script_chars = memoized(
    lambda text: (len(text) - len(_CJK.sub("", text))) << 32 | (len(text) - len(_NON_ASCII.sub("", text)))
)


def _texts(part: Part) -> Iterator[str]:
    if isinstance(part, TextPart):
        yield part.text
    elif isinstance(part, ToolCallPart):
        yield part.arguments_text()
    elif isinstance(part, ToolResultPart):
        for p in part.content:
            yield from _texts(p)


def content_kind(request: CanonicalRequest) -> str:
    """The request's kind of content, by its characters (calibration is kept per kind as well as
    per model: a counter over-counts each kind by its own factor): ``cjk`` when at least a quarter
    are CJK / kana / hangul characters, else ``other_script`` when at least a quarter are not ASCII
    (Cyrillic, Greek, accented Latin, CJK together), else ``latin``."""
    total = cjk = non_ascii = 0
    for message in request.all_messages():
        for part in message.content:
            for text in _texts(part):
                total += len(text)
                if not text.isascii():
                    both = _script_chars(text)
                    cjk += both >> 32
                    non_ascii += both & 0xFFFFFFFF
    if total and 4 * cjk >= total:
        return "cjk"
    if total and 4 * non_ascii >= total:
        return "other_script"
    return "latin"


def heuristic_request_tokens(request: CanonicalRequest, model: ModelSpec | None = None) -> int:
    base, tile = _image_costs(model) if model is not None else (DEFAULT_IMAGE_BASE, DEFAULT_IMAGE_TILE)
    return chat_tokens(request, _heuristic_memo, lambda image: heuristic_image_tokens(image, base, tile))
