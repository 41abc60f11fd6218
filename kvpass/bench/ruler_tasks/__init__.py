"""RULER's needle tasks over prose that ships with Python, as lm-evaluation-harness tasks.

The YAML configs in this folder are found by lm-eval's ``TaskManager(include_path=TASKS_DIR)`` (or
``--include_path``; ``python -m kvpass.bench.lm_eval`` adds it); their data comes from
:mod:`kvpass.bench.ruler_tasks.prose`. Importing this package imports nothing of lm-eval.
"""

from pathlib import Path

#: The folder of the task YAMLs, for ``TaskManager(include_path=...)`` and ``--include_path``.
TASKS_DIR = Path(__file__).resolve().parent

#: The tasks the folder defines (the tag ``ruler_prose`` selects them all).
PROSE_TASKS = ("niah_single_2_prose", "niah_single_3_prose", "niah_multikey_1_prose", "niah_multivalue_prose",
               "niah_multiquery_prose")
