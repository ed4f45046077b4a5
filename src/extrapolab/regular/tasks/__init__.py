"""Regular-language tasks of thesis Table 6.1, one file each, behind ``make_task(name)``."""
from .base import DFA, IGNORE, MembershipTask, Task, TransductionTask
from .registry import TASKS, make_task, register_task, task_names

from . import even_pairs  # noqa: F401
from . import modular_arithmetic  # noqa: F401
from . import parity  # noqa: F401
from . import cycle_navigation  # noqa: F401
from . import tomita  # noqa: F401
from . import dyck  # noqa: F401

DELETANG = ("even_pairs", "modular_arithmetic", "parity", "cycle_navigation")
BHATTACHARYA = ("d2", "d3", "d4", "d12", "tomita3", "tomita4", "tomita5", "tomita6")

__all__ = ["DFA", "MembershipTask", "Task", "TransductionTask", "TASKS", "make_task",
           "register_task", "task_names", "DELETANG", "BHATTACHARYA"]
