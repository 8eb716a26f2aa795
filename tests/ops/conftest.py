"""The test modules here import their harnesses by name (``_lowering_harness``, ``opinfo_harness``): put
this directory on sys.path. Last, not first: tests/ is a package root before it, so tests/test_random.py
still imports as ``test_random`` and not as this directory's test_random.py (see __init__.py)."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.append(_HERE)
