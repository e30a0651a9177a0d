"""Eight CPU devices for every test; set before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "").replace(
    "--xla_force_host_platform_device_count=8", "") + " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

assert len(jax.devices()) >= 8, "tests need 8 host devices"

from launch.runtime import relax_gc  # noqa: E402

relax_gc()   # as the shardzero command does
