"""course_grader: the course's grader, apart from the library it grades (course_lib never imports it).

Importing the package, or any module but ``grade``, ``child``, ``audit``, ``grading`` and ``checks``, loads the
standard library only (and nbgrader, for ``nbgrader_plugins``): every nbgrader command reads the course's
configuration, and torch stays out of it (``tests/test_architecture.py`` holds both rules).

- ``checks/``: the graded tests, one probe and one judge per test cell (``nbNN.py`` visible, ``nbNN_hidden.py``
  the instructor's only), and ``grading`` (``forbid`` and the comparisons the probes use).
- ``grade`` (the grading server: runs a submission in a fenced fork, judges its data here), ``child`` (the fork),
  ``audit`` (the PEP 578 hook that refuses or flags what a submission may not do while it is graded).
- ``sandbox`` (the Landlock fence of a grading process), ``nbgrader_plugins`` (the sandboxed kernel, the scores
  from the checks, the quiet restore of a released test cell: what ``nbgrader_config.py`` selects).
- ``edition`` (the student edition: graded references stubbed, hidden checks left out), ``release`` (notebooks/ from
  solutions/), ``student_path`` (the student edition validated as a student's Validate button does).
"""
