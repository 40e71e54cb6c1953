"""Every patch of a TensorFlow or Keras internal that the application makes, and `REGISTRY`, what each relies on.

The application runs on TensorFlow 2.6.3 (the Poplar SDK's, with Keras 2.6) and on TensorFlow 2.20/2.21 with
tf-keras. Where no public API does what it needs, it patches a private name: the function that does so is here,
called from the module that needs it, its docstring saying the versions it is needed for and what happens without
it. An override of a Keras private method stays in its class (training/optimizers.py, training/callbacks.py) and
is registered here only. `REGISTRY` names the private names of each and its versions, and
tests/test_tf_workarounds.py checks that the running TensorFlow has them: an upgrade that removes one fails a test
named after the workaround, where the code would otherwise fall back, or break, without a word.

Adding one: its function here (or the override in its class), and its entry in `REGISTRY`.

TensorFlow is imported inside the functions: this module's registry is read without starting TensorFlow.
"""

import atexit
import multiprocessing.pool
import signal
import threading
import time

from absl import logging

# Where Keras' classes are: tf-keras (TensorFlow 2.16 and later), then Keras 2.6's package; the first that imports.
_KERAS_CALLBACKS = ("tf_keras.src.callbacks", "keras.callbacks")
_KERAS_OPTIMIZER = ("tf_keras.src.optimizers.legacy.optimizer_v2", "keras.optimizer_v2.optimizer_v2")
_KERAS_ADAM = ("tf_keras.src.optimizers.legacy.adam", "keras.optimizer_v2.adam")
_KERAS_NEW_OPTIMIZER = ("tf_keras.src.optimizers.optimizer", "keras.optimizers.optimizer")
_KERAS_BATCH_NORM = ("tf_keras.src.layers.normalization.batch_normalization",
                     "keras.layers.normalization.batch_normalization")
_DISTRIBUTE = "tensorflow.python.distribute."

# name -> {"where": what applies it (a function here, whose docstring says what it does, or the class whose
# override it is, said above its entry), "names": the private names it relies on, as (module, attribute) with
# "Class.attribute" for a class's (a method, or an attribute its instances are given in the class's code),
# "versions": (first, last) TensorFlow versions it is needed for; last None: later ones too, until one is seen
# not to need it.
REGISTRY = {
    "unfoldable_file_mapping": {
        "where": "tf_workarounds.keep_out_of_constant_folding",
        "names": (("tensorflow.python.framework.ops", "Operation._set_attr"),),
        "versions": ("2.6", None)},
    "fixed_order_central_storage_reduction": {
        "where": "tf_workarounds.replace_central_storage_reduction",
        "names": ((_DISTRIBUTE + "parameter_server_strategy", "ParameterServerStrategyExtended._cross_device_ops"),),
        "versions": ("2.6", None)},
    "untuned_device_datasets": {
        "where": "tf_workarounds.wrap_device_datasets",
        "names": (("tensorflow.python.data.ops.multi_device_iterator_ops", "_create_device_dataset"),),
        "versions": ("2.6", None)},
    "cross_device_pools_closed_at_exit": {
        "where": "tf_workarounds.close_pools_at_exit",
        "names": ((_DISTRIBUTE + "cross_device_ops", "CollectiveAllReduce._pool"),
                  (_DISTRIBUTE + "collective_all_reduce_strategy", "CollectiveAllReduceExtended._cross_device_ops"),
                  (_DISTRIBUTE + "collective_all_reduce_strategy",
                   "CollectiveAllReduceExtended._host_cross_device_ops"),
                  (_DISTRIBUTE + "mirrored_strategy", "MirroredExtended._collective_ops")),
        "versions": ("2.6", "2.6")},
    "sigterm_taken_back": {
        "where": "tf_workarounds.take_back_sigterm",
        "names": (),  # a handler TensorFlow's C++ installs; no Python name
        "versions": ("2.9", None)},
    # Slots made before the first trace; without it Keras traces the training step twice.
    "optimizer_slots_before_trace": {
        "where": "training.optimizers.create_slots",
        "names": ((_KERAS_OPTIMIZER, "OptimizerV2._create_all_weights"),),
        "versions": ("2.6", None)},
    # --weight_decay decays each weight before the optimizer's own update, as PyTorch's AdamW, on TF 2.6 too
    # (whose Keras has no AdamW). Test: tests/test_optimizer_knobs.py.
    "decoupled_weight_decay": {
        "where": "training.optimizers._DecoupledWeightDecay",
        "names": tuple((_KERAS_OPTIMIZER, "OptimizerV2." + name) for name in (
            "_prepare_local", "_resource_apply_dense", "_resource_apply_sparse_duplicate_indices", "_decayed_lr",
            "_fallback_apply_state")),
        "versions": ("2.6", None)},
    # PyTorch's epsilon placement in Adam's update (the reference's). Test: tests/test_checkpoints.py.
    "torch_adam_epsilon": {
        "where": "training.optimizers._TorchEpsilon",
        "names": ((_KERAS_ADAM, "Adam._prepare_local"),),
        "versions": ("2.6", None)},
    # One learning-rate chart in TensorBoard, not two nearly equal ones. Test: tests/e2e/test_loop.py.
    "one_learning_rate_chart": {
        "where": "training.callbacks.EpochScalars",
        "names": ((_KERAS_CALLBACKS, "TensorBoard._collect_learning_rate"),),
        "versions": ("2.6", None)},
    # The step-level scalars (--log_every_n_steps) in the epoch scalars' event file, at the optimizer's step.
    # Test: tests/test_progress_lines.py.
    "step_level_scalars": {
        "where": "training.callbacks.EpochScalars",
        "names": ((_KERAS_CALLBACKS, "TensorBoard._implements_train_batch_hooks"),
                  (_KERAS_CALLBACKS, "TensorBoard._train_writer"),
                  (_KERAS_OPTIMIZER, "OptimizerV2._get_hyper")),
        "versions": ("2.6", None)},
    # IPU replicas keep one set of moving statistics: each update is the replicas' mean (Keras updates them
    # through these two methods only). Test: tests/test_ipu_fixes.py.
    "replica_mean_moving_statistics": {
        "where": "strategies.ipu._update_with",
        "names": ((_KERAS_BATCH_NORM, "BatchNormalization._assign_moving_average"),
                  (_KERAS_BATCH_NORM, "BatchNormalization._assign_new_value")),
        "versions": ("2.6", None)},
    # The learning rate of the step-level scalars with Keras' TF >= 2.11 optimizers (SGD's default class there),
    # whose rate or schedule has no public getter. Test: tests/test_progress_lines.py.
    "new_optimizer_learning_rate": {
        "where": "training.callbacks.rate_of_update",
        "names": ((_KERAS_NEW_OPTIMIZER, "_BaseOptimizer._learning_rate"),),
        "versions": ("2.11", None)},
    # A progress bar that fits the terminal, headed with the run's epochs. Test: tests/test_logs.py.
    "fitted_progress_bar": {
        "where": "training.callbacks.RunProgbar",
        "names": ((_KERAS_CALLBACKS, "ProgbarLogger._maybe_init_progbar"),),
        "versions": ("2.6", None)},
    # Progress lines inside an epoch (--log_every): batch hooks only when asked for, Keras' logs as tensors.
    # Test: tests/test_progress_lines.py.
    "progress_lines": {
        "where": "training.callbacks.ProgressLines",
        "names": ((_KERAS_CALLBACKS, "Callback._implements_train_batch_hooks"),
                  (_KERAS_CALLBACKS, "Callback._supports_tf_logs")),
        "versions": ("2.6", None)},
}


def keep_out_of_constant_folding(op) -> None:
  """Marks `op`, an op without inputs that is not stateful (the memory map of data/hdf5_native.py), as not
  constant-foldable, by a `_scoped_allocator` attribute.

  Needed: TF 2.6 to 2.21, whose classic graph optimizer constant-folds, when a tf.data function is
  instantiated, every foldable node whose output feeds the rest of the function; `IsConstantFoldable`
  (tensorflow/core/common_runtime/constant_folding.cc) skips a node with that attribute, and an empty list
  assigns no output to a scoped allocator, so the kernel runs as before. Without it: the op is evaluated at
  instantiation and its output deep-copied, then thrown away as too large for a constant (gdb:
  FunctionLibraryRuntimeImpl::CreateItem -> GraphOptimizer::Optimize -> ConstantFold -> GraphRunner::Run ->
  tensor::DeepCopy): every iterator start reads a mapped file whole and needs its size in free memory, once per
  shard. Test: tests/test_cellspike_pipeline.py (peak memory while mapping large files).
  """
  from tensorflow.core.framework import attr_value_pb2  # pylint: disable=import-outside-toplevel
  op._set_attr("_scoped_allocator",  # pylint: disable=protected-access
               attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue()))


def replace_central_storage_reduction(strategy, make_reduction) -> bool:
  """Gives CentralStorageStrategy `strategy` the reduction `make_reduction(reduce_to_device)` (the device its
  own reduces to); whether it could (False: this TensorFlow keeps no ReductionToOneDevice there).

  Needed: TF 2.6 to 2.21: the strategy takes no cross-device ops of the caller's and makes a ReductionToOneDevice
  (`ParameterServerStrategyExtended.__init__`, parameter_server_strategy.py) summing with one `AddN`.
  Without it: the order of the replicas' gradient sum depends on timing, and so do the last bits of the weights
  (strategies/ordered_reduction.py). Test: tests/test_ordered_reduction.py.
  """
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  extended = strategy.extended
  built = getattr(extended, "_cross_device_ops", None)
  if not isinstance(built, tf.distribute.ReductionToOneDevice):
    return False
  extended._cross_device_ops = make_reduction(built.reduce_to_device)  # pylint: disable=protected-access
  return True


_WRAPPED = "_tf_workarounds_wrapped"


def wrap_device_datasets(transform) -> bool:
  """Makes each per-device dataset of tf.distribute's MultiDeviceIterator `transform(dataset)`, once per process;
  whether it is in effect (False: this TensorFlow has no `multi_device_iterator_ops._create_device_dataset`).

  Needed: TF 2.6 to 2.21, where those datasets carry default `tf.data.Options` that no public API reaches.
  Without it (the transform turning autotuning off, strategies/device_pipelines.py): the end of every fit,
  evaluate and predict waits for tf.data's sleeping model thread, up to a minute. Tests:
  tests/test_strategies.py, tests/e2e/test_input_stalls.py.
  """
  from tensorflow.python.data.ops import multi_device_iterator_ops  # pylint: disable=import-outside-toplevel
  create = getattr(multi_device_iterator_ops, "_create_device_dataset", None)
  if create is None:
    return False
  if not getattr(create, _WRAPPED, False):
    def create_transformed(*args, **kwargs):
      return transform(create(*args, **kwargs))
    setattr(create_transformed, _WRAPPED, True)
    multi_device_iterator_ops._create_device_dataset = create_transformed  # pylint: disable=protected-access
  return True


# Where the strategies' extended objects keep cross-device ops that may own a pool (TF 2.6).
_CROSS_DEVICE_OPS = ("_cross_device_ops", "_host_cross_device_ops", "_collective_ops")


def close_pools_at_exit(strategy) -> None:
  """Registers the closing of the ThreadPools of `strategy`'s cross-device ops at exit, before multiprocessing's
  own hook (atexit runs the later first).

  Needed: TF 2.6, whose CollectiveAllReduce keeps a `multiprocessing.pool.ThreadPool` (`_pool`) for its life: a
  MultiWorkerMirroredStrategy runs every eager cross-replica reduction on it, a MirroredStrategy makes one beside
  its own cross-device ops. Later versions make and close a pool per reduction: there is nothing to close.
  Without it: multiprocessing's hook stops such a pool without waiting for its threads, and a thread still
  deleting its thread-local TensorFlow graph when Python finalises is ended by pthread_exit inside a pybind11
  destructor: std::terminate aborts a multi-worker run (SIGABRT) instead of letting it exit with its status. A
  pool left to the interpreter's teardown prints "Exception ignored in: <function Pool.__del__ ...>" with a
  traceback at the end of every replicated CPU run. Test: tests/e2e/test_main.py.
  """
  atexit.register(_close_pools, strategy)


def _pools_of(strategy) -> list:
  """The distinct ThreadPools owned by `strategy`'s cross-device ops."""
  pools = []
  for name in _CROSS_DEVICE_OPS:
    pool = getattr(getattr(strategy.extended, name, None), "_pool", None)
    if isinstance(pool, multiprocessing.pool.ThreadPool) and all(pool is not p for p in pools):
      pools.append(pool)
  return pools


def _close_pools(strategy, timeout: float = 10.0) -> None:
  """Closes `strategy`'s pools and waits up to `timeout` s for their threads; never raises."""
  deadline = time.monotonic() + timeout
  for pool in _pools_of(strategy):
    try:
      pool.close()  # no new work; each thread exits after its current task
      for thread in list(getattr(pool, "_pool", ())):  # a thread stuck in a collective is left
        thread.join(max(0.0, deadline - time.monotonic()))
    except Exception as error:  # pylint: disable=broad-except  # never fail an exit over this
      logging.warning("Could not stop the all-reduce threads: %s", error)


def take_back_sigterm() -> None:
  """Gives SIGTERM back to the handler the program set (its one-line stop, or training's stop flag) after a
  multi-worker strategy has started: setting the Python handler again reinstalls Python's C handler.

  Needed: TF 2.9 and later, whose coordination service installs a C++ SIGTERM handler of its own for its
  preemption notifier (tensorflow/tsl/distributed_runtime/preemption/preemption_notifier.cc), which only logs
  "SIGTERM caught". Without it: a time limit's SIGTERM before training is lost, and the job runs on until
  SIGKILL. Training's stop flag, installed later, sets its own handler.
  """
  handler = signal.getsignal(signal.SIGTERM)
  if handler is not None and threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, handler)
