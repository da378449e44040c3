"""The records every pass reads and writes: the activation trace, the residency schedule,
and (in :mod:`.ops`, which imports torch) the ``hyper_offload::`` ops lowered graphs hold.

Torch-free except :mod:`.ops` and :mod:`.properties` (what a tensor's consumer can
observe); of the library, imports only :mod:`hyper_offload.errors`.
"""
