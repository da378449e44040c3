"""``hyper_offload.estimate``: will a training step fit under a budget, before any memory is
spent? The model's graphs captured on fake tensors at the real shapes
(:mod:`..fake_capture`) and planned as the backend plans them: region by region
(:mod:`.fit`, which also holds the public function), or as the backend's step plan under
``budget_scope="step"`` (:mod:`.step_scope`, which also compiles a model of identical
blocks one block at a time); :mod:`.report` is what it returns
(:class:`~.report.EstimateReport`)."""
