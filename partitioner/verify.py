"""Numerical verification: both lowerings against the unpartitioned program on local devices.

Where a lowering misses the float32 reference, the reference's own rounding is the suspect
first: an optimizer can amplify it (Adam's first step divides each gradient by its own size,
so a gradient that is zero but for rounding becomes a step of +-lr whose sign is noise). So the
unpartitioned program also runs in float64 (`exact_outputs`), and the lowering passes if, per
output, its distance from that exact answer beyond the tolerance is at most `NOISE` times the
float32 reference's own: amplified rounding passes, a wrong collective does not. Where the
reference happens to round closer than that (HF LongT5's XLA-partitioned jit lowering under
dp+Megatron+ZeRO-3: 600 elements of a key kernel 5e-4 from the exact answer, the reference
1e-4), the lowerings themselves run in float64 (`widened_lowerings`) and pass if they match the
float64 program: a partitioning exact in arithmetic does, to float64's rounding, which Adam's
epsilon swallows; a wrong collective is as wrong in float64.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import NamedTuple

import jax
import numpy as np


NOISE = 4.0   # how far past the tolerance a lowering may be, in units of the reference's error


class Verification(NamedTuple):
  ok: bool
  max_abs_err: float
  errors: dict            # lowering name -> max abs error over all outputs
  worst: str              # output with the largest error
  rtol: float
  atol: float
  exact: bool = False     # whether the float64 reference judged (the float32 one was missed
                          # and the program ran in float64)
  widened: bool = False   # whether the lowerings ran in float64 too (`widened_lowerings`)


def example_inputs(args, seed: int = 0) -> list:
  """Concrete flat leaves: given arrays and constants (Python numbers) as they are, abstract
  arrays filled at random (floats in [0, 0.1), integers in {0, 1}, booleans at random)."""
  rng = np.random.default_rng(seed)
  out = []
  for x in jax.tree_util.tree_leaves(tuple(args)):
    if not isinstance(x, jax.ShapeDtypeStruct):
      out.append(x)
      continue
    dtype = np.dtype(x.dtype)
    if np.issubdtype(dtype, np.floating):
      out.append(jax.numpy.asarray(rng.uniform(0, 0.1, x.shape), dtype))
    elif dtype == np.bool_:
      out.append(jax.numpy.asarray(rng.integers(0, 2, x.shape).astype(bool)))
    else:
      out.append(jax.numpy.asarray(rng.integers(0, 2, x.shape), dtype))
  return out


def max_error(expected, actual) -> tuple[float, int]:
  worst, where = 0.0, -1
  for i, (a, b) in enumerate(zip(expected, actual)):
    a, b = np.asarray(a), np.asarray(b)
    if a.size == 0:
      continue
    if a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer):
      err = float(np.sum(a != b))
    else:
      err = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
    if not err <= worst:  # also catches NaN
      worst, where = err, i
  return worst, where


def tolerance(dtype, rtol: float, atol: float) -> tuple[float, float]:
  """The tolerance for floats computed in `dtype`: as given for float32 and wider, scaled by
  the machine epsilon for narrower floats (bf16's is 2**-7, float32's 2**-23)."""
  dtype = np.dtype(dtype)
  if dtype.itemsize >= 4 or not jax.numpy.issubdtype(dtype, jax.numpy.floating):
    return rtol, atol
  scale = float(jax.numpy.finfo(dtype).eps) / float(np.finfo(np.float32).eps)
  return rtol * scale, atol * scale


def compute_dtype(program):
  """The narrowest float dtype the program computes in: an f32 output of a bf16 computation
  (mixed precision with f32 master weights) carries bf16's rounding."""
  floats = [v.dtype for v in program.values
            if jax.numpy.issubdtype(v.dtype, jax.numpy.floating)]
  return min(floats, key=lambda d: d.itemsize, default=np.dtype(np.float32))


def _judge(expected, actual, rtol, atol, floor, floats_ok) -> bool:
  """Integers and booleans equal; each float output `floats_ok(i, a, b, rtol, atol)` with the
  tolerance of the narrower of its dtype and `floor`."""
  for i, (a, b) in enumerate(zip(expected, actual)):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer):
      if not np.array_equal(a, b):
        return False
      continue
    r, t = tolerance(min(a.dtype, np.dtype(floor), key=lambda d: d.itemsize), rtol, atol)
    if not floats_ok(i, a.astype(np.float64), b.astype(np.float64), r, t):
      return False
  return True


def _close(expected, actual, rtol, atol, floor=np.float32) -> bool:
  return _judge(expected, actual, rtol, atol, floor,
                lambda i, a, b, r, t: np.allclose(a, b, rtol=r, atol=t, equal_nan=True))


def _narrow_float(value) -> bool:
  if not isinstance(value, (np.dtype, type)):
    return False
  try:
    dtype = np.dtype(value)
  except TypeError:
    return False
  return bool(jax.numpy.issubdtype(dtype, jax.numpy.floating)) and dtype.itemsize < 8


_NARROW_INT = {np.dtype(np.int64): np.dtype(np.int32), np.dtype(np.uint64): np.dtype(np.uint32)}


def _wide(x):
  dtype = getattr(x, "dtype", None)
  if dtype is None:   # a Python scalar constant, typed as traced: a 32-bit int, a wide float
    return (x if isinstance(x, bool) else np.int32(x) if isinstance(x, int)
            else np.float64(x) if isinstance(x, float) else x)
  if _narrow_float(dtype):
    return x.astype(np.float64)
  # Traced without 64-bit types, a 64-bit integer is a constant as numpy typed it: 32-bit.
  return x.astype(_NARROW_INT.get(np.dtype(dtype), dtype))


def _widen(op, args, params):
  """An op bound in float64: its float arguments, constants and the dtypes it names widened
  (a scatter's typed combining function traced again on float64 scalars)."""
  from partitioner.compat import eval_jaxpr
  params = {k: np.dtype(np.float64) if _narrow_float(v) else v for k, v in params.items()}
  update = params.get("update_jaxpr")
  if update is not None and _narrow_float(update.invars[0].aval.dtype):
    consts = params.get("update_consts", ())
    scalar = np.float64(0)
    again = jax.make_jaxpr(lambda x, y: eval_jaxpr(update, consts, x, y))(scalar, scalar)
    params.update(update_jaxpr=again.jaxpr, update_consts=tuple(again.consts))
  return [_wide(a) for a in args], params


def exact_outputs(program, inputs) -> list | None:
  """The unpartitioned program in float64: every float input, constant and dtype an op names
  widened, so its rounding is 2**-29 of float32's. None where an op does not run so (a bitcast
  between floats and integers, say). Constants are typed as the program was traced (without
  64-bit types): an int constant bound as int64 made every HF T5 step fail to run so, and its
  amplified rounding was then reported as a mismatch."""
  from partitioner.compat import enable_x64
  from partitioner.ir import rewriting_binds
  with enable_x64(), rewriting_binds(_widen):
    try:
      run = jax.jit(program.evaluate)
      return [np.asarray(x) for x in run(*[_wide(jax.numpy.asarray(x)) for x in inputs])]
    except Exception:   # an op with no float64 form: no exact answer to judge by
      return None


def widened_lowerings(pp, inputs, mesh, names=("shard_map", "jit")) -> dict | None:
  """The lowerings `names` of `pp` run in float64, every op widened as `exact_outputs` widens
  the unpartitioned program: lowering name -> flat outputs; None where an op does not run so."""
  from partitioner.compat import enable_x64
  from partitioner.ir import rewriting_binds
  program = pp.program
  run = {"shard_map": lambda: jax.jit(pp.lower_spmd(mesh).flat),
         "jit": lambda: pp.jit(mesh).wrapped}
  with enable_x64(), rewriting_binds(_widen):
    try:
      stored = program.store_inputs([_wide(jax.numpy.asarray(x)) for x in inputs])
      return {name: program.load_outputs(list(run[name]()(*stored))) for name in names}
    except Exception:
      return None


def _close_to_exact(expected, actual, exact, rtol, atol, floor=np.float32) -> bool:
  """Per output: the lowering's distance from the exact answer beyond the tolerance is at most
  `NOISE` times the float32 reference's own distance from it."""
  def ok(i, a, b, r, t):
    x = np.asarray(exact[i], np.float64)
    past = np.abs(b - x) - (t + r * np.abs(x))
    return not past.size or np.max(past) <= NOISE * np.max(np.abs(a - x))   # NaN: False
  return _judge(expected, actual, rtol, atol, floor, ok)


# Per program: the inputs it last ran on unpartitioned and its outputs. Schedules of one
# program are often verified one after another (a search's candidates, a test's cases); the
# reference then compiles and runs once.
_REFERENCES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _digest(x) -> tuple:
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)   # typed PRNG keys have no NumPy form
  a = np.asarray(x)
  return a.shape, a.dtype.str, hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()


def _reference(program, inputs) -> list:
  """The unpartitioned program's outputs on `inputs`, computed once for the same inputs."""
  key = tuple(_digest(x) for x in inputs)
  known = _REFERENCES.get(program)
  if known is not None and known[0] == key:
    return known[1]
  outputs = jax.jit(program.evaluate)(*inputs)
  _REFERENCES[program] = (key, outputs)
  return outputs


def verify(pp, args, seed: int = 0, rtol: float = 1e-4, atol: float = 1e-4,
           jax_mesh=None, expected=None) -> Verification:
  """Runs the unpartitioned program, the shard_map lowering and the jit lowering; compares.
  `expected`: the unpartitioned program's outputs on these inputs, if already known."""
  program = pp.program.root   # a rewrite (micro-batches, layouts) is checked too
  flat = example_inputs(args, seed)
  concrete = jax.tree_util.tree_unflatten(program.in_tree, flat)
  inputs = program.flatten_args(concrete)
  if expected is None:
    expected = _reference(program, inputs)
  mesh = jax_mesh if jax_mesh is not None else pp.mesh.to_jax()
  results = {
      "shard_map": pp.program.load_outputs(
          list(jax.jit(pp.lower_spmd(mesh).flat)(*pp.program.store_inputs(inputs)))),
      "jit": jax.tree_util.tree_leaves(pp.jit(mesh)(*concrete)),
  }
  floor = compute_dtype(program)
  errors, missed, worst, worst_err, exact = {}, [], "", -1.0, None
  for name, actual in results.items():
    err, where = max_error(expected, actual)
    errors[name] = err
    if not _close(expected, actual, rtol, atol, floor):
      if exact is None:
        exact = exact_outputs(program, inputs) or []
      if not (exact and _close_to_exact(expected, actual, exact, rtol, atol, floor)):
        missed.append(name)
    if err > worst_err or err != err:
      worst_err, worst = err, program.output_names[where] if where >= 0 else ""
  wide = widened_lowerings(pp, inputs, mesh, missed) if missed and exact else None
  if wide is not None:   # judged in float64, where Adam's epsilon swallows the rounding
    missed = [name for name in missed if not _close(exact, wide[name], rtol, atol)]
  return Verification(not missed, max(errors.values()), errors, worst, rtol, atol, bool(exact),
                      wide is not None)
