"""pytest imports test modules by basename (rootdir-relative, no packages), so two test files with the same
name in different folders stop the whole collection with "import file mismatch". Running one folder at a time
hides it; this catches it before the full suite does."""
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_files_share_a_basename():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    shared = sorted(name for name, count in names.items() if count > 1)
    assert not shared, f"test files share a basename (rename one): {shared}"
