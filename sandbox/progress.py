"""``Progress``: how long work (a runtime's steps, an image build) reports what it is
doing, one line at a time. Standard library only."""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str], None]
