"""The names of a run's checkpoint folders and of their index file, without TensorFlow: the run folder's
checks (training/run_folder.py) read them before TensorFlow starts. training/checkpoints.py writes them."""

LAST, BEST = "last", "best"
INDEX_FILE = "checkpoint"
