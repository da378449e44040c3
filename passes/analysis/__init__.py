"""What a trace and a schedule imply, choosing nothing: liveness and offload gaps, the one
validator, the one timeline model, the stall lower bound and the Chrome-trace export.

Imports :mod:`..ir` only; every planner and lowering is judged by what lives here.
"""
