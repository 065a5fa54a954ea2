"""Completions verified per second: our verifier (verifier.py) beside Math-Verify on the same completions, on 1, 2 and
all cores. Run from the repository root:
  python -m bench.verify_speed                           # lengths 500, 2000, 8000, 20000 tokens; 1, 2, all cores
  python -m bench.verify_speed --tokens 20000 --n 64     # one length, fewer completions
Each completion is N tokens of reasoning (about 4 characters a token: sentences with inline and display LaTeX, a few
intermediate \\boxed{} results) and then its final \\boxed{answer}. Two answer sets: `integers` (DAPO-Math-17k's
golds are integers; half the completions right) and `peer forms` (the 218 pairs of tests/data/verifier_equal_peer.jsonl:
fractions, intervals, sets, matrices, equations ...). Rows per number of cores c:
  ours, verify_batch(num_workers=c)   one call, as the trainer makes it: extraction inline, symbolic pairs on c workers
  ours, c processes                   the completions in c shards, each verified in its own process
  Math-Verify, c processes            parse + verify (crosscheck.math_verify_judge) in a pool of c processes
`right`: the share of verdicts equal to the label (an integer answer equals its gold or not; a peer pair's label is
its project's). Our cache is cleared before every timed round; pools are started and warmed up before the timings.
Math-Verify (requirements/crosscheck.txt) is skipped if missing. Last, the huge outputs of docs/data.md: seconds for
one completion at the size limit (our worst inputs), and for an answer of 300,000 digits.
Threads are pinned to one per process (OMP_NUM_THREADS etc.) before anything is imported."""
import os

for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import crosscheck  # noqa: E402
import verifier  # noqa: E402

PEER_CASES = Path(__file__).resolve().parents[1] / "tests" / "data" / "verifier_equal_peer.jsonl"
# Reasoning as models write it: prose, inline and display math, checks, and boxed intermediate results.
SENTENCES = [
    "Let $x = {a}$, so that $x^2 = {a2}$ and $2x + {b} = {c}$. ",
    "We need $\\frac{{{a}}}{{{b}}}$ in lowest terms, and $\\gcd({a}, {b})$ decides it. ",
    "Hmm, wait. Let me re-check the case $n = {a}$ before going on. ",
    "\\[ \\sum_{{k=1}}^{{{a}}} k = \\frac{{{a}({a}+1)}}{{2}} = {tri}. \\]\n",
    "So far the value is $\\boxed{{{a}}}$, but the problem asks for more. ",
    "Substituting $y = {b}$ gives $\\sqrt{{{a2}}} = {a}$, which is consistent. ",
    "**Step {a}.** The area is ${a} \\times {b} = {ab}$ square units.\n",
]


def reasoning(tokens: int, rng: random.Random) -> str:
    """About `tokens` tokens (4 characters each) of reasoning text."""
    parts, size = [], 0
    while size < 4 * tokens:
        a, b = rng.randint(2, 999), rng.randint(2, 99)
        part = rng.choice(SENTENCES).format(a=a, b=b, a2=a * a, c=2 * a + b, tri=a * (a + 1) // 2, ab=a * b)
        parts.append(part)
        size += len(part)
    return "".join(parts)[:4 * tokens]


def workloads(tokens: int, n: int, seed: int = 0) -> dict[str, tuple[list[str], list[str], list[bool]]]:
    """name -> (completions, golds, right verdicts): n integer-answer completions, and n over the peer pairs (whose
    labels are the peer projects')."""
    rng = random.Random(seed)
    golds = [str(rng.randint(0, 10**6)) for _ in range(n)]
    answers = [g if rng.random() < 0.5 else str(int(g) + 1) for g in golds]
    integers = [reasoning(tokens, rng) + f"\n\nThe answer is $\\boxed{{{a}}}$." for a in answers]
    peers = [json.loads(line) for line in PEER_CASES.read_text().splitlines() if line.strip()]
    picked = [peers[i % len(peers)] for i in range(n)]
    forms = [reasoning(tokens, rng) + f"\n\nThe answer is $\\boxed{{{c['pred']}}}$." for c in picked]
    return {"integers": (integers, golds, [a == g for a, g in zip(answers, golds)]),
            "peer forms": (forms, [c["gold"] for c in picked], [c["expected"] for c in picked])}


def ours_shard(args: tuple) -> list[bool]:
    """One process's shard, verified with one symbolic worker."""
    completions, golds = args
    verifier._CACHE.clear()
    return verifier.verify_batch(completions, golds, num_workers=1)[0]


def math_verify_pair(pair: tuple) -> bool:
    return crosscheck.math_verify_judge(*pair)


def warm_up(have_math_verify: bool) -> bool:
    """A process's first calls, outside the timings: our symbolic worker forks, Math-Verify's grammar loads."""
    verifier.math_equal("x+1", "1+x")
    return crosscheck.math_verify_judge("\\boxed{x+1}", "1+x") if have_math_verify else True


def timed(fn, rounds: int) -> tuple[float, object]:
    """Seconds per round (the best of `rounds`: the machine is shared) and the last result."""
    best, out = float("inf"), None
    for _ in range(rounds):
        verifier._CACHE.clear()
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def process_pool(cores: int, have_math_verify: bool) -> ProcessPoolExecutor:
    """`cores` forked processes, started and warmed up. Not multiprocessing.Pool: its workers are daemonic, and a
    daemonic process cannot start the verifier's own worker processes."""
    pool = ProcessPoolExecutor(cores, mp_context=multiprocessing.get_context("fork"))
    list(pool.map(warm_up, [have_math_verify] * 4 * cores))
    return pool


def in_processes(pool: ProcessPoolExecutor, fn, items: list, cores: int) -> list:
    """fn over `items` on the pool's processes, in order."""
    return list(pool.map(fn, items, chunksize=max(1, len(items) // (4 * cores))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="500,2000,8000,20000", help="reasoning tokens before the box, comma list")
    ap.add_argument("--n", type=int, default=128, help="completions per answer set and length")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds per setting (the best is reported)")
    ap.add_argument("--cores", default="", help="comma list of core counts (default: 1, 2 and all)")
    args = ap.parse_args()
    all_cores = os.cpu_count() or 1
    cores = sorted({int(c) for c in args.cores.split(",")} if args.cores else {1, min(2, all_cores), all_cores})
    try:
        import math_verify  # noqa: F401
        have_math_verify = True
    except ImportError:
        have_math_verify = False
    warm_up(have_math_verify)  # our first symbolic worker, Math-Verify's grammar: before the pools fork
    pools = {c: process_pool(c, have_math_verify) for c in cores}
    print(f"cpu_count={all_cores}  completions per set and length={args.n}  rounds={args.rounds} (best kept)  "
          f"Math-Verify={'yes' if have_math_verify else 'not installed'}")
    print(f"{'tokens':>6s}  {'answers':10s}  {'setting':34s} {'cores':>5s} {'compl/s':>9s}  {'right':>5s}")
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for name, (completions, golds, labels) in workloads(tokens, args.n).items():
            shards = lambda c: [(completions[i::c], golds[i::c]) for i in range(c)]  # noqa: E731
            for c in cores:
                rows = [("ours, verify_batch(num_workers=c)",
                         lambda: verifier.verify_batch(completions, golds, num_workers=c)[0]),
                        ("ours, c processes", lambda: in_processes(pools[c], ours_shard, shards(c), c))]
                if have_math_verify:
                    rows.append(("Math-Verify, c processes", lambda: in_processes(
                        pools[c], math_verify_pair, list(zip(completions, golds)), c)))
                for setting, fn in rows:
                    seconds, out = timed(fn, args.rounds)
                    if setting == "ours, c processes":  # shards back in the original order
                        out = [v for i in range(len(completions)) for v in [out[i % c][i // c]]]
                    right = sum(a == b for a, b in zip(out, labels)) / len(out)  # verdicts matching the labels
                    print(f"{tokens:6d}  {name:10s}  {setting:34s} {c:5d} {len(completions) / seconds:9.0f}  "
                          f"{right:5.2f}", flush=True)
    for pool in pools.values():
        pool.shutdown()
    huge_outputs()
    verifier.close_verifier_pool()


def huge_outputs():
    """Seconds for one verify_batch call on each huge output: the bound of docs/data.md."""
    limit = verifier._MAX_TEXT
    digits = "".join(random.Random(0).choice("123456789") for _ in range(300_000))
    filler = "Let me double-check that step once more. " * 36_000
    cases = {"3 MB of text around the answer": (filler + "\\boxed{\\frac{5}{2}}" + filler, "2.5"),
             "an answer of 300,000 digits": (f"\\boxed{{{digits}}}", digits),
             "unclosed last box, then 4M braces": ("\\boxed{5}\\boxed{" + "{" * (limit - 20), "5"),
             "balanced brace pairs, unclosed last box": ("\\boxed{5}" + "{}" * (limit // 2 - 10) + "\\boxed{", "5"),
             "a flood of 570,000 boxes": ("\\boxed{5}" + "\\boxed{" * (limit // 7 - 2), "5")}
    print(f"\nhuge outputs (limit {limit:,} characters): seconds for one completion")
    for name, (completion, gold) in cases.items():
        seconds, (verdicts, info) = timed(lambda: verifier.verify_batch([completion], [gold], num_workers=1), 3)
        print(f"  {name:42s} {len(completion):>10,} chars  {seconds:6.3f} s  verdict {verdicts[0]}  "
              f"refused {info['refused']}")


if __name__ == "__main__":
    main()
