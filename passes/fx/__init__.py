"""The compile path's graph passes: traces from AOTAutograd's forward and backward graphs,
which saved tensors may move, the lowering onto ``hyper_offload::`` ops, and its check.

Imports torch (FX, fake tensors), :mod:`..ir` and :mod:`..analysis`.
"""
