"""Learners (JAX + Optax + rlax) and what wires them to actors.

`sgd` (the learner that holds a `TrainingState` and its config base), one package per
algorithm's learning side (`ppo`, `alphazero`: config, pure losses, builder), `builders` (what
the builders share), `algorithms` (a builder by name from a run's settings), `run_config` (a
run's `config.json`), `checkpointing` and `policies` (a trained policy from a run)."""
