"""Learners (JAX + Optax + rlax). Not built yet: see the open issue on learned policies."""
