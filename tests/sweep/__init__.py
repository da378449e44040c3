"""Exactness over torch's own op database (issue 41, item 3).

Library-independent harness: :mod:`.opdb` turns every autograd OpInfo sample of
``torch.testing._internal.common_methods_invocations.op_db`` into a tiny module whose
inputs are activations, :mod:`.exact` captures and compares steps bit for bit,
:mod:`.doors` runs one case through a door (compile or eager) with and without
hyper_offload, :mod:`.summary` counts the results. ``scripts/opdb_sweep.py`` (``make
sweep``) runs all of it; ``test_opdb_subset.py`` runs a fixed subset in ``make test``.
"""
