"""claas_verl.utils.hf_quiet: progress bars off inside the block, the caller's setting restored after it."""

import pytest
from transformers.utils import logging as hf_logging

from claas_verl.utils.hf_quiet import hf_progress_bars_off


@pytest.mark.parametrize("initially_on", [True, False])
def test_bars_are_off_inside_and_restored_after_even_on_error(initially_on):
    (hf_logging.enable_progress_bar if initially_on else hf_logging.disable_progress_bar)()
    try:
        with pytest.raises(RuntimeError), hf_progress_bars_off():
            assert not hf_logging.is_progress_bar_enabled()
            raise RuntimeError
        assert hf_logging.is_progress_bar_enabled() == initially_on
    finally:
        hf_logging.enable_progress_bar()
