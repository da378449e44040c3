"""Choosing what moves and when: the planner protocol, the greedy and ILP planners, their
refinement, the release and prefetch placement passes, and the one pipeline every door runs.

Imports :mod:`..ir` and :mod:`..analysis`; :func:`.planning.plan_residency` is the entry.
"""
