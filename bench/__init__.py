"""Side-by-side benchmarks: ``python -m bench`` (or ``make bench``) writes bench/RESULTS.md and a plot."""
