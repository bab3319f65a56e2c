import re

import pytest
from cagflow.documents.parsing import DocumentError, parse_file, parse_html, parse_markdown, parse_text


def test_every_corpus_document_parses_into_sections(corpus):
    for entry in corpus.documents:
        document = parse_file(corpus.file(entry), entry.title)
        assert document.title == entry.title
        assert document.sections, entry.doc_id
        if entry.tier == "fixed":
            assert len(document.sections) >= 4, entry.doc_id
            words = re.findall(r"[\u4e00-\u9fff]|[^\s\u4e00-\u9fff]+", document.render())  # a Han character is a word
            assert len(words) > 800, entry.doc_id


def test_markdown_sections_and_code_fences():
    document = parse_markdown("# Manual\n\nIntro.\n\n## Ports\nUse 8443.\n```\n# not a heading\n```\n## Limits\nTen.\n")
    assert document.title == "Manual"
    assert [s.heading for s in document.sections] == ["", "Ports", "Limits"]
    assert "# not a heading" in document.sections[1].text


def test_text_headings_are_capital_lines_followed_by_blank():
    document = parse_text("Backup Guide\n\nOVERVIEW\n\nWe back up nightly.\nNOT A HEADING\nstill text\n")
    assert document.title == "Backup Guide"
    assert document.sections[0].heading == "Overview"
    assert "NOT A HEADING" in document.sections[0].text


def test_chinese_text_headings_are_numbered_lines_followed_by_blank():
    document = parse_text("数据安全制度\n\n第一章 总则\n\n一、目的\n\n为保障数据安全，制定本制度。\n\n"
                          "二、适用范围\n\n本制度适用于全体员工。\n\n第二章 账号\n\n1.1 密码要求\n\n密码不少于 14 位。\n"
                          "一、这是一句完整的话，不是标题。\n\n1.5 GB of logs\n\n（三）审批\n\n须经批准。\n")
    assert document.title == "数据安全制度"
    assert [s.heading for s in document.sections] == [
        "第一章 总则 — 一、目的", "二、适用范围", "第二章 账号 — 1.1 密码要求", "（三）审批"]
    assert "一、这是一句完整的话，不是标题。" in document.sections[2].text  # a sentence, not a heading
    assert "1.5 GB of logs" in document.sections[2].text  # numbered Latin text keeps the capitals rule


def test_html_headings_lists_and_entities():
    document = parse_html("<html><head><title>T</title><style>p{}</style></head><body><h1>Policy</h1>"
                          "<h2>Access &amp; keys</h2><p>Rotate   every\n90 days.</p><ul><li>one</li><li>two</li></ul>"
                          "<script>var x;</script></body></html>")
    assert document.title == "T"
    assert document.sections[0].heading == "Access & keys"
    assert "Rotate every 90 days." in document.sections[0].text
    assert "- one" in document.sections[0].text and "var x" not in document.render()


def test_unusable_files_fail_clearly(tmp_path):
    empty = tmp_path / "empty.md"
    empty.write_text("# Title only\n\n")
    with pytest.raises(DocumentError, match="no text"):
        parse_file(empty)
    with pytest.raises(DocumentError, match="unsupported format"):
        parse_file(tmp_path / "doc.docx")
    with pytest.raises(DocumentError, match="not found"):
        parse_file(tmp_path / "missing.md")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(DocumentError, match="not UTF-8"):
        parse_file(binary)


def _text_pdf(lines: list[str], title: str) -> bytes:
    """A minimal one-page PDF with a text layer (Helvetica), written by hand so the test needs no PDF writer."""
    content = "BT /F1 11 Tf 72 760 Td 14 TL " + " ".join(f"({line}) '" for line in lines) + " ET"
    objects = [
        "<< /Type /Catalog /Pages 2 0 R >>",
        "<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 4 0 R >> >> "
        "/Contents 5 0 R >>",
        "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        f"<< /Length {len(content)} >>\nstream\n{content}\nendstream",
        f"<< /Title ({title}) >>",
    ]
    out, offsets = "%PDF-1.4\n", []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n{body}\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n" + "".join(f"{o:010d} 00000 n \n" for o in offsets)
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R /Info 6 0 R >>\nstartxref\n{xref}\n%%EOF\n"
    return out.encode("latin-1")


def test_pdf_text_is_parsed_into_sections(tmp_path):
    pdf = tmp_path / "guide.pdf"
    pdf.write_bytes(_text_pdf(["OVERVIEW", "", "Backups run nightly at 01:30.", "RETENTION", "",
                               "Raw readings are kept for 30 days."], "Backup Guide"))
    document = parse_file(pdf)
    assert document.title == "Backup Guide"
    assert [s.heading for s in document.sections] == ["Overview", "Retention"]
    assert "30 days" in document.sections[1].text


def test_broken_pdf_fails_clearly(tmp_path):
    pdf = tmp_path / "broken.pdf"
    pdf.write_bytes(b"%PDF-1.4 this is not really a pdf")
    with pytest.raises(DocumentError, match="broken.pdf"):
        parse_file(pdf)
