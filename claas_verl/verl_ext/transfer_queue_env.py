"""TransferQueue's thread count for hosts with fewer physical cores than its default.

TransferQueue (verl's data plane) runs every put and get under ``torch.set_num_threads($TQ_NUM_THREADS)``, default 8,
and on a host with fewer physical cores it clamps the count to the cores and logs a warning, on every call, in every
process (driver, storage units): dozens of identical lines in a short CPU run. The clamp is the right behaviour, so
the warning carries nothing to act on; setting ``TQ_NUM_THREADS`` to the value it clamps to gives the same threads
without the noise. It must be in the environment before Ray starts (the Ray processes inherit it, and TransferQueue
reads it at import); a value the user set is kept.
"""

from __future__ import annotations

import os

ENV = "TQ_NUM_THREADS"
TQ_DEFAULT_THREADS = 8  # transfer_queue.client's default for $TQ_NUM_THREADS


def cap_transfer_queue_threads() -> str:
    """Set ``$TQ_NUM_THREADS`` to ``min(8, physical cores)`` unless set; returns the value it now has."""
    if ENV not in os.environ:
        import psutil

        cores = psutil.cpu_count(logical=False) or 1
        os.environ[ENV] = str(min(TQ_DEFAULT_THREADS, cores))
    return os.environ[ENV]
