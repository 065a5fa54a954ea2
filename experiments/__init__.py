"""The science studies (learning curves, hard prompts, DARO's mechanism, LoRA ranks), their data (experiments/data/)
and results (experiments/results/). Each script runs as a module from the repository's root:
python -m experiments.learning --plan"""
