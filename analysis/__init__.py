"""After training: the report of a run, from its folder alone.

evaluation.py loads a run (run_config.yaml, checkpoints/best or last) and computes per-parameter
metrics and verdicts (`tools/predict.py`, `main.py --predict`); plots.py draws them and the training
curves; events.py reads the run's TensorBoard scalars back; export.py writes a standalone SavedModel.
Nothing here is needed to train, and nothing in `training/` imports it.
"""
