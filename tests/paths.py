"""Where tests find the project's shared data: `../shared` beside the checkout
(as on developers' machines and in CI). Tests that need it skip without it."""

from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"
SYNTHETIC_TRACE = SHARED / "traces" / "synthetic_trace.jsonl"
