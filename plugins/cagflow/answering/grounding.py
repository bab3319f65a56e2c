"""Is an answer grounded in the text it was given? A small model asked something its document does not
say often invents a plausible figure ("the share price is $1.218") or describes the neighbour of an
identifier that does not exist (alarm E-408 when the manual lists E-407); the same holds in Chinese. Support answers live on such
figures, so an answer is held unsupported when it states a number or identifier that appears nowhere in
its source (the document or passages it was answered from). A plain quantity the question itself gives
("a CVSS score of 7.5") may be repeated; an identifier from the question (E-408, 5.3.2, or a number named
as one: "port 9441") must be in the source whether the answer repeats it or not, or the answer describes
something the documents do not know. It is a one-sided check: an invented answer without figures passes,
and a supported figure is never doubted.

A number with a unit is one figure: "60 seconds" is unsupported by a document that says "60 minutes"
wherever it writes 60. One check catches the model answering next to the question: an amount asked ("How
many employees?") and every figure stated found in the source only in sentences that share no word with the
question ("at most 10 Administrator accounts"): ``off_topic_figures``. (Checks on the wording of an answer
alone, "no amount stated" and "no name stated", declined right answers on public data: "infinitely many
primes" has an amount in words; they were removed.) And two on the question itself, for Chinese questions
(segmented by jieba): one that names someone or something (a person, place, organisation or work) its
source never mentions is about another document, however well the answer reads ("杨丽音是何时毕业于国光艺校
戏剧科的？" over an article on 黄华麒): ``question_name_absent``; one most of whose words (nouns, verbs,
numbers ...) its source lacks is too ("蓝线裸顶鲷的俗名是什么？" over an article on yarrow):
``question_terms_absent``. Half was chosen on the CMRC 2018 calibration half, where every answerable
question's document holds at least half of its words and 14 of 15 near-miss ones fewer (bench/README.md).

Each check is a rule of ``cagflow.rules``: all are evaluated and reported
in ``Grounding.fired``; only those not switched off decide.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..documents.text import HAN_RUN, question_names, question_words, sentences
from ..rules import DECLINE_ORDER

# A run of (ASCII) word characters and joiners holding at least one digit: 8443, E-407, 192.168.77.1/24, 5.1.3,
# 3,450. ASCII only, so that in Chinese, where no space separates words, "端口9443" holds the figure "9443".
_FIGURE = re.compile(r"[\w./:,+-]*\d[\w./:,+-]*", re.ASCII)
_EDGE = ".,:/+-_"
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
# A unit written onto its number ("12GB", "500ms", "24h") is the same quantity as "12 GB": split, so that the
# number is the figure either way. Chinese text often writes them together, the documents often apart.
_GLUED_UNIT = re.compile(r"(?<=\d)(?=(?:[kmgtp]i?b|[kmg]?hz|[mun]?s|min|h|[mk]?g|[mck]?m|k?w|m?v|ma)\b)", re.ASCII)
_QUANTITY = re.compile(r"\d+(?:\.\d+)?")
_ORDINAL = re.compile(r"(\d+)(?:st|nd|rd|th)")
# A plain number right after one of these words names something (port 9441, code 17, 端口 9444) rather than
# counts it.
_NAMING_WORD = re.compile(r"(?:\b(?:port|code|alarm|error|id|number|version|release|ticket|incident|rule|build|model)s?"
                          r"|端口|告警|错误码|代码|编号|版本|缺陷|型号|工单)\s*$", re.IGNORECASE)
# Questions that ask for an amount (off_topic_figures looks where the answer's figures stand).
_ASKS_QUANTITY = re.compile(r"\bhow\s+(?:many|much|long|old|big|large|far|soon|fast|heavy)\b"
                            r"|多少|多久|多长|多大|几[个天年次位小分秒月周条台点倍人名项级]", re.IGNORECASE)
_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                 "twelve")
# Units a number is read with, by the canonical name they are compared under. "月" and "日" alone are parts
# of a date (3月18日), not durations; dates are taken out before units are read.
_UNITS = {
    "second": r"seconds?|secs?|s|秒钟?",
    "millisecond": r"milliseconds?|ms|毫秒",
    "minute": r"minutes?|mins?|分钟",
    "hour": r"hours?|hrs?|h|个?小时",
    "day": r"(?:business |working |calendar )?days?|个?工作日|天",
    "week": r"weeks?|个?(?:周|星期)",
    "month": r"months?|个月",
    "year": r"years?|yrs?|年",
    "percent": r"%|percent|per cent",
    "kb": r"kb|kib", "mb": r"mb|mib", "gb": r"gb|gib", "tb": r"tb|tib",
    # Chinese counts things with a measure word: "240 条事件" is not the manual's "240 小时". Any measure word
    # counts as the same unit (5 台 and 5 个 gateways); after the longer units above (个月, 个小时).
    "count": r"[个条次台名位项份家款人]",
}
_AMOUNT = rf"(\d+(?:\.\d+)?|{'|'.join(_NUMBER_WORDS)})"
_WITH_UNIT = re.compile(rf"(?<![\w.]){_AMOUNT}((?:\s*(?:-|–|~|to|and|or|至|到|或)\s*{_AMOUNT})*)[\s-]*"
                        rf"(?:{'|'.join(f'(?P<{name}>{spelling})' for name, spelling in _UNITS.items())})(?![a-z])")
_DATE = re.compile(r"\d{4}\s*年\s*\d{1,2}\s*月(?:\s*\d{1,2}\s*[日号])?|\d{1,2}\s*月\s*\d{1,2}\s*[日号]")
# Words that carry no topic: a question's sentence in the source must share one of the others.
_FUNCTION_WORDS = frozenset("""a an the of to in on for at by with from and or is are was were be been being do does
did have has had how many much long old big large far soon fast heavy what which who whom whose when where why can
could must may might should would will shall it its this that these those there their our your my we you they he she
them us me not no any all each every per after before than then about into over under up down out off if as so such
more most less least very also only just same other another get gets got use used using uses""".split())
_ORDINAL_WORDS = ("zeroth", "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth",
                  "tenth", "eleventh", "twelfth")
# "excerpt": a re-asked question quotes one (engine.engine), and the model then declines in its words.
_DECLINE = re.compile(r"\b(?:documents?|passages?|text|manual|excerpts?)\s+(?:do|does)\s+not\s+"
                      r"(?:contain|include|mention|say|specify|state|provide|have|list|give)\b"
                      r"|\bnot\s+(?:found|mentioned|stated|specified|provided|given|listed|included)\s+in\s+the\s+"
                      r"(?:provided\s+|given\s+)?(?:documents?|passages?|text|manual|excerpts?)\b"
                      r"|(?:文档|文本|资料|手册|材料)(?:中|里)?并?(?:没有|未|不)(?:包含|提及|提到|说明|涉及|给出|列出|记载|找到)"
                      r"|(?:文档|文本|资料|手册|材料)(?:中|里)(?:没有|找不到|未找到)"
                      r"|没有(?:找到)?(?:相关|有关)的?信息",
                      re.IGNORECASE)


def _normalise(text: str) -> str:
    return _GLUED_UNIT.sub(" ", _THOUSANDS.sub("", text.lower()))


def figures(text: str) -> list[str]:
    """Numbers and identifiers in ``text``, lower-cased, without thousands separators or edge punctuation."""
    found = (match.strip(_EDGE) for match in _FIGURE.findall(_normalise(text)))
    return [figure for figure in found if any(char.isdigit() for char in figure)]


def listed_figures(text: str) -> set[str]:
    """The figures of ``text``, with the parts of listed ones ("yf-e116/yf-e117", "8443,8883") also on their
    own: what a question's identifier is looked up in, as a set."""
    found = set()
    for figure in figures(text):
        found.add(figure)
        found.update(part.strip(_EDGE) for part in re.split(r"[/,]", figure))
    return found


def identifiers(question: str) -> list[str]:
    """The figures of a question that name something: any figure but a plain quantity, and a plain number
    right after a naming word ("port 9441")."""
    text = _normalise(question)
    found = []
    for match in _FIGURE.finditer(text):
        figure = match.group(0).strip(_EDGE)
        if any(char.isdigit() for char in figure) and (
                not _QUANTITY.fullmatch(figure) or _NAMING_WORD.search(text[:match.start()])):
            found.append(figure)
    return found


def is_declined(answer: str) -> bool:
    """Whether the answer says the documents do not hold the answer (in the prompt's words or close to them)."""
    return bool(_DECLINE.search(answer))


def _amounts_with_units(text: str) -> list[tuple[str, str, str]]:
    """(number, canonical unit, as written) for each number written with a unit in ``text`` (normalised);
    every number of a range ("5 to 10 seconds") takes the range's unit."""
    found = []
    for match in _WITH_UNIT.finditer(_DATE.sub(" ", text)):
        unit = next(name for name in _UNITS if match.group(name))
        for amount in (match.group(1), *re.findall(_AMOUNT, match.group(2))):
            number = str(_NUMBER_WORDS.index(amount)) if amount in _NUMBER_WORDS else amount
            found.append((number, unit, match.group(0).strip()))
    return found


def _wrong_units(answer: str, text: str, question: str) -> list[str]:
    """Amounts of ``answer`` (all three normalised) that ``question`` does not give and whose number ``text``
    writes, every time, with another unit."""
    given = {(number, unit) for number, unit, _ in _amounts_with_units(question)}
    stated = [amount for amount in _amounts_with_units(answer) if amount[:2] not in given]
    if not stated:  # most answers: the source is not scanned
        return []
    undated = _DATE.sub(" ", text)
    written = _amounts_with_units(undated)
    wrong = []
    for number, unit, as_written in stated:
        units = {other for found, other, _ in written if found == number}
        occurrences = len(re.findall(rf"(?<![\w.]){re.escape(number)}(?![\w]|\.\d)", undated))
        if units and unit not in units and occurrences <= sum(found == number for found, _, _ in written):
            wrong.append(as_written)
    return wrong


def _topic(text: str) -> set[str]:
    """The words of ``text`` that carry its topic: English words by their first five letters (employee,
    employees), Chinese as character pairs."""
    words = {word[:5] for word in re.findall(r"[a-z][a-z0-9'-]+", text.lower())
             if len(word) >= 3 and word not in _FUNCTION_WORDS}
    han = "".join(HAN_RUN.findall(text))
    return words | {han[i:i + 2] for i in range(len(han) - 1)}


def figures_off_topic(answer: str, source: str, question: str) -> bool:
    """Whether ``question`` asks for an amount and every figure of ``answer`` that the source holds stands
    there only in sentences sharing no topic word with the question: the nearest number, not the answer."""
    if not _ASKS_QUANTITY.search(question):
        return False
    given = set(figures(question))
    stated = [figure for figure in figures(answer) if figure not in given]
    if not stated:
        return False
    topic = _topic(question)
    normalised = [(sentence, _normalise(sentence)) for sentence in sentences(source)]
    located = False
    for figure in stated:
        holding = [sentence for sentence, text in normalised if _in_source(figure, text)]
        if any(_topic(sentence) & topic for sentence in holding):
            return False
        located = located or bool(holding)
    return located


@dataclass(frozen=True)
class Grounding:
    answered: bool
    unsupported: tuple[str, ...] = ()  # figures of the answer that its source does not contain
    misses: str | None = None  # next to the question: off_topic_figures, question_name_absent, question_terms_absent
    fired: tuple[str, ...] = ()  # every rule that holds the answer unsupported, switched off or not

    @property
    def reason(self) -> str | None:
        """Why the answer counts as declined: the model said so, it stated figures its source lacks, or it
        answered next to the question."""
        if self.answered:
            return None
        if self.unsupported:
            return "unsupported_figures"
        return self.misses or "model_declined"


def _in_source(figure: str, text: str) -> bool:
    """A figure is in the source as a whole token, or (0–12, and their ordinals) spelt out as a word."""
    if re.search(rf"(?<![\w]){re.escape(figure)}(?![\w])", text, re.ASCII):
        return True
    ordinal = _ORDINAL.fullmatch(figure)
    number = int(ordinal.group(1)) if ordinal else int(figure) if figure.isdigit() else None
    if number is None or number >= len(_NUMBER_WORDS):
        return False
    word = (_ORDINAL_WORDS if ordinal else _NUMBER_WORDS)[number]
    return bool(re.search(rf"\b{word}\b", text))


def _mostly_absent(words: list[str], lowered_source: str) -> bool:
    """Whether the (lower-cased) source holds fewer than half of ``words`` (False when there are none)."""
    return 2 * sum(word.lower() in lowered_source for word in words) < len(words)


def check(answer: str, source: str | None, question: str = "", disabled: frozenset[str] = frozenset()) -> Grounding:
    """Whether ``answer`` answers from ``source``: not a decline, every identifier the question names is in
    the source, every figure the answer states is in the source as a whole token (``8443`` does not match
    inside ``18443``) or is a plain quantity given by ``question``, with the unit the source writes it with,
    and the answer is of the kind the question asks for (module docstring). Without a source (a question
    asked alone) only a decline counts. Rules named in ``disabled`` are reported in ``fired`` but decide
    nothing."""
    if is_declined(answer) or not answer.strip():
        return Grounding(False)
    if source is None:
        return Grounding(True)
    text = _normalise(source)
    named = set(identifiers(question))
    given = {figure for figure in figures(question) if _QUANTITY.fullmatch(figure) and figure not in named}
    stated = [*named, *(figure for figure in figures(answer) if figure not in given)]
    missing = tuple(dict.fromkeys([*(figure for figure in stated if not _in_source(figure, text)),
                                   *_wrong_units(_normalise(answer), text, _normalise(question))]))
    lowered = source.lower()
    verdicts = {"unsupported_figures": bool(missing),
                "off_topic_figures": figures_off_topic(answer, source, question),
                "question_name_absent": any(name.lower() not in lowered for name in question_names(question)),
                "question_terms_absent": _mostly_absent(question_words(question), lowered)}
    fired = tuple(name for name in DECLINE_ORDER if verdicts.get(name))
    deciding = [name for name in fired if name not in disabled]
    if not deciding:
        return Grounding(True, fired=fired)
    if deciding[0] == "unsupported_figures":
        return Grounding(False, missing, fired=fired)
    return Grounding(False, misses=deciding[0], fired=fired)

