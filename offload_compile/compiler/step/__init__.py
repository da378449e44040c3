"""The compile door's step: its lifecycle (:mod:`.controller`), how a step is learnt
(:mod:`.recorder`: invocations from autograd; :mod:`.meter`: the eager code between
regions) and the lowerings its plans want (:mod:`.lowerings`)."""
