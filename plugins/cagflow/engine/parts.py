"""A document as the engine precomputes it: whole, or cut into section-aligned parts that each fit the prefix
budget, so that no text is ever dropped."""

from __future__ import annotations

from dataclasses import dataclass

from ..answering.prompt import PromptBuilder, PromptError, document_system
from ..documents.keys import validate_doc_id, validate_version
from ..documents.parsing import ParsedDocument, Section


@dataclass(frozen=True)
class DocumentPart:
    """A document, or one section-aligned part of one that would not fit the context whole."""

    doc_id: str
    doc_version: str
    title: str
    sections: tuple[Section, ...]
    part: int | None = None

    @property
    def body(self) -> str:
        return ParsedDocument(self.title, self.sections).render()

    @property
    def system(self) -> str:
        title = f"{self.title} (part {self.part})" if self.part else self.title
        return document_system(title, self.body)


def split_document(prompts: PromptBuilder, prefix_budget: int, max_context_tokens: int, doc_id: str,
                   doc_version: str, document: ParsedDocument) -> list[DocumentPart]:
    """Pack whole sections into as few parts as fit the prefix budget; never drop text.

    A section larger than the budget is cut at paragraph, then line, then word boundaries.
    """
    validate_doc_id(doc_id)
    validate_version(doc_version)
    whole = DocumentPart(doc_id, doc_version, document.title, document.sections)
    if len(prompts.prefix_ids(whole.system)) <= prefix_budget:
        return [whole]
    overhead = len(prompts.prefix_ids(DocumentPart(doc_id, doc_version, document.title, (), 99).system))
    room = prefix_budget - overhead
    if room < 32:
        raise PromptError(f"model.max_context_tokens={max_context_tokens} leaves no room for documents")
    units: list[tuple[Section, int]] = []
    for section in document.sections:
        units.extend(_fit_section(prompts, section, room))
    groups: list[list[Section]] = [[]]
    used = 0
    for section, tokens in units:
        cost = tokens + 2  # the blank line between sections
        if groups[-1] and used + cost > room:
            groups.append([])
            used = 0
        groups[-1].append(section)
        used += cost
    parts = [DocumentPart(doc_id, doc_version, document.title, tuple(g), i) for i, g in enumerate(groups, 1)]
    for part in parts:
        if len(prompts.prefix_ids(part.system)) > prefix_budget:
            raise PromptError(f"{doc_id} part {part.part} does not fit the context after splitting")
    return parts

def _fit_section(prompts: PromptBuilder, section: Section, room: int) -> list[tuple[Section, int]]:
    tokens = len(prompts.encode(section.render()))
    if tokens <= room:
        return [(section, tokens)]
    pieces: list[tuple[Section, int]] = []
    for separator in ("\n\n", "\n", " "):
        chunks = section.text.split(separator)
        if len(chunks) > 1:
            break
    current: list[str] = []
    for chunk in chunks:
        candidate = separator.join([*current, chunk])
        if current and len(prompts.encode(Section(section.heading, candidate).render())) > room:
            piece = Section(section.heading, separator.join(current))
            pieces.extend(_fit_section(prompts, piece, room) if len(current) == 1 else
                          [(piece, len(prompts.encode(piece.render())))])
            current = [chunk]
        else:
            current.append(chunk)
    if current:
        piece = Section(section.heading, separator.join(current))
        pieces.append((piece, len(prompts.encode(piece.render()))))
    return pieces
