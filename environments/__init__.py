"""The dm-env partitioning environment: tasks, observations, action space, reward."""

from environments.actions import Action, DecisionPoint, decision_points
from environments.observations import Sizes
from environments.partitioning_env import (EnvConfig, InvalidActionError, PartitioningEnv,
                                           TaskContext, task_context)
from environments.tasks import Task, TaskDistribution, parse_bytes

__all__ = ["Action", "DecisionPoint", "EnvConfig", "InvalidActionError", "PartitioningEnv",
           "Sizes", "Task", "TaskContext", "TaskDistribution", "decision_points", "parse_bytes",
           "task_context"]
