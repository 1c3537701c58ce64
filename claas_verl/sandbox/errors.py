"""The sandbox's one exception, shared with every grader that is not sandboxed (standard library only)."""

from __future__ import annotations


class GraderError(RuntimeError):
    """A verifier could not produce a verdict (crash, timeout, non-bool): reward None."""
