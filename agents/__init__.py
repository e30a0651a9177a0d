"""Acme-style interfaces and agents (expert, random, greedy, MCTS, learned policy).

Not built yet: see the open issues on search agents and learned policies.
"""
