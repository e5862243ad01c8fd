"""A simulated provider: its own tokenizer, the input tokens it would bill, and realistic requests.

``SimProvider(profile).billed(request)`` is what a provider would bill as input (input +
cache read + cache write) for a :class:`~tracker.counting.request.CanonicalRequest`. Its
tokenizer differs from every counter the project ships (the BPE encodings and the
character-class heuristic): it reads text as pieces — a word with the space before it,
digit runs, whitespace runs, punctuation runs, runs of accented / Cyrillic / Greek
letters, single CJK characters, astral symbols — and charges each piece by its own
per-profile ratios, then frames messages, tools and images its own way (a tool-use
preamble, per-message framing, Anthropic's ``w*h/750`` image rule or a flat image cost).

Two profiles: ``ANTHROPIC_LIKE`` and ``GEMINI_LIKE``. Against the shipped heuristic they
land where the project measured real providers (the heuristic runs about 1.3-1.5x what
they bill on realistic requests), with a different ratio per kind of content, so a
calibration has real spread to cope with. ``workload(rng, ...)`` builds varied realistic
requests (prose, long code, tool calls and results, non-English text) from a seeded
``random.Random``: the same seed gives the same requests.

Used by the calibration bench (``tracker bench --only calibration``) and the tests; nothing is fetched.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tracker.counting.counters import memoized
from tracker.counting.request import (
    CanonicalRequest,
    ImagePart,
    Message,
    Part,
    TextPart,
    ToolCallPart,
    ToolDef,
    ToolResultPart,
    canonical_json,
)

# -- the tokenizer ---------------------------------------------------------------------------

_PIECES = re.compile(
    r" ?[A-Za-z\u00c0-\u024f]+"  # a Latin word (accents included), with the space before it
    r"| ?[\u0370-\u052f]+"  # a Greek or Cyrillic word, with the space before it
    r"| ?[0-9]+"  # digits
    r"|\r?\n+"  # line breaks
    r"|[ \t]+"  # other whitespace
    r"|[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af\uf900-\ufaff]"  # one CJK / kana / hangul character
    r"|[\U00010000-\U0010ffff]"  # emoji and other astral symbols
    r"|[!-/:-@\[-`{-~]+"  # ASCII punctuation
    r"|.",  # anything else, one at a time
    re.DOTALL,
)
_ACCENTED = re.compile(r"[\u00c0-\u024f]")
_CASE_RUNS = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Profile:
    """Per-piece costs. ``x_per_token`` ratios are characters per token (integers, so billing is exact)."""

    name: str
    word_chars: int  # lower-case letters per token after the first
    caps_chars: int  # capitals per token after the first
    digit_chars: int
    space_chars: int  # spaces / tabs per token in a run
    punct_num: int  # punctuation run of n costs ceil(n * num / den)
    punct_den: int
    accented_num: int  # each accented Latin letter adds num / den (summed over the text, then ceil)
    accented_den: int
    cyrillic_num: int  # Greek / Cyrillic letters: ceil(n * num / den) over the text
    cyrillic_den: int
    cjk_num: int  # CJK characters: ceil(n * num / den) over the text
    cjk_den: int
    astral: int  # per emoji / astral symbol
    per_message: int
    per_tool_call: int
    per_tool_result: int
    tools_preamble: int  # once, when the request defines tools
    per_tool: int
    image_flat: int | None  # None: Anthropic's w*h/750 rule (1600 max, 1600 when unknown)


ANTHROPIC_LIKE = Profile(
    name="anthropic-like",
    word_chars=6,
    caps_chars=3,
    digit_chars=2,
    space_chars=8,
    punct_num=3,
    punct_den=5,
    accented_num=8,
    accented_den=5,
    cyrillic_num=11,
    cyrillic_den=8,
    cjk_num=8,
    cjk_den=5,
    astral=3,
    per_message=4,
    per_tool_call=6,
    per_tool_result=4,
    tools_preamble=290,
    per_tool=14,
    image_flat=None,
)

# Gemini-like: the same word rules, other prices (only what differs is written).
GEMINI_LIKE = replace(
    ANTHROPIC_LIKE,
    name="gemini-like",
    punct_den=4,
    cyrillic_num=7,
    cyrillic_den=5,
    cjk_num=5,
    cjk_den=3,
    astral=2,
    per_message=3,
    per_tool_call=4,
    per_tool_result=3,
    tools_preamble=120,
    per_tool=10,
    image_flat=258,
)


def _piece_cost(piece: str, p: Profile) -> tuple[int, int, int, int]:
    """One piece's tokens, and its accented, Greek/Cyrillic and CJK letters (priced per text)."""
    word = piece.lstrip(" ") or piece
    c = word[0]
    if "a" <= c.lower() <= "z" or "\u00c0" <= c <= "\u024f":
        tokens = 0
        for run in _CASE_RUNS.findall(_ACCENTED.sub("a", word)) or [word]:
            per = p.caps_chars if run.isupper() and len(run) > 1 else p.word_chars
            tokens += 1 + (len(run) - 1) // per
        return tokens, len(_ACCENTED.findall(word)), 0, 0
    if "\u0370" <= c <= "\u052f":
        return 0, 0, len(word), 0
    if "0" <= c <= "9":
        return _ceil(len(word), p.digit_chars), 0, 0, 0
    if c in "\r\n":
        return 1, 0, 0, 0
    if c in " \t":
        return _ceil(len(piece), p.space_chars), 0, 0, 0
    if "\u3040" <= c <= "\ufaff":
        return 0, 0, 0, 1
    if ord(c) >= 0x10000:
        return p.astral, 0, 0, 0
    return _ceil(len(piece) * p.punct_num, p.punct_den), 0, 0, 0


#: each profile's priced pieces: a text is priced piece by piece, and its pieces repeat
_PRICED: dict[Profile, dict[str, tuple[int, int, int, int]]] = {}
_PRICED_MAX = 200_000


def sim_text_tokens(text: str, p: Profile) -> int:
    if not text:
        return 0
    priced = _PRICED.setdefault(p, {})
    if len(priced) > _PRICED_MAX:
        priced.clear()
    total = accented = cyrillic = cjk = 0
    for piece, n in Counter(_PIECES.findall(text)).items():
        cost = priced.get(piece)
        if cost is None:
            cost = priced[piece] = _piece_cost(piece, p)
        total += n * cost[0]
        accented += n * cost[1]
        cyrillic += n * cost[2]
        cjk += n * cost[3]
    total += _ceil(accented * p.accented_num, p.accented_den)
    total += _ceil(cyrillic * p.cyrillic_num, p.cyrillic_den)
    return total + _ceil(cjk * p.cjk_num, p.cjk_den)


# -- the provider ----------------------------------------------------------------------------


class SimProvider:
    """``billed(request)``: the input tokens this provider bills for the request (cache read/write included)."""

    def __init__(self, profile: Profile = ANTHROPIC_LIKE) -> None:
        self.profile = profile
        self.text = memoized(lambda text: sim_text_tokens(text, profile))
        """the tokens of a text (long texts' counts remembered: a session's requests repeat them)"""

    def _image(self, part: ImagePart) -> int:
        if self.profile.image_flat is not None:
            return self.profile.image_flat
        if part.width and part.height:
            return min(1600, _ceil(part.width * part.height, 750))
        return 1600

    def _part(self, part: Part) -> int:
        p = self.profile
        if isinstance(part, TextPart):
            return self.text(part.text)
        if isinstance(part, ToolCallPart):
            return p.per_tool_call + self.text(part.name) + self.text(part.arguments_text())
        if isinstance(part, ToolResultPart):
            return p.per_tool_result + sum(self._part(q) for q in part.content)
        if isinstance(part, ImagePart):
            return self._image(part)
        raise TypeError(f"unknown part {part!r}")

    def billed(self, request: CanonicalRequest) -> int:
        p = self.profile
        total = sum(self.text(t.text) for t in request.system)
        for message in request.messages:
            total += p.per_message + sum(self._part(part) for part in message.content)
        if request.tools:
            total += p.tools_preamble
            for tool in request.tools:
                total += p.per_tool + self.text(canonical_json(tool.to_data()))
        return total


# -- realistic requests ----------------------------------------------------------------------


def _vocab(words: str) -> list[str]:
    return words.split()


_ENGLISH = _vocab(
    "the of and to in is that it for as with was on be by this are or from at which an have not "
    "but all they their more one can has been would will there if about when what so up out other "
    "into than them these some could time only new also people use may after first two work because "
    "any way most should over well even such through where much between system request context model "
    "window token count limit session agent history message summary compaction decision provider "
    "response budget threshold estimate measurement conversation function argument result error "
    "configuration database service worker queue retry timeout latency throughput deployment "
    "understand important carefully specifically approximately unfortunately straightforward "
    "implementation responsibility characteristics documentation infrastructure"
)
_IDENTS = _vocab(
    "request session_id input_tokens max_tokens window user_id fetchRecords parseHeader httpClient "
    "retryCount config self cls data result items value key index offset buffer stream handler "
    "getUserById toJSON XMLHttpRequest URLSearchParams event_store snapshot revision basis"
)
_GERMAN = _vocab(
    "die der und zu den das nicht von sie ist des sich mit dem dass er es ein ich auf so eine auch "
    "als an nach wie im für über Größe Straße müssen können würde Verständnis Anforderung Zusammenfassung "
    "Gespräch Kontextfenster Übersetzung während natürlich"
)
_FRENCH = _vocab(
    "le de un être et à il avoir ne je son que se qui ce dans en du elle au pour pas plus très "
    "déjà élève après côté être fenêtre résumé requête modèle réponse contexte"
)
_RUSSIAN = _vocab(
    "и в не на я быть он с что а по это она этот к но они мы как из у который то за свой весь "
    "год от так о для ты же все тот мочь вы человек контекст запрос модель ответ сообщение окно"
)
_CHINESE = "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点从业本去把性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原又么利比或但质气第向道命此变条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果料象员革位入常文总次品式活设及管特件长求老头基资边流路级少图山统接知较将组见计别她手角期根论运农指几九区强放决西被干做必战先回则任取据处理府研质"
_EMOJI = "🙂🚀✅🔥📈🧠"


def _choices(rng: random.Random, seq: Sequence[str], k: int) -> list[str]:
    """``[rng.choice(seq) for _ in range(k)]``, the same draws (``choice`` takes ``seq[r]`` for the
    first ``r = getrandbits(len(seq).bit_length())`` below ``len(seq)``) at about half the cost: the
    simulated sessions' text is most of the calibration tests' time. tests/unit/test_calibration.py
    holds it to ``rng.choice``."""
    n = len(seq)
    bits = n.bit_length()
    draw = rng.getrandbits
    out = []
    for _ in range(k):
        r = draw(bits)
        while r >= n:
            r = draw(bits)
        out.append(seq[r])
    return out


def _words(rng: random.Random, vocab: list[str], n: int, sentence: tuple[int, int] = (6, 18)) -> str:
    out: list[str] = []
    while len(out) < n:
        k = rng.randint(*sentence)
        words = _choices(rng, vocab, k)
        words[0] = words[0].capitalize()
        if rng.random() < 0.3:
            words[rng.randrange(k)] += ","
        out.extend(words)
        out[-1] += rng.choice([".", ".", ".", "?", ":"])
    return " ".join(out)


def prose(rng: random.Random, words: int) -> str:
    paras = []
    left = words
    while left > 0:
        n = min(left, rng.randint(40, 120))
        paras.append(_words(rng, _ENGLISH, n))
        left -= n
    return "\n\n".join(paras)


#: one line of code each, from three identifiers (the same draws, in the same order, as ever)
_CODE_LINES: tuple[Callable[[random.Random, str, str, str], str], ...] = (
    lambda rng, a, b, c: f"def {a}({b}, {c}={rng.randint(0, 999)}):",
    lambda rng, a, b, c: f"if {a}.{b} is not None and len({c}) > {rng.randint(1, 64)}:",
    lambda rng, a, b, c: f"{a} = {b}.get('{c}', {{}}).get(\"{rng.choice(_IDENTS)}\")",
    lambda rng, a, b, c: f"return [{a}[i] for i in range({b}, {c} + {rng.randint(1, 9)})]",
    lambda rng, a, b, c: f"# {_words(rng, _ENGLISH, rng.randint(5, 12), (5, 12))}",
    lambda rng, a, b, c: f'raise ValueError(f"{a}: {{{b}!r}} exceeds {rng.randint(100, 99999)}")',
    lambda rng, a, b, c: f"for {a}, {b} in enumerate(self.{c}):",
    lambda rng, a, b, c: f"{a}_{b} = {c} * 0x{rng.getrandbits(24):06x} // {rng.randint(2, 4096)}",
    lambda rng, a, b, c: f'logger.debug("{a}=%s {b}=%d", {a}, {c})',
)


def code(rng: random.Random, lines: int) -> str:
    out = []
    indent = 0
    for _ in range(lines):
        a, b, c = _choices(rng, _IDENTS, 3)
        line = _CODE_LINES[rng.randrange(len(_CODE_LINES))](rng, a, b, c)
        out.append("    " * indent + line)
        if line.endswith(":"):
            indent = min(indent + 1, 5)
        elif rng.random() < 0.3:
            indent = max(indent - 1, 0)
    return "\n".join(out)


def non_english(rng: random.Random, words: int, language: str) -> str:
    if language == "de":
        return _words(rng, _GERMAN, words)
    if language == "fr":
        return _words(rng, _FRENCH, words)
    if language == "ru":
        return _words(rng, _RUSSIAN, words)
    if language == "zh":
        chars = _choices(rng, _CHINESE, words * 2)
        for i in range(rng.randint(8, 20), len(chars), rng.randint(8, 20)):
            chars[i] = "，" if rng.random() < 0.6 else "。"
        return "".join(chars)
    raise ValueError(language)


def log_output(rng: random.Random, lines: int) -> str:
    out = []
    for _ in range(lines):
        ts = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z"
        level = rng.choice(["INFO", "DEBUG", "WARN", "ERROR"])
        out.append(
            f"{ts} {level} [{rng.choice(_IDENTS)}] {_words(rng, _ENGLISH, rng.randint(4, 14), (4, 14))} id={rng.getrandbits(64):016x}"
        )
    return "\n".join(out)


TOOLS = (
    ToolDef(
        "read_file",
        "Read a file of the repository and return its text.",
        {
            "type": "object",
            "properties": {"path": {"type": "string", "description": "Repository-relative path"}},
            "required": ["path"],
        },
    ),
    ToolDef(
        "run_shell",
        "Run a shell command in the sandbox and return stdout, stderr and the exit status.",
        {
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout_s": {"type": "integer", "minimum": 1}},
            "required": ["command"],
        },
    ),
    ToolDef(
        "search_docs",
        "Search the documentation index for passages matching a query.",
        {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query"],
        },
    ),
)

#: kinds of content a turn may carry, and the language of non-English prose
KINDS = ("prose", "code", "tools", "logs", "de", "fr", "ru", "zh")


def turn(rng: random.Random, kind: str, i: int) -> list[Message]:
    """One user / assistant exchange of the given kind (a tool exchange adds the call and its result)."""
    if kind == "prose":
        return [
            Message("user", (TextPart(prose(rng, rng.randint(30, 200))),)),
            Message("assistant", (TextPart(prose(rng, rng.randint(80, 400))),)),
        ]
    if kind == "code":
        return [
            Message(
                "user", (TextPart("Please review this:\n```python\n" + code(rng, rng.randint(20, 120)) + "\n```"),)
            ),
            Message(
                "assistant",
                (
                    TextPart(
                        prose(rng, rng.randint(40, 150)) + "\n```python\n" + code(rng, rng.randint(10, 60)) + "\n```"
                    ),
                ),
            ),
        ]
    if kind in ("tools", "logs"):
        call_id = f"toolu_{rng.getrandbits(80):020x}"
        if kind == "tools":
            call = ToolCallPart(call_id, "read_file", {"path": f"src/{rng.choice(_IDENTS)}/{rng.choice(_IDENTS)}.py"})
            result = code(rng, rng.randint(40, 200))
        else:
            call = ToolCallPart(
                call_id, "run_shell", {"command": f"pytest -q tests/test_{rng.choice(_IDENTS)}.py", "timeout_s": 120}
            )
            result = log_output(rng, rng.randint(20, 120))
        return [
            Message("assistant", (TextPart(_words(rng, _ENGLISH, rng.randint(8, 30))), call)),
            Message("user", (ToolResultPart(call_id, (TextPart(result),)),)),
        ]
    text = non_english(rng, rng.randint(40, 300), kind)
    answer = non_english(rng, rng.randint(60, 400), kind)
    if rng.random() < 0.2:
        answer += " " + rng.choice(_EMOJI)
    return [Message("user", (TextPart(text),)), Message("assistant", (TextPart(answer),))]


@dataclass(frozen=True)
class Workload:
    """How one model's sessions look: the share of each kind of turn."""

    name: str
    weights: dict[str, int]
    system: str


CODING_AGENT = Workload(
    "coding agent",
    {"prose": 3, "code": 3, "tools": 4, "logs": 2, "de": 1},
    "You are a careful coding agent. Use the tools to read files and run tests before answering.",
)
MULTILINGUAL_ASSISTANT = Workload(
    "multilingual assistant",
    {"prose": 4, "de": 2, "fr": 2, "ru": 2, "zh": 2, "code": 1, "tools": 1},
    "You are a helpful assistant. Answer in the language of the question.",
)

#: sessions over Chinese documents: the user pastes documents and asks about them (a fleet mixing
#: these with coding sessions under one model is where one factor per model cannot fit both)
CJK_DOCUMENTS = Workload(
    "Chinese documents",
    {"zh": 6, "prose": 1},
    "You answer questions about the user's documents, in the language they are written in.",
)


def session(rng: random.Random, workload: Workload, turns: int) -> list[CanonicalRequest]:
    """A growing conversation: the request sent at each turn (every request includes the whole history)."""
    kinds = list(workload.weights)
    weights = [workload.weights[k] for k in kinds]
    system = (TextPart(workload.system + "\n\n" + prose(rng, rng.randint(100, 400))),)
    history: list[Message] = []
    requests = []
    for i in range(turns):
        history.extend(turn(rng, rng.choices(kinds, weights)[0], i))
        requests.append(CanonicalRequest(system=system, messages=tuple(history), tools=TOOLS))
    return requests


def request_of(rng: random.Random, workload: Workload, turns: int) -> CanonicalRequest:
    """One request: a session's history after ``turns`` turns."""
    return session(rng, workload, turns)[-1]
