"""The JAX names that moved between the pinned stack (JAX 0.4.34) and current JAX (0.10).

Everything else imports these from here, so no other module asks which JAX it runs on. Each
name is found by what the running JAX has, not by its version number:
- `Primitive`, `Jaxpr`, `ClosedJaxpr`, `Literal`, `Var` live in `jax.extend.core` on both;
  `ShapedArray`, `Tracer` and `eval_jaxpr` stay in `jax.core`; `DropVar` moved to the former.
- `get_aval` left `jax.core`; `jax.typeof` replaced it.
- `Primitive.get_bind_params` returned (subfuns, params); it now returns the params alone.
- Literals in a jaxpr were numpy arrays; they are now `TypedNdArray`/`TypedFloat` wrappers.
- `shard_map` moved from `jax.experimental.shard_map` to `jax.shard_map`, and its
  `check_rep` became `check_vma`.
- `enable_x64` moved from `jax.experimental` to a `jax.enable_x64(True)` context.
- The threefry PRNG's functions on raw key data live in `jax.extend.random` on both
  (`threefry`: what the tracer writes typed keys' random primitives as).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import numpy as np
import jax.extend.core as _core
from jax.core import ShapedArray, Tracer, eval_jaxpr  # noqa: F401 (re-exported)
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Primitive, Var  # noqa: F401
from jax.extend.random import threefry_prng_impl as threefry  # noqa: F401

DropVar = getattr(_core, "DropVar", None) or jax.core.DropVar

get_aval = getattr(jax, "typeof", None) or jax.core.get_aval


@functools.cache
def optimization_barrier_p() -> Primitive:
  """The primitive `lax.optimization_barrier` binds (JAX keeps it private), read off a trace.
  JAX 0.4.34 cannot vmap it, as pipelines and held partial sums run ops; its results are its
  operands, so a batched barrier is the barrier of the batched operands."""
  primitive = jax.make_jaxpr(jax.lax.optimization_barrier)(np.float32(0)).eqns[0].primitive
  try:   # traced, not run: importing the partitioner must not start a backend
    jax.make_jaxpr(jax.vmap(jax.lax.optimization_barrier))(np.zeros(1, np.float32))
  except NotImplementedError:
    from jax.interpreters import batching
    batching.primitive_batchers[primitive] = lambda args, dims: (primitive.bind(*args), dims)
  return primitive


optimization_barrier_p()   # before any program holding one is run


def bind(primitive, args, params):
  """Binds a primitive to arguments with the parameters a jaxpr equation holds."""
  got = primitive.get_bind_params(params)
  subfuns, bound = got if isinstance(got, tuple) else ((), got)
  return primitive.bind(*subfuns, *args, **bound)


def literal(value):
  """A jaxpr literal's value as a numpy array (of its own dtype), as JAX 0.4 held it."""
  dtype = getattr(value, "dtype", None)
  if dtype is None or type(value) is np.ndarray:
    return value
  return np.array(value, dtype=dtype)


def shard_map(f, *, mesh, in_specs, out_specs):
  """`shard_map` with replication checks off: the partitioner states where each value is
  replicated, and the plan's collectives are what make it so."""
  if hasattr(jax, "shard_map"):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  from jax.experimental.shard_map import shard_map as legacy
  return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


@contextlib.contextmanager
def enable_x64():
  """64-bit types inside the block (float64 references in `verify`)."""
  if callable(getattr(jax, "enable_x64", None)):
    with jax.enable_x64(True):
      yield
  else:
    from jax.experimental import enable_x64 as legacy
    with legacy():
      yield
