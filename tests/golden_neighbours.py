"""The neighbours' golden vectors (tests/data/neighbours_golden.json): each case's inputs and what neighbours.py's
functions give in float64. Written by `python -m tests.golden_neighbours` (--check: is the file what it writes);
tests/test_neighbours.py checks the file against formulas written there independently. Schema: tests/data/README.md.
"""
import json
import os
import random
import sys

import torch

import neighbours
from common import group_advantages

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "neighbours_golden.json")


def _random_case(name: str, seed: int, N: int, G: int, temperature: float, shaping: bool,
                 anchor: float, scale: float) -> dict:
    rng = random.Random(seed)
    correct = [[int(rng.random() < p) for _ in range(G)] for p in (rng.random() for _ in range(N))]
    correct[0], correct[1] = [0] * G, [1] * G  # an all-wrong and an all-correct group in every random case
    rewards = [[(1.0 if c else -1.0) - (rng.choice([0.0, 0.0, 0.25, 0.5]) if shaping else 0.0) for c in row]
               for row in correct]
    return {"name": name, "G": G, "correct": correct, "rewards": rewards, "temperature": temperature,
            "anchor": anchor, "hadw_scale": scale}


CASES = [
    # G = 4: one correct of four, two of four, an all-wrong and an all-correct group; +1/-1 rewards
    {"name": "hand_G4", "G": 4, "correct": [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]],
     "rewards": [[1.0, -1.0, -1.0, -1.0], [1.0, 1.0, -1.0, -1.0], [-1.0] * 4, [1.0] * 4], "temperature": 2.0,
     "anchor": 0.5, "hadw_scale": 1.0},
    _random_case("G8_random", 1, 12, 8, 2.0, False, 0.3, 1.3),
    _random_case("G8_shaped_T05", 2, 12, 8, 0.5, True, 0.625, 1.5),  # DAPO's shaping: rewards need not be +1/-1
    _random_case("G5_T10", 3, 9, 5, 10.0, True, 0.8, 1.3),
]
# HA-DW's anchor over a run: each step's batch accuracy y_t in, the prior C_t- each step's weights use out
ANCHOR_RUN = {"observations": [0.5, 0.25, 0.75, 0.625, 0.125, 0.875, 0.5, 0.375, 1.0, 0.0, 0.5, 0.5], "window": 4,
              "eta": 1.5}


def expected(case: dict) -> dict:
    correct = torch.tensor(case["correct"], dtype=torch.float64)
    rewards = torch.tensor(case["rewards"], dtype=torch.float64)
    T = case["temperature"]
    weight = neighbours.dqw_weights(correct, T, neighbours.dqw_sums(correct, T))
    return {"maxrl": neighbours.maxrl_advantages(correct).tolist(),
            "linear_r": neighbours.linear_r_advantages(correct).tolist(),
            "dgae": neighbours.dgae_advantages(rewards).tolist(),
            "valid": neighbours.mixed(correct).tolist(),
            "dqw": weight[:, 0].tolist(),
            "dgpo": (neighbours.dgae_advantages(rewards) * weight).tolist(),
            "hadw": (group_advantages(rewards) * neighbours.hadw_weights(
                group_advantages(rewards), correct, case["anchor"], case["hadw_scale"])).tolist()}


def anchor_priors(run: dict, kind: str) -> list:
    """The prior anchor C_t- of each step of `run` (neighbours.next_anchor step by step, as HADW keeps it)."""
    observations, beliefs, priors = [], [], []
    for y in run["observations"]:
        observations = (observations + [y])[-run["window"]:]
        priors.append(beliefs[-1] if beliefs else y)
        beliefs = (beliefs + [neighbours.next_anchor(beliefs, observations, kind, run["eta"])])[-run["window"]:]
    return priors


def build() -> dict:
    return {"schema": "da3po-neighbours-golden/1", "dtype": "float64",
            "generated_by": "python -m tests.golden_neighbours",
            "cases": [{"name": c["name"], "inputs": {k: v for k, v in c.items() if k != "name"},
                       "expected": expected(c)} for c in CASES],
            "hadw_anchor": {"inputs": ANCHOR_RUN, "expected": {kind: anchor_priors(ANCHOR_RUN, kind)
                                                               for kind in ("window", "kalman")}}}


def dumps(data: dict) -> str:
    return json.dumps(data, indent=1) + "\n"


if __name__ == "__main__":
    text = dumps(build())
    if "--check" in sys.argv[1:]:
        same = os.path.exists(PATH) and open(PATH).read() == text
        print("up to date" if same else f"{PATH} differs: run python -m tests.golden_neighbours")
        sys.exit(0 if same else 1)
    with open(PATH, "w") as f:
        f.write(text)
    print(f"wrote {PATH} ({len(CASES)} cases)")
