"""``.ci/run``'s line per finished test file (tests/conftest.py's ``FileProgress``, issue 75
item 2): a real pytest with two xdist workers, each test file on one, as ``.ci/run`` runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_each_test_file_says_when_it_is_done(tmp_path: Path) -> None:
    (tmp_path / "test_one.py").write_text(
        "import pytest\n"
        "def test_a(): pass\n"
        "@pytest.mark.parametrize('x', [1, 2])\n"
        "def test_b(x): pass\n"
        "def test_c(): pytest.skip('not here')\n")
    (tmp_path / "test_two.py").write_text(
        "import pytest\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError('setup')\n"
        "def test_d(broken): pass\n"
        "def test_e(): assert False\n")
    done = subprocess.run(  # only the plugins it needs (schemathesis' take seconds to load)
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "-p", "xdist.plugin",
         "-p", "tests.conftest", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    lines = re.findall(r"^(test_\w+\.py) done \((.*), (\d+\.\d) s\)$", done.stdout, re.M)
    assert sorted((path, counts) for path, counts, _ in lines) == [
        ("test_one.py", "3 passed, 1 skipped"), ("test_two.py", "1 error, 1 failed")], \
        done.stdout
    assert "2 failed" not in done.stdout and done.returncode == 1
