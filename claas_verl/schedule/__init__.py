"""Stage schedules of continual MOPD (docs/math.md §B.8): pure python/numpy, no ray, verl or torch.

``build_plan(ScheduleConfig.from_dict(...))`` gives every step's stage, kind, domain, block and
teacher, and the models each stage must keep; ``python -m claas_verl.plan`` prints it for a recipe (read by
``claas_verl/mopd/recipe_schedule.py``, which also counts prompt files).
"""

from claas_verl.schedule.build import allowed_models, build_plan, check_plan_setting
from claas_verl.schedule.config import ScheduleConfig
from claas_verl.schedule.plan import Plan, Step, compute_held, expert, student
from claas_verl.schedule.spread import spread

__all__ = [
    "Plan", "Step", "ScheduleConfig", "build_plan", "check_plan_setting", "allowed_models", "compute_held",
    "expert", "student", "spread",
]
