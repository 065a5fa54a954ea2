"""The shipped demos: arith/ (the sums demo) and reasoning/ (what `python da3po.py` runs), built by
python -m demo.build"""
