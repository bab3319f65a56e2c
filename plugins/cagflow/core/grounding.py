"""Is an answer grounded in the text it was given? A small model asked something its document does not
say often invents a plausible figure ("the share price is $1.218") or describes the neighbour of an
identifier that does not exist (alarm E-408 when the manual lists E-407); the same holds in Chinese. Support answers live on such
figures, so an answer is held unsupported when it states a number or identifier that appears nowhere in
its source (the document or passages it was answered from). A plain quantity the question itself gives
("a CVSS score of 7.5") may be repeated; an identifier from the question (E-408, 5.3.2, or a number named
as one: "port 9441") must be in the source whether the answer repeats it or not, or the answer describes
something the documents do not know. It is a one-sided check: an invented answer without figures passes,
and a supported figure is never doubted.

A question asking for an amount ("How many days ...?", "How much does ... cost?", "多长时间", "几年") is not
answered by text that states no quantity besides the question's own: the model describing the neighbourhood
of the fact ("action items are tracked weekly until they are closed") is held as not answering.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
# Questions that ask for an amount: the answer must state one.
_ASKS_QUANTITY = re.compile(r"\bhow\s+(?:many|much|long|old|big|large|far|soon|fast|heavy)\b"
                            r"|多少|多久|多长|多大|几[个天年次位小分秒月周条台点倍人名项级]", re.IGNORECASE)
_HAN_NUMERAL = re.compile(r"[零一二两三四五六七八九十百千万半]")
_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                 "twelve")
_QUANTITY_WORD = re.compile(rf"\b(?:{'|'.join(_NUMBER_WORDS[1:])}|dozen|hundred|thousand|million|half|twice)\b")
_ORDINAL_WORDS = ("zeroth", "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth",
                  "tenth", "eleventh", "twelfth")
_DECLINE = re.compile(r"\b(?:documents?|passages?|text|manual)\s+(?:do|does)\s+not\s+"
                      r"(?:contain|include|mention|say|specify|state|provide|have|list|give)\b"
                      r"|\bnot\s+(?:found|mentioned|stated|specified|provided|given|listed|included)\s+in\s+the\s+"
                      r"(?:provided\s+|given\s+)?(?:documents?|passages?|text|manual)\b"
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


def _quantity_words(text: str) -> set[str]:
    return set(_QUANTITY_WORD.findall(text.lower())) | set(_HAN_NUMERAL.findall(text))


def states_no_quantity(answer: str, question: str) -> bool:
    """Whether ``question`` asks for an amount and ``answer`` states none besides the question's own figures
    and number words."""
    if not _ASKS_QUANTITY.search(question):
        return False
    given = set(figures(question))
    return (all(figure in given for figure in figures(answer))
            and not _quantity_words(answer) - _quantity_words(question))


@dataclass(frozen=True)
class Grounding:
    answered: bool
    unsupported: tuple[str, ...] = ()  # figures of the answer that its source does not contain
    no_quantity: bool = False  # the question asks for an amount and the answer states none

    @property
    def reason(self) -> str | None:
        """Why the answer counts as declined: the model said so, it stated figures its source lacks, or it
        gave no amount where one was asked for."""
        if self.answered:
            return None
        if self.unsupported:
            return "unsupported_figures"
        return "no_quantity" if self.no_quantity else "model_declined"


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


def check(answer: str, source: str | None, question: str = "") -> Grounding:
    """Whether ``answer`` answers from ``source``: not a decline, an amount where the question asks for one,
    every identifier the question names is in the source, and every figure the answer states is in the source
    as a whole token (``8443`` does not match inside ``18443``) or is a plain quantity given by ``question``.
    Without a source (a question asked alone) only a decline counts."""
    if is_declined(answer) or not answer.strip():
        return Grounding(False)
    if source is None:
        return Grounding(True)
    if states_no_quantity(answer, question):
        return Grounding(False, no_quantity=True)
    text = _normalise(source)
    named = set(identifiers(question))
    given = {figure for figure in figures(question) if _QUANTITY.fullmatch(figure) and figure not in named}
    stated = [*named, *(figure for figure in figures(answer) if figure not in given)]
    missing = tuple(dict.fromkeys(figure for figure in stated if not _in_source(figure, text)))
    return Grounding(not missing, missing)

