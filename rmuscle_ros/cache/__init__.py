"""rMuscle: the reference library (library.py), retrieval and alignment, the sliding GPU window and the Context and Action Caches per call (runtime.py)."""
