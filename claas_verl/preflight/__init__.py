"""Checks a run passes before Ray starts or before verl places its workers: each failure names the key, the numbers
and the fix, instead of a crash hours into the run or a job Ray waits on forever.

* :mod:`.models`: every model a MOPD plan loads is a local Hugging Face directory (not ``???``, not a hub id);
* :mod:`.extras`: the optional packages (``eval`` extra) the reward imports for the prompt files' data sources;
* :mod:`.disk`: the checkpoint disk a MOPD run needs (printed by ``python -m claas_verl.plan`` and at start-up);
* :mod:`.placement`: verl's worker placement fits the Ray cluster (CPUs and GPUs per node);
* :mod:`.runtime`: the verl runtime group (``cpu`` / ``gpu``) from the cluster's GPUs, not the driver's.
"""
