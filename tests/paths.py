"""Where tests find the checkout and the project's shared data: `../shared`
beside the checkout (as on developers' machines and in CI). Tests that need
it skip without it (`needs_trace`)."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
SYNTHETIC_TRACE = SHARED / "traces" / "synthetic_trace.jsonl"

needs_trace = pytest.mark.skipif(not SYNTHETIC_TRACE.is_file(),
                                 reason=f"trace {SYNTHETIC_TRACE} not present")
