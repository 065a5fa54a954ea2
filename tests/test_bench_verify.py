"""bench/verify_speed.py runs as its docstring says, on a tiny setting: every row printed, our verdicts all right,
and the huge outputs judged. Run: python -m pytest -q tests/test_bench_verify.py"""
import re

from tests.conftest import run_script


def test_verify_speed_runs(tmp_path):
    r = run_script(["-m", "bench.verify_speed", "--tokens", "50", "--n", "8", "--rounds", "1", "--cores", "1"])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.splitlines() if re.match(r"\s+50 ", line)]
    ours = [row for row in rows if "ours," in row]
    assert len(ours) == 4 and all(row[-1] == "1.00" for row in ours)  # 2 answer sets x 2 ways, all verdicts right
    assert len(rows) in (4, 6)  # + Math-Verify's two rows where it is installed
    verdicts = re.findall(r"verdict (True|False)", r.stdout)
    assert verdicts == ["True", "True", "True", "True", "False"]  # the box flood has no closed box
