"""The applications: what a user runs, on top of the library in ``course_lib/``.

``run_all`` (the course's main job: every notebook on this machine's tier), ``preflight`` (a workshop host's check
of the GPU paths), ``finetune``, ``benchmark``, ``size_sweep`` (the largest model per offload strategy),
``accelerate_configs`` and ``cluster`` (launch files for a node and a Slurm cluster). Nothing in the library imports
them (``tests/test_architecture.py``). The grader's applications (the student edition, the release, the sandbox) are
in ``course_grader``.
"""
