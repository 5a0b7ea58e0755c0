"""README.md, docs/*.md and the notes of the benchmark records speak about the library, the machine, its load
and the command: never about how the work on the project was organised (who ran what, lock files, tickets,
work rounds, sessions). A user reading a page or a record's note has no use for those words."""
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RECORDS = sorted((ROOT / "docs" / "bench").glob("*.json"))

WORDS = re.compile("|".join((
    r"\bhelpers?\b", r"\bcoordinators?\b", r"\bsessions?\b",
    r"heavy\.lock", r"/tmp/[\w.-]*\.lock\b", r"\block (file|hold)\b",
    r"\bissues? #?\d+",  # a tracker's number (upstream bugs are cited as owner/repo#N)
    # "round" as a unit of work; rounding and benchmark --rounds are fine
    r"\b(this|that|last|next|previous|earlier|later|second|third|fourth|fifth|final) round\b", r"\bround['’]s\b",
    r"\bround[- ]by[- ]round\b", r"\bthe round (cut|added|made|changed)\b", r"\bheavy lock\b",
)), re.I)


def hits(text: str) -> list:
    return [m.group(0) for m in WORDS.finditer(text)]


def notes(value, path=""):
    """(field path, text) of every string in a record: notes, sources, commands."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from notes(v, f"{path}.{k}")
    elif isinstance(value, list):
        for v in value:
            yield from notes(v, f"{path}[]")
    elif isinstance(value, str):
        yield path, value


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_has_no_words_about_the_work(page):
    bad = [f"{page.name}:{n}: {h}" for n, line in enumerate(page.read_text().splitlines(), 1) for h in hits(line)]
    assert not bad, bad


def test_record_notes_have_no_words_about_the_work():
    bad = [f"{r.name}{field}: {h}" for r in RECORDS for field, text in notes(json.loads(r.read_text()))
           for h in hits(text)]
    assert not bad, bad


@pytest.mark.parametrize("text", ["taken under /tmp/heavy.lock", "no helper running", "the coordinator's run",
                                  "after this round of cuts", "see issue 29", "about 6 sessions",
                                  "what the round cut", "round by round", "under the heavy lock"])
def test_words_are_caught(text):
    assert hits(text), text


@pytest.mark.parametrize("text", ["ropepool rounds once at the end", "ties round away from zero",
                                  "--rounds 3", "vllm-project/vllm#56081", "rounding mode", "a round trip"])
def test_ordinary_words_pass(text):
    assert not hits(text), text


def test_index_links_every_page():
    """docs/README.md, the index, links every page of docs/ (a page nobody links is a page nobody reads)."""
    index = (ROOT / "docs" / "README.md").read_text()
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md" and f"]({p.name})" not in index]
    assert not unlinked, unlinked
