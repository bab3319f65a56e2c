import pytest

from cagflow.documents import DocumentError, parse_file, parse_html, parse_markdown, parse_text


def test_every_corpus_document_parses_into_sections(corpus):
    for entry in corpus.documents:
        document = parse_file(corpus.file(entry), entry.title)
        assert document.title == entry.title
        assert document.sections, entry.doc_id
        if entry.tier == "fixed":
            assert len(document.sections) >= 4, entry.doc_id
            assert len(document.render().split()) > 800, entry.doc_id


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
