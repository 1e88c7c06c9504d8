"""rMuscle: the reference library, retrieval and alignment (sliding window and caches come next)."""
