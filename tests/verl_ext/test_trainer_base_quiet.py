"""Quiet long runs: verl's progress bar hidden where its step count is a placeholder, and TransferQueue's
thread-count warning avoided by giving it the thread count it would clamp to (real verl and TransferQueue code)."""

from __future__ import annotations

import io
import logging
import os

from claas_verl.verl_ext.trainer_base import hidden_verl_progress_bar
from claas_verl.verl_ext.transfer_queue_env import ENV, cap_transfer_queue_threads


def test_verl_trainer_bar_is_disabled_inside_the_block_and_restored_after():
    from verl.trainer.ppo.v1 import trainer_base

    original = trainer_base.tqdm
    out = io.StringIO()
    with hidden_verl_progress_bar():
        bar = trainer_base.tqdm(total=10**9, initial=0, desc="Training Progress", file=out)  # as verl's fit builds it
        bar.update(1)
        bar.close()
    assert out.getvalue() == ""
    assert trainer_base.tqdm is original
    shown = trainer_base.tqdm(total=3, desc="Training Progress", file=out)
    shown.update(1)
    shown.close()
    assert "Training Progress" in out.getvalue()


def test_transfer_queue_threads_capped_to_the_cores_without_a_warning(monkeypatch, caplog):
    import psutil
    from transfer_queue.utils.common import limit_pytorch_auto_parallel_threads

    monkeypatch.delenv(ENV, raising=False)
    value = cap_transfer_queue_threads()
    assert value == os.environ[ENV] == str(min(8, psutil.cpu_count(logical=False)))
    with caplog.at_level(logging.WARNING, logger="transfer_queue.utils.common"):
        with limit_pytorch_auto_parallel_threads(target_num_threads=int(value)):
            pass
    assert not [r for r in caplog.records if "physical CPU cores" in r.getMessage()]
    monkeypatch.setenv(ENV, "3")
    assert cap_transfer_queue_threads() == "3"  # the user's own value is kept
