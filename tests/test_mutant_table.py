"""The mutant table (tests/mutants/run_mutants.py) stays true to the tree: every mutant's `old` text occurs exactly
once in its file, and every test pattern it selects matches a collected test.

What this is: the table's staleness check, run in CI (seconds: a copy of the tree and one `pytest --collect-only`).
What it is not: the mutation run itself, which runs each mutant's tests (about 75 minutes; docs/testing.md).
A test renamed or re-parametrized (`[Q2_K]` becoming `[Q2_K-8]`) fails here, not in the next mutation run.
"""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_mutant_table_matches_the_tree():
    r = subprocess.run([sys.executable, str(REPO / "tests/mutants/run_mutants.py"), "--check"],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "the mutant table is current" in r.stdout
