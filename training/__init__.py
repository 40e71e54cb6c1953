"""The fit loop and its callbacks: build data and model on a backend, train, evaluate, report."""
