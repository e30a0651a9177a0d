"""The dm-env partitioning environment (tasks, observations, action space, reward).

Not built yet: see the open issue on the environment and search agents.
"""
