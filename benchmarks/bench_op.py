"""The operator benchmark as a script; the same options as `oal bench op` (see `--help`).

python benchmarks/bench_op.py --quick --max-n 2048 --dtypes fp32 --out runs/bench_op_smoke
"""

import typer

from oal.bench.cli import op

if __name__ == "__main__":
    typer.run(op)
