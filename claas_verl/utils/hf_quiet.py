"""Hugging Face's per-model progress bars ("Loading weights", "Writing model shards") off for a block.

A benchmark loads and saves dozens of tiny models: one bar each buries the lines that matter in its console
and test logs. The previous setting is restored afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def hf_progress_bars_off() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
