"""tests/ops is a package so that its test modules may share basenames with tests/ (test_random.py and
test_resize.py live in both): pytest's default import mode allows that only across packages."""
