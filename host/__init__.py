"""Facts and safe operations of the machine the run is on, without TensorFlow: what its processor is and
how many cores this process may use (`cpuinfo.py`), file locks and files written whole, never through a
link (`atomic_files.py`), output paths checked before a tool's work (`output_paths.py`). Both `data/` and
`strategies/` stand on it; it imports neither.
"""
