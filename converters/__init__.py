"""Command-line tools over the ``w12`` library (``w12 convert|verify|info|restore|demo``)."""
