"""The demo's MPI ranks, for the deploy/ recipes (run-ranks.sh, slurm/): the program is sparkbus.demo.ranks.

    mpiexec -n 2 python deploy/train.py --ranks tcp://broker-host:5556 [--epochs 3 --summary out.json]
"""

import sys

from sparkbus.demo.ranks import main

if __name__ == "__main__":
    sys.exit(main())
