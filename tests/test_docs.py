"""The docs hold together: every reference to a doc names a file that exists and, where it names a section,
a section that exists; the docs are reference, not a journal. Pure file reads, no cluster."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SOURCE_DIRS = ("operator", "engine-image", "tests", "bench", "charts", "crds")
SOURCE_SUFFIXES = {".py", ".c", ".sh", ".md", ".yaml", ".tpl", ".toml"}

#: A doc named in text, optionally followed by the section it points at: `docs/x.md`, "Section",
#: (docs/x.md, *Section*), docs/x.md "Section", and markdown links [..](docs/x.md#anchor).
DOC_REF = re.compile(r"docs/([a-z0-9-]+)\.md(?:#([a-z0-9-]+))?`?(?:,? *(?:\"([^\"\n]+)\"|\*([^*\n]+)\*))?")
#: What the project's stop hook counts as a journal line in docs/*.md.
JOURNAL = re.compile(
    r"(20[0-9]{2}-[0-9]{2}-[0-9]{2}[ T][0-9]{2}:[0-9]{2})"
    r"|\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth) pass\b"
)
REFERENCE_DOCS = ("engine.md", "operator.md", "router.md")
TEST_DIRS = ("tests", "e2e")
MAX_LINES = 450


def _sections(text: str) -> list[str]:
    """Headings and bold lead-ins (``**A new class, in order.**``), without markup."""
    heads = [m.group(1) for m in re.finditer(r"^#+ +(.+?) *$", text, re.M)]
    leads = [m.group(1) for m in re.finditer(r"^(?:[-*] +)?\*\*([^*]+?)\.?\*\*", text, re.M)]
    return [h.replace("`", "").strip() for h in heads + leads]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _texts() -> list[Path]:
    files = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    for d in SOURCE_DIRS:
        files += [p for p in sorted((ROOT / d).rglob("*")) if p.suffix in SOURCE_SUFFIXES and p.is_file()]
    return [p for p in files if p != Path(__file__).resolve()]


def _references() -> list[tuple[str, str, str | None, str | None]]:
    refs = []
    for path in _texts():
        for m in DOC_REF.finditer(path.read_text(errors="replace")):
            section = m.group(3) or m.group(4)
            refs.append((str(path.relative_to(ROOT)), m.group(1), m.group(2), section))
    return refs


def test_every_doc_named_exists_and_every_section_named_is_one_of_its_sections() -> None:
    sections = {p.stem: _sections(p.read_text()) for p in DOCS.glob("*.md")}
    problems = []
    for where, doc, anchor, section in _references():
        if doc not in sections:
            problems.append(f"{where}: docs/{doc}.md does not exist")
            continue
        if anchor is not None and anchor not in {_slug(s) for s in sections[doc]}:
            problems.append(f"{where}: docs/{doc}.md#{anchor} is no heading's anchor")
        if section is not None and not any(s.startswith(section.strip()) for s in sections[doc]):
            problems.append(f"{where}: docs/{doc}.md has no section {section!r}")
    assert not problems, "\n".join(problems)


def test_the_checker_sees_the_references_it_checks() -> None:
    """The reference pattern finds quoted and emphasised section names, so the test above can fail."""
    found = {(doc, section) for _, doc, _, section in _references()}
    assert ("router", "Replica choice") in found
    assert ("operator", "A new class, in order") in found
    assert ("engine", "What the plugin costs inside vLLM") in found


def test_every_test_the_docs_cite_as_proof_exists() -> None:
    """The docs say which test proves each guarantee: each test function or file they name is there."""
    files: set[str] = set()
    functions: set[str] = set()
    for d in TEST_DIRS:
        for path in (ROOT / d).rglob("*.py"):
            files.add(path.stem)
            functions.update(re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), re.M))
    missing = [
        f"docs/{doc.name}: {name}"
        for doc in sorted(DOCS.glob("*.md"))
        for name in sorted(set(re.findall(r"\b(test_\w*[a-z0-9])\b", doc.read_text())))
        if name not in functions and name not in files
    ]
    assert not missing, "\n".join(missing)


def test_anchors_are_githubs() -> None:
    assert _slug("Several worker processes in one router (--workers N)") == (
        "several-worker-processes-in-one-router---workers-n"
    )


@pytest.mark.parametrize("doc", sorted(p.name for p in DOCS.glob("*.md")))
def test_docs_are_reference_not_a_journal(doc: str) -> None:
    lines = (DOCS / doc).read_text().splitlines()
    dated = [f"{i}: {ln}" for i, ln in enumerate(lines, 1) if JOURNAL.search(ln)]
    history = "measurement history goes to bench/results/"
    assert not dated, f"docs/{doc} has journal lines ({history}):\n" + "\n".join(dated)


@pytest.mark.parametrize("doc", REFERENCE_DOCS)
def test_component_docs_stay_short_enough_to_read(doc: str) -> None:
    n = len((DOCS / doc).read_text().splitlines())
    assert n < MAX_LINES, f"docs/{doc} has {n} lines; keep it under {MAX_LINES} (history: bench/results/)"
