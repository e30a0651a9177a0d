"""Agents, Acme's way.

At the bottom, importing nothing above them: Acme's interfaces (`core`, `adders`, `specs`,
`counting`, `loggers`, `environment_loop`). Then what learned agents share: the graph network
(`networks`), the Reverb data plane (`variable_client`, `reverb_adders`), actors that feed an
adder (`actors`) and playing a trained policy (`decoding`). One package per algorithm's acting
side (`ppo`, `alphazero`: config, networks, acting) and one for the search agents (`search`).
Their learning side is in `learners`.
"""
