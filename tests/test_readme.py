"""The README is a front page (issue 62 item 13): at most 300 lines, a Quickstart of exactly two
command lines, a chip section that says where its figures were measured; the rest lives under
docs/, and every relative link of these pages leads to a file (and heading) that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _section(text: str, heading: str) -> str:
    """The text under ``## heading``, up to the next heading of level 2."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README.md has no '## {heading}' section"
    return match.group(1)


def _prose(text: str) -> str:
    """The page without its code: links inside code blocks or spans are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6} (.+)$", FENCE.sub("", page.read_text()), re.M)
    return {_slug(heading) for heading in headings}


def _relative_links() -> list[tuple[Path, str]]:
    links = []
    for page in PAGES:
        for target in LINK.findall(_prose(page.read_text())):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                links.append((page, target))
    return links


def test_the_readme_is_a_front_page_of_at_most_300_lines() -> None:
    lines = README.read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines; move detail under docs/"


def test_the_quickstart_is_two_command_lines() -> None:
    [block] = re.findall(r"^```bash\n(.*?)^```", _section(README.read_text(), "Quickstart"),
                         re.S | re.M)
    commands = [line for line in block.splitlines() if line.strip() and
                not line.lstrip().startswith("#")]
    assert commands == [
        "python3 -m venv .venv && .venv/bin/pip install -e '.[tune,serve]' && "
        ".venv/bin/autotune demo",
        "bash .ci/run"]


def _requirement(item: str) -> str:
    """A package's normalized name (``jax[tpu] (libtpu)`` reads ``jax``), or an extra of this
    project as ``[extra]`` (``flash-autotune[all]`` in pyproject.toml, `` `all` `` in the
    README)."""
    extra = re.fullmatch(r"`([a-z]+)`", item.strip())
    if extra:
        return f"[{extra.group(1)}]"
    name = re.match(r"[A-Za-z0-9._-]+", item.strip()).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


def _extras_table() -> dict[str, tuple[set[str], set[str]]]:
    """The README's extras table: per extra, the commands it enables and what it brings."""
    rows = re.findall(r"^\| `([a-z]+)` \| (.*) \| (.*) \|$",
                      _section(README.read_text(), "Install"), re.M)
    return {extra: ({c.removeprefix("autotune ") for c in re.findall(r"`([^`]+)`", enables)},
                    {_requirement(item) for item in re.split(r", | and ", brings)})
            for extra, enables, brings in rows}


def test_the_extras_table_matches_pyproject_and_the_commands() -> None:
    """Issue 75 item 6: the table left out pydantic, pydantic-settings and xprof of ``tune``,
    pytest-timeout and flatbuffers of ``test``, and commands its extras enable."""
    import tomllib

    from autotune.extras import COMMAND_EXTRAS

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    table = _extras_table()
    assert table.keys() == extras.keys()
    for extra, requirements in extras.items():
        brought = set()
        for requirement in requirements:
            inner = re.fullmatch(r"flash-autotune\[([a-z,]+)\]", requirement)
            brought |= ({f"[{e}]" for e in inner.group(1).split(",")} if inner
                        else {_requirement(requirement)})
        assert table[extra][1] == brought, extra
        if extra in ("tune", "serve", "tpu"):
            assert table[extra][0] == {command for command, choices in COMMAND_EXTRAS.items()
                                       if any(extra in c.split(",") for c in choices)}, extra


def test_the_chip_results_say_where_they_were_measured() -> None:
    section = _section(README.read_text(), "Results on a TPU v5e")
    for label in ("TPU v5e", "2026-12-0", "jax and jaxlib 0.10.2", "libtpu 0.0.42.1",
                  "whole step", "docs/measurements.md"):
        assert label in section, f"the chip section does not say {label!r}"


def test_the_link_checker_sees_links_and_anchors() -> None:
    """The checks below would pass vacuously if no link were found."""
    targets = [target for _, target in _relative_links()]
    assert "docs/chip-results.md" in targets
    assert any("#" in target for target in targets)
    assert _slug("Tune on every chip of a TPU VM (or every GPU of a server)") == \
        "tune-on-every-chip-of-a-tpu-vm-or-every-gpu-of-a-server"


@pytest.mark.parametrize(("page", "target"), _relative_links(),
                         ids=lambda value: value.name if isinstance(value, Path) else value)
def test_every_relative_link_resolves(page: Path, target: str) -> None:
    path, _, anchor = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    assert linked.is_file(), f"{page.relative_to(ROOT)} links to {target}: no such file"
    if anchor and linked.suffix == ".md":
        assert anchor in _anchors(linked), \
            f"{page.relative_to(ROOT)} links to {target}: no such heading in {linked.name}"


def test_every_docs_page_is_linked_from_another_page() -> None:
    """A page under docs/ that no other page links to is one a reader never finds."""
    linked = {(page.parent / path).resolve() for page, target in _relative_links()
              if (path := target.partition("#")[0]) and (page.parent / path).resolve() != page}
    orphans = [page.name for page in PAGES[1:] if page not in linked]
    assert not orphans, f"no page links to docs/{', docs/'.join(orphans)}: add it to README.md's " \
                        "'Where to read on' or to a page on its topic"
