"""The examples of README.md and docs/ (docs/examples/*.sh, *.py), run against
deployments/local.yaml as the session deploys it, print what their .out files show.

In a .out file ``...`` stands for any text (doctest's ELLIPSIS): ids, timestamps, and
what the model says beyond the words the page promises.
"""

from __future__ import annotations

import doctest
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "docs" / "examples"
EXAMPLES = sorted(p for p in EXAMPLES_DIR.iterdir() if p.suffix in (".sh", ".py"))


def test_every_example_has_its_output():
    assert EXAMPLES
    for example in EXAMPLES:
        assert example.with_name(example.name + ".out").exists(), example.name


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_prints_what_the_docs_show(example, deployed):
    command = ["bash", str(example)] if example.suffix == ".sh" else [sys.executable, str(example)]
    # The session serves local.yaml's application under /local, beside the tiny models.
    env = {**os.environ, "SERVE_APP_URL": f"{deployed}/local"}
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    expected = example.with_name(example.name + ".out").read_text()
    checker = doctest.OutputChecker()
    assert checker.check_output(expected, run.stdout, doctest.ELLIPSIS), (
        f"{example.name} printed something else than its .out file shows:\n"
        + checker.output_difference(doctest.Example("", expected), run.stdout, doctest.ELLIPSIS)
    )
