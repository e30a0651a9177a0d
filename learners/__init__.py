"""Learners (JAX + Optax + rlax): pure losses and update steps over a `TrainingState`, and the
`SGDLearner` that holds it. `ppo` (clipped surrogate, GAE) and `alphazero` (fit the search's
visit distributions and the returns); `checkpointing` saves and restores runs."""
