"""The documentation: README.md short and in step with the example files, and the MkDocs
site (mkdocs.yml, docs/) building with --strict, so a broken link or include fails."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# "<!-- example: docs/examples/chat.sh -->" (or example-output:) and the fenced block after it.
EXAMPLE_BLOCK = re.compile(r"<!-- example(?:-output)?: (\S+) -->\n```[a-z]*\n(.*?)```\n", re.S)


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; the rest belongs in docs/"


def test_readme_examples_are_the_example_files():
    blocks = EXAMPLE_BLOCK.findall(README.read_text())
    assert {path for path, _ in blocks} >= {"docs/examples/chat.sh", "docs/examples/openai_client.py"}
    for path, shown in blocks:
        assert shown == (ROOT / path).read_text(), f"README's copy of {path} differs from the file"


def test_user_facing_text_names_no_issues():
    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    for page in pages:
        found = re.findall(r"\b[Ii]ssues? #?\d+|\(#\d+\)", page.read_text())
        assert not found, f"{page.relative_to(ROOT)} names {found}"


def test_docs_site_builds_strict(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists() and shutil.which("mkdocs") is None:
        pytest.fail("mkdocs is not installed: `make install` installs the docs extra")
    run = subprocess.run([str(mkdocs) if mkdocs.exists() else "mkdocs", "build", "--strict",
                          "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # mkdocs-material's banner
    assert run.returncode == 0, run.stdout + run.stderr
