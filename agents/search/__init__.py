"""Search agents, which plan with clones of the partitioning environment: `expert` (the best of
the corpus' expert strategies), `baselines` (random, greedy), `beam`, `mcts`, `ilp` (the
integer-programming baseline); `planning` is what they share, `auto` solves `Auto` tactics
with them."""
