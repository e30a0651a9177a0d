"""Acme-style interfaces (`core`, `adders`, `specs`, `counting`, `loggers`,
`environment_loop`) and the search agents (`expert`, `baselines`, `beam`, `mcts`), which plan
with clones of the partitioning environment."""
