"""Speed and memory against peers, and their results (bench/results/). Each script runs as a module from the
repository's root: python -m bench.vs_trl"""
