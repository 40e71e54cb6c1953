"""Shared by the tests, tested by none: running main.py as a user does (helpers), hand-made cellSpike
and MNIST files (cellspike_files, idx_files), small training fixtures (training_parts), and the recording
stand-in for Graphcore's `ipu` module (fake_ipu)."""
