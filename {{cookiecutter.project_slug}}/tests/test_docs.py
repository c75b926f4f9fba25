"""The docs stay true and short: every section a file cites exists, every module and test file is on a
map (README.md, tests/README.md), and each doc's prose averages at most 25 words a sentence, none over 40."""

import re
from pathlib import Path

import pytest

from conftest import ROOT, SLUG, report

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md"]
CITING = [*DOCS, ROOT / "Makefile", *sorted((ROOT / "scripts").rglob("*.sh")),
          *sorted(path for path in ROOT.glob("[sbt]*/**/*.py") if path.name != "test_docs.py")]
# `README, "Title"`, `docs/x.md, "Title"`, `README's "Title" section`: the title is a heading's start
CITATION = re.compile(r"\b(README|(?:docs/)?[a-z_]+\.md)(?:,|'s) \"([^\"]+)\"")
ANCHOR = re.compile(r"\]\(([\w./-]*\.md)#([\w-]+)\)")  # [text](docs/x.md#a-heading)
LINK = re.compile(r"\]\(([\w./-]+)(?:#[\w-]*)?\)")  # [text](a/relative/path): the file exists
MAX_WORDS_PER_SENTENCE = 25  # on average over a doc
LONGEST_SENTENCE = 40  # words: one fact per sentence


def headings(doc: Path) -> list[str]:
    fenced, found = False, []
    for line in doc.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and (match := re.match(r"#+ (.+)", line)):
            found.append(match[1].strip())
    return found


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def cited_doc(name: str, citing: Path) -> Path:
    if name == "README":
        return ROOT / "README.md"
    return ROOT / name if "/" in name else ROOT / "docs" / name


def missing_sections(text: str, citing: Path) -> list[str]:
    """Each citation in `text` whose file or section does not exist."""
    missing = []
    for name, title in CITATION.findall(text):
        doc = cited_doc(name, citing)
        if not doc.is_file() or not any(re.match(re.escape(title) + r"\b", h) for h in headings(doc)):
            missing.append(f'{name}, "{title}"')
    if citing.suffix == ".md":
        missing += [path for path in LINK.findall(text) if not (citing.parent / path).exists()]
    for path, anchor in ANCHOR.findall(text):
        doc = (citing.parent / path).resolve()
        if not doc.is_file() or anchor not in map(slug, headings(doc)):
            missing.append(f"{path}#{anchor}")
    return missing


def test_the_checker_finds_a_missing_section():
    readme = ROOT / "README.md"
    assert missing_sections('README, "' + 'No such section"', readme) == ['README, "No such section"']
    assert missing_sections("see [this](docs/guarantees.md#" + "no-such-heading)", readme)
    assert missing_sections("see [this](docs/" + "no_such_doc.md)", readme) == ["docs/no_such_doc.md"]
    assert not missing_sections('docs/guarantees.md, "Accumulation is exact"', readme)


@pytest.mark.parametrize("citing", CITING, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_cited_section_exists(citing):
    assert not missing_sections(citing.read_text(), citing)


def test_every_module_and_test_file_is_on_a_map():
    readme, tests_readme = (ROOT / "README.md").read_text(), (ROOT / "tests" / "README.md").read_text()
    modules = [path.name for path in (ROOT / "src" / SLUG).glob("*.py") if path.name != "__init__.py"]
    assert [name for name in modules if f"`{name}`" not in readme] == []
    test_files = [path.relative_to(ROOT / "tests").as_posix() for path in (ROOT / "tests").rglob("*.py")
                  if path.name != "__init__.py"]
    assert [name for name in test_files if f"`{name}`" not in tests_readme] == []


def prose(text: str) -> str:
    """The lines a reader reads as sentences: not code blocks, tables, headings or HTML."""
    lines, fenced = [], False
    for line in text.splitlines():
        stripped = line.strip()
        fenced ^= stripped.startswith("```")
        code = fenced or stripped.startswith("```")
        lines.append("" if code or stripped.startswith(("#", "|", "<", "![")) else stripped)
    return "\n".join(lines)


def sentence_lengths(text: str) -> list[int]:
    """Words per sentence, split at `.`, `;`, `?` and `!` that end a clause (not inside `code` or a
    file name such as config.py)."""
    lengths = []
    for paragraph in prose(text).split("\n\n"):
        paragraph = re.sub(r"`[^`]*`", lambda code: re.sub(r"[.;?!]", "", code[0]), " ".join(paragraph.split()))
        paragraph = re.sub(r"\]\([^)]*\)", "]", paragraph)  # a link's target is not words
        for sentence in re.split(r"[.;?!](?=\s|$)", paragraph):
            words = [word for word in sentence.split() if re.search(r"\w", word)]
            if words:
                lengths.append(len(words))
    return lengths


def test_sentence_lengths_split_where_sentences_end():
    assert sentence_lengths("One two three. Four five; six `a.b; c` config.py\n\n| a | table |\n```\nx. y.\n```") \
        == [3, 2, 4]


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_sentences_are_short(doc):
    lengths = sentence_lengths(doc.read_text())
    mean = sum(lengths) / len(lengths)
    report(f"{doc.relative_to(ROOT)}: {mean:.1f} words a sentence on average ({len(lengths)} sentences, "
           f"longest {max(lengths)})")
    assert mean <= MAX_WORDS_PER_SENTENCE and max(lengths) <= LONGEST_SENTENCE, sorted(lengths)[-5:]
