"""Acme-style interfaces (`core`, `adders`, `specs`, `counting`, `loggers`,
`environment_loop`) and, to come, the agents: expert, random, greedy, MCTS, learned policy."""
