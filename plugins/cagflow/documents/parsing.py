"""Parse corpus files into titled sections.

Sections are the unit for splitting a long document into snapshot parts and for chunking, so every
format is reduced to the same shape: a title and an ordered list of (heading, text) sections.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

from ..errors import CagflowError
from .text import HAN_RANGES

# Part of every model fingerprint: a parser change renders documents differently, so snapshots of the
# old rendering must not be reused under the same key.
PARSER_VERSION = "3"


class DocumentError(CagflowError, ValueError):
    """A document that cannot be parsed or is unusable (empty, unknown format)."""

    code = "invalid_document"


@dataclass(frozen=True)
class Section:
    heading: str
    text: str

    def render(self) -> str:
        return f"## {self.heading}\n{self.text}" if self.heading else self.text


@dataclass(frozen=True)
class ParsedDocument:
    title: str
    sections: tuple[Section, ...] = field(default_factory=tuple)

    def render(self) -> str:
        """The document as the model reads it: Markdown-like, one blank line between sections."""
        return "\n\n".join(section.render() for section in self.sections)


_MD_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_TXT_HEADING = re.compile(r"^[A-Z0-9][A-Z0-9 &/,.'()-]{2,}$")
# Chinese headings: "第一章 总则", "第3节 备份", "一、适用范围", "（二）审批", "1.1 密码要求"; short, with no sentence end.
_CJK_NUMERAL = "一二三四五六七八九十百零〇两"
_TXT_HEADING_ZH = re.compile(rf"^(?:第[{_CJK_NUMERAL}\d]+[章节条篇部分]+\s*|[{_CJK_NUMERAL}]+、\s*|[（(][{_CJK_NUMERAL}]+[）)]\s*"
                             rf"|\d+(?:\.\d+)+\s+(?=[{HAN_RANGES}]))[^。！？；：:]{{0,30}}$")


def _clean(text: str) -> str:
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _collect(pairs: list[tuple[str, list[str]]]) -> tuple[Section, ...]:
    """Sections with text; a heading with no text of its own (a parent of subsections) is carried into
    the next heading, "Ports — HTTPS", so no structure is lost."""
    sections = []
    carried = ""
    for heading, body in pairs:
        heading = " — ".join(h for h in (carried, heading.strip()) if h)
        text = _clean("\n".join(body))
        if text:
            sections.append(Section(heading, text))
            carried = ""
        else:
            carried = heading
    return tuple(sections)


def parse_markdown(text: str) -> ParsedDocument:
    title = ""
    pairs: list[tuple[str, list[str]]] = [("", [])]
    in_fence = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        match = None if in_fence else _MD_HEADING.match(line)
        if match and len(match.group(1)) == 1 and not title:
            title = match.group(2)
        elif match:
            pairs.append((match.group(2), []))
        else:
            pairs[-1][1].append(line)
    return ParsedDocument(title, _collect(pairs))


def parse_text(text: str, blank_after_heading: bool = True) -> ParsedDocument:
    """Plain text: a line in capitals, or a numbered Chinese heading ("第一章 总则", "一、目的", "1.1 密码要求"),
    followed by a blank line starts a section. Text extracted from a PDF has no blank lines, so there a short
    such line alone is enough."""
    lines = text.splitlines()
    pairs: list[tuple[str, list[str]]] = [("", [])]
    for index, line in enumerate(lines):
        following = lines[index + 1] if index + 1 < len(lines) else ""
        latin = bool(_TXT_HEADING.match(line.strip())) and len(line.split()) <= 8
        heading_like = latin or bool(_TXT_HEADING_ZH.match(line.strip()))
        if heading_like and (not blank_after_heading or not following.strip()):
            pairs.append((line.strip().title() if latin else line.strip(), []))
        else:
            pairs[-1][1].append(line)
    sections = _collect(pairs)
    title = ""
    if sections and not sections[0].heading and "\n" not in sections[0].text:
        title, sections = sections[0].text, sections[1:]
    return ParsedDocument(title, sections)


class _HtmlSections(HTMLParser):
    _BLOCKS = {"p", "li", "tr", "pre", "br", "div", "dt", "dd", "table", "ul", "ol"}
    _SKIP = {"script", "style", "head"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.title = ""
        self.pairs: list[tuple[str, list[str]]] = [("", [])]
        self._heading: list[str] | None = None
        self._heading_tag = ""
        self._skip_depth = 0
        self._in_title = False
        self._seen_h1 = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self._SKIP:
            self._skip_depth += 1
        elif tag == "title":
            self._in_title = True
        elif re.fullmatch(r"h[1-6]", tag):
            self._heading, self._heading_tag = [], tag
        elif tag == "li":
            self.pairs[-1][1].append("\n- ")
        elif tag in self._BLOCKS:
            self.pairs[-1][1].append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self._SKIP:
            self._skip_depth = max(0, self._skip_depth - 1)
        elif tag == "title":
            self._in_title = False
        elif tag == self._heading_tag and self._heading is not None:
            heading = " ".join("".join(self._heading).split())
            if tag == "h1" and not self._seen_h1:
                self._seen_h1 = True  # the document's own title, not a section
                self.title = self.title or heading
            else:
                self.pairs.append((heading, []))
            self._heading = None
        elif tag in self._BLOCKS:
            self.pairs[-1][1].append("\n")

    def handle_data(self, data: str) -> None:
        if self._in_title and not self.title:
            self.title = data.strip()
        elif self._skip_depth:
            return
        elif self._heading is not None:
            self._heading.append(data)
        else:
            self.pairs[-1][1].append(re.sub(r"\s+", " ", data))  # in HTML a newline is just a space


def parse_html(text: str) -> ParsedDocument:
    parser = _HtmlSections()
    parser.feed(text)
    parser.close()
    pairs = []
    for heading, parts in parser.pairs:
        body = "".join(parts)
        lines = [" ".join(line.split()) for line in body.splitlines()]
        pairs.append((heading, ["\n".join(line for line in lines if line and line != "-")]))
    return ParsedDocument(parser.title, _collect(pairs))


def parse_pdf_bytes(data: bytes) -> ParsedDocument:
    """Text PDFs: the extracted text is read like a plain-text document (capital-letter headings), with
    the PDF's own title when it has one. Scanned PDFs have no text layer and fail as empty."""
    from io import BytesIO

    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    try:
        reader = PdfReader(BytesIO(data))
        text = "\n\n".join(page.extract_text() or "" for page in reader.pages)
        title = (reader.metadata.title if reader.metadata else None) or ""
    except (PdfReadError, ValueError, KeyError) as exc:
        raise DocumentError(f"not a readable PDF: {exc}") from None
    parsed = parse_text(text, blank_after_heading=False)
    return ParsedDocument(title.strip() or parsed.title, parsed.sections)


PARSERS = {".md": parse_markdown, ".markdown": parse_markdown, ".txt": parse_text,
           ".html": parse_html, ".htm": parse_html}  # text formats; PDF is binary: see parse_file


def parse_document_text(text: str, format: str, title: str | None, name: str) -> ParsedDocument:
    """Parse a document given as text in a text format (``md``, ``txt``, ``html``); ``name`` titles it
    when neither ``title`` nor the text does."""
    parser = PARSERS.get("." + format.lower().lstrip("."))
    if parser is None:
        formats = sorted({suffix.lstrip(".") for suffix in PARSERS})
        raise DocumentError(f"FORMAT {format!r} is not supported (use one of: {', '.join(formats)})")
    parsed = parser(text)
    if not any(section.text.strip() for section in parsed.sections):
        raise DocumentError(f"document {name} has no text")
    return ParsedDocument(title or parsed.title or name, parsed.sections)


def parse_file(path: str | Path, title: str | None = None) -> ParsedDocument:
    """Parse a corpus file by extension; the manifest title, when given, wins over the file's."""
    path = Path(path)
    parser = PARSERS.get(path.suffix.lower())
    if parser is None and path.suffix.lower() != ".pdf":
        supported = ", ".join(sorted([*PARSERS, ".pdf"]))
        raise DocumentError(f"{path}: unsupported format {path.suffix!r} (supported: {supported})")
    try:
        if path.suffix.lower() == ".pdf":
            parsed = parse_pdf_bytes(path.read_bytes())
        else:
            parsed = parser(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DocumentError(f"{path}: file not found") from None
    except UnicodeDecodeError as exc:
        raise DocumentError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except DocumentError as exc:
        raise DocumentError(f"{path}: {exc}") from None
    if not any(section.text.strip() for section in parsed.sections):
        raise DocumentError(f"{path}: document has no text")
    return ParsedDocument(title or parsed.title or path.stem, parsed.sections)
