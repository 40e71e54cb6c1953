"""Stopping TensorFlow 2.6's all-reduce thread pools before the interpreter exits.

TensorFlow 2.6's CollectiveAllReduce keeps a `multiprocessing.pool.ThreadPool` for its whole life. A
MultiWorkerMirroredStrategy runs every eager cross-replica reduction on it (the workers' agreement
to stop, Keras' reads of its metrics), and a MirroredStrategy makes one beside its own cross-device
ops. Two things then go wrong at exit:
- multiprocessing's atexit hook stops such a pool without waiting for its threads. A thread still
  deleting its thread-local TensorFlow graph when Python begins to finalise is ended by pthread_exit
  inside a pybind11 destructor, and std::terminate aborts the process (SIGABRT, "terminate called
  without an active exception") instead of letting it exit with its status (multi-worker runs);
- a pool still open when the interpreter tears its modules down is closed by `Pool.__del__`, which
  then fails and prints "Exception ignored in: <function Pool.__del__ ...>" with a traceback at the
  end of every 4-replica CPU run.
`close_at_exit(strategy)`, registered after multiprocessing's hook, runs before it: it closes the
pools and lets their threads finish while Python still runs normally. Newer TensorFlow versions
create and close a pool per reduction, so there is nothing to close there.
"""

import atexit
import multiprocessing.pool
import time

from absl import logging

# Where the strategies' extended objects keep cross-device ops that may own a pool (TF 2.6).
_CROSS_DEVICE_OPS = ("_cross_device_ops", "_host_cross_device_ops", "_collective_ops")


def pools_of(strategy) -> list:
  """The distinct ThreadPools owned by `strategy`'s cross-device ops."""
  pools = []
  for name in _CROSS_DEVICE_OPS:
    pool = getattr(getattr(strategy.extended, name, None), "_pool", None)
    if isinstance(pool, multiprocessing.pool.ThreadPool) and all(pool is not p for p in pools):
      pools.append(pool)
  return pools


def close_pools(strategy, timeout: float = 10.0) -> None:
  """Closes `strategy`'s pools and waits up to `timeout` s for their threads; never raises."""
  deadline = time.monotonic() + timeout
  for pool in pools_of(strategy):
    try:
      pool.close()  # no new work; each thread exits after its current task
      for thread in list(getattr(pool, "_pool", ())):  # a thread stuck in a collective is left
        thread.join(max(0.0, deadline - time.monotonic()))
    except Exception as error:  # pylint: disable=broad-except  # never fail an exit over this
      logging.warning("Could not stop the all-reduce threads: %s", error)


def close_at_exit(strategy) -> None:
  """Registers `close_pools(strategy)` to run at exit, before multiprocessing's own hook."""
  atexit.register(close_pools, strategy)
