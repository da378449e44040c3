"""Keep, move or recompute each saved activation: the search (:mod:`.search`), the
partitions it prices (:mod:`.candidates`), what may be recomputed exactly (:mod:`.rules`)
and the spliced backward that recomputes op by op, bit for bit, under Inductor in low
precision (:mod:`.splice`)."""
