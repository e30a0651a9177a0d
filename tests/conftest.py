"""Eight CPU devices for every test; set before JAX is imported anywhere. Under
SHARDZERO_CORE_ONLY (`make test-current`: current JAX, where the `train` extra cannot be
installed) the modules that test training are not collected."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "").replace(
    "--xla_force_host_platform_device_count=8", "") + " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU's LLVM back end at -O0: compiling is most of what the tests wait for, and the
# programs they compile are small. The HLO passes (fusion, SPMD partitioning, buffer
# assignment) are those of an optimised build, so what the tests read of the compiled program
# (collectives, memory footprints, dots) is the same. Subprocesses the tests start inherit it.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# (`make test-current` adds XLA flags of its own for current JAX: the Makefile's
# CURRENT_XLA_FLAGS. The pinned stack's one alternative runtime,
# `--xla_cpu_use_thunk_runtime=false`, saves 8% but aborts on convolutions.)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Nothing kept in ~/.cache by the commands the tests run (`launch.runtime.compilation_cache`).
os.environ.setdefault("SHARDZERO_COMPILATION_CACHE", "off")

import jax  # noqa: E402

assert len(jax.devices()) >= 8, "tests need 8 host devices"

from launch.runtime import relax_gc  # noqa: E402

relax_gc()   # as the shardzero command does


# Modules that start Reverb, train, or compute training losses with rlax: the pinned stack only.
TRAINING_TESTS = ["agents/test_learned.py", "launch/test_data_plane.py", "launch/test_faults.py",
                  "launch/test_ray.py", "launch/test_train.py", "learners/test_losses.py"]
collect_ignore = TRAINING_TESTS if os.environ.get("SHARDZERO_CORE_ONLY") else []
