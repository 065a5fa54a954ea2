"""The test suite (python -m pytest -q tests), and the helpers its tests launch as modules under torchrun
(python -m tests.lockstep ...). A package, so that tests and tools import its helpers by one name: tests.harness."""
