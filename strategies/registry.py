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

The order is --backend=auto's preference: the first backend present wins (the CPU always is).

A backend whose runtime reads environment variables once, when TensorFlow loads (Poplar's), cannot set
them from its module, which imports TensorFlow: it names a TensorFlow-free function of
`strategies/environment.py` in START_UP, which `environment.prepare` calls for `--backend=NAME` and
for `--backend=auto`.
"""

BACKENDS = {
    "ipu": "strategies.ipu",
    "gpu": "strategies.gpu",
    "cpu": "strategies.cpu",
}

START_UP = {
    "ipu": "ipu_variables",
}

CHOICES = ("auto",) + tuple(BACKENDS)
