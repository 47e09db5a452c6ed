"""The docs: the pages under docs/ build with `mkdocs build --strict` (a link to a missing page or anchor fails it),
and every link of the README, the newcomer's path into them, reaches a page and a heading that exist."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]+\]\(([^)\s]+)\)")


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"),
                           "-d", str(site)], capture_output=True, text=True, timeout=120)


def slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    body = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a "# comment" in a code block is no heading
    return {slug(line.lstrip("#")) for line in body.splitlines() if re.match(r"#{1,6} ", line)}


def test_the_docs_build_strictly_and_a_broken_link_fails_the_build(tmp_path):
    result = build(REPO_ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "site" / "model_families" / "index.html").is_file()
    # The same pages with one link to a heading that is not there: the check is real.
    copy = tmp_path / "copy"
    shutil.copytree(REPO_ROOT / "docs", copy / "docs")
    shutil.copy(REPO_ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    page = copy / "docs" / "index.md"
    page.write_text(page.read_text() + "\nSee [nothing](tracking.md#no-such-heading).\n")
    broken = build(copy, tmp_path / "site2")
    assert broken.returncode != 0 and "no-such-heading" in broken.stderr


def test_every_readme_link_reaches_a_page_and_heading_that_exist():
    links = LINK.findall((REPO_ROOT / "README.md").read_text())
    assert len(links) >= 10
    for target in links:
        path, _, anchor = target.partition("#")
        page = REPO_ROOT / path
        assert page.is_file(), target
        assert not anchor or anchor in anchors(page), target


def test_the_anchor_rule_is_mkdocs_own():
    assert slug("Checkpoints and resume") == "checkpoints-and-resume"
    assert slug("Planning a job: `rlm plan`") == "planning-a-job-rlm-plan"
