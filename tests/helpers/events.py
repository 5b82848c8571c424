"""Event builders for tests: a group member's trajectory and a weight version of a run.

The builders are library code (schemas/synthetic.py), since `rollstream bench streams` feeds the
stream processor with the same events; tests take them from here.
"""

from __future__ import annotations

from schemas.synthetic import trajectory, weights

__all__ = ["trajectory", "weights"]
