"""The backends `--backend` can name: one entry each, pointing at its module in `strategies/`.

TensorFlow-free, so that `flags.py` reads its choices from here before TensorFlow is imported;
`strategies/select.py` imports the module of the chosen backend and asks it everything else. A new
backend is one module plus one entry. The module states what it knows about its hardware:

    present() -> bool                 whether this machine has it (for --backend=auto)
    has_16bit_units() -> bool         whether --precision=auto means mixed 16-bit there
    check_precision(precision)        a UserError where this software cannot compute at `precision`
    POLICIES                          {--precision: Keras policy name}, for "32.32", "16.32", "16.16"
    create(config) -> Backend         the backend for `config`, whose backend and precision are
                                      resolved (never "auto")

`create` builds the Backend's fields with `backend.options_from_config(config)` (plus its own), and
does what its hardware needs of the process; for a tf.distribute strategy, as cpu.py and gpu.py do:
hide the devices it must not use (`tf.config.set_visible_devices`), call `device_pipelines.apply()`
(tf.distribute's per-device input otherwise stalls at the end of every fit) and, where a cluster is
described (`multiworker.cluster_source()`), return `multiworker.create(...)`. Setting the Keras
policy is select.py's (from POLICIES); POLICIES names a policy for every precision that
`check_precision` accepts.

The order is --backend=auto's preference: the first backend present wins (the CPU always is).

A backend whose runtime reads environment variables once, when TensorFlow loads (Poplar's flags;
TensorFlow's own switch to oneDNN's CPU kernels), cannot set them from its module, which imports
TensorFlow: it names a TensorFlow-free function of `strategies/environment.py` in START_UP, which
`environment.prepare` calls for `--backend=NAME` and for `--backend=auto`.
"""

from strategies import pipeline_rules

BACKENDS = {
    "ipu": "strategies.ipu",
    "gpu": "strategies.gpu",
    "cpu": "strategies.cpu",
}

START_UP = {
    "ipu": "ipu_variables",
    "cpu": "cpu_variables",
}

# Where a backend's own compiler caches executables: the environment variable and flag its START_UP
# function sets from --cache_dir, and a launcher's variable that wins over it (poprun's). The others use
# TensorFlow's XLA persistent cache (XLA_CACHE), with --jit_compile.
EXECUTABLE_CACHES = {
    "ipu": ("TF_POPLAR_FLAGS", "--executable_cache_path=", "POPDIST_EXECUTABLE_CACHE_PATH"),
}
XLA_CACHE = ("TF_XLA_FLAGS", "--tf_xla_persistent_cache_directory=", None)

# Flag rules a backend imposes, checked when the flags are parsed (before TensorFlow loads): backend
# name -> a TensorFlow-free function(values) -> problem text or None, where `values` maps the flags
# of FLAG_RULE_FLAGS to their parsed values.
FLAG_RULE_FLAGS = ("backend", "replicas", "ipus_per_replica", "precision")
FLAG_RULES = {
    "ipu": pipeline_rules.ipu_flag_problem,
}

# Settings that only a backend's hardware reads: backend name -> RunConfig fields. On another backend a
# value other than the default is without effect, and the log says so (select.py); not an error, as an
# IPU user's flag file also serves runs on a CPU.
BACKEND_ONLY_FIELDS = {
    "ipu": ("ipu_connection", "ipu_model", "available_memory_proportion", "stochastic_rounding"),
}

CHOICES = ("auto",) + tuple(BACKENDS)


def flag_problem(values: dict):
  """What is wrong with the parsed flag `values` for their --backend, by its FLAG_RULES (or None)."""
  rule = FLAG_RULES.get(values["backend"])
  return rule(values) if rule else None
